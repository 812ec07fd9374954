"""Device mesh, logical-axis rules, and the NamedShardings of params and batches.

Params carry logical axis names (see ``models/transformer.py``); one short rules table maps them to
the mesh axes ``data`` (pure data parallel), ``fsdp`` (data parallel with params sharded) and
``tensor`` (tensor parallel). Batches shard their leading (batch) axis over ``('data', 'fsdp')``.
A param dimension that does not divide evenly by its mesh axes is replicated instead (logged once),
so any mesh shape works for any model, only less efficiently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

from absl import logging
from flax import nnx
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from jaxrl_ga.config import MeshConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import activations
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


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over ``devices`` (default: all); a size of -1 takes the rest."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(
          f'mesh data={cfg.data}, fsdp={cfg.fsdp}, tensor={cfg.tensor}: the fixed sizes '
          f'(product {known}) do not divide the {len(devices)} devices; choose sizes whose '
          f'product divides {len(devices)}.')
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(
        f'mesh data={cfg.data}, fsdp={cfg.fsdp}, tensor={cfg.tensor} needs {math.prod(sizes)} '
        f'devices but {len(devices)} are available; make the product equal {len(devices)} or '
        f'set one size to -1.')
  return Mesh(_device_grid(devices, sizes), MESH_AXES)


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


def activation_sharding(mesh: Mesh, rules=DEFAULT_RULES):
  """A context manager under which the model's named activations get sharding constraints on
  ``mesh`` (``rules`` map their logical axes); enter it while tracing a step, e.g. with
  ``with_activation_sharding``."""
  def spec(x, axes):
    return logical_to_spec(axes, x.shape, mesh, rules)

  def fn(x, axes):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(x, axes)))
  return activations.constrain_activations_with(fn)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
  """Where a kernel that the partitioner cannot split (the splash-attention Pallas call,
  ``attention.splash_attention``) runs per shard under ``shard_map``: ``mesh``, its arrays'
  specs from their logical axes by ``rules`` (``spec``). The forward's options carry it
  (``ForwardOptions.kernel_mesh``, set by ``programs.forward_options`` for a step on ``mesh``);
  None there: the kernel runs as is."""
  mesh: Mesh
  rules: tuple = DEFAULT_RULES

  def spec(self, x, axes) -> P:
    return logical_to_spec(axes, x.shape, self.mesh, self.rules)


def with_activation_sharding(f, mesh: Mesh, rules=DEFAULT_RULES):
  """``f`` traced under ``activation_sharding(mesh)``: wrap a step before ``jax.jit``."""
  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    with activation_sharding(mesh, rules):
      return f(*args, **kwargs)
  return wrapped


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
