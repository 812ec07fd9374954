"""What a stage is to the run (``Stage``: its config, checks, programs and ``run``; the
registered ones: ``trainers/registry.py``) and a stage's life around its own training loop:
restore or start, the bookkeeping of each micro-step (``StageLoop``: logging, periodic
evaluation, checkpoints, non-finite windows, a clean stop on SIGTERM), the final evaluation and
the finished checkpoint.

Each stage module (``sft``, ``grpo``, ``dpo``) writes its loop itself, top to bottom::

    state, meta = stage.restore(ctx, ckpt, 'grpo', fresh_state, k)
    with stage.StageLoop(ctx, 'grpo', ckpt, meta, ...) as loop:
      while not loop.done:
        ...                                  # rollout when due, micro-batch, learner step
        step = loop.micro_step_done(state, out)  # the optimizer step that fired, or 0
        if step:
          loop.log(step, out, host_metrics)
          if loop.eval_due(step):
            loop.report_eval(step, evaluator.accuracy(params))
          loop.save_if_due(step, state)
        if loop.stop_requested(state):       # SIGTERM: saves, raises Preempted
          break
    accuracy = stage.evaluate_or_save(ctx, ckpt, state, meta, evaluate)
    stage.finish(ckpt, state, meta, summary)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from absl import logging
import jax
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import placement
from jaxrl_ga import schedule
from jaxrl_ga.config import RunConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import policy
from jaxrl_ga.trainers import reporting


# -- what a stage is to the run -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measured:
  """The prompts measured before any stage runs (api.validate_lengths), for a stage's own
  lengths (``Stage.choose_lengths``, ``Stage.length_limits``)."""
  source: str  # what they came from: 'data.train/data.eval' or "task 'arith'"
  train: list  # the training examples measured (none where the stage's data checks its own)
  prompt_eval: int  # tokens of the longest held-out prompt
  prompt_longest: int  # tokens of the longest prompt measured, training and held-out
  # The ids sampling stops at, the tokenizer's eos first (policy.stop_ids), which a reference
  # reply ends with (text.encode_reply); (): the tokenizer's eos alone.
  stops: tuple[int, ...] = ()


class Stage:
  """A stage of a run (``stages=sft,grpo``), registered by its ``name`` (trainers/registry.py):
  api.py validates, sizes and runs every stage through these methods and names none. A stage
  trains the policy it is given and hands its result to the next (docs/design.md, "Stages").

  The defaults are those of a stage that trains on fixed micro-batches (SFT, DPO): K is
  ``grad_accum_steps`` and the micro-batch splits over the data-parallel shards.
  """

  name: str = ''  # the stage's name in ``stages`` and its config's field of RunConfig
  config_type: type = type(None)  # that field's type (SFTConfig, GRPOConfig, DPOConfig)
  # Whether api.build_context prints each length chosen from the data (GRPO's first rollout
  # reports its prompt width itself).
  announces_chosen_lengths: bool = True

  def config(self, cfg: RunConfig):
    """The stage's config (``cfg.<name>``)."""
    return getattr(cfg, self.name)

  def validate(self, cfg: RunConfig, dp: int) -> None:
    """ConfigError for a setting of the stage that cannot run on ``dp`` data-parallel shards,
    or that contradicts another, before anything is built (api.validate_against_mesh)."""
    schedule.check_micro_batch(self.config(cfg).micro_batch_size, dp,
                               name=f'{self.name}.micro_batch_size')

  def validate_roles(self, cfg: RunConfig, meshes: dict) -> None:
    """ConfigError for a setting that cannot run on a role's own mesh (``meshes``: role ->
    mesh, sharding.role_meshes); only GRPO's rollout and reference may have one."""

  def optimizer_every(self, stage_cfg) -> int:
    """K of the stage: micro-steps per optimizer step."""
    return stage_cfg.grad_accum_steps

  def owned_positions(self, cfg: RunConfig, mesh) -> Optional[Callable[[int], bool]]:
    """Whether this process trains on the training row at a data position (the rows
    data.build_task checks on this process); None: the stage has no rule of its own."""
    return None

  def choose_lengths(self, cfg: RunConfig, task, tokenizer, model_cfg, measured: Measured
                     ) -> tuple[RunConfig, dict[str, int]]:
    """The stage's own lengths left at 0 (prompt widths aside: api._choose_lengths), chosen
    from the data. -> (cfg with them, {setting: the longest sequence it holds})."""
    return cfg, {}

  def length_limits(self, cfg: RunConfig, task, tokenizer, measured: Measured
                    ) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
    """The stage's own lengths (prompt widths aside) against the data and the model. ->
    ([(setting, value, tokens the data needs)], [(what, positions a sequence can take)])."""
    return [], []

  def check_inputs(self, cfg: RunConfig, task, model_cfg) -> None:
    """ConfigError for a refused input of the stage (a reward function, a reference model),
    before anything compiles."""

  def programs(self, ctx, stage_cfg, **inputs):
    """The stage's compiled programs (``jaxrl_ga.programs``), fitted to the device's memory."""
    raise NotImplementedError

  def run(self, ctx, params) -> tuple[Any, dict[str, Any]]:
    """Trains (or resumes) the stage from ``params`` with ``ctx.cfg``. -> (params, summary)."""
    raise NotImplementedError


# The stream of training examples (seed + this) that the checks before any stage read
# (api.validate_lengths, the reward functions' dry call).
LENGTH_CHECK_STREAM = 7907


# A length chosen from the data (a setting of 0) is rounded up to a multiple of this: nothing in
# the mesh constrains it (no axis shards the sequence; the splash kernel pads to its own block),
# and a few widths only keep the compiled shapes stable when a dataset grows a little.
PROMPT_WIDTH_MULTIPLE = 8


def rounded_up(needed: int, room: int) -> int:
  """``needed`` tokens rounded up to PROMPT_WIDTH_MULTIPLE, but not past ``room`` (the model's
  positions left) when ``needed`` itself still fits; past it the position check names both."""
  step = PROMPT_WIDTH_MULTIPLE
  return min(max(step, -(-needed // step) * step), max(needed, room))


def check_rollout_chunk(stage: str, sampling_cfg, n: int, what: str) -> None:
  """``<stage>.sampling.rollout_micro_batch_size`` divides the ``n`` rows generated at once
  (``what`` says which)."""
  size = sampling_cfg.rollout_micro_batch_size
  if 0 < size < n and n % size:
    divisors = [d for d in range(1, n) if n % d == 0]
    near = ([d for d in divisors if d < size][-1:] + [d for d in divisors if d > size][:1])
    raise ConfigError(
        f'{stage}.sampling.rollout_micro_batch_size={size} must divide the {n} rows generated '
        f'at once ({what}); set it to {" or ".join(map(str, near))}, or 0 (all at once).')


def on_every_process(what: str, fn, catch: tuple[type[BaseException], ...] = (ConfigError,)):
  """``fn()``, whose ConfigError (or other ``catch``) on any process stops every process (the
  process that found it raises its own error; the others a ConfigError naming the processes)
  instead of leaving them waiting at the first collective. -> what fn returns."""
  error = out = None
  try:
    out = fn()
  except catch as e:  # pylint: disable=catching-non-exception
    error = e
  failed = np.flatnonzero(placement.per_process(error is not None)).tolist()
  if error is not None:
    raise error
  if failed:
    raise ConfigError(f'{what} on process(es) {failed} (their error names it); fix it there.')
  return out


class NonFiniteError(RuntimeError):
  """Too many optimizer-step windows in a row had a non-finite gradient."""


def fresh_meta() -> dict[str, Any]:
  """Host-side progress saved with every checkpoint."""
  return {'micro_step': 0, 'data_position': 0, 'done': False, 'summary': {}}


def restore(ctx, ckpt, stage: str, state, k: int,
            added: Sequence[checkpoint.AddedLeaf] = ()) -> tuple[Any, dict[str, Any]]:
  """The latest readable checkpoint of the stage onto ``state``'s shardings, or (state, fresh
  meta). Metrics rows the run logged after that checkpoint are dropped from metrics.jsonl, so a
  resumed run logs each step once. ``added``: leaves older checkpoints lack
  (``Checkpointer.restore``)."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = ckpt.restore_latest(abstract, added)
  if restored is None:
    ctx.writer.drop_after(stage, 0, 0)
    meta = fresh_meta()
    digest = getattr(ctx.task, 'data_digest', None)
    if digest:  # the rows this stage trains on; check_resume refuses other rows
      meta['data_digest'] = digest
    base = base_digest(ctx.cfg)
    if base:  # LoRA: the frozen base, read again at every resume and export
      meta['base_digest'] = base
    return state, meta
  meta = restored[1]
  if not meta['done']:
    print(f'[{stage}] resumed at micro-step {meta["micro_step"]} (optimizer step '
          f'{meta["micro_step"] // k}) from {ckpt.directory}', flush=True)
  logging.info('%s: resumed at micro-step %d', stage, meta['micro_step'])
  ctx.writer.drop_after(stage, meta['micro_step'] // k, meta['micro_step'])
  return restored


def base_digest(cfg) -> Optional[str]:
  """Of a LoRA run on model.hf_path: ``policy.weights_digest`` of its frozen base weights,
  which a resume and an export read again from there (None otherwise)."""
  if not (cfg.model.lora.rank and cfg.model.hf_path):
    return None
  return policy.weights_digest(cfg.model.hf_path)


def trains_on(stage: str, meta: dict[str, Any], num_steps: int, k: int) -> bool:
  """Whether a restored stage has work left: False for a finished stage (it is skipped), True
  for an unfinished one or for a finished one whose num_steps was raised since (it trains on, as
  one longer run would; a stage ended by its target accuracy stays finished)."""
  if not meta['done']:
    return True
  done_steps = meta['micro_step'] // k
  if meta['summary'].get(f'{stage}/stopped_at_target') or num_steps <= done_steps:
    print(f'[{stage}] already finished ({done_steps} optimizer steps); skipping', flush=True)
    return False
  print(f'[{stage}] finished at step {done_steps}; {stage}.num_steps={num_steps}: training on',
        flush=True)
  meta['done'] = False
  return True


def check_resume(ctx, stages: Sequence[Stage]) -> None:
  """Before any stage runs or compiles: every stage checkpoint of the workdir fits this run
  (``stages``: the run's, in order).

  Raises ConfigError (one line naming each changed setting, old and new value) if a checkpoint
  was written with settings that change what its state means, or while data.train held other
  rows (``rows.source_digest``; an unfinished stage only), if an unfinished stage has
  trained past its num_steps, or if a finished stage's num_steps was raised after a later stage
  started from its result.
  """
  cfg = ctx.cfg
  records = {}
  digest = getattr(ctx.task, 'data_digest', None)
  base = None  # base_digest(cfg), read once, when a checkpoint has one to compare
  for stage in cfg.stages:
    ckpt = ctx.checkpointer(stage)
    try:
      record = ckpt.latest_record()
      if record is not None:
        step, fingerprint, meta = record
        try:
          ckpt.check_fingerprint(step, fingerprint)
        except checkpoint.CheckpointMismatchError as e:
          raise ConfigError(str(e)) from None
        if digest and meta.get('data_digest', digest) != digest and not meta['done']:
          raise ConfigError(
              f'data.train: its rows differ from those the {stage} checkpoint in {ctx.workdir} '
              f'was training on (another content, rows added or removed): the data order and '
              f'the held-out split depend on them, so the run would not continue as it began. '
              f'Restore the data, or start a fresh --workdir (model.hf_path may be an export '
              f'of this one, python -m jaxrl_ga.export).')
        if meta.get('base_digest'):
          base = base or base_digest(cfg)
          if base and meta['base_digest'] != base:
            raise ConfigError(policy.BASE_CHANGED.format(
                source=f'model.hf_path={cfg.model.hf_path}', where=ckpt.directory,
                use='resumed'))
        records[stage] = meta
    finally:
      ckpt.close()
  for i, stage in enumerate(cfg.stages):
    if stage not in records:
      continue
    meta, k = records[stage], stages[i].optimizer_every(stages[i].config(cfg))
    steps, num_steps = meta['micro_step'] // k, getattr(cfg, stage).num_steps
    if not meta['done'] and meta['micro_step'] > num_steps * k:
      raise ConfigError(
          f'{stage}.num_steps={num_steps}, but the {stage} checkpoint in {ctx.workdir} is at '
          f'optimizer step {steps}; set {stage}.num_steps to {steps} or more, or use a fresh '
          f'--workdir.')
    later = [s for s in cfg.stages[i + 1:] if s in records]
    if (meta['done'] and num_steps > steps and later
        and not meta['summary'].get(f'{stage}/stopped_at_target')):
      raise ConfigError(
          f'{stage}.num_steps={num_steps}, but {stage} finished at step {steps} and {later[0]} '
          f'has already trained from that result; set {stage}.num_steps back to {steps}, or '
          f'use a fresh --workdir to train a longer {stage}.')


# -- the loop's bookkeeping ---------------------------------------------------------------------
class StageLoop:
  """The bookkeeping between a stage's micro-steps, called by name from the stage's own loop.

  A context manager: inside it SIGTERM/SIGINT set a flag (``ctx.guard``, or a guard of its
  own), never kill a step half-way. On the way out: after a normal end, the last window's
  finiteness is checked; after a Preempted, the stop's checkpoint is written; on every way out,
  errors included, the checkpoint writes already started are finished first.

  ``meta['micro_step']`` is the progress (saved with every checkpoint); ``micro_step_done``
  advances it. The non-finite status of a window is fetched one optimizer step late, so the host
  never waits for the device; a checkpoint is written only after a finite window.
  """

  def __init__(self, ctx, stage: str, ckpt, meta: dict[str, Any], *, num_steps: int,
               optimizer_every: int, log_every: int, log_keys: Sequence[str],
               max_consecutive_nonfinite: int, eval_every: int = 0,
               stop_at_micro_step: Optional[int] = None):
    self.ctx, self.stage, self.ckpt, self.meta = ctx, stage, ckpt, meta
    self.num_steps, self.k = num_steps, optimizer_every
    self.log_every, self.log_keys, self.eval_every = log_every, log_keys, eval_every
    self.max_consecutive_nonfinite = max_consecutive_nonfinite
    self.stop_at_micro_step = stop_at_micro_step  # the test hook of an interrupted run
    self.stopped = False  # stop_at_micro_step was reached (checkpointed)
    self._progress = reporting.Progress(stage, num_steps, start=meta['micro_step'] // self.k)
    self._every = ctx.cfg.checkpoint.every_steps
    self._own_guard = ctx.guard is None
    self._guard = checkpoint.PreemptionGuard() if self._own_guard else ctx.guard
    self._pending = None  # (optimizer step, its device-side count of non-finite windows)
    self._last_saved = None
    self._state = None  # the state after the last counted micro-step

  @property
  def micro_step(self) -> int:
    return self.meta['micro_step']

  @property
  def done(self) -> bool:
    """All ``num_steps`` optimizer steps are done."""
    return self.micro_step >= self.num_steps * self.k

  def __enter__(self) -> 'StageLoop':
    if self._own_guard:
      self._guard.__enter__()
    return self

  def micro_step_done(self, state, out: dict[str, Any]) -> int:
    """Counts the micro-step that produced ``state`` (what a stop checkpoints) and learner
    outputs ``out``. -> the optimizer step (1-based) that fired after it, or 0. Raises
    NonFiniteError when the previous window made ``max_consecutive_nonfinite`` skipped windows
    in a row."""
    self._state = state
    self.meta['micro_step'] += 1
    if self.micro_step % self.k:
      return 0
    step = self.micro_step // self.k
    if self._pending is not None:
      _check_finite(self.stage, self._pending, self.max_consecutive_nonfinite)
    self._pending = (step, out['nonfinite_consecutive'])
    return step

  def log(self, step: int, out: dict[str, Any], host_metrics: dict[str, Any]) -> None:
    """Every ``log_every`` steps and at the last: the window's metrics to metrics.jsonl and
    TensorBoard, and the progress line."""
    if step % self.log_every and step != self.num_steps:
      return
    metrics = jax.device_get(out) | host_metrics
    metrics.pop('stepped', None)
    self.ctx.writer.write(self.stage, step, metrics)
    self._progress.update(step, reporting.fmt_metrics(metrics, self.log_keys), force=True)

  def eval_due(self, step: int) -> bool:
    return bool(self.eval_every) and step % self.eval_every == 0 and step < self.num_steps

  def report_eval(self, step: int, results) -> None:
    """An accuracy, or an ``Evaluator.evaluate`` dict."""
    reporting.report_accuracy(self.ctx, self.stage, step, results, f'at step {step}')

  def save_if_due(self, step: int, state) -> None:
    """Every ``checkpoint.every_steps`` optimizer steps (not the last: ``finish`` writes it),
    unless the window just ended was not finite (it is checked at the next step)."""
    if (self._every and step % self._every == 0 and step < self.num_steps
        and int(self._pending[1]) == 0):
      self._save(state)

  def stop_requested(self, state) -> bool:
    """After a SIGTERM/SIGINT (agreed by every process): checkpoints and raises
    checkpoint.Preempted. At ``stop_at_micro_step``: checkpoints and returns True."""
    stop = self._guard.should_stop_at(self.micro_step)
    if not stop and self.micro_step != self.stop_at_micro_step:
      return False
    self._save(state)
    self.ckpt.wait()
    if stop:
      raise checkpoint.Preempted(self.stage, self.micro_step, self._guard.signal_received)
    self.stopped = True
    return True

  def _save(self, state) -> None:
    if self._last_saved != self.micro_step:
      self.ckpt.save(self.micro_step, state, self.meta)
      self._last_saved = self.micro_step

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is None and not self.stopped and self._pending is not None:
        _check_finite(self.stage, self._pending, self.max_consecutive_nonfinite)
      elif (exc_type is not None and issubclass(exc_type, checkpoint.Preempted)
            and self._state is not None):  # e.g. a SIGTERM during a periodic evaluation
        self._save(self._state)
        self.ckpt.wait()
    finally:
      try:
        if self._own_guard:
          self._guard.__exit__(exc_type, exc, tb)
      finally:
        if exc_type is None:
          self.ckpt.wait()  # a failed write is this way out's error
        else:
          wait_quietly(self.ckpt)


def _check_finite(stage: str, pending, limit: int) -> None:
  step, consecutive = pending
  consecutive = int(consecutive)
  if consecutive:
    logging.warning('%s: the gradient of optimizer step %d was not finite; the window was '
                    'skipped (%d in a row)', stage, step, consecutive)
  if consecutive >= limit:
    raise NonFiniteError(
        f'{stage}: {consecutive} optimizer-step windows in a row had a non-finite gradient (the '
        f'last at step {step}); stopping. The last checkpoint is from before them. Lower '
        f'{stage}.optimizer.learning_rate, check the data, or raise '
        f'{stage}.optimizer.max_consecutive_nonfinite.')


def wait_quietly(ckpt) -> None:
  """Finishes the checkpoint writes in flight; on an error path, a failing write is logged
  instead of hiding the error that is on its way out."""
  try:
    ckpt.wait()
  except Exception as e:  # pylint: disable=broad-except
    logging.error('a checkpoint write failed as well: %s', e)


def evaluate_or_save(ctx, ckpt, state, meta: dict[str, Any], evaluate) -> float:
  """``evaluate(state)`` at the end of a stage; a stop requested meanwhile checkpoints the
  stage (not marked done: a re-run evaluates again and finishes) and raises Preempted."""
  try:
    accuracy = evaluate(state)
    if ctx.guard is not None and ctx.guard.should_stop:
      raise checkpoint.Preempted('', meta['micro_step'], ctx.guard.signal_received)
    return accuracy
  except checkpoint.Preempted as e:
    if ckpt.latest_step() != meta['micro_step']:
      ckpt.save(meta['micro_step'], state, meta)
    ckpt.wait()
    raise checkpoint.Preempted(ckpt.directory.name, meta['micro_step'], e.signum) from None


def finish(ckpt, state, meta: dict[str, Any], summary: dict[str, Any]) -> None:
  """The stage's last checkpoint, marked done with its summary (a re-run skips the stage)."""
  meta.update(done=True, summary=summary)
  ckpt.save(meta['micro_step'], state, meta, replace=True)
  ckpt.wait()
