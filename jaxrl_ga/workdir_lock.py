"""One run per workdir: ``<workdir>/run.lock``, held while a run writes there.

A second run started on a workdir that a live run holds stops at once with one line naming the
holder (host and pid). A lock left behind by a process that no longer runs on this host (killed
with SIGKILL, a machine that lost power) is taken over with a warning. A holder on another host
cannot be checked from here: the message names the file to delete once that run is gone.

The file holds JSON naming its holder: ``{"host", "pid", "start", "since"}`` (``start``: the
process's start time in clock ticks after boot, from /proc, so that a pid that was reused by
another process does not count as the holder).

- Local workdir: the file is also ``flock``-ed for the run's lifetime, so two runs starting at
  the same moment cannot both win, and the kernel releases it however the process ends. On a
  filesystem without flock, the JSON check alone decides.
- Bucket (``gs://...``): the record is created only if no object is there (Cloud Storage's
  precondition ifGenerationMatch=0, checked atomically by the server: of runs starting together
  one wins); a stale record is deleted only if it is still the generation that was read, then the
  creation is tried again. tests/test_workdir_safety.py races two processes through gcsfs against
  a Cloud Storage emulator on 127.0.0.1.
- Several processes (jax.distributed): process 0 decides and broadcasts its decision, so every
  process of the job stops, or goes on, together; then every process must see a probe file that
  process 0 writes into the workdir (``_check_shared``), or all stop with one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga.errors import ConfigError

LOCK_NAME = 'run.lock'
_MESSAGE_BYTES = 2048  # the decision broadcast to every process: '' (go) or the error line
_BUCKET_ROUNDS = 5  # create, or read and delete a stale record: each round that fails saw a change


def _process_start(pid: int) -> Optional[int]:
  """The start time of ``pid`` (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return int(f.read().rsplit(')', 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


def _own_record() -> dict:
  return {'host': socket.gethostname(), 'pid': os.getpid(), 'start': _process_start(os.getpid()),
          'since': time.strftime('%Y-%m-%d %H:%M:%S %Z')}


def _is_stale(holder: dict) -> bool:
  """True if the holder ran on this host and its process is gone (or its pid is another's)."""
  if holder.get('host') != socket.gethostname():
    return False  # another host: cannot be checked
  pid = holder.get('pid')
  if not isinstance(pid, int) or pid <= 0:
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    pass  # alive, another user's
  start = holder.get('start')
  return start is not None and _process_start(pid) not in (None, start)


def _parse(text: str) -> Optional[dict]:
  try:
    holder = json.loads(text)
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _held_error(workdir: str, lock_path: str, holder: Optional[dict]) -> ConfigError:
  if holder is None:
    who = 'another run that is starting'
  else:
    who = (f'another run (host {holder.get("host")}, pid {holder.get("pid")}, since '
           f'{holder.get("since")})')
  hint = ''
  if holder is not None and holder.get('host') != socket.gethostname():
    hint = f' If that run is no longer running, delete {lock_path}.'
  return ConfigError(f'--workdir={workdir} is in use by {who}: wait for it to end, or give '
                     f'another --workdir.{hint}')


class WorkdirLock:
  """The held lock of one workdir (process 0's); ``release()`` frees it."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = fileio.join(workdir, LOCK_NAME)
    self._fd: Optional[int] = None
    self._record = _own_record()

  def acquire(self) -> WorkdirLock:
    """Takes the lock or raises ConfigError naming its live holder."""
    fileio.makedirs(self.workdir)
    if fileio.is_remote(self.path):
      self._acquire_in_bucket()
      return self
    try:
      fd = self._open_locked()
    except OSError as e:
      raise fileio.WriteError(self.path, e) from None
    self._fd = fd
    try:
      self._take(_parse(os.pread(fd, 4096, 0).decode('utf-8', 'replace')))
    except BaseException:
      self._fd = None
      os.close(fd)
      raise
    return self

  def _open_locked(self) -> int:
    """The lock file's descriptor, flock-ed (ConfigError if another process holds it)."""
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no flock here
          logging.warning('%s: the filesystem has no flock; only the holder\'s record decides.',
                          self.path)
        else:
          holder = _parse(os.pread(fd, 4096, 0).decode('utf-8', 'replace'))
          os.close(fd)
          raise _held_error(self.workdir, self.path, holder) from None
      try:  # the previous holder unlinks the file at release: lock the file the path names
        if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
          return fd
      except FileNotFoundError:
        pass
      os.close(fd)

  def _acquire_in_bucket(self) -> None:
    """Creates the record where no object is; else deletes a stale one (at the generation
    read) and tries again. Each round ends in a win, a live holder's error, or another run
    having changed the object first (then the next round reads that run's record)."""
    data = json.dumps(self._record).encode('utf-8')
    for _ in range(_BUCKET_ROUNDS):
      if fileio.create_new(self.path, data):
        return
      try:
        text, generation = fileio.read_generation(self.path)
      except FileNotFoundError:
        continue  # released in between
      self._refuse_live(_parse(text))
      fileio.remove_generation(self.path, generation)
    raise ConfigError(f'--workdir={self.workdir}: {self.path} changed under each of '
                      f'{_BUCKET_ROUNDS} tries to take it: start one run at a time there.')

  def _refuse_live(self, holder: Optional[dict]) -> None:
    """ConfigError for a live holder; a stale one (or an unreadable record) is logged."""
    if holder is None:
      return
    if not _is_stale(holder):
      raise _held_error(self.workdir, self.path, holder)
    logging.warning('--workdir=%s: taking over the lock of a run that is no longer running '
                    '(host %s, pid %s, since %s).', self.workdir, holder.get('host'),
                    holder.get('pid'), holder.get('since'))

  def _take(self, holder: Optional[dict]) -> None:
    """Writes this process's record into the flock-ed file over no record (an empty or
    unreadable file) or a stale one; raises ConfigError for a live holder."""
    self._refuse_live(holder)
    data = json.dumps(self._record).encode('utf-8')
    try:
      os.ftruncate(self._fd, 0)
      os.pwrite(self._fd, data, 0)
    except OSError as e:
      raise fileio.WriteError(self.path, e) from None

  def release(self) -> None:
    """Removes the lock file if it is still this run's record, and unlocks it."""
    try:
      if self._fd is None:
        try:
          text, generation = fileio.read_generation(self.path)
        except FileNotFoundError:
          return
        if _parse(text) == self._record:
          fileio.remove_generation(self.path, generation)
        return
      try:
        if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
          os.unlink(self.path)
      except FileNotFoundError:
        pass
      finally:
        os.close(self._fd)
        self._fd = None
    except OSError as e:  # a lost mount at exit: the next run finds the record stale
      logging.warning('could not release %s: %s', self.path, e)


def acquire_for_job(workdir: str) -> Optional[WorkdirLock]:
  """Process 0 takes the workdir's lock; every process raises the same ConfigError if it cannot
  (a live holder, or the lock cannot be written). -> the lock on process 0, None elsewhere."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir).acquire()
    except (ConfigError, OSError) as e:
      error = e
  if jax.process_count() > 1:  # one decision for the job
    text = str(error).encode('utf-8')[:_MESSAGE_BYTES] if error else b''
    sent = np.frombuffer(text.ljust(_MESSAGE_BYTES, b'\0'), np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(sent)).tobytes().rstrip(b'\0')
    if got and error is None:
      error = ConfigError(got.decode('utf-8', 'replace'))
  if error is not None:
    raise error
  if jax.process_count() > 1:
    try:
      _check_shared(workdir)
    except ConfigError:
      if lock is not None:
        lock.release()
      raise
  return lock


_PROBE_WAIT_S = 5.0  # how long a process looks for process 0's probe file


def _check_shared(workdir: str) -> None:
  """Every process of the job must see the workdir process 0 writes (orbax writes one checkpoint
  cooperatively into it; in per-host directories the first save waits forever): process 0 writes
  a probe file of a new name (no cache has seen it: an NFS client looks it up afresh), every
  process looks for it, and all raise the same ConfigError naming those that did not see it."""
  token = np.frombuffer(os.urandom(8), np.uint8)
  token = np.asarray(multihost_utils.broadcast_one_to_all(token)).tobytes().hex()
  probe = fileio.join(workdir, f'.shared-probe-{token}')
  if jax.process_index() == 0:
    fileio.write_text(probe, 'a probe of jaxrl_ga: every process of the job must see it\n')
  multihost_utils.sync_global_devices('jaxrl_ga_workdir_probe')
  deadline = time.time() + _PROBE_WAIT_S
  seen = fileio.exists(probe)
  while not seen and time.time() < deadline:
    time.sleep(0.5)
    seen = fileio.exists(probe)
  seen_by = np.asarray(multihost_utils.process_allgather(np.int32(seen))).reshape(-1)
  if jax.process_index() == 0:
    try:
      fileio.path(probe).unlink()
    except OSError:
      pass
  blind = [int(i) for i in np.flatnonzero(seen_by == 0)]
  if blind:
    raise ConfigError(
        f'--workdir={workdir} is not shared by every process of the job: process(es) {blind} do '
        f'not see the file process 0 wrote there. Give a bucket path (gs://...) or a directory '
        f'every host mounts at the same path (docs/scaling.md).')


@contextlib.contextmanager
def held(workdir: str):
  """acquire_for_job(workdir), released on the way out (errors and SIGTERM's Preempted too)."""
  lock = acquire_for_job(workdir)
  try:
    yield lock
  finally:
    if lock is not None:
      lock.release()
