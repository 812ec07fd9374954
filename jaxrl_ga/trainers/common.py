"""What the SFT, GRPO and DPO host loops share: the run context, tokenization into padded
batches, metrics output, the progress line, held-out evaluation, and stage checkpoints.

Host loops only move batches, call reward functions, log and checkpoint; every per-token
computation runs inside the jitted rollout and learner steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from typing import Any, Optional, Sequence

from absl import logging
import jax
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import fileio
from jaxrl_ga import sampling
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, RunConfig
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import chat


@dataclasses.dataclass
class RunContext:
  """Everything a stage needs besides its own config."""
  cfg: RunConfig
  workdir: str
  mesh: Any
  task: Any  # jaxrl_ga.tasks.base.Task
  tokenizer: Any  # transformers tokenizer
  model_cfg: tfm.ModelConfig
  graphdef: Any
  param_shardings: Any
  writer: 'MetricWriter'
  # SIGTERM/SIGINT -> a flag for the whole run (main.run holds it); None: each stage loop holds
  # its own.
  guard: Optional[checkpoint.PreemptionGuard] = None

  @property
  def is_primary(self) -> bool:
    return jax.process_index() == 0

  @property
  def eos_id(self) -> int:
    return int(self.tokenizer.eos_token_id)

  @property
  def pad_id(self) -> int:
    return int(self.tokenizer.pad_token_id)

  def checkpointer(self, stage: str) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(
        fileio.join(self.workdir, 'checkpoints', stage),
        max_to_keep=self.cfg.checkpoint.max_to_keep, fingerprint=self.fingerprint(stage))

  def fingerprint(self, stage: str) -> dict[str, Any]:
    """Every setting that changes what a stage checkpoint's state means: a resume with another
    value is refused. Lengths and cadences (RESUMABLE_SETTINGS, eval.*, checkpoint.*) and the
    mesh (orbax restores onto any sharding) may change."""
    stage_cfg = dataclasses.asdict(getattr(self.cfg, stage))
    for name in RESUMABLE_SETTINGS:
      stage_cfg.pop(name, None)
    stage_cfg.get('optimizer', {}).pop('max_consecutive_nonfinite', None)
    return _jsonable({'stage': stage, 'seed': self.cfg.seed, stage: stage_cfg,
                      'model': dataclasses.asdict(self.model_cfg),
                      'model_source': self.cfg.model.hf_path,
                      'task': dataclasses.asdict(self.cfg.task)})


# Stage settings that may change when a run resumes: how long it trains and how often it logs,
# evaluates and probes. Everything else of the stage is in its checkpoints' fingerprint.
RESUMABLE_SETTINGS = ('num_steps', 'log_every', 'eval_every', 'target_accuracy', 'probe_every',
                      'probe_examples')


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


# -- model -----------------------------------------------------------------------------------------
def model_config(cfg: RunConfig, vocab_size: int) -> tfm.ModelConfig:
  """The policy's architecture, read from ``model.hf_path``'s config (no weights) or built from
  the ``model.*`` fields with the tokenizer's ``vocab_size``."""
  spec = cfg.model
  if spec.hf_path:
    from jaxrl_ga.models import gguf  # pylint: disable=g-import-not-at-top
    if gguf.is_gguf_source(spec.hf_path):
      return gguf.model_config(gguf.resolve(spec.hf_path), dtype=spec.dtype,
                               param_dtype=spec.param_dtype)
    try:
      return hf.model_config_from_hf(spec.hf_path, dtype=spec.dtype,
                                     param_dtype=spec.param_dtype)
    except (OSError, ValueError, KeyError) as e:  # unknown model_type, unsupported feature
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ConfigError(f'model.hf_path={spec.hf_path}: {first} (supported: Qwen2ForCausalLM '
                        f'and LlamaForCausalLM checkpoints, or a llama GGUF file)') from None
  return spec.architecture_config(vocab_size)


def build_model(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh):
  """(graphdef, params, shardings) of ``model_cfg``: from HF weights or freshly initialised."""
  shardings_fn = functools.partial(sharding.param_shardings, mesh=mesh)
  if cfg.model.hf_path:
    _, graphdef, params = hf.load_model(cfg.model.hf_path, dtype=cfg.model.dtype,
                                        param_dtype=cfg.model.param_dtype,
                                        shardings_fn=shardings_fn)
    _, shapes, axes = sharding.abstract_model(model_cfg)
    return graphdef, params, shardings_fn(shapes, axes)
  return sharding.init_params(model_cfg, cfg.seed, mesh)


# -- tokenization --------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
  return tokenizer(text, add_special_tokens=False)['input_ids']


def encode_prompt(tokenizer, text: str) -> list[int]:
  """A task prompt's ids: through the tokenizer's chat template when it has one (a user message
  plus the assistant generation prompt; ``jaxrl_ga.tasks.chat``), else the raw text."""
  return chat.prompt_ids(tokenizer, text)


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, what: str):
  """-> tokens, mask [N, length] int32, right-aligned. Too long: ConfigError naming ``what``."""
  out = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ConfigError(f'a prompt of {len(s)} tokens exceeds {what}={length}; raise {what}.')
    if not s:
      raise ConfigError('an empty prompt: every prompt needs at least one token.')
    out[i, length - len(s):] = s
    mask[i, length - len(s):] = 1
  return out, mask


# -- metrics and progress ------------------------------------------------------------------------
class MetricWriter:
  """metrics.jsonl (one object per logged step: phase, step, metrics) and TensorBoard events.
  Only process 0 writes. The workdir may be a bucket (gs://...)."""

  def __init__(self, workdir: str):
    self._active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if self._active:
      fileio.makedirs(workdir)
      self._jsonl_path = fileio.join(workdir, 'metrics.jsonl')
      self._jsonl = fileio.TextAppender(self._jsonl_path)
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(fileio.join(workdir, 'tensorboard'))

  def write(self, phase: str, step: int, metrics: dict[str, Any]):
    if not self._active:
      return
    clean = {k: _to_float(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({'phase': phase, 'step': int(step), **clean}) + '\n')
    for k, v in clean.items():
      if v is not None:
        self._tb.add_scalar(f'{phase}/{k}', v, int(step))

  def drop_after(self, stage: str, step: int):
    """Drops the rows of ``stage`` (and its eval and probe rows) logged after optimizer step
    ``step``: a run resumed from that step logs them again. (TensorBoard keeps both; its
    viewer shows the later point.)"""
    if not self._active:
      return
    path = self._jsonl_path
    self._jsonl.close()  # flushes lines still buffered (a bucket's appender buffers)
    self._jsonl = None
    try:
      if not fileio.exists(path):
        return
      phases = {stage, f'{stage}_eval', f'{stage}_probe'}
      lines = fileio.read_text(path).splitlines(keepends=True)
      keep = [l for l in lines if not _logged_after(l, phases, step)]
      if len(keep) != len(lines):
        fileio.write_text(path, ''.join(keep))
    finally:
      self._jsonl = fileio.TextAppender(path)
    if len(keep) == len(lines):
      return
    logging.info('metrics.jsonl: dropped %d %s rows after step %d (resumed there)',
                 len(lines) - len(keep), stage, step)

  def close(self):
    if self._active:
      self._jsonl.close()
      self._tb.close()


def _logged_after(line: str, phases: set[str], step: int) -> bool:
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return not line.strip()  # a row cut short by a kill goes too
  return row.get('phase') in phases and int(row.get('step', 0)) > step


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


# -- evaluation ----------------------------------------------------------------------------------
class Evaluator:
  """Greedy held-out exact-match accuracy; one compile for the run (fixed batch shape)."""

  def __init__(self, ctx: RunContext, max_prompt_length: int, examples=None):
    """examples: default the task's held-out set (eval.num_examples of it)."""
    self.ctx = ctx
    ecfg = ctx.cfg.eval
    if examples is None:
      examples = ctx.task.eval_examples()
      examples = examples[:ecfg.num_examples] if ecfg.num_examples else examples
    self.examples = list(examples)
    self.max_prompt_length = max_prompt_length
    sampler = sampling.Sampler(max_completion_length=ecfg.max_completion_length,
                               eos_id=ctx.eos_id, pad_id=ctx.pad_id)
    self._generate = sampling.make_generate_fn(ctx.graphdef, sampler, greedy=True, mesh=ctx.mesh,
                                               param_shardings=ctx.param_shardings)
    self.batch_size = round_up(ecfg.batch_size, sharding.data_parallel_size(ctx.mesh))

  def accuracy(self, params) -> float:
    """Each process encodes, decodes and checks only the rows its devices hold."""
    ctx, bs = self.ctx, self.batch_size
    rows = sharding.batch_rows(bs, ctx.mesh)
    correct = np.zeros(bs, np.float32)
    for start in range(0, len(self.examples), bs):
      if ctx.guard is not None and ctx.guard.should_stop:  # a long evaluation is interruptible
        raise checkpoint.Preempted('', -1, ctx.guard.signal_received)
      n = min(bs, len(self.examples) - start)
      chunk = [self.examples[start + (r if r < n else 0)] for r in rows]  # fixed shape
      tokens, mask = sharding.shard_rows(lambda _: left_pad(
          [encode_prompt(ctx.tokenizer, e.prompt) for e in chunk], self.max_prompt_length,
          ctx.pad_id, 'max_prompt_length'), bs, ctx.mesh)
      out = self._generate(params, tokens, mask, jax.random.PRNGKey(0), 1.0, 1.0)
      texts = decode_completions(ctx.tokenizer, sharding.local_part(out.tokens)[1],
                                 sharding.local_part(out.mask)[1])
      correct[rows] += [float(r < n and ctx.task.is_correct(e, t))
                        for r, e, t in zip(rows, chunk, texts)]
    total = sharding.gather_rows(correct[rows], rows, bs, ctx.mesh).sum()
    return float(total) / max(len(self.examples), 1)


def to_host(x) -> np.ndarray:
  """The whole (global) array on this host. On several processes a batch-sharded array is not
  fully addressable: its rows are gathered from every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def decode_completions(tokenizer, tokens, mask) -> list[str]:
  """Completion texts, without EOS and padding."""
  tokens, mask = to_host(tokens), to_host(mask)
  eos = tokenizer.eos_token_id
  out = []
  for row, m in zip(tokens, mask):
    ids = [int(t) for t, keep in zip(row, m) if keep and t != eos]
    out.append(tokenizer.decode(ids, skip_special_tokens=True))
  return out


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


# -- the stage loop ------------------------------------------------------------------------------
class NonFiniteError(RuntimeError):
  """Too many optimizer-step windows in a row had a non-finite gradient."""


def fresh_meta() -> dict[str, Any]:
  """Host-side progress saved with every checkpoint."""
  return {'micro_step': 0, 'data_position': 0, 'done': False, 'summary': {}}


def restore(ctx: RunContext, ckpt, stage: str, state, k: int) -> tuple[Any, dict[str, Any]]:
  """The latest readable checkpoint of the stage onto ``state``'s shardings, or (state, fresh
  meta). Metrics rows the run logged after that checkpoint are dropped from metrics.jsonl, so a
  resumed run logs each step once."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = ckpt.restore_latest(abstract)
  if restored is None:
    ctx.writer.drop_after(stage, 0)
    return state, fresh_meta()
  meta = restored[1]
  if not meta['done']:
    print(f'[{stage}] resumed at micro-step {meta["micro_step"]} (optimizer step '
          f'{meta["micro_step"] // k}) from {ckpt.directory}', flush=True)
  logging.info('%s: resumed at micro-step %d', stage, meta['micro_step'])
  ctx.writer.drop_after(stage, meta['micro_step'] // k)
  return restored


def report_accuracy(ctx: RunContext, stage: str, step: int, accuracy: float, when: str):
  ctx.writer.write(f'{stage}_eval', step, {'accuracy': accuracy})
  print(f'[{stage}] held-out accuracy {when}: {accuracy:.3f}', flush=True)


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


def check_resume(ctx: RunContext) -> None:
  """Before any stage runs or compiles: every stage checkpoint of the workdir fits this run.

  Raises ConfigError (one line naming each changed setting, old and new value) if a checkpoint
  was written with settings that change what its state means, if an unfinished stage has
  trained past its num_steps, or if a finished stage's num_steps was raised after a later stage
  started from its result.
  """
  cfg = ctx.cfg
  records = {}
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
        records[stage] = meta
    finally:
      ckpt.close()
  for i, stage in enumerate(cfg.stages):
    if stage not in records:
      continue
    meta, k = records[stage], optimizer_every(cfg, stage)
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


def optimizer_every(cfg: RunConfig, stage: str) -> int:
  """K of a stage: micro-steps per optimizer step."""
  if stage == 'grpo':
    return cfg.grpo.schedule.optimizer_every
  return getattr(cfg, stage).grad_accum_steps


def run_micro_steps(ctx: RunContext, stage: str, ckpt, state, meta: dict[str, Any], *,
                    num_steps: int, k: int, log_every: int, step_fn, log_keys: Sequence[str],
                    max_consecutive_nonfinite: int, eval_every: int = 0, evaluate=None,
                    stop_at_micro_step: Optional[int] = None,
                    done_early=None) -> tuple[Any, Optional[str]]:
  """The loop every stage shares: micro-steps until ``num_steps`` optimizer steps, logging,
  periodic evaluation and checkpoints, and a clean stop on SIGTERM.

  step_fn(state, meta) -> (state, device outputs of the learner step, host metrics) runs one
  micro-step and advances meta['data_position'] itself. Returns (state, why it ended early or
  None): 'stop_at_micro_step' (``stop_at_micro_step`` reached: checkpointed, the test hook of an
  interrupted run) or 'done_early' (``done_early(step, state)``, asked after every optimizer
  step, said so: a normal finish such as SFT reaching its target accuracy).

  Raises checkpoint.Preempted after checkpointing when SIGTERM/SIGINT arrived (also during an
  evaluation), and NonFiniteError when ``max_consecutive_nonfinite`` windows in a row were
  skipped (no checkpoint is written after the first of them). On every way out, errors
  included, the checkpoint writes already started are finished first.
  """
  total = num_steps * k
  progress = Progress(stage, num_steps, start=meta['micro_step'] // k)
  every = ctx.cfg.checkpoint.every_steps
  s, last_saved, pending = meta['micro_step'], None, None
  guard = ctx.guard if ctx.guard is not None else checkpoint.PreemptionGuard()
  nested = ctx.guard is None
  try:
    with (guard if nested else contextlib.nullcontext()):
      try:
        while s < total:
          state, out, host_metrics = step_fn(state, meta)
          s += 1
          meta['micro_step'] = s
          if s % k == 0:
            step = s // k
            # The previous window's status, fetched one step late so the host never waits.
            if pending is not None:
              _check_finite(stage, pending, max_consecutive_nonfinite)
            pending = (step, out['nonfinite_consecutive'])
            if step % log_every == 0 or step == num_steps:
              metrics = jax.device_get(out) | host_metrics
              metrics.pop('stepped', None)
              ctx.writer.write(stage, step, metrics)
              progress.update(step, fmt_metrics(metrics, log_keys), force=True)
            if eval_every and step % eval_every == 0 and step < num_steps:
              report_accuracy(ctx, stage, step, evaluate(state), f'at step {step}')
            if done_early is not None and done_early(step, state):
              return state, 'done_early'  # the caller's finish() writes the last checkpoint
            if every and step % every == 0 and step < num_steps:
              if int(pending[1]) == 0:  # never save a bad window (checked at the next step)
                ckpt.save(s, state, meta)
                last_saved = s
          stop = guard.should_stop_at(s)
          if stop or s == stop_at_micro_step:
            if last_saved != s:
              ckpt.save(s, state, meta)
              last_saved = s
            ckpt.wait()
            if stop:
              raise checkpoint.Preempted(stage, s, guard.signal_received)
            return state, 'stop_at_micro_step'
        if pending is not None:
          _check_finite(stage, pending, max_consecutive_nonfinite)
      except checkpoint.Preempted:
        if last_saved != s:
          ckpt.save(s, state, meta)
        ckpt.wait()
        raise
  finally:
    wait_quietly(ckpt)
  return state, None


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
  except Exception:  # pylint: disable=broad-except
    logging.exception('a checkpoint write failed')


def evaluate_or_save(ctx: RunContext, ckpt, state, meta: dict[str, Any], evaluate) -> float:
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
