"""Workdir files on a local disk or in a bucket (``gs://...``), through ``etils.epath``.

A multi-host run needs a workdir that every host sees: orbax writes one checkpoint cooperatively.
Everything else a run writes there (metrics.jsonl, summary.json, tokenizer/, dpo_pairs.npz) goes
through these few functions, so ``--workdir=gs://bucket/run`` works as a local path does. Bucket
paths need ``gcsfs`` (and ``google-cloud-storage`` for TensorBoard events): the ``[tpu]`` extra.

Local writes are atomic (a temporary file, then ``os.replace``); an object-store write is atomic
by itself. Object stores cannot append: ``TextAppender`` buffers lines and, at most every
``flush_every_s`` seconds and at close, uploads them as a small object that Cloud Storage's compose
operation appends server-side (``gcsfs.GCSFileSystem.merge``; see
https://cloud.google.com/storage/docs/composite-objects), so each flush uploads only the new
lines, never the whole file.

A write that fails (a full disk, a quota, a lost mount) raises ``WriteError``, whose message
names the path; an atomic write leaves the old content, and ``TextAppender`` leaves no part of
the line it could not append.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import logging
import os
import re
import socket
import tempfile
import urllib.parse
import time
import uuid
from typing import Callable, Optional

from etils import epath
import fsspec
import numpy as np


class _RaisedErrorLogFilter(logging.Filter):
  """Drops two of gcsfs's (2026.x) log records whose error reaches the caller anyway, where
  jaxrl_ga reports it in one line: the failed probe of a bucket's layout (Cloud Storage's control
  plane; gcsfs then falls back to the plain API) and a request out of retries (it raises next).
  Each is logged with its whole traceback, about a hundred lines."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith(('Could not determine bucket type', 'Error: Bucket '))
                or ' out of retries on exception: ' in message)


logging.getLogger('gcsfs').addFilter(_RaisedErrorLogFilter())


def os_error_code(error: BaseException) -> Optional[int]:
  """The OS error number of a failed write: an OSError's, or the one a library puts in its
  message (tensorstore: ``[os_error_code='28']``, safetensors: ``(os error 28)``)."""
  if isinstance(error, OSError) and error.errno:
    return error.errno
  found = re.search(r"os_error_code='?(\d+)|os error (\d+)", str(error))
  return int(found.group(1) or found.group(2)) if found else None


class WriteError(OSError):
  """Writing ``path`` failed: 'cannot write <path>: <reason><note>', the reason being the OS's
  (e.g. No space left on device) when ``os_error_code`` finds it."""

  def __init__(self, path, cause: BaseException, note: str = ''):
    code = os_error_code(cause)
    text = str(cause).strip()
    reason = (os.strerror(code) if code else
              text.splitlines()[0][:200] if text else type(cause).__name__)
    super().__init__(f'cannot write {os.fspath(path)}: {reason}{note}')
    self.errno, self.path = code, os.fspath(path)


@contextlib.contextmanager
def writing(p):
  """An OSError inside, or a library's error carrying an OS error number, becomes a WriteError
  naming ``p`` (one already naming its path passes)."""
  try:
    yield
  except WriteError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if not isinstance(e, OSError) and os_error_code(e) is None:
      raise
    raise WriteError(p, e) from e


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def path(p) -> epath.Path:
  """An epath.Path; local paths are made absolute (orbax requires it)."""
  p = os.fspath(p)
  return epath.Path(p if is_remote(p) else os.path.abspath(p))


def join(*parts) -> str:
  return os.fspath(path(parts[0]).joinpath(*parts[1:]))


def makedirs(p) -> None:
  with writing(p):
    path(p).mkdir(parents=True, exist_ok=True)


def exists(p) -> bool:
  return path(p).exists()


def check_endpoint(p) -> None:
  """For a gs:// path: that the Cloud Storage endpoint's name resolves (``STORAGE_EMULATOR_HOST``
  where set, else storage.googleapis.com), so that a host without a route to it is told at once;
  gcsfs would retry a failed connection for about a minute before saying so. OSError (naming the
  host) where it does not resolve; nothing for other paths, nor where gs:// is served by another
  fsspec filesystem than gcsfs's (an in-memory test bucket)."""
  protocol = os.fspath(p).split('://', 1)[0] if '://' in os.fspath(p) else ''
  if protocol not in ('gs', 'gcs'):
    return
  try:
    served_by = fsspec.get_filesystem_class(protocol)
  except (ImportError, ValueError):
    return  # no gcsfs: reading the path says so, with its pip command
  if not served_by.__module__.startswith('gcsfs'):
    return
  emulator = os.environ.get('STORAGE_EMULATOR_HOST', '')
  url = urllib.parse.urlsplit(emulator if '://' in emulator else f'http://{emulator}')
  host, port = (url.hostname, url.port or 80) if emulator else ('storage.googleapis.com', 443)
  try:
    socket.getaddrinfo(host, port)
  except OSError as e:
    raise OSError(f'cannot resolve the Cloud Storage endpoint {host} ({e}); '
                  'is this machine on a network that reaches it?') from None


def write_bytes(p, data: bytes) -> None:
  """Writes ``p`` whole and atomically (readers see the old or the new content)."""
  target = path(p)
  makedirs(target.parent)
  if is_remote(p):
    with writing(p):
      target.write_bytes(data)
    return
  tmp = os.fspath(target.parent / f'.{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp')
  try:
    with writing(p):
      with open(tmp, 'xb') as f:  # the umask's permissions, as a plain open() gives
        f.write(data)
      os.replace(tmp, os.fspath(target))
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_text(p, text: str) -> None:
  write_bytes(p, text.encode('utf-8'))


def read_text(p) -> str:
  return path(p).read_text()


# -- a bucket object as a lock record: create only if absent, delete only if unchanged ---------
# Cloud Storage checks the preconditions ifGenerationMatch=0 (no live object) and
# ifGenerationMatch=<g> (the live object is generation g) atomically, so of two runs racing one
# wins (https://cloud.google.com/storage/docs/request-preconditions). A filesystem without
# generations (not gcsfs) gets the same calls as a check, then a write: best effort.
def create_new(p, data: bytes) -> bool:
  """Writes the bucket object ``p`` only if none is there (gcsfs: ``mode='create'``, an upload
  with ifGenerationMatch=0). -> True if written, False if an object is there."""
  fs, key = fsspec.core.url_to_fs(os.fspath(p))
  try:
    with writing(p):
      fs.pipe_file(key, data, mode='create')
  except WriteError as e:
    if isinstance(e.__cause__, FileExistsError):  # gcsfs: HTTP 412, the precondition failed
      return False
    raise
  return True


def read_generation(p) -> tuple[str, Optional[str]]:
  """(text, generation) of the bucket object ``p``: the text is that generation's (None where
  the filesystem has no generations). FileNotFoundError if there is none."""
  fs, key = fsspec.core.url_to_fs(os.fspath(p))
  fs.invalidate_cache(key)  # gcsfs answers info() from its listing cache
  generation = fs.info(key).get('generation')
  data = fs.cat_file(key, **({'generation': generation} if generation else {}))
  return data.decode('utf-8', 'replace'), generation


def remove_generation(p, generation: Optional[str]) -> bool:
  """Deletes the bucket object ``p`` if it still is ``generation`` (ifGenerationMatch; None:
  whatever is there). -> False if it is gone or was replaced."""
  fs, key = fsspec.core.url_to_fs(os.fspath(p))
  try:
    with writing(p):
      if generation is None:
        fs.rm_file(key)
      else:
        bucket, name, _ = fs.split_path(key)
        fs.call('DELETE', 'b/{}/o/{}', bucket, name, ifGenerationMatch=generation)
  except WriteError as e:  # gcsfs: HTTP 404 gone, 412 another generation
    if isinstance(e.__cause__, (FileNotFoundError, FileExistsError)):
      return False
    raise
  finally:
    fs.invalidate_cache(key)
  return True


class TextAppender:
  """Appends to a text file: an open file locally (each line written through at once; a line
  that cannot be written whole is cut off again), a composed object in a bucket.

  In a bucket, writes are buffered and flushed when ``flush_every_s`` seconds have passed since
  the last flush (checked at each write), and by ``flush`` / ``close``. A flush uploads the
  buffered text as a part object next to the file, composes ``[file, part]`` into the file
  (server-side: the file's bytes are not re-sent) and deletes the part, so the bytes sent per
  flush do not grow with the file. Cloud Storage allows about one write per second to one object,
  hence the interval. A filesystem without compose (not Cloud Storage, or a zonal bucket) falls
  back to rewriting the object at each flush.
  """

  def __init__(self, p, flush_every_s: float = 5.0):
    self._path = os.fspath(p)
    self._pending: list[str] = []
    self._flush_every_s = flush_every_s
    self._last_flush = -float('inf')
    if is_remote(p):
      self._file = None
      try:  # gcsfs for gs://; without an fsspec filesystem (e.g. TensorFlow's gfile), rewrite
        self._fs = fsspec.filesystem(self._path.split('://', 1)[0])
      except (ImportError, ValueError):
        self._fs = None
    else:
      makedirs(os.path.dirname(os.path.abspath(p)))
      with writing(p):
        self._file = open(p, 'ab', buffering=0)  # unbuffered: nothing is left to flush later

  def write(self, text: str) -> None:
    if self._file is not None:
      with writing(self._path):
        end = self._file.seek(0, os.SEEK_END)
        data = memoryview(text.encode('utf-8'))
        try:
          while data:
            data = data[self._file.write(data):]
        except OSError:
          try:  # a full disk: no half line stays behind to merge with the next one
            self._file.truncate(end)
          except OSError:
            pass
          raise
      return
    self._pending.append(text)
    if time.monotonic() - self._last_flush >= self._flush_every_s:
      self.flush()

  def flush(self) -> None:
    """Makes every line written so far visible in the file."""
    if self._file is not None:
      return
    self._last_flush = time.monotonic()
    if not self._pending:
      return
    data = ''.join(self._pending).encode('utf-8')
    with writing(self._path):
      self._append_remote(data)
    self._pending.clear()

  def _append_remote(self, data: bytes) -> None:
    if not exists(self._path):
      write_bytes(self._path, data)
    elif hasattr(self._fs, 'merge'):  # gcsfs: Cloud Storage's compose
      part = f'{self._path}.part-{uuid.uuid4().hex[:12]}'
      write_bytes(part, data)
      try:
        self._fs.merge(self._path, [self._path, part])
      except NotImplementedError:  # e.g. a zonal bucket: no compose
        write_bytes(self._path, path(self._path).read_bytes() + data)
      finally:
        path(part).unlink(missing_ok=True)
    else:
      write_bytes(self._path, path(self._path).read_bytes() + data)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    else:
      self.flush()


def save_npz(p, arrays: dict[str, np.ndarray]) -> None:
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  write_bytes(p, buf.getvalue())


def load_npz(p) -> dict[str, np.ndarray]:
  with np.load(io.BytesIO(path(p).read_bytes())) as f:
    return {k: f[k] for k in f.files}


def save_directory(p, save: Callable[[str], None]) -> None:
  """``save(local_dir)`` (e.g. a tokenizer's save_pretrained), then its files into ``p``."""
  if not is_remote(p):
    makedirs(p)
    with writing(p):
      save(os.fspath(path(p)))
    return
  with tempfile.TemporaryDirectory() as tmp:
    save(tmp)
    for root, _, files in os.walk(tmp):
      for name in files:
        rel = os.path.relpath(os.path.join(root, name), tmp)
        with open(os.path.join(root, name), 'rb') as f:
          write_bytes(join(p, rel), f.read())


def fetch_directory(remote: str, local: str, patterns: tuple[str, ...],
                    chunk_bytes: int = 64 << 20) -> list[str]:
  """Copies the files of ``remote`` (one level, names matching one of the fnmatch ``patterns``)
  into the local directory ``local``, streamed ``chunk_bytes`` at a time (a multi-GB safetensors
  file never sits in memory), each through a temporary file and ``os.replace``. A file already
  there with the remote's size is kept (a second run reads the bucket's listing only). Returns
  the names copied or kept."""
  fs, root = fsspec.core.url_to_fs(remote)
  os.makedirs(local, exist_ok=True)
  names = []
  for entry in fs.ls(root, detail=True):
    name = entry['name'].rstrip('/').rsplit('/', 1)[-1]
    if entry.get('type') == 'directory' or not any(fnmatch.fnmatch(name, p) for p in patterns):
      continue
    names.append(name)
    dst = os.path.join(local, name)
    if os.path.exists(dst) and os.path.getsize(dst) == entry.get('size'):
      continue
    tmp = f'{dst}.{uuid.uuid4().hex}.tmp'
    with writing(dst), fs.open(entry['name'], 'rb') as src, open(tmp, 'wb') as out:
      while chunk := src.read(chunk_bytes):
        out.write(chunk)
    os.replace(tmp, dst)
  return names
