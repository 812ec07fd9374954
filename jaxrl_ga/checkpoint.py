"""Checkpoints of the train state (orbax): atomic, asynchronous, last-N, fingerprinted by config.

Usage (every process of a multi-host job runs the same calls):
  ckpt = Checkpointer(f'{workdir}/checkpoints/grpo', max_to_keep=3, fingerprint={'model': ...})
  restored = ckpt.restore_latest(abstract_state)  # None, or (state on its shardings, meta dict)
  with PreemptionGuard() as guard:
    for ...:
      ckpt.save(step, state, meta={'data_position': ...})  # returns at once; writes in background
      if guard.should_stop_at(step):  # SIGTERM / SIGINT arrived
        ckpt.save(step, state, meta=...); ckpt.wait(); break
  ckpt.wait()  # writes are durable after this (also run at interpreter exit)

A checkpoint is one directory ``<directory>/<step>`` holding ``state`` (the pytree's arrays,
tensorstore) and ``meta`` (JSON: {'fingerprint': ..., 'meta': ...}). Orbax writes it under
``<step>.orbax-checkpoint-tmp`` and renames it when complete, so a run killed mid-save leaves only
a tmp dir that listings ignore (and the next Checkpointer deletes): restore always finds the last
complete checkpoint. In a bucket (``gs://``: the arrays through tensorstore's own Cloud Storage
client, the rest through etils.epath and gcsfs) a rename is a copy, so orbax writes ``<step>`` in
place and writes ``<step>/commit_success.txt`` last; a step without it is incomplete, ignored and
deleted alike. ``state`` may be any pytree of jax.Arrays (sharded or not), numpy arrays,
flax.struct dataclasses, namedtuples (optax states), ``None`` subtrees and PRNG keys, raw uint32 or
typed (orbax stores typed keys natively); it is restored bitwise (inf/nan included) onto the
shardings of ``abstract_state``, whose structure, shapes and dtypes are checked against the
checkpoint first.

Multi-host: orbax coordinates processes. Each process writes only its addressable shards; the JSON
``meta`` and the directory renames are done by the primary process alone; nothing here writes
an array or JSON file itself (it renames and deletes step directories, on the primary process).
``PreemptionGuard.should_stop_at(step)`` makes every process stop (and save) at the same step:
ask it at the same point of the loop on every process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import logging as py_logging
import os
import signal
import sys
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_ga import fileio

_FIX = ('Resume with the configuration that wrote it, or start a new run with a fresh --workdir '
        '(or delete {directory}).')


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit this run (another config, or another state structure)."""


class CheckpointUnreadableError(RuntimeError):
  """No checkpoint of a directory can be read."""


class CheckpointCorruptError(ValueError):
  """A checkpoint's arrays read back other bits than were saved (its files changed on disk). A
  run's restore_latest sets such a checkpoint aside and uses the one before."""


class CheckpointWriteError(fileio.WriteError):
  """Writing a checkpoint failed (e.g. a full disk); the complete ones before it are intact."""


class Preempted(Exception):
  """SIGTERM or SIGINT stopped a stage; its checkpoint was written (and is durable)."""

  def __init__(self, stage: str, micro_step: int, signum: Optional[int]):
    self.stage, self.micro_step, self.signum = stage, micro_step, signum
    name = signal.Signals(signum).name if signum else 'a stop on another process'
    super().__init__(f'{name}: {stage} stopped at micro-step {micro_step}')


def all_steps(directory) -> list[int]:
  """The steps of the complete checkpoints under ``directory``, ascending ([] if none)."""
  found = ocp.step.standard_name_format().find_all(fileio.path(directory))
  return sorted(m.step for m in found)


def latest_step(directory) -> Optional[int]:
  """The step of the newest complete checkpoint under ``directory``, or None."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def _json_default(x):
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(x).tolist()
  raise TypeError(f'{type(x).__name__} is not JSON-serializable: {x!r}')


def _to_json(x: Any, what: str) -> Any:
  """x as it reads back from JSON (tuples -> lists, numpy scalars -> numbers)."""
  try:
    return json.loads(json.dumps(x, default=_json_default))
  except (TypeError, ValueError) as e:
    raise ValueError(f'checkpoint {what} must be JSON-serializable: {e}') from e


def _dict_diff(stored: Any, current: Any, prefix: str = '') -> list[str]:
  """'key: checkpoint X, current Y' for every dotted key whose values differ."""
  if isinstance(stored, dict) and isinstance(current, dict):
    return [line for k in sorted(set(stored) | set(current))
            for line in _dict_diff(stored.get(k, '<absent>'), current.get(k, '<absent>'),
                                   f'{prefix}{k}.')]
  if json.dumps(stored, sort_keys=True) == json.dumps(current, sort_keys=True):
    return []
  return [f'{prefix[:-1] or "<fingerprint>"}: checkpoint {stored!r}, current {current!r}']


def _key_str(k) -> str:
  for attr in ('key', 'name', 'idx'):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _flat(tree) -> dict[str, Any]:
  """{'a.b.0': leaf} (None subtrees have no leaves: they are structure, like orbax stores them)."""
  return {'.'.join(map(_key_str, path)) or '<root>': leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _stored_form(leaf) -> tuple[tuple[int, ...], np.dtype]:
  """(shape, dtype) as orbax stores a leaf: a typed PRNG key array as its raw key data."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.eval_shape(jax.random.key_data, leaf)
  return tuple(leaf.shape), np.dtype(leaf.dtype)


def _words(u: Any, xp) -> Any:
  """A leaf's bits as uint32 words (``xp``: numpy or jax.numpy): 1- and 2-byte elements widened,
  8-byte ones as two words along a new last axis."""
  size = np.dtype(u.dtype).itemsize
  if u.dtype == np.bool_:
    u = u.astype(np.uint8)
  bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[size]
  if xp is np:
    u = np.ascontiguousarray(u).view(bits).reshape(u.shape + ((2,) if size == 8 else ()))
  else:
    u = jax.lax.bitcast_convert_type(u, bits)
  return u.astype(np.uint32)


def _position_weights(shape: tuple[int, ...]) -> jax.Array:
  """2 * (row-major index) + 1 mod 2**32 for every element of ``shape``: odd, so that any change
  of one word changes the weighted sum; built from per-axis iotas (no reshape of a sharded
  array)."""
  index = jnp.zeros(shape, np.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(np.uint32, shape, axis) * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return index * np.uint32(2) + np.uint32(1)


def _leaf_sums(u: Any, xp) -> tuple[Any, Any]:
  """(sum of the words, position-weighted sum of the words), both mod 2**32; in numpy by
  chunks of the flat words, so that a large leaf needs no full-size temporary."""
  w = _words(u, xp)
  if xp is not np:
    return (jnp.sum(w, dtype=np.uint32),
            jnp.sum(w * _position_weights(w.shape), dtype=np.uint32))
  flat, chunk = w.reshape(-1), 1 << 22
  total, weighted = np.zeros((), np.uint32), np.zeros((), np.uint32)  # arrays wrap silently
  for start in range(0, flat.size, chunk):
    part = flat[start:start + chunk]
    index = (np.arange(part.size, dtype=np.uint64) + start).astype(np.uint32)
    total += np.sum(part, dtype=np.uint32)
    weighted += np.sum(part * (index * np.uint32(2) + np.uint32(1)), dtype=np.uint32)
  return total, weighted


@jax.jit
def _device_sums(leaves: list) -> list:
  return [jnp.stack(_leaf_sums(u, jnp)) for u in leaves]


def _devices_key(x: jax.Array) -> tuple[int, ...]:
  return tuple(sorted(d.id for d in x.sharding.device_set))


def checksums(tree: Any, on_host: bool = False) -> dict[str, str]:
  """{dotted leaf path: 'xxxxxxxx-yyyyyyyy'}: two 32-bit sums of each leaf's bits (the plain sum
  of its 32-bit words, and the sum weighted by each word's odd position weight). Any one flipped
  bit changes both, and a moved or swapped block changes the second. Computed where the arrays
  are (accelerator or multi-process jax.Arrays, sharded or not, in one jitted program whose sums
  are the same on any sharding; numpy arrays and a CPU process's arrays on the host), so the
  same bits give the same strings whether a checkpoint is saved from devices or read to the
  host (``restore_raw``). Other leaves (Python numbers, which orbax may read back as another
  type) have none. on_host: every leaf on the host, nothing compiled (export's raw read)."""
  flat = {k: (jax.random.key_data(v) if isinstance(v, jax.Array)
              and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
          for k, v in _flat(tree).items()}
  # On the host: what export reads, and what a CPU process holds whole anyway (no compile).
  flat = {k: np.asarray(jax.device_get(v)) if isinstance(v, jax.Array) and (on_host or (
      v.is_fully_addressable and all(d.platform == 'cpu' for d in v.sharding.device_set)))
          else v for k, v in flat.items()}
  sums = {}
  groups = itertools.groupby(sorted((k for k, v in flat.items() if isinstance(v, jax.Array)),
                                    key=lambda k: _devices_key(flat[k])),
                             key=lambda k: _devices_key(flat[k]))
  for _, keys in groups:  # one program per set of devices (jit takes no mix of them)
    keys = list(keys)
    sums.update(zip(keys, jax.device_get(_device_sums([flat[k] for k in keys]))))
  for k, v in flat.items():
    if k not in sums and isinstance(v, (np.ndarray, np.generic)):
      sums[k] = _leaf_sums(np.asarray(v), np)
  return {k: f'{int(a):08x}-{int(b):08x}' for k, (a, b) in sorted(sums.items())}


def _check_checksums(where: str, stored: Optional[dict], state: Any,
                     on_host: bool = False) -> None:
  """Raises CheckpointCorruptError naming the leaves whose bits differ from those saved
  (``stored``: the checkpoint's ``checksums``; None for checkpoints written before them)."""
  if not stored:
    return
  try:
    now = checksums(state, on_host)
  except Exception as e:  # pylint: disable=broad-except
    # a failure to compute them is not a sign of a bad checkpoint: it must not be set aside
    logging.warning('checkpoint %s: its checksums could not be verified (%s: %s)', where,
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else '')
    return
  bad = sorted(k for k in stored if k in now and now[k] != stored[k])
  if bad:
    raise CheckpointCorruptError(
        f'checkpoint {where}: {len(bad)} array(s) read back other bits than were saved '
        f'({", ".join(bad[:5])}{", ..." if bad[5:] else ""}); its files changed on disk. Use '
        f'another step (a run sets this one aside and resumes from the one before).')


# Words of orbax-checkpoint 0.12's ValueError when the restore target's tree differs from the
# stored one (StandardRestore).
_ORBAX_TREE_MISMATCH = 'tree structures do not match'


def _structure_errors(stored_tree, abstract_state) -> list[str]:
  stored, current = _flat(stored_tree), _flat(abstract_state)
  errors = [f'{k}: in the checkpoint, not in the current state' for k in stored
            if k not in current]
  errors += [f'{k}: in the current state, not in the checkpoint' for k in current
             if k not in stored]
  for k in stored.keys() & current.keys():
    if not isinstance(current[k], (jax.ShapeDtypeStruct, jax.Array)):
      errors.append(f'{k}: expected a jax.ShapeDtypeStruct, got {type(current[k]).__name__}')
      continue
    if getattr(current[k], 'sharding', None) is None:
      errors.append(f'{k}: the abstract state leaf has no .sharding to restore onto')
    want = _stored_form(current[k])
    have = (tuple(stored[k].shape), np.dtype(stored[k].dtype))
    if have != want:
      errors.append(f'{k}: checkpoint {have[1].name}{list(have[0])}, '
                    f'current {want[1].name}{list(want[0])}')
  return sorted(errors)


@dataclasses.dataclass(frozen=True)
class AddedLeaf:
  """A leaf of the state that checkpoints written before it existed lack, and how a restore
  fills it in: ``leaf``, its dotted path (as a mismatch names it, e.g. 'buffer.policy_version');
  ``without(abstract_state)``, the abstract state as such a checkpoint holds it (the leaf
  removed); ``fill(state, meta, abstract_state)`` -> (the restored state with the leaf put
  back, onto the abstract leaf's sharding; one line saying what it was set to)."""
  leaf: str
  without: Callable[[Any], Any]
  fill: Callable[[Any, dict, Any], tuple[Any, str]]


class Checkpointer:
  """Saves and restores (state pytree, JSON meta) under ``directory``; keeps the last N."""

  def __init__(self, directory, *, max_to_keep: int = 3, fingerprint: Optional[dict] = None,
               async_save: bool = True, read_only: bool = False):
    """fingerprint: JSON-able dict that must match at restore (e.g. the model config).
    read_only: only read (export, sample): create nothing, and leave a save in flight
    (``<step>.orbax-checkpoint-tmp``; in a bucket, a ``<step>`` without its commit_success.txt)
    and a cut-short replacement alone, since a run may be writing this directory right now."""
    self.directory = fileio.path(directory)
    self.fingerprint = _to_json(fingerprint or {}, 'fingerprint')
    self._async = async_save
    self._writing: Optional[int] = None  # the step of the save in flight
    _install_quiet_unraisable()
    if not read_only:  # before orbax's manager, whose start deletes incomplete steps meanwhile
      self._recover_replaced()
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep), create=not read_only,
        cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save)
    registry = ocp.DefaultCheckpointHandlerRegistry()  # lets a new process read both items
    for item, handler, save_args, restore_args in (
        ('state', ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore),
        ('meta', ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore)):
      registry.add(item, save_args, handler)
      registry.add(item, restore_args, handler)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          handler_registry=registry)
    self._wait_at_exit = functools.partial(_wait_if_alive, weakref.ref(self))
    atexit.register(self._wait_at_exit)

  def _recover_replaced(self) -> None:
    """Undoes a ``save(replace=True)`` cut short: ``<step>.replaced`` comes back as ``<step>``
    when the new one never committed, and is deleted when it did. Committed means complete to
    orbax: in a bucket an uncommitted ``<step>`` exists (written in place, without its
    commit_success.txt), and is deleted first."""
    if not self.directory.exists():
      return
    leftovers = [p for p in self.directory.iterdir() if p.name.endswith('.replaced')]
    if not leftovers:
      return
    if jax.process_index() == 0:
      committed = all_steps(self.directory)
      for old in leftovers:
        final = self.directory / old.name[:-len('.replaced')]
        if int(final.name) in committed:
          old.rmtree()
        else:
          logging.warning('restoring %s: its replacement never completed', final)
          if final.exists():
            final.rmtree()
          old.rename(final)
    self._sync('jaxrl_ga_recover_replaced')

  @staticmethod
  def _sync(name: str) -> None:
    """A barrier across processes (no-op on one): the primary process renames, others wait."""
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(name)

  def all_steps(self) -> list[int]:
    """The steps this checkpointer's orbax manager knows, a save in flight included (the
    module-level ``all_steps(directory)`` reads complete ones from the directory, for readers
    that hold no manager: export, sample)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: Optional[dict] = None, *,
           replace: bool = False) -> bool:
    """Starts writing checkpoint ``step``; False (nothing written) if it is the latest already.

    replace: rewrite the latest checkpoint when it is ``step`` (e.g. to mark a stage done after
    its last step was saved unfinished). The old one is renamed to ``<step>.replaced`` first and
    deleted once the new one is durable; a process killed in between finds it restored at start.
    """
    step, latest = int(step), self.latest_step()
    if replace and step == latest:
      self.wait()
      old = self.directory / f'{step}.replaced'
      if jax.process_index() == 0:
        (self.directory / str(step)).rename(old)
      self._sync(f'jaxrl_ga_replace_{step}')
      self._manager.reload()
      self.save(step, state, meta)
      self.wait()
      if jax.process_index() == 0:
        old.rmtree()
      return True
    if latest is not None and step <= latest:
      if step == latest:
        logging.info('Checkpoint step %d already saved in %s.', step, self.directory)
        return False
      raise ValueError(f'cannot save step {step} in {self.directory}: it holds a newer step '
                       f'{latest}. Steps must increase within a run directory.')
    record = _to_json({'fingerprint': self.fingerprint, 'meta': meta or {},
                       'checksums': checksums(state)}, 'meta')
    self.wait()  # a failure of the save before this one is reported as that step's
    self._writing = step
    with self._write_errors():
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)))
    logging.info('Saving checkpoint step %d to %s%s.', step, self.directory,
                 ' (in the background)' if self._async else '')
    return True

  def wait(self):
    """Blocks until every started save is complete and durable; raises CheckpointWriteError
    (once) if one failed."""
    with self._write_errors():
      self._manager.wait_until_finished()
    self._writing = None

  @contextlib.contextmanager
  def _write_errors(self):
    """orbax's error for the write of checkpoint ``self._writing`` -> one CheckpointWriteError
    line naming it, the reason (e.g. No space left on device) and the newest complete step."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      step, self._writing = self._writing, None
      if step is None:
        raise
      _note_write_failed()
      steps = all_steps(self.directory)
      kept = (f'; the checkpoints before it are intact (the newest: step {steps[-1]})' if steps
              else '')
      raise CheckpointWriteError(self.directory / str(step), e, note=kept) from e

  def restore(self, step: int, abstract_state: Any,
              added: Sequence[AddedLeaf] = ()) -> tuple[Any, dict]:
    """(state on the shardings of ``abstract_state``, meta) of checkpoint ``step``.

    abstract_state: the state's pytree with jax.ShapeDtypeStruct leaves carrying .sharding.
    added: leaves newer than some checkpoints (``AddedLeaf``): a checkpoint whose only
    difference from ``abstract_state`` is the lack of one of them is restored without it and
    the leaf filled in, with one console line saying so.
    Raises CheckpointMismatchError, before reading any array, if the checkpoint was written with
    another fingerprint or holds another tree structure, shape or dtype.
    """
    self.wait()
    step = int(step)
    where = f'{self.directory}/{step}'
    fix = _FIX.format(directory=self.directory)
    record = self._record(step)
    fingerprint, meta, stored_sums = (record.get('fingerprint', {}), record.get('meta', {}),
                                      record.get('checksums'))
    self.check_fingerprint(step, fingerprint)
    stored_tree = self._manager.item_metadata(step)['state'].tree
    errors = _structure_errors(stored_tree, abstract_state)
    older = [a for a in added
             if errors == [f'{a.leaf}: in the current state, not in the checkpoint']]
    if older:  # written before that leaf existed: everything else must match, as always
      without = older[0].without(abstract_state)
      errors = _structure_errors(stored_tree, without)
    if errors:
      raise CheckpointMismatchError(
          f'checkpoint {where} does not match the state to restore:\n  '
          + '\n  '.join(errors[:20]) + (f'\n  ... {len(errors) - 20} more' if errors[20:] else '')
          + f'\nThe config fingerprints match: the code builds another state than it saved. {fix}')
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(without if older else abstract_state)))
    except ValueError as e:
      # orbax's check of the whole tree: the arrays match (above), nodes without arrays differ
      # (e.g. an optimizer state of another version): a mismatch, not an unreadable file.
      if _ORBAX_TREE_MISMATCH not in str(e):
        raise
      raise CheckpointMismatchError(
          f'checkpoint {where} does not match the state to restore: its arrays do, but not the '
          f'tree around them (nodes that hold no array). The config fingerprints match: the code '
          f'builds another state than it saved (another version of jaxrl_ga?). {fix}') from None
    state = restored['state']
    _check_checksums(where, stored_sums, state)
    logging.info('Restored checkpoint step %d from %s.', step, self.directory)
    if older:
      state, line = older[0].fill(state, meta, abstract_state)
      print(f'checkpoint {where} was written before {older[0].leaf} existed: {line}', flush=True)
    return state, meta

  def restore_raw(self, step: int) -> tuple[Any, dict, dict]:
    """(state as stored: nested dicts of host arrays, meta, fingerprint) of checkpoint ``step``.

    For tools that do not rebuild the training state (e.g. export); loads every array, each
    as a numpy array of its stored dtype, whatever the devices that wrote it (a pod slice's
    checkpoint reads on one host; no device memory; typed PRNG keys as their raw uint32 data).
    """
    record = self._record(step)
    target = jax.tree.map(  # np.empty: the pages are touched only as orbax fills them
        lambda m: np.empty(m.shape, m.dtype)
        if isinstance(m, ocp.metadata.ArrayMetadata) else m,
        self._manager.item_metadata(int(step))['state'].tree,
        is_leaf=lambda m: isinstance(m, ocp.metadata.ArrayMetadata))
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))
    _check_checksums(f'{self.directory}/{int(step)}', record.get('checksums'), restored['state'],
                     on_host=True)
    return restored['state'], record.get('meta', {}), record.get('fingerprint', {})

  def read_record(self, step: int) -> tuple[dict, dict]:
    """(fingerprint, meta) of checkpoint ``step``: its JSON only, no array is read."""
    record = self._record(step)
    return record.get('fingerprint', {}), record.get('meta', {})

  def _record(self, step: int) -> dict:
    """Checkpoint ``step``'s JSON: fingerprint, meta and (since they exist) checksums."""
    self.wait()
    return self._manager.restore(int(step), args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))['meta']

  def check_fingerprint(self, step: int, stored: dict) -> None:
    """Raises CheckpointMismatchError (one line per differing setting) if ``stored``, the
    fingerprint read from checkpoint ``step``, differs from this run's."""
    diffs = _dict_diff(stored, self.fingerprint)
    if diffs:
      raise CheckpointMismatchError(
          f'checkpoint {self.directory}/{int(step)} was written with other settings, and they '
          f'change what its state means: {"; ".join(diffs)}. '
          + _FIX.format(directory=self.directory))

  def latest_record(self) -> Optional[tuple[int, dict, dict]]:
    """(step, fingerprint, meta) of the newest checkpoint whose JSON reads, or None if there is
    none. An unreadable newer one is set aside (see ``restore_latest``)."""
    for step in reversed(self.all_steps()):
      try:
        return (step, *self.read_record(step))
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, e)
    return None

  def restore_latest(self, abstract_state: Any,
                     added: Sequence[AddedLeaf] = ()) -> Optional[tuple[Any, dict]]:
    """restore() of the newest readable checkpoint, or None if there is none.

    A checkpoint that cannot be read (a truncated or deleted file) is moved aside to
    ``<directory>/<step>.unreadable`` with a warning naming it, and the next older one is tried:
    a run falls back to the last checkpoint it can trust. CheckpointMismatchError (another
    config or state structure) is raised as is, and CheckpointUnreadableError when every
    checkpoint is unreadable.
    """
    steps = self.all_steps()
    for step in reversed(steps):
      try:
        return self.restore(step, abstract_state, added)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, e)
    if steps:
      raise CheckpointUnreadableError(
          f'no checkpoint in {self.directory} can be read (steps {steps} were set aside as '
          f'<step>.unreadable); start a new run with a fresh --workdir.')
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    """Renames an unreadable checkpoint out of the step listing (kept for inspection), so that
    the run can save that step again."""
    where = self.directory / str(step)
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ''
    logging.warning('checkpoint %s cannot be read (%s: %s); it is moved to %s.unreadable and the '
                    'previous checkpoint is used.', where, type(error).__name__, first, where)
    if jax.process_index() == 0:
      target = self.directory / f'{step}.unreadable'
      if target.exists():
        target.rmtree()
      where.rename(target)
    self._sync(f'jaxrl_ga_set_aside_{step}')
    self._manager.reload()

  def close(self):
    """Waits for pending saves and releases orbax's threads."""
    atexit.unregister(self._wait_at_exit)
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info):
    self.close()


def _wait_if_alive(ref: weakref.ref):
  ckpt = ref()
  if ckpt is not None:
    try:
      ckpt.wait()
    except CheckpointWriteError as e:  # at exit: one line, not an atexit traceback
      logging.error('%s', e)


class _QuietFailedSave(py_logging.Filter):
  """Unless --verbose (absl verbosity INFO or more): drops orbax's ERROR records (a failed save
  logs its traceback from several background threads; the error reaches the main thread, where
  Checkpointer.wait / save report it in one line), and after a failed write the asyncio records
  of the futures orbax left behind."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if logging.get_verbosity() >= logging.INFO or record.levelno < py_logging.ERROR:
      return True
    if f'{os.sep}orbax{os.sep}' in record.pathname:
      return False
    return not (_WRITE_FAILED and record.name == 'asyncio'
                and 'never retrieved' in record.getMessage())


_WRITE_FAILED = False  # a checkpoint write of this process failed (set by _write_errors)


def _note_write_failed() -> None:
  """After a failed checkpoint write, unless --verbose: orbax's abandoned save leaves asyncio
  coroutines that are garbage-collected unawaited, at any time up to interpreter exit; their
  RuntimeWarning would print after the one error line (it did under load in CI), so it is
  ignored. Other warnings are untouched."""
  global _WRITE_FAILED
  _WRITE_FAILED = True
  if logging.get_verbosity() < logging.INFO:
    warnings.filterwarnings('ignore', message=r"coroutine '.*' was never awaited",
                            category=RuntimeWarning)
_QUIET = _QuietFailedSave()
for _name in ('absl', 'asyncio'):
  py_logging.getLogger(_name).addFilter(_QUIET)


def _quiet_unraisable(hook):
  """sys.unraisablehook, unless --verbose without the 'Event loop is closed' errors of
  tensorstore callbacks that complete after orbax closed the event loop of a failed save."""
  def filtered(unraisable):
    if (logging.get_verbosity() >= logging.INFO
        or not isinstance(unraisable.exc_value, RuntimeError)
        or str(unraisable.exc_value) != 'Event loop is closed'):
      hook(unraisable)
  filtered.jaxrl_ga_quiet = True
  return filtered


def _install_quiet_unraisable() -> None:
  if not getattr(sys.unraisablehook, 'jaxrl_ga_quiet', False):
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


_SYNC_POINT_CALLS = itertools.count(1)  # the preemption service's step ids, this process


class PreemptionGuard:
  """Context manager turning SIGTERM / SIGINT into a flag, ``should_stop``, polled by the loop.

  The handler only records the signal; the trainer saves and exits at its next check. A second
  SIGINT (Ctrl-C twice) raises KeyboardInterrupt at once. The previous handlers come back on exit.
  Must be entered in the main thread (Python delivers signals there only).

  Several processes (jax.distributed, with jax's preemption service, on by default): SIGTERM is
  left to that service, which tells every process and agrees on the step at which all of them
  stop; the training loop asks ``should_stop_at(step)``, a local look-up with no collective, so
  hosts are not synchronized at every micro-step. SIGINT keeps its default there (Ctrl-C stops
  at once), and ``should_stop`` (asked between evaluation batches) is False.
  """

  def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
    self._signals = tuple(signals)
    self._previous: dict[int, Any] = {}
    self._received: Optional[int] = None
    self._logged = False
    self._sync_points = False

  def __enter__(self) -> PreemptionGuard:
    self._sync_points = (jax.process_count() > 1
                         and bool(getattr(jax.config, 'jax_enable_preemption_service', False)))
    for s in self._signals:
      if not self._sync_points:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc_info):
    for s, handler in self._previous.items():
      signal.signal(s, signal.SIG_DFL if handler is None else handler)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self._received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if self._received is None:
      self._received = signum

  @property
  def signal_received(self) -> Optional[int]:
    """The first signal caught by this process, or None."""
    return self._received

  @property
  def should_stop(self) -> bool:
    """True once a signal arrived (on any process: a collective when jax.process_count() > 1,
    unless the preemption service handles SIGTERM; then False, see the class doc)."""
    if self._sync_points:
      return False
    stop = self._received is not None
    if jax.process_count() > 1:
      stop = bool(np.any(multihost_utils.process_allgather(np.asarray(stop))))
    if stop:
      self._log()
    return stop

  def should_stop_at(self, step: int) -> bool:
    """should_stop for a training loop at ``step``; every process must ask it equally often.
    With the preemption service: True at the call all processes agreed on after one of them got
    SIGTERM (multihost_utils.reached_preemption_sync_point). The service is given this process's
    count of such calls, which keeps increasing across stages and guards (``step`` restarts)."""
    del step
    if not self._sync_points:
      return self.should_stop
    if multihost_utils.reached_preemption_sync_point(next(_SYNC_POINT_CALLS)):
      self._received = self._received or signal.SIGTERM
      self._log()
      return True
    return False

  def _log(self):
    if not self._logged:
      self._logged = True
      name = ('another process' if self._received is None
              else signal.Signals(self._received).name)
      logging.warning('Stop requested (%s): saving a checkpoint and exiting.', name)
