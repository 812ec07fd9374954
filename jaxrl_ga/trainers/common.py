"""What the SFT, GRPO and DPO host loops share: the run context, tokenization into padded
batches, metrics output, the progress line, held-out evaluation, and stage checkpoints.

Host loops only move batches, call reward functions, log and checkpoint; every per-token
computation runs inside the jitted rollout and learner steps.
"""

from __future__ import annotations

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
        max_to_keep=self.cfg.checkpoint.max_to_keep,
        # What must not change across a resume (lengths like num_steps may).
        fingerprint={'model': _jsonable(dataclasses.asdict(self.model_cfg)),
                     'task': _jsonable(dataclasses.asdict(self.cfg.task)),
                     'seed': self.cfg.seed, 'stage': stage})


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


# -- model -----------------------------------------------------------------------------------------
def build_model(cfg: RunConfig, vocab_size: int, mesh):
  """(model_cfg, graphdef, params, shardings): from HF weights or freshly initialised."""
  spec = cfg.model
  shardings_fn = functools.partial(sharding.param_shardings, mesh=mesh)
  if spec.hf_path:
    model_cfg, graphdef, params = hf.load_model(spec.hf_path, dtype=spec.dtype,
                                                param_dtype=spec.param_dtype,
                                                shardings_fn=shardings_fn)
    _, shapes, axes = sharding.abstract_model(model_cfg)
    return model_cfg, graphdef, params, shardings_fn(shapes, axes)
  model_cfg = tfm.ModelConfig(
      vocab_size=vocab_size, hidden_size=spec.hidden_size,
      intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
      num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
      rope_theta=spec.rope_theta, attention_bias=spec.attention_bias,
      tie_word_embeddings=spec.tie_word_embeddings,
      max_position_embeddings=spec.max_position_embeddings, architecture=spec.architecture,
      dtype=spec.dtype, param_dtype=spec.param_dtype)
  graphdef, params, shardings = sharding.init_params(model_cfg, cfg.seed, mesh)
  return model_cfg, graphdef, params, shardings


# -- tokenization --------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
  return tokenizer(text, add_special_tokens=False)['input_ids']


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
      self._jsonl = fileio.TextAppender(fileio.join(workdir, 'metrics.jsonl'))
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

  def close(self):
    if self._active:
      self._jsonl.close()
      self._tb.close()


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
      n = min(bs, len(self.examples) - start)
      chunk = [self.examples[start + (r if r < n else 0)] for r in rows]  # fixed shape
      tokens, mask = sharding.shard_rows(lambda _: left_pad(
          [encode(ctx.tokenizer, e.prompt) for e in chunk], self.max_prompt_length, ctx.pad_id,
          'max_prompt_length'), bs, ctx.mesh)
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
def fresh_meta() -> dict[str, Any]:
  """Host-side progress saved with every checkpoint."""
  return {'micro_step': 0, 'data_position': 0, 'done': False, 'summary': {}}


def restore(ckpt, stage: str, state) -> tuple[Any, dict[str, Any]]:
  """The latest checkpoint of the stage onto ``state``'s shardings, or (state, fresh meta)."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = ckpt.restore_latest(abstract)
  if restored is None:
    return state, fresh_meta()
  logging.info('%s: resumed at micro-step %d', stage, restored[1]['micro_step'])
  return restored


def report_accuracy(ctx: RunContext, stage: str, step: int, accuracy: float, when: str):
  ctx.writer.write(f'{stage}_eval', step, {'accuracy': accuracy})
  print(f'[{stage}] held-out accuracy {when}: {accuracy:.3f}', flush=True)


def run_micro_steps(ctx: RunContext, stage: str, ckpt, state, meta: dict[str, Any], *,
                    num_steps: int, k: int, log_every: int, step_fn, log_keys: Sequence[str],
                    eval_every: int = 0, evaluate=None, stop_at_micro_step: Optional[int] = None,
                    done_early=None) -> tuple[Any, bool]:
  """The loop every stage shares: micro-steps until ``num_steps`` optimizer steps, logging,
  periodic evaluation and checkpoints, and a clean stop on SIGTERM.

  step_fn(state, meta) -> (state, device outputs of the learner step, host metrics) runs one
  micro-step and advances meta['data_position'] itself. Returns (state, stopped_early): a stop
  requested by ``stop_at_micro_step`` checkpoints and returns; SIGTERM checkpoints and exits 0.
  ``done_early(step, state) -> bool``, asked after every optimizer step, ends the stage early
  (a normal finish, e.g. SFT reaching its target accuracy).
  """
  total = num_steps * k
  progress = Progress(stage, num_steps, start=meta['micro_step'] // k)
  every = ctx.cfg.checkpoint.every_steps
  s, last_saved = meta['micro_step'], None
  with checkpoint.PreemptionGuard() as guard:
    while s < total:
      state, out, host_metrics = step_fn(state, meta)
      s += 1
      meta['micro_step'] = s
      if s % k == 0:
        step = s // k
        if step % log_every == 0 or step == num_steps:
          metrics = jax.device_get(out) | host_metrics
          metrics.pop('stepped', None)
          ctx.writer.write(stage, step, metrics)
          progress.update(step, fmt_metrics(metrics, log_keys), force=True)
          if not np.isfinite(metrics['loss']):
            logging.warning('%s: non-finite loss at step %d (the window was skipped)', stage,
                            step)
        if eval_every and step % eval_every == 0 and step < num_steps:
          report_accuracy(ctx, stage, step, evaluate(state), f'at step {step}')
        if done_early is not None and done_early(step, state):
          break  # the caller's finish() writes the last checkpoint
        if every and step % every == 0 and step < num_steps:
          ckpt.save(s, state, meta)
          last_saved = s
      if guard.should_stop or s == stop_at_micro_step:
        logging.warning('%s: stopping; checkpointing micro-step %d', stage, s)
        if last_saved != s:
          ckpt.save(s, state, meta)
        ckpt.wait()
        if guard.should_stop:
          raise SystemExit(0)
        return state, True
  return state, False


def finish(ckpt, state, meta: dict[str, Any], summary: dict[str, Any]) -> None:
  """The stage's last checkpoint, marked done with its summary (a re-run skips the stage)."""
  meta.update(done=True, summary=summary)
  ckpt.save(meta['micro_step'], state, meta)  # periodic saves skip the stage's last step
  ckpt.wait()
