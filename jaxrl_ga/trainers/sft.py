"""SFT host loop: the task's reference completions, token cross-entropy, exact accumulation."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, SFTConfig
from jaxrl_ga.trainers import common


def sft_batch(ctx: common.RunContext, examples, max_length: int) -> dict[str, np.ndarray]:
  """Right-padded prompt+completion+eos rows; the loss covers the completion and the eos."""
  n = len(examples)
  tokens = np.full((n, max_length), ctx.pad_id, np.int32)
  attn = np.zeros((n, max_length), np.int32)
  loss = np.zeros((n, max_length), np.int32)
  for i, ex in enumerate(examples):
    p = common.encode_prompt(ctx.tokenizer, ex.prompt)
    c = common.encode(ctx.tokenizer, ctx.task.sft_completion(ex)) + [ctx.eos_id]
    if len(p) + len(c) > max_length:
      raise ConfigError(f'an SFT example of {len(p) + len(c)} tokens exceeds '
                        f'sft.max_length={max_length}; raise sft.max_length.')
    tokens[i, :len(p) + len(c)] = p + c
    attn[i, :len(p) + len(c)] = 1
    loss[i, len(p):len(p) + len(c)] = 1
  return {'tokens': tokens, 'attention_mask': attn, 'loss_mask': loss}


def run_sft(ctx: common.RunContext, cfg: SFTConfig, params) -> tuple[Any, dict[str, Any]]:
  """Trains (or resumes) the SFT stage from ``params``. -> (params, summary)."""
  schedule.check_micro_batch(cfg.micro_batch_size, sharding.data_parallel_size(ctx.mesh),
                             name='sft.micro_batch_size')
  learner = learner_lib.Learner(ctx.graphdef, learner_lib.sft_task_loss(), cfg.optimizer,
                                ctx.mesh, ctx.param_shardings,
                                optimizer_every=cfg.grad_accum_steps)
  b, seed = cfg.micro_batch_size, ctx.cfg.seed

  def batch_at(position):  # each process builds only its own rows
    return sharding.shard_rows(lambda rows: sft_batch(
        ctx, [ctx.task.train_example(position + int(i), seed) for i in rows], cfg.max_length),
        b, ctx.mesh)

  ckpt = ctx.checkpointer('sft')
  k = cfg.grad_accum_steps
  state, meta = common.restore(ctx, ckpt, 'sft', learner.init(params, batch_at(0)), k)
  if not common.trains_on('sft', meta, cfg.num_steps, k):
    return state.params, meta['summary']

  def step_fn(state, meta):
    state, out = learner.step(state, batch_at(meta['data_position']))
    meta['data_position'] += b
    return state, out, {}

  evaluator = common.Evaluator(ctx, max_prompt_length=cfg.max_length)
  stop_at_target = None
  if cfg.target_accuracy:
    # Training problems from a stream the run never trains on (seed + 7919).
    probe = common.Evaluator(ctx, max_prompt_length=cfg.max_length, examples=[
        ctx.task.train_example(i, seed + 7919) for i in range(cfg.probe_examples)])

    def stop_at_target(step, st):
      if step % cfg.probe_every:
        return False
      acc = probe.accuracy(st.params)
      ctx.writer.write('sft_probe', step, {'accuracy': acc})
      if acc >= cfg.target_accuracy:
        print(f'[sft] step {step}: probe accuracy {acc:.3f} >= sft.target_accuracy='
              f'{cfg.target_accuracy}; warm start done', flush=True)
        return True
      return False

  state, ended = common.run_micro_steps(
      ctx, 'sft', ckpt, state, meta, num_steps=cfg.num_steps, k=k, log_every=cfg.log_every,
      step_fn=step_fn, log_keys=('loss', 'grad_norm'), eval_every=cfg.eval_every,
      evaluate=lambda st: evaluator.accuracy(st.params), done_early=stop_at_target,
      max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite)
  summary = {'eval/accuracy_after_sft': common.evaluate_or_save(
                 ctx, ckpt, state, meta, lambda st: evaluator.accuracy(st.params)),
             'sft/optimizer_steps': meta['micro_step'] // k,
             'sft/stopped_at_target': ended == 'done_early'}
  common.report_accuracy(ctx, 'sft', summary['sft/optimizer_steps'],
                         summary['eval/accuracy_after_sft'], 'after SFT')
  common.finish(ckpt, state, meta, summary)
  return state.params, summary
