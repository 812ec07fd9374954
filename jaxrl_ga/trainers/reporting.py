"""What a run reports: metrics.jsonl and TensorBoard rows, the progress line, and the held-out
accuracy lines."""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Sequence

from absl import logging
import jax
import numpy as np

from jaxrl_ga import fileio


class MetricWriter:
  """metrics.jsonl (one object per logged step: phase, step, metrics) and TensorBoard events.
  Only process 0 writes. The workdir may be a bucket (gs://...)."""

  def __init__(self, workdir: str):
    self._active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    self._completions = None
    self._workdir = workdir
    if self._active:
      fileio.makedirs(workdir)
      self._jsonl_path = fileio.join(workdir, 'metrics.jsonl')
      self._jsonl = fileio.TextAppender(self._jsonl_path)
      self._completions_path = fileio.join(workdir, 'completions.jsonl')
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb_path = fileio.join(workdir, 'tensorboard')
      self._tb = SummaryWriter(self._tb_path)

  def write(self, phase: str, step: int, metrics: dict[str, Any]):
    if not self._active:
      return
    clean = {k: _to_float(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({'phase': phase, 'step': int(step), **clean}) + '\n')
    for k, v in clean.items():
      if v is not None:
        self._tb.add_scalar(f'{phase}/{k}', v, int(step))

  def write_completions(self, phase: str, step: int, micro_step: int,
                        records: list[dict[str, Any]]):
    """Sampled completions of the rollout generated at ``micro_step``: one JSON object per
    completion in completions.jsonl (with phase, optimizer step and micro-step), and one
    TensorBoard text entry per call."""
    if not self._active or not records:
      return
    if self._completions is None:
      self._completions = fileio.TextAppender(self._completions_path)
    for r in records:
      self._completions.write(json.dumps({'phase': phase, 'step': int(step),
                                          'micro_step': int(micro_step), **r},
                                         ensure_ascii=False, default=str) + '\n')
    keys = list(records[0])
    table = ['| ' + ' | '.join(keys) + ' |', '|' + ' --- |' * len(keys)] + [
        '| ' + ' | '.join(_cell(r.get(k)) for k in keys) + ' |' for r in records]
    self._tb.add_text(f'{phase}/completions', '\n'.join(table), int(step))

  def drop_after(self, stage: str, step: int, micro_step: int):
    """A run resumed at ``micro_step`` (optimizer step ``step``) logs again what came after it:
    drops from metrics.jsonl the rows of ``stage`` (and its eval and probe rows) logged after
    optimizer step ``step``, and from completions.jsonl the completions of the rollouts
    generated at or after ``micro_step``. (TensorBoard keeps both; its viewer shows the later
    point.)"""
    if not self._active:
      return
    phases = {stage, f'{stage}_eval', f'{stage}_probe'}
    self._jsonl.close()  # flushes lines still buffered (a bucket's appender buffers)
    try:
      dropped = _drop_rows(self._jsonl_path, lambda row: row.get('phase') in phases
                           and int(row.get('step', 0)) > step)
    finally:
      self._jsonl = fileio.TextAppender(self._jsonl_path)
    if self._completions is not None:
      self._completions.close()
      self._completions = None
    dropped_completions = _drop_rows(self._completions_path, lambda row: row.get(
        'phase') == stage and int(row.get('micro_step', 0)) >= micro_step)
    for name, n in (('metrics.jsonl', dropped), ('completions.jsonl', dropped_completions)):
      if n:
        logging.info('%s: dropped %d %s rows after micro-step %d (resumed there)', name, n,
                     stage, micro_step)

  def close(self, quiet: bool = False):
    """Flushes and closes both files; a failed write raises fileio.WriteError, or with ``quiet``
    (an error is already on its way out, e.g. the full disk's) is logged at INFO."""
    if not self._active:
      return
    try:
      self._jsonl.close()
      if self._completions is not None:
        self._completions.close()
      with fileio.writing(self._tb_path):
        self._tb.close()
    except fileio.WriteError as e:
      if not quiet:
        raise
      logging.info('%s', e)


def _cell(value) -> str:
  """A markdown table cell: text on one line, pipes escaped."""
  text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
  return text.replace('|', '\\|').replace('\n', '\\n')


def _drop_rows(path: str, after) -> int:
  """Rewrites the JSON-lines file ``path`` without the rows ``after(row)`` selects and without a
  row a kill cut short (or a blank line). -> how many lines went."""
  if not fileio.exists(path):
    return 0
  lines = fileio.read_text(path).splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if not after(row):
      keep.append(line if line.endswith('\n') else line + '\n')  # a whole row, newline cut
  if keep != lines:
    fileio.write_text(path, ''.join(keep))
  return len(lines) - len(keep)


def _to_float(v) -> Optional[float]:
  v = float(np.asarray(v))
  return v if np.isfinite(v) else None


class Progress:
  """A progress line with rate and ETA, printed by process 0 at most every ``min_interval`` s."""

  def __init__(self, phase: str, total: int, start: int = 0, min_interval: float = 2.0):
    self.phase, self.total, self.start = phase, total, start
    self.t0 = time.time()
    self.min_interval = min_interval
    self._last = 0.0

  def update(self, done: int, extra: str = '', force: bool = False):
    now = time.time()
    if jax.process_index() != 0 or (not force and now - self._last < self.min_interval):
      return
    self._last = now
    rate = (now - self.t0) / max(done - self.start, 1)
    eta = rate * (self.total - done)
    print(f'[{self.phase}] {done}/{self.total} ({100 * done / max(self.total, 1):.0f}%) '
          f'{rate:.2f} s/step, ETA {_fmt_s(eta)}{"  " + extra if extra else ""}', flush=True)

def _fmt_s(s: float) -> str:
  s = int(round(s))
  return f'{s // 60}m{s % 60:02d}s' if s >= 60 else f'{s}s'

def fmt_metrics(m: dict[str, Any], keys: Sequence[str]) -> str:
  return '  '.join(f'{k} {float(np.asarray(m[k])):.4g}' for k in keys if k in m)

def report_accuracy(ctx, stage: str, step: int, results, when: str):
  """One held-out evaluation: an accuracy, or ``Evaluator.evaluate``'s dict (accuracy None when
  no reward marks correctness; reward and metric means besides) -> metrics.jsonl, TensorBoard
  and one console line."""
  results = results if isinstance(results, dict) else {'accuracy': results}
  ctx.writer.write(f'{stage}_eval', step, {k: v for k, v in results.items() if v is not None})
  accuracy = results['accuracy']
  others = ''.join(f', {k} {v:.4g}' for k, v in results.items()
                   if k != 'accuracy' and v is not None)
  print(f'[{stage}] held-out accuracy {when}: '
        f'{"n/a (no reward marks correctness)" if accuracy is None else f"{accuracy:.3f}"}'
        f'{others}', flush=True)
