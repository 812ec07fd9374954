"""What a run reports: metrics.jsonl, TensorBoard and Weights & Biases rows (``log.report_to``),
the progress line, and the held-out accuracy lines."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Sequence

from absl import logging
import jax
import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga.config import LogConfig
from jaxrl_ga.errors import ConfigError


class MetricWriter:
  """metrics.jsonl (one object per logged step: phase, step, metrics), and as ``log.report_to``
  asks TensorBoard events and a Weights & Biases run (scalars ``phase/metric`` at the optimizer
  step, the run's config ``run_config``). Only process 0 writes. The workdir may be a bucket
  (gs://...)."""

  def __init__(self, workdir: str, log: LogConfig = LogConfig(),
               run_config: Optional[dict[str, Any]] = None):
    self._active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    self._wandb = None
    self._completions = None
    self._workdir = workdir
    if self._active:
      fileio.makedirs(workdir)
      if 'wandb' in log.report_to:  # first: a W&B run that cannot start leaves nothing open
        self._wandb = WandbRun(workdir, log, run_config or {})
      self._jsonl_path = fileio.join(workdir, 'metrics.jsonl')
      self._jsonl = fileio.TextAppender(self._jsonl_path)
      self._completions_path = fileio.join(workdir, 'completions.jsonl')
      if 'tensorboard' in log.report_to:
        # lazy: optional dependency (tensorboardX)
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self._tb_path = fileio.join(workdir, 'tensorboard')
        self._tb = SummaryWriter(self._tb_path)

  def write(self, phase: str, step: int, metrics: dict[str, Any]):
    if not self._active:
      return
    clean = {k: _to_float(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({'phase': phase, 'step': int(step), **clean}) + '\n')
    scalars = {f'{phase}/{k}': v for k, v in clean.items() if v is not None}
    if self._tb is not None:
      for name, v in scalars.items():
        self._tb.add_scalar(name, v, int(step))
    if self._wandb is not None:
      self._wandb.log(phase, step, scalars)

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
    if self._tb is not None:
      table = ['| ' + ' | '.join(keys) + ' |', '|' + ' --- |' * len(keys)] + [
          '| ' + ' | '.join(_cell(r.get(k)) for k in keys) + ' |' for r in records]
      self._tb.add_text(f'{phase}/completions', '\n'.join(table), int(step))
    if self._wandb is not None:
      self._wandb.log_table(phase, step, keys, records)

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
    """Flushes and closes the files and finishes the W&B run; a failed write raises
    fileio.WriteError, or with ``quiet`` (an error is already on its way out, e.g. the full
    disk's or a SIGTERM's) is logged at INFO, and the W&B run is marked failed."""
    if not self._active:
      return
    try:
      self._jsonl.close()
      if self._completions is not None:
        self._completions.close()
      if self._tb is not None:
        with fileio.writing(self._tb_path):
          self._tb.close()
    except fileio.WriteError as e:
      if not quiet:
        raise
      logging.info('%s', e)
    finally:
      if self._wandb is not None:
        self._wandb.finish(failed=quiet)
        self._wandb = None


class WandbRun:
  """The run's Weights & Biases run (``log.report_to`` names wandb; process 0 only). Each phase
  (``grpo``, ``grpo_eval``, ...) charts its scalars against its own ``<phase>/step``, the
  optimizer step, so stages and evaluations each have their x axis. The run's id is kept in
  WORKDIR/wandb_run_id: a resumed run continues the same W&B run. W&B's files go under the
  workdir when it is local and WANDB_DIR is unset; WANDB_MODE (e.g. offline) is W&B's own."""

  def __init__(self, workdir: str, log: LogConfig, run_config: dict[str, Any]):
    # lazy: optional dependency (wandb)
    import wandb  # pylint: disable=g-import-not-at-top
    self._wandb = wandb
    id_path = fileio.join(workdir, 'wandb_run_id')
    run_id = fileio.read_text(id_path).strip() if fileio.exists(id_path) else None
    local_dir = not fileio.is_remote(workdir) and not os.environ.get('WANDB_DIR')
    name = (log.wandb_run_name or os.environ.get('WANDB_NAME')
            or os.path.basename(os.path.normpath(workdir)))
    try:
      self._run = wandb.init(
          project=log.wandb_project or os.environ.get('WANDB_PROJECT') or 'jaxrl_ga',
          entity=log.wandb_entity or None, name=name, id=run_id, resume='allow',
          config=json.loads(json.dumps(run_config, default=str)),
          dir=workdir if local_dir else None)
    except (wandb.Error, OSError) as e:  # no login (online mode), no network, ...
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise ConfigError(f'log.report_to names wandb, but W&B could not start a run ({first}); '
                        f'run `wandb login` or set WANDB_API_KEY, or WANDB_MODE=offline.'
                        ) from None
    if run_id is None:
      fileio.write_text(id_path, self._run.id)
    self._phases: set[str] = set()

  def log(self, phase: str, step: int, scalars: dict[str, float]):
    if phase not in self._phases:
      self._phases.add(phase)
      self._run.define_metric(f'{phase}/step')
      self._run.define_metric(f'{phase}/*', step_metric=f'{phase}/step')
    self._run.log({f'{phase}/step': int(step), **scalars})

  def log_table(self, phase: str, step: int, keys: list[str], records: list[dict[str, Any]]):
    """Completions as a W&B table (chat messages as JSON text)."""
    cell = lambda v: v if v is None or isinstance(v, (int, float, str)) else json.dumps(
        v, ensure_ascii=False, default=str)
    table = self._wandb.Table(columns=keys, data=[[cell(r.get(k)) for k in keys]
                                                  for r in records])
    self.log(phase, step, {f'{phase}/completions': table})

  def finish(self, failed: bool):
    self._run.finish(exit_code=1 if failed else 0)


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
