"""SFT host loop: the task's reference completions or your data's rows (``jaxrl_ga.sft_data``),
packed or one per row, token cross-entropy, exact accumulation."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_ga import placement
from jaxrl_ga import programs
from jaxrl_ga import sft_data
from jaxrl_ga.config import ConfigError, SFTConfig
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage


def example_sequence(ctx: context.RunContext, index: int, seed: int, max_length: int
                     ) -> tuple[list[int], list[int]]:
  """(token ids, loss mask) of the training example at data position ``index``: a row of your
  data (``sft_data.SFTDataTask``, encoded once), or a built-in task's prompt + reference
  completion + eos with the loss on the completion and the eos."""
  if isinstance(ctx.task, sft_data.SFTDataTask):
    return ctx.task.train_sequence(index, seed)
  ex = ctx.task.train_example(index, seed)
  ids, mask = sft_data.prompt_completion_ids(ctx.tokenizer, ex.prompt,
                                             ctx.task.sft_completion(ex), ctx.eos_id)
  if len(ids) > max_length:
    raise ConfigError(f'a sequence of {len(ids)} tokens (prompt + completion) exceeds '
                      f'sft.max_length={max_length}; raise sft.max_length.')
  return ids, mask


def micro_batch(ctx: context.RunContext, cfg: SFTConfig, position: int, seed: int, rows
                ) -> tuple[dict[str, np.ndarray], int]:
  """The micro-batch at data position ``position``: its rows ``rows`` (this process's) of
  tokens, attention_mask and loss_mask [len(rows), sft.max_length], and the examples it consumes
  (micro_batch_size; with sft.packing as many as greedily fill micro_batch_size packed rows,
  ``sft_data.greedy_rows``: every process packs the whole micro-batch, then keeps its rows)."""
  b, length = cfg.micro_batch_size, cfg.max_length
  at = lambda i: example_sequence(ctx, position + i, seed, length)
  if not cfg.packing:
    return sft_data.padded_rows([at(int(i)) for i in rows], length, ctx.pad_id), b
  sequences, tokens = [], 0
  while tokens < b * length:  # enough to fill every row
    sequences.append(at(len(sequences)))
    tokens += len(sequences[-1][0])
  packed = sft_data.greedy_rows([len(ids) for ids, _ in sequences], b, length)
  batch = sft_data.pack([[sequences[j] for j in packed[int(i)]] for i in rows], length,
                        ctx.pad_id)
  return batch, sum(len(r) for r in packed)


def run_sft(ctx: context.RunContext, cfg: SFTConfig, params) -> tuple[Any, dict[str, Any]]:
  """Trains (or resumes) the SFT stage from ``params``. -> (params, summary)."""
  cfg = ctx.with_chosen_lengths('sft', cfg)  # sft.max_length=0: the one chosen from the data
  # sft.micro_batch_size is checked against the mesh before anything is built
  # (main.validate_against_mesh), as GRPO's schedule is.
  part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
  b, seed, k = cfg.micro_batch_size, ctx.cfg.seed, cfg.grad_accum_steps

  def batch_at(position):  # each process builds only its own rows -> (batch, examples used)
    batch, consumed = micro_batch(ctx, cfg, position, seed, placement.batch_rows(b, ctx.mesh))
    return placement.place_rows(batch, b, ctx.mesh), consumed

  # The stage's programs (programs.LearnerPrograms), compiled and checked against the device's
  # memory here (jaxrl_ga.fit), 'auto' knobs chosen.
  progs = programs.fitted_sft_programs(ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings,
                                       ctx.graphdef, cfg, eos_id=ctx.eos_id, pad_id=ctx.pad_id)
  learner = progs.learner
  ckpt = ctx.checkpointer('sft')
  state, meta = stage.restore(ctx, ckpt, 'sft', progs.init_state(params), k)
  if not stage.trains_on('sft', meta, cfg.num_steps, k):
    return part.policy(state.params), meta['summary']
  evaluator = evaluation.Evaluator(ctx, progs.table['evaluation'])
  # With sft.target_accuracy: training problems from a stream the run never trains on (seed +
  # 7919), checked every probe_every steps; the warm start ends when they are solved.
  probe = evaluation.Evaluator(ctx, progs.table['evaluation'], examples=[
      ctx.task.train_example(i, seed + 7919) for i in range(cfg.probe_examples)]) \
      if cfg.target_accuracy else None

  before = {}
  if cfg.eval_before and meta['micro_step'] == 0:
    before['eval/accuracy_before_sft'] = evaluator.accuracy(part.policy(state.params))
    reporting.report_accuracy(ctx, 'sft', 0, before['eval/accuracy_before_sft'], 'before SFT')
  reached_target = False
  with stage.StageLoop(ctx, 'sft', ckpt, meta, num_steps=cfg.num_steps, optimizer_every=k,
                       log_every=cfg.log_every, log_keys=('loss', 'grad_norm'),
                       eval_every=cfg.eval_every,
                       max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite) as loop:
    while not loop.done:
      batch, consumed = batch_at(meta['data_position'])
      state, out = learner.step(state, batch, part.frozen)
      meta['data_position'] += consumed
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

  summary = {**before, 'eval/accuracy_after_sft': stage.evaluate_or_save(
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
