"""Device mesh, logical-axis rules, and the NamedShardings of params and batches.

Params carry logical axis names (see ``models/transformer.py``); one short rules table maps them to
the mesh axes ``data`` (pure data parallel), ``fsdp`` (data parallel with params sharded) and
``tensor`` (tensor parallel). Batches shard their leading (batch) axis over ``('data', 'fsdp')``.
A param dimension that does not divide evenly by its mesh axes is replicated instead (logged once),
so any mesh shape works for any model, only less efficiently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

from absl import logging
from flax import nnx
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from jaxrl_ga.config import ROLES, MeshConfig, device_slice
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import transformer as tfm

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')

# logical axis -> mesh axis (or axes, or None: replicated)
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', BATCH_AXES),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('layers', None),
    ('norm', None),
    # activations (the model names them; see models/transformer.py): the batch over every
    # data-parallel axis, fsdp included, so fsdp gathers weights and shards activations.
    ('activation_batch', BATCH_AXES),
    ('activation_length', None),
    ('activation_embed', None),
    ('activation_heads', 'tensor'),
    ('activation_mlp', 'tensor'),
    ('activation_vocab', 'tensor'),
)


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None,
              name: str = 'mesh') -> Mesh:
  """A (data, fsdp, tensor) mesh over ``devices`` (default: all); a size of -1 takes the rest.
  ``cfg``: a MeshConfig or a RoleMeshConfig (its sizes), ``name`` its setting in errors."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(
          f'{name} data={cfg.data}, fsdp={cfg.fsdp}, tensor={cfg.tensor}: the fixed sizes '
          f'(product {known}) do not divide the {len(devices)} devices; choose sizes whose '
          f'product divides {len(devices)}.')
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(
        f'{name} data={cfg.data}, fsdp={cfg.fsdp}, tensor={cfg.tensor} needs {math.prod(sizes)} '
        f'devices but {len(devices)} are available; make the product equal {len(devices)} or '
        f'set one size to -1.')
  return Mesh(_device_grid(devices, sizes), MESH_AXES)


def role_meshes(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None
                ) -> dict[str, Mesh]:
  """{role: its mesh} for ``config.ROLES`` (docs/design.md, "Roles"): the actor's over
  ``mesh.devices`` of ``devices`` (default: jax.devices()) with mesh.data/fsdp/tensor; the
  rollout's over ``mesh.rollout.devices`` with its own sizes, or the actor's very mesh (the same
  object) when those are unset; the reference's over ``mesh.reference.devices``, or the
  rollout's very mesh (whose step then computes the reference log-probs). A slice past the
  devices is a ConfigError naming the setting."""
  devices = list(jax.devices() if devices is None else devices)

  def mesh_of(name, role_cfg):
    span = device_slice(f'{name}.devices', role_cfg.devices)
    if span is None:
      return None
    if span[1] > len(devices):
      raise ConfigError(f'{name}.devices={role_cfg.devices!r}: there are {len(devices)} devices '
                        f'(0:{len(devices)}); give a slice within them.')
    return make_mesh(role_cfg, devices[span[0]:span[1]], name=name)

  actor = mesh_of('mesh', cfg) or make_mesh(cfg, devices)
  rollout = mesh_of('mesh.rollout', cfg.rollout) or actor
  return dict(zip(ROLES, (actor, rollout, mesh_of('mesh.reference', cfg.reference) or rollout)))


def reshard(tree: Any, shardings: Any) -> Any:
  """``tree`` (arrays) on ``shardings`` (a tree of NamedShardings, or a prefix of it):
  ``jax.device_put`` of each leaf not already there; a leaf already on its sharding is returned
  itself, so between roles that share a mesh nothing is copied. None: None."""
  if tree is None:
    return None

  def put(x, sh):
    return x if x.sharding == sh else jax.device_put(x, sh)
  return jax.tree.map(put, tree, shardings)


def sync_weights(params: Any, dst_role) -> Any:
  """The actor's ``params`` on role ``dst_role``'s param shardings (a
  ``trainers.context.Role``): what GRPO does before each rollout. Where the roles share a mesh
  it returns ``params`` themselves (no copy); else the weights are transferred
  (``jax.device_put``) to the role's devices."""
  return reshard(params, dst_role.param_shardings)


def _device_grid(devices, sizes):
  """Devices arranged as a mesh grid; uses jax's topology-aware layout when it applies."""
  try:
    return mesh_utils.create_device_mesh(sizes, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    return np.asarray(devices).reshape(sizes)


def data_parallel_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def _mesh_axes_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


_warned: set = set()


def logical_to_spec(logical: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
                    rules=DEFAULT_RULES) -> P:
  """PartitionSpec for one array; dims that do not divide their mesh axes are replicated."""
  table = dict(rules)
  spec = []
  for name, dim in zip(logical, shape):
    if name is not None and name not in table:
      raise ValueError(f'logical axis {name!r} has no sharding rule; rules cover {list(table)}.')
    axes = table.get(name)
    if axes is not None and dim % _mesh_axes_size(mesh, axes):
      key = (name, dim, str(axes))
      if key not in _warned:
        _warned.add(key)
        logging.warning('logical axis %s (size %d) does not divide mesh axes %s (size %d): '
                        'replicated.', name, dim, axes, _mesh_axes_size(mesh, axes))
      axes = None
    spec.append(axes)
  return P(*spec)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
  """A step's mesh and the rules that map its arrays' logical axes to it (``spec``). The
  forward's options carry one for each use (set by ``programs.forward_options`` for a step on
  ``mesh``; None there: none): ``ForwardOptions.kernel_mesh``, where a kernel that the
  partitioner cannot split (the splash-attention Pallas call, ``attention.splash_attention``)
  runs per shard under ``shard_map``; ``ForwardOptions.activation_mesh``, on which the model's
  named activations get sharding constraints (``constrain``; ``models/activations.py``)."""
  mesh: Mesh
  rules: tuple = DEFAULT_RULES

  def spec(self, x, axes) -> P:
    return logical_to_spec(axes, x.shape, self.mesh, self.rules)

  def constrain(self, x, axes):
    """``x`` constrained to the sharding of its logical ``axes`` (identical values)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(x, axes)))


def param_shardings(params_like: Any, axes_tree: dict, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """NamedShardings for a params pytree (arrays or ShapeDtypeStructs) given its logical axes."""
  return jax.tree.map(
      lambda x, axes: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules)),
      params_like, axes_tree, is_leaf=lambda n: isinstance(n, tuple))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading axis over the data-parallel axes, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def abstract_model(cfg: tfm.ModelConfig) -> tuple[nnx.GraphDef, Any, dict]:
  """(graphdef, params ShapeDtypeStructs, logical axes) without allocating any weights."""
  abstract = nnx.eval_shape(lambda: tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  return graphdef, nnx.to_pure_dict(state), tfm.logical_axes(state)


def init_params(cfg: tfm.ModelConfig, seed: int, mesh: Mesh,
                rules=DEFAULT_RULES) -> tuple[nnx.GraphDef, dict, Any]:
  """Randomly initialised params, born sharded: (graphdef, params, their shardings)."""
  graphdef, shapes, axes = abstract_model(cfg)
  shardings = param_shardings(shapes, axes, mesh, rules)

  def init():
    return tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

  params = jax.jit(init, out_shardings=shardings)()
  return graphdef, params, shardings
