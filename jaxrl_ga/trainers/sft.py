"""The SFT stage (``SFTStage``): its loop on the task's reference completions or your data's rows
(``jaxrl_ga.sft_data``), packed or one per row, token cross-entropy, exact accumulation."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_ga import placement
from jaxrl_ga import programs
from jaxrl_ga import sft_data
from jaxrl_ga.config import SFTConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage


def example_sequence(ctx: context.RunContext, index: int, seed: int, max_length: int
                     ) -> tuple[list[int], list[int]]:
  """(token ids, loss mask) of the training example at data position ``index``: a row of your
  data (``sft_data.SFTDataTask``, encoded once), or a built-in task's prompt + reference
  completion as its reply (``sft_data.prompt_completion_ids``), the loss on the reply."""
  if isinstance(ctx.task, sft_data.SFTDataTask):
    return ctx.task.train_sequence(index, seed)
  ex = ctx.task.train_example(index, seed)
  ids, mask = sft_data.prompt_completion_ids(ctx.tokenizer, ex.prompt,
                                             ctx.task.sft_completion(ex), ctx.generation_stops)
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


class SFTStage(stage.Stage):
  """Supervised fine-tuning (``stages=sft``): token cross-entropy on reference completions."""

  name = 'sft'
  config_type = SFTConfig

  def choose_lengths(self, cfg, task, tokenizer, model_cfg, measured):
    """sft.max_length=0: your rows' longest (or the longest held-out prompt), rounded up."""
    if cfg.sft.max_length:
      return cfg, {}
    if not isinstance(task, sft_data.SFTDataTask):
      raise ConfigError(f'sft.max_length=0 measures your data (data.train with stages=sft); '
                        f'{measured.source} generates its examples: set sft.max_length.')
    needed = max(task.longest(), measured.prompt_eval)
    room = model_cfg.max_position_embeddings - cfg.eval.max_completion_length
    return dataclasses.replace(cfg, sft=dataclasses.replace(
        cfg.sft, max_length=stage.rounded_up(needed, room))), {'sft.max_length': needed}

  def length_limits(self, cfg, task, tokenizer, measured):
    """Every example (prompt + its reply, as example_sequence encodes it) and held-out prompt
    fits sft.max_length, and a held-out prompt with its greedy completion the model's
    positions."""
    if isinstance(task, sft_data.SFTDataTask):
      example = task.longest()
    else:
      stops = measured.stops or int(tokenizer.eos_token_id)
      example = max((len(sft_data.prompt_completion_ids(tokenizer, e.prompt,
                                                         task.sft_completion(e), stops)[0])
                     for e in measured.train), default=0)
    return ([('sft.max_length', cfg.sft.max_length, max(example, measured.prompt_eval))],
            [('sft.max_length + eval.max_completion_length',
              cfg.sft.max_length + cfg.eval.max_completion_length)])

  def programs(self, ctx: context.RunContext, stage_cfg: SFTConfig):
    """The stage's programs (programs.LearnerPrograms: the learner and the held-out
    evaluation), compiled and checked against the device's memory (jaxrl_ga.fit), 'auto'
    knobs chosen."""
    return programs.fitted_sft_programs(ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings,
                                        ctx.graphdef, stage_cfg, eos_id=ctx.generation_stops,
                                        pad_id=ctx.pad_id)

  def run(self, ctx: context.RunContext, params) -> tuple[Any, dict[str, Any]]:
    cfg = ctx.cfg.sft  # sft.max_length=0: the one chosen from the data (api.build_context)
    if getattr(ctx.task, 'held_out_note', None):
      print(ctx.task.held_out_note, flush=True)
    # sft.micro_batch_size is checked against the mesh before anything is built (validate).
    part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
    b, seed, k = cfg.micro_batch_size, ctx.cfg.seed, cfg.grad_accum_steps

    def batch_at(position):  # each process builds only its own rows -> (batch, examples used)
      batch, consumed = micro_batch(ctx, cfg, position, seed, placement.batch_rows(b, ctx.mesh))
      return placement.place_rows(batch, b, ctx.mesh), consumed

    progs = self.programs(ctx, cfg)
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
