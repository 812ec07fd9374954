"""Host data <-> global jax.Arrays: each process builds, and reads back, only the rows its
devices hold.

On one process these are plain ``jax.device_put`` / ``device_get``. On several (a TPU pod slice,
or ``jax.distributed`` on CPUs) a batch-sharded array is not fully addressable: every process
places its own rows (``shard_rows``, ``from_local``), reads its own part back without
communication (``local_part``), and gathers only what every process needs (``gather_rows``,
``to_host``). The shardings come from ``jaxrl_ga.sharding``.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
import numpy as np

from jaxrl_ga.sharding import batch_sharding, data_parallel_size


def put(x, sh: NamedSharding) -> jax.Array:
  """A host array (the same on every process) -> a global jax.Array on ``sh``. On several
  processes each one places only the shards its own devices hold."""
  if jax.process_count() == 1:
    return jax.device_put(x, sh)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])


def shard_batch(tree: Any, mesh: Mesh) -> Any:
  """Host numpy arrays (the global batch, identical on every process) -> global jax.Arrays
  whose leading axis is sharded over the data-parallel axes."""
  return jax.tree.map(lambda x: put(x, batch_sharding(mesh, max(1, np.ndim(x)))), tree)


def local_indices(shape: Sequence[int], sh: NamedSharding, axis: int = 0) -> np.ndarray:
  """Sorted indices along ``axis`` of a global array of ``shape`` on ``sh`` that this process's
  devices hold (all of them on one process)."""
  rows = set()
  for idx in sh.addressable_devices_indices_map(tuple(shape)).values():
    rows.update(range(*idx[axis].indices(shape[axis])))
  return np.asarray(sorted(rows), np.int64)


def from_local(local: np.ndarray, rows: np.ndarray, shape: Sequence[int], sh: NamedSharding,
               axis: int = 0) -> jax.Array:
  """A global jax.Array of ``shape`` on ``sh`` from this process's part only: ``local`` holds
  the global indices ``rows`` along ``axis`` (at least ``local_indices(shape, sh, axis)``), full
  along every other axis. The multi-host counterpart of ``jax.device_put`` of a global array,
  as ``jax.make_array_from_process_local_data`` but for rows in any order or subset."""
  local = np.asarray(local)
  pos = {int(r): i for i, r in enumerate(rows)}

  def shard(idx):
    want = range(*idx[axis].indices(shape[axis]))
    missing = [r for r in want if r not in pos]
    if missing:
      raise ValueError(f'process {jax.process_index()} was given rows {list(rows)[:8]}... '
                       f'but its devices hold row {missing[0]}; build local_indices() rows.')
    rest = list(idx)
    rest[axis] = slice(None)
    return np.take(local, [pos[r] for r in want], axis=axis)[tuple(rest)]

  return jax.make_array_from_callback(tuple(shape), sh, shard)


def shard_rows(build, n: int, mesh: Mesh) -> Any:
  """A batch of ``n`` rows sharded over the data-parallel axes, of which this process builds only
  its own: ``build(rows)`` gets the global row indices its devices hold and returns a pytree of
  host arrays with ``len(rows)`` leading rows. -> the pytree of global jax.Arrays."""
  return place_rows(build(batch_rows(n, mesh)), n, mesh)


def place_rows(tree: Any, n: int, mesh: Mesh) -> Any:
  """This process's rows of an ``n``-row batch, already built for ``batch_rows(n, mesh)`` (a
  pytree of host arrays with that many leading rows) -> the pytree of global jax.Arrays."""
  rows = batch_rows(n, mesh)
  return jax.tree.map(
      lambda x: from_local(x, rows, (n, *np.shape(x)[1:]), batch_sharding(mesh, np.ndim(x))),
      tree)


@functools.lru_cache(maxsize=64)
def batch_rows(n: int, mesh: Mesh) -> np.ndarray:
  """This process's rows of an [n] batch-sharded batch (local_indices), computed once per
  (n, mesh): batches are built every micro-step."""
  rows = local_indices((n,), batch_sharding(mesh, 1))
  rows.flags.writeable = False
  return rows


def local_part(x: jax.Array, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(indices, values) of the part of ``x`` along ``axis`` that this process's devices hold,
  without communication; ``x`` must be unsharded along every other axis."""
  parts = {}
  for s in x.addressable_shards:
    for other, sl in enumerate(s.index):
      if other != axis and sl.indices(x.shape[other]) != (0, x.shape[other], 1):
        raise ValueError(f'local_part: axis {other} of {x.shape} is sharded ({x.sharding}).')
    start = s.index[axis].indices(x.shape[axis])[0]
    parts.setdefault(start, s.data)
  starts = sorted(parts)
  values = np.concatenate([np.asarray(parts[k]) for k in starts], axis=axis)
  indices = np.concatenate([np.arange(k, k + parts[k].shape[axis]) for k in starts])
  return indices, values


def gather_rows(local: np.ndarray, rows: np.ndarray, n: int, mesh: Mesh) -> np.ndarray:
  """The inverse of building rows per host: every process passes the values of its own
  ``rows`` (of ``n``, its ``local_indices``) and gets the whole [n, ...] array."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    out = np.empty((n, *local.shape[1:]), local.dtype)
    out[np.asarray(rows)] = local
    return out
  x = from_local(local, rows, (n, *local.shape[1:]), batch_sharding(mesh, local.ndim))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def per_process(x) -> np.ndarray:
  """A small host value of each process, stacked [num_processes, ...] on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)[None]
  return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def to_host(x) -> np.ndarray:
  """The whole (global) array on this host. On several processes a batch-sharded array is not
  fully addressable: its rows are gathered from every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def padded_batch_size(n: int, mesh: Mesh) -> int:
  """``n`` rounded up to a multiple of the mesh's data-parallel size (a fixed-shape batch that
  every data shard gets the same number of rows of)."""
  dp = data_parallel_size(mesh)
  return -(-n // dp) * dp
