"""The sharding constraint of the model's named activations (MaxText's logical-axis idiom).

The model names its activations' logical axes with ``constrain(on, x, *axes)``: on a mesh
(``on``: ``ForwardOptions.activation_mesh``, a ``sharding.KernelMesh``: the step's mesh and the
rules of its logical axes) a ``with_sharding_constraint``, which places values and never changes
them; with ``on`` None (one device, tests) the identity. The mesh is an argument of the forward,
like the splash kernel's (``ForwardOptions.kernel_mesh``): no module state decides what a step
computes.
"""

from __future__ import annotations

from typing import Any, Optional

import jax


def constrain(on: Any, x: jax.Array, *axes: Optional[str]) -> jax.Array:
  """``x`` with its logical axes named: a sharding constraint on ``on`` (``on.constrain``), or
  ``x`` unchanged when ``on`` is None."""
  return x if on is None else on.constrain(x, axes)
