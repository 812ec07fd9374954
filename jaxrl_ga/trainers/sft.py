"""SFT host loop: the task's reference completions, token cross-entropy, exact accumulation."""

from __future__ import annotations

from typing import Any

from absl import logging
import jax
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, ScheduleConfig, SFTConfig
from jaxrl_ga.trainers import common


def sft_batch(ctx: common.RunContext, examples, max_length: int) -> dict[str, np.ndarray]:
  """Right-padded prompt+completion+eos rows; the loss covers the completion and the eos."""
  n = len(examples)
  tokens = np.full((n, max_length), ctx.pad_id, np.int32)
  attn = np.zeros((n, max_length), np.int32)
  loss = np.zeros((n, max_length), np.int32)
  for i, ex in enumerate(examples):
    p = common.encode(ctx.tokenizer, ex.prompt)
    c = common.encode(ctx.tokenizer, ctx.task.sft_completion(ex)) + [ctx.eos_id]
    if len(p) + len(c) > max_length:
      raise ConfigError(f'an SFT example of {len(p) + len(c)} tokens exceeds '
                        f'sft.max_length={max_length}; raise sft.max_length.')
    tokens[i, :len(p) + len(c)] = p + c
    attn[i, :len(p) + len(c)] = 1
    loss[i, len(p):len(p) + len(c)] = 1
  return {'tokens': tokens, 'attention_mask': attn, 'loss_mask': loss}


def run_sft(ctx: common.RunContext, cfg: SFTConfig, params) -> tuple[Any, dict[str, Any]]:
  sched = ScheduleConfig(micro_batch_size=cfg.micro_batch_size, num_generations=1,
                         steps_per_generation=1, grad_accum_steps=cfg.grad_accum_steps)
  schedule.validate_for_mesh(sched, sharding.data_parallel_size(ctx.mesh))
  learner = learner_lib.Learner(ctx.graphdef, learner_lib.sft_task_loss(), cfg.optimizer, sched,
                                ctx.mesh, ctx.param_shardings)
  b, k = cfg.micro_batch_size, cfg.grad_accum_steps
  seed = ctx.cfg.seed

  def batch_at(position):
    examples = [ctx.task.train_example(position + i, seed) for i in range(b)]
    return sharding.shard_batch(sft_batch(ctx, examples, cfg.max_length), ctx.mesh)

  state = learner.init(params, batch_at(0))
  meta = {'micro_step': 0, 'data_position': 0, 'done': False, 'summary': {}}
  ckpt = ctx.checkpointer('sft')
  restored = ckpt.restore_latest(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
  if restored is not None:
    state, meta = restored
    logging.info('sft: resumed at micro-step %d', meta['micro_step'])
  if meta['done']:
    return state.params, meta['summary']

  evaluator = common.Evaluator(ctx, max_prompt_length=cfg.max_length)
  total = cfg.num_steps * k
  progress = common.Progress('sft', cfg.num_steps, start=meta['micro_step'] // k)
  s = meta['micro_step']
  last_saved = None
  with checkpoint.PreemptionGuard() as guard:
    while s < total:
      state, out = learner.step(state, batch_at(meta['data_position']))
      s += 1
      meta.update(micro_step=s, data_position=meta['data_position'] + b)
      if s % k == 0:
        step = s // k
        if step % cfg.log_every == 0 or step == cfg.num_steps:
          metrics = jax.device_get(out)
          metrics.pop('stepped', None)
          ctx.writer.write('sft', step, metrics)
          progress.update(step, common.fmt_metrics(metrics, ('loss', 'grad_norm')), force=True)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_steps:
          acc = evaluator.accuracy(state.params)
          ctx.writer.write('sft_eval', step, {'accuracy': acc})
          print(f'[sft] step {step}: held-out accuracy {acc:.3f}', flush=True)
        every = ctx.cfg.checkpoint.every_steps
        if every and step % every == 0 and step < cfg.num_steps:
          ckpt.save(s, state, meta)
          last_saved = s
      if guard.should_stop:
        logging.warning('sft: stop requested; checkpointing micro-step %d', s)
        if last_saved != s:
          ckpt.save(s, state, meta)
        ckpt.wait()
        raise SystemExit(0)
  summary = {'eval/accuracy_after_sft': evaluator.accuracy(state.params)}
  ctx.writer.write('sft_eval', cfg.num_steps, {'accuracy': summary['eval/accuracy_after_sft']})
  print(f'[sft] held-out accuracy after SFT: {summary["eval/accuracy_after_sft"]:.3f}',
        flush=True)
  meta.update(done=True, summary=summary)
  ckpt.save(s, state, meta)  # periodic saves skip the last step, so s is new
  ckpt.wait()
  return state.params, summary
