"""Workdir files on a local disk or in a bucket (``gs://...``), through ``etils.epath``.

A multi-host run needs a workdir that every host sees: orbax writes one checkpoint cooperatively.
Everything else a run writes there (metrics.jsonl, summary.json, tokenizer/, dpo_pairs.npz) goes
through these few functions, so ``--workdir=gs://bucket/run`` works as a local path does. Bucket
paths need ``gcsfs`` (and ``google-cloud-storage`` for TensorBoard events): the ``[tpu]`` extra.

Local writes are atomic (a temporary file, then ``os.replace``); an object-store write is atomic
by itself. Object stores cannot append, so ``append_text`` rewrites the object: fine for the small
logs written here.
"""

from __future__ import annotations

import io
import os
import tempfile
import uuid
from typing import Callable

from etils import epath
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
  """Appends to a text file: an open file locally, a rewritten object in a bucket."""

  def __init__(self, p):
    self._path = p
    if is_remote(p):
      self._text = read_text(p) if exists(p) else ''
      self._file = None
    else:
      makedirs(os.path.dirname(os.path.abspath(p)))
      self._file = open(p, 'a', encoding='utf-8')

  def write(self, text: str) -> None:
    if self._file is None:
      self._text += text
      write_text(self._path, self._text)
    else:
      self._file.write(text)
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


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
