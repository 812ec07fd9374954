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
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import uuid
from typing import Callable

from etils import epath
import fsspec
import numpy as np


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def path(p) -> epath.Path:
  """An epath.Path; local paths are made absolute (orbax requires it)."""
  p = os.fspath(p)
  return epath.Path(p if is_remote(p) else os.path.abspath(p))


def join(*parts) -> str:
  return os.fspath(path(parts[0]).joinpath(*parts[1:]))


def makedirs(p) -> None:
  path(p).mkdir(parents=True, exist_ok=True)


def exists(p) -> bool:
  return path(p).exists()


def write_bytes(p, data: bytes) -> None:
  """Writes ``p`` whole and atomically (readers see the old or the new content)."""
  target = path(p)
  target.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(p):
    target.write_bytes(data)
    return
  tmp = os.fspath(target.parent / f'.{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp')
  try:
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


class TextAppender:
  """Appends to a text file: an open file locally (flushed at every write), a composed object in
  a bucket.

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
      self._file = open(p, 'a', encoding='utf-8')

  def write(self, text: str) -> None:
    if self._file is not None:
      self._file.write(text)
      self._file.flush()
      return
    self._pending.append(text)
    if time.monotonic() - self._last_flush >= self._flush_every_s:
      self.flush()

  def flush(self) -> None:
    """Makes every line written so far visible in the file."""
    if self._file is not None:
      self._file.flush()
      return
    self._last_flush = time.monotonic()
    if not self._pending:
      return
    data = ''.join(self._pending).encode('utf-8')
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
    self._pending.clear()

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
    save(os.fspath(path(p)))
    return
  with tempfile.TemporaryDirectory() as tmp:
    save(tmp)
    for root, _, files in os.walk(tmp):
      for name in files:
        rel = os.path.relpath(os.path.join(root, name), tmp)
        with open(os.path.join(root, name), 'rb') as f:
          write_bytes(join(p, rel), f.read())
