"""The sharding-constraint context of the model's activations (MaxText's axis-rules idiom).

Inside ``constrain_activations_with(fn)`` (at trace time) the model names its activations'
logical axes with ``constrain(x, *axes)``, which calls ``fn(x, axes)`` (a
``with_sharding_constraint``); outside it (one device, tests) ``constrain`` is the identity. Where
a kernel that the partitioner cannot split runs per shard is no part of this context: the
forward's options carry it (``ForwardOptions.kernel_mesh``, ``sharding.KernelMesh``).
``jaxrl_ga.sharding.activation_sharding`` is the user-facing wrapper.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import jax

# (array, logical axis names) -> array with a sharding constraint; None: no constraint.
_constrain_fn: list[Optional[Callable[[jax.Array, tuple], jax.Array]]] = [None]


@contextlib.contextmanager
def constrain_activations_with(fn: Optional[Callable[[jax.Array, tuple], jax.Array]]):
  """While active (at trace time), ``constrain(x, *axes)`` calls ``fn(x, axes)``.
  ``jaxrl_ga.sharding.activation_sharding`` is the user-facing wrapper."""
  prev = _constrain_fn[0]
  _constrain_fn[0] = fn
  try:
    yield
  finally:
    _constrain_fn[0] = prev


def constrain(x: jax.Array, *axes: Optional[str]) -> jax.Array:
  """Names the logical axes of an activation; a sharding constraint under
  ``constrain_activations_with``, else ``x`` unchanged."""
  fn = _constrain_fn[0]
  return x if fn is None else fn(x, axes)


def active() -> bool:
  """Whether a ``constrain_activations_with`` context is active."""
  return _constrain_fn[0] is not None
