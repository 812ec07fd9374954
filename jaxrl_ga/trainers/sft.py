"""SFT host loop: the task's reference completions, token cross-entropy, exact accumulation."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_ga import placement
from jaxrl_ga import programs
from jaxrl_ga.config import SFTConfig
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage
from jaxrl_ga.trainers import text


def sft_batch(ctx: context.RunContext, examples, max_length: int) -> dict[str, np.ndarray]:
  """Right-padded prompt+completion+eos rows; the loss covers the completion and the eos."""
  return text.right_padded_rows(
      [text.encode_prompt(ctx.tokenizer, ex.prompt) for ex in examples],
      [text.encode(ctx.tokenizer, ctx.task.sft_completion(ex)) + [ctx.eos_id] for ex in examples],
      max_length, ctx.pad_id, 'sft.max_length')


def run_sft(ctx: context.RunContext, cfg: SFTConfig, params) -> tuple[Any, dict[str, Any]]:
  """Trains (or resumes) the SFT stage from ``params``. -> (params, summary)."""
  # sft.micro_batch_size is checked against the mesh before anything is built
  # (main.validate_against_mesh), as GRPO's schedule is.
  part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
  learner = programs.build_sft_learner(ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings,
                                       ctx.graphdef, sft=cfg)
  b, seed, k = cfg.micro_batch_size, ctx.cfg.seed, cfg.grad_accum_steps

  def batch_at(position):  # each process builds only its own rows
    return placement.shard_rows(lambda rows: sft_batch(
        ctx, [ctx.task.train_example(position + int(i), seed) for i in rows], cfg.max_length),
        b, ctx.mesh)

  ckpt = ctx.checkpointer('sft')
  fresh = learner.init(part.trained, batch_at(0), part.frozen)
  state, meta = stage.restore(ctx, ckpt, 'sft', fresh, k)
  if not stage.trains_on('sft', meta, cfg.num_steps, k):
    return part.policy(state.params), meta['summary']
  evaluator = evaluation.Evaluator(ctx, max_prompt_length=cfg.max_length)
  # With sft.target_accuracy: training problems from a stream the run never trains on (seed +
  # 7919), checked every probe_every steps; the warm start ends when they are solved.
  probe = evaluation.Evaluator(ctx, max_prompt_length=cfg.max_length, examples=[
      ctx.task.train_example(i, seed + 7919) for i in range(cfg.probe_examples)]) \
      if cfg.target_accuracy else None

  reached_target = False
  with stage.StageLoop(ctx, 'sft', ckpt, meta, num_steps=cfg.num_steps, optimizer_every=k,
                       log_every=cfg.log_every, log_keys=('loss', 'grad_norm'),
                       eval_every=cfg.eval_every,
                       max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite) as loop:
    while not loop.done:
      state, out = learner.step(state, batch_at(meta['data_position']), part.frozen)
      meta['data_position'] += b
      step = loop.micro_step_done(state, out)
      if step:  # an optimizer step fired
        loop.log(step, out, {})
        if loop.eval_due(step):
          loop.report_eval(step, evaluator.accuracy(part.policy(state.params)))
        if probe is not None and step % cfg.probe_every == 0:
          reached_target = _probe_reaches_target(ctx, cfg, probe, step,
                                                 part.policy(state.params))
          if reached_target:
            break  # finish() below writes the last checkpoint
        loop.save_if_due(step, state)
      if loop.stop_requested(state):
        break

  summary = {'eval/accuracy_after_sft': stage.evaluate_or_save(
                 ctx, ckpt, state, meta, lambda st: evaluator.accuracy(part.policy(st.params))),
             'sft/optimizer_steps': meta['micro_step'] // k,
             'sft/stopped_at_target': reached_target}
  reporting.report_accuracy(ctx, 'sft', summary['sft/optimizer_steps'],
                            summary['eval/accuracy_after_sft'], 'after SFT')
  stage.finish(ckpt, state, meta, summary)
  return part.policy(state.params), summary


def _probe_reaches_target(ctx, cfg: SFTConfig, probe, step: int, params) -> bool:
  accuracy = probe.accuracy(params)
  ctx.writer.write('sft_probe', step, {'accuracy': accuracy})
  if accuracy < cfg.target_accuracy:
    return False
  print(f'[sft] step {step}: probe accuracy {accuracy:.3f} >= sft.target_accuracy='
        f'{cfg.target_accuracy}; warm start done', flush=True)
  return True
