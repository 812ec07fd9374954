"""The sharding-constraint context of the model's activations (MaxText's axis-rules idiom).

Inside ``constrain_activations_with(fn, kernel_mesh)`` (at trace time) the model names its
activations' logical axes with ``constrain(x, *axes)``, which calls ``fn(x, axes)`` (a
``with_sharding_constraint``); outside it (one device, tests) ``constrain`` is the identity.
``kernel_mesh`` is where a kernel that the partitioner cannot split (the splash-attention Pallas
call, ``models/attention.py``) runs per shard under ``shard_map``.
``jaxrl_ga.sharding.activation_sharding`` is the user-facing wrapper.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import jax

# (array, logical axis names) -> array with a sharding constraint; None: no constraint.
_constrain_fn: list[Optional[Callable[[jax.Array, tuple], jax.Array]]] = [None]
# (mesh, (array, logical axis names) -> PartitionSpec): where a kernel that the partitioner
# cannot split (the splash-attention Pallas call) runs per shard under ``shard_map``; None: as is.
_kernel_mesh: list[Optional[tuple[Any, Callable[[jax.Array, tuple], Any]]]] = [None]


@contextlib.contextmanager
def constrain_activations_with(fn: Optional[Callable[[jax.Array, tuple], jax.Array]],
                               kernel_mesh: Optional[tuple[Any, Callable]] = None):
  """While active (at trace time), ``constrain(x, *axes)`` calls ``fn(x, axes)``, and the
  splash-attention kernel runs per shard of ``kernel_mesh`` (mesh, spec function).
  ``jaxrl_ga.sharding.activation_sharding`` is the user-facing wrapper."""
  prev = _constrain_fn[0], _kernel_mesh[0]
  _constrain_fn[0], _kernel_mesh[0] = fn, kernel_mesh
  try:
    yield
  finally:
    _constrain_fn[0], _kernel_mesh[0] = prev


def constrain(x: jax.Array, *axes: Optional[str]) -> jax.Array:
  """Names the logical axes of an activation; a sharding constraint under
  ``constrain_activations_with``, else ``x`` unchanged."""
  fn = _constrain_fn[0]
  return x if fn is None else fn(x, axes)


def active() -> bool:
  """Whether a ``constrain_activations_with`` context is active."""
  return _constrain_fn[0] is not None


def kernel_mesh() -> Optional[tuple[Any, Callable[[jax.Array, tuple], Any]]]:
  """The active context's (mesh, spec function) for per-shard kernels; None: run as is."""
  return _kernel_mesh[0]
