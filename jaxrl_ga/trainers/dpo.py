"""DPO host loop on pairs sampled from the current (SFT) policy.

For each of ``num_prompts`` prompts the policy samples ``samples_per_prompt`` completions; the
first correct and the first incorrect one make a (chosen, rejected) pair. The pairs and their
reference log-probs (the policy at the start of the stage) are computed once and cached in
``WORKDIR/dpo_pairs.npz`` (written atomically), so a resumed run trains on the same data.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga import losses
from jaxrl_ga import placement
from jaxrl_ga import programs
from jaxrl_ga import sampling
from jaxrl_ga.config import DPOConfig
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage
from jaxrl_ga.trainers import text

GENERATION_PROMPTS = 32  # prompts per generation call (fixed shape: one compile)
_LOG_KEYS = ('loss', 'rewards/accuracies', 'rewards/margins', 'grad_norm')


def build_pairs(ctx: context.RunContext, cfg: DPOConfig, params) -> dict[str, np.ndarray]:
  """Samples completions, pairs a correct with an incorrect one per prompt, adds ref log-probs."""
  spp = cfg.samples_per_prompt
  sampler = sampling.Sampler.from_config(cfg.sampling, eos_id=ctx.eos_id, pad_id=ctx.pad_id)
  generate = sampling.make_generate_fn(ctx.graphdef, sampler, mesh=ctx.mesh,
                                       param_shardings=ctx.param_shardings)
  seed = ctx.cfg.seed
  examples = [ctx.task.train_example(i, seed + 1) for i in range(cfg.num_prompts)]
  chosen, rejected, prompts = [], [], []
  for start in range(0, len(examples), GENERATION_PROMPTS):
    chunk = examples[start:start + GENERATION_PROMPTS]
    chunk = chunk + [chunk[0]] * (GENERATION_PROMPTS - len(chunk))
    ids = [text.encode_prompt(ctx.tokenizer, ex.prompt) for ex in chunk for _ in range(spp)]
    tokens, mask = text.left_pad(ids, cfg.sampling.max_prompt_length, ctx.pad_id,
                                   'dpo.sampling.max_prompt_length')
    out = generate(params, *placement.shard_batch((tokens, mask), ctx.mesh),
                   jax.random.PRNGKey(seed * 1000 + start), cfg.sampling.temperature,
                   cfg.sampling.top_p)
    c_tok, c_mask = placement.to_host(out.tokens), placement.to_host(out.mask)
    texts = text.decode_completions(ctx.tokenizer, c_tok, c_mask)
    for j, ex in enumerate(chunk[:len(examples[start:start + GENERATION_PROMPTS])]):
      good = bad = None
      for r in range(j * spp, (j + 1) * spp):
        row = list(c_tok[r][c_mask[r].astype(bool)])
        if ctx.task.is_correct(ex, texts[r]):
          good = row if good is None else good
        else:
          bad = row if bad is None else bad
      if good is None and bad is not None and cfg.reference_as_chosen:
        good = text.encode(ctx.tokenizer, ctx.task.sft_completion(ex)) + [ctx.eos_id]
      if good is not None and bad is not None:
        chosen.append(good)
        rejected.append(bad)
        prompts.append(text.encode_prompt(ctx.tokenizer, ex.prompt))
  if len(chosen) < cfg.micro_batch_size:
    raise RuntimeError(f'only {len(chosen)} (correct, incorrect) pairs from {cfg.num_prompts} '
                       f'prompts; raise dpo.num_prompts or dpo.samples_per_prompt, or start from '
                       f'a policy whose accuracy is neither 0 nor 1.')
  pairs = {}
  for side, comps in (('chosen', chosen), ('rejected', rejected)):
    rows = text.right_padded_rows(prompts, comps, cfg.max_length, ctx.pad_id, 'dpo.max_length')
    pairs.update({f'{side}_{key}': value for key, value in rows.items()})
  # Reference log-probs, once, with the policy at the start of the stage.
  _, ref_fn = programs.build_dpo_programs(ctx.cfg, ctx.model_cfg, ctx.mesh,
                                          ctx.param_shardings, ctx.graphdef, dpo=cfg)
  bs = placement.padded_batch_size(cfg.micro_batch_size, ctx.mesh)
  n = len(chosen)
  for side in ('chosen', 'rejected'):
    vals = []
    for start in range(0, n, bs):
      idx = np.arange(start, start + bs) % n
      args = [pairs[f'{side}_{k}'][idx] for k in ('tokens', 'attention_mask', 'loss_mask')]
      vals.append(placement.to_host(ref_fn(params, *placement.shard_batch(args, ctx.mesh))))
    pairs[f'ref_{side}_logps'] = np.concatenate(vals)[:n].astype(np.float32)
  return pairs


def _load_or_build_pairs(ctx, cfg, params):
  path = fileio.join(ctx.workdir, 'dpo_pairs.npz')
  if fileio.exists(path):
    return fileio.load_npz(path)
  pairs = build_pairs(ctx, cfg, params)
  if ctx.is_primary:
    fileio.save_npz(path, pairs)  # atomic
  return pairs


def run_dpo(ctx: context.RunContext, cfg: DPOConfig, params) -> tuple[Any, dict[str, Any]]:
  """Trains (or resumes) the DPO stage from ``params``. -> (params, summary)."""
  # dpo.micro_batch_size is checked against the mesh before anything is built
  # (main.validate_against_mesh), as GRPO's schedule is.
  part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
  learner, _ = programs.build_dpo_programs(ctx.cfg, ctx.model_cfg, ctx.mesh,
                                           ctx.param_shardings, ctx.graphdef, dpo=cfg)
  evaluator = evaluation.Evaluator(ctx, cfg.sampling.max_prompt_length)
  pairs = _load_or_build_pairs(ctx, cfg, params)
  n_pairs = len(pairs['ref_chosen_logps'])
  b = cfg.micro_batch_size
  epochs = {}

  def pair_indices(position, count):
    idx = []
    for p in range(position, position + count):
      epoch, i = divmod(p, n_pairs)
      if epoch not in epochs:  # a fixed shuffle per epoch: resumable from the position alone
        epochs[epoch] = np.random.default_rng([ctx.cfg.seed, epoch]).permutation(n_pairs)
      idx.append(epochs[epoch][i])
    return np.asarray(idx)

  window_pairs = b * cfg.grad_accum_steps

  def rpo_scale(position):
    """RPO's NLL term is a token mean over the whole optimizer-step window (losses.dpo_loss):
    the window's denominator / chosen tokens, from the K micro-batches that hold `position`."""
    w = pair_indices(position - position % window_pairs, window_pairs)
    count = lambda key: pairs[key][w].sum(axis=-1)
    den, chosen = losses.dpo_window_normalizers(
        count('chosen_loss_mask'), count('rejected_loss_mask'), count('chosen_attention_mask'),
        count('rejected_attention_mask'), cfg.loss)
    return np.float32(den / max(chosen, 1.0))

  def batch_at(position):
    idx = pair_indices(position, b)
    extra = {}
    if cfg.loss.rpo_alpha:
      extra['rpo_scale'] = np.full(b, rpo_scale(position), np.float32)
    return placement.shard_rows(
        lambda rows: {k: v[idx[rows]] for k, v in pairs.items()} |
        {k: v[rows] for k, v in extra.items()}, b, ctx.mesh)

  ckpt = ctx.checkpointer('dpo')
  k = cfg.grad_accum_steps
  fresh = learner.init(part.trained, batch_at(0), part.frozen)
  state, meta = stage.restore(ctx, ckpt, 'dpo', fresh, k)
  if not stage.trains_on('dpo', meta, cfg.num_steps, k):
    return part.policy(state.params), meta['summary']
  summary = meta['summary']
  if 'eval/accuracy_before' not in summary:
    summary['eval/accuracy_before'] = stage.evaluate_or_save(
        ctx, ckpt, state, meta, lambda st: evaluator.accuracy(part.policy(st.params)))
    reporting.report_accuracy(ctx, 'dpo', 0, summary['eval/accuracy_before'],
                              f'before DPO ({n_pairs} pairs)')
  summary['dpo/pairs'] = n_pairs

  with stage.StageLoop(ctx, 'dpo', ckpt, meta, num_steps=cfg.num_steps, optimizer_every=k,
                       log_every=cfg.log_every, log_keys=_LOG_KEYS,
                       max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite) as loop:
    while not loop.done:
      state, out = learner.step(state, batch_at(meta['data_position']), part.frozen)
      meta['data_position'] += b
      step = loop.micro_step_done(state, out)
      if step:  # an optimizer step fired
        loop.log(step, out, {})
        loop.save_if_due(step, state)
      if loop.stop_requested(state):
        break

  summary['eval/accuracy_after'] = stage.evaluate_or_save(
      ctx, ckpt, state, meta, lambda st: evaluator.accuracy(part.policy(st.params)))
  reporting.report_accuracy(ctx, 'dpo', cfg.num_steps, summary['eval/accuracy_after'],
                            'after DPO')
  stage.finish(ckpt, state, meta, summary)
  return part.policy(state.params), summary
