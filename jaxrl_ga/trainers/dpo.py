"""The DPO stage (``DPOStage``): its loop on pairs sampled from the current (SFT) policy, or
read from a preference dataset (``dpo.pairs='dataset'``, ``jaxrl_ga.preference``).

Sampled: for each of ``num_prompts`` prompts the policy samples ``samples_per_prompt``
completions; the first correct and the first incorrect one make a (chosen, rejected) pair. The
pairs and their reference log-probs (the policy at the start of the stage) are computed once and
cached in ``WORKDIR/dpo_pairs.npz`` (written atomically), so a resumed run trains on the same
data; a dataset's in ``WORKDIR/dpo_dataset_pairs.npz`` with the dataset's fingerprint. In the
first optimizer window (no ``dpo.ref_model``) the learner takes its own forward's log-probs as the
reference's instead (``PairStream.reference_is_policy``): step 1's rewards are exactly 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga import losses
from jaxrl_ga import placement
from jaxrl_ga import preference
from jaxrl_ga import programs
from jaxrl_ga import sharding
from jaxrl_ga.config import DPOConfig, LoRAConfig, RunConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage
from jaxrl_ga.trainers import text

GENERATION_PROMPTS = programs.DPO_GENERATION_PROMPTS  # prompts per generation call
_LOG_KEYS = ('loss', 'rewards/accuracies', 'rewards/margins', 'grad_norm')


def build_pairs(ctx: context.RunContext, cfg: DPOConfig, params, progs) -> dict[str, np.ndarray]:
  """Samples completions, pairs a correct with an incorrect one per prompt, adds ref log-probs.
  ``progs``: the stage's programs (its 'generation' and 'reference' entries)."""
  spp = cfg.samples_per_prompt
  generate = progs.table['generation'].fn
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
                   jax.random.PRNGKey(seed * 1000 + start),
                   np.float32(cfg.sampling.temperature), np.float32(cfg.sampling.top_p))
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
        # ended as the template ends a turn, as the sampled rejected replies end (Gemma 3:
        # <end_of_turn>, not <eos>: a pair differing in its last token teaches that token)
        good = text.encode_reply(ctx.tokenizer, ex.prompt, ctx.task.sft_completion(ex),
                                 ctx.generation_stops)
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
  return add_reference_logps(ctx, cfg, params, pairs, progs)


def add_reference_logps(ctx: context.RunContext, cfg: DPOConfig, params,
                        pairs: dict[str, np.ndarray], progs) -> dict[str, np.ndarray]:
  """``pairs`` with ``ref_chosen_logps`` and ``ref_rejected_logps`` [N] (float32): the summed
  completion log-probs under ``params`` (the policy at the start of the stage) or under
  ``dpo.ref_model``, computed once."""
  if cfg.ref_model:
    ref_cfg = reference_config(ctx.cfg, cfg)
    params = policy.build_model(ref_cfg, reference_model_config(ctx, cfg), ctx.mesh)[1]
  ref_fn, args = progs.table['reference']
  bs = args[1].shape[0]
  n = len(pairs['chosen_tokens'])
  pairs = dict(pairs)
  for side in ('chosen', 'rejected'):
    vals = []
    for start in range(0, n, bs):
      idx = np.arange(start, start + bs) % n
      args = [pairs[f'{side}_{k}'][idx] for k in ('tokens', 'attention_mask', 'loss_mask')]
      vals.append(placement.to_host(ref_fn(params, *placement.shard_batch(args, ctx.mesh))))
    pairs[f'ref_{side}_logps'] = np.concatenate(vals)[:n].astype(np.float32)
  return pairs


def reference_config(run_cfg: RunConfig, cfg: DPOConfig) -> RunConfig:
  """The run's config with ``dpo.ref_model`` as its model (without adapters)."""
  model = dataclasses.replace(run_cfg.model, hf_path=cfg.ref_model, lora=LoRAConfig())
  return dataclasses.replace(run_cfg, model=model)


def reference_model_config(ctx: context.RunContext, cfg: DPOConfig):
  """``dpo.ref_model``'s architecture (its vocabulary the tokenizer's)."""
  return policy.model_config(reference_config(ctx.cfg, cfg), len(ctx.tokenizer))


def reference_programs_args(ctx: context.RunContext, cfg: DPOConfig):
  """``programs.build_dpo_programs``' ``reference``: (graphdef, model config, param
  shardings) of ``dpo.ref_model``, abstractly; None without one (the policy is the reference)."""
  if not cfg.ref_model:
    return None
  model_cfg = reference_model_config(ctx, cfg)
  graphdef, shapes, axes = sharding.abstract_model(model_cfg)
  return graphdef, model_cfg, sharding.param_shardings(shapes, axes, ctx.mesh)


def check_reference(run_cfg: RunConfig, cfg: DPOConfig, model_cfg) -> None:
  """Before anything compiles: ``dpo.ref_model`` exists and has the policy's vocabulary."""
  if not cfg.ref_model:
    return
  hf.check_model_source(cfg.ref_model, 'dpo.ref_model')
  ref = policy.model_config(reference_config(run_cfg, cfg), model_cfg.vocab_size)
  if ref.vocab_size != model_cfg.vocab_size:
    raise ConfigError(f'dpo.ref_model={cfg.ref_model}: a vocabulary of {ref.vocab_size} tokens, '
                      f'the policy\'s has {model_cfg.vocab_size}; give a reference model with the '
                      f'policy\'s tokenizer.')


def load_or_build_pairs(ctx: context.RunContext, cfg: DPOConfig, params, progs=None
                        ) -> dict[str, np.ndarray]:
  """The stage's pairs with their reference log-probs, from the workdir's cache when there is
  one: sampled ones (``dpo_pairs.npz``), or a preference dataset's (``dpo_dataset_pairs.npz``,
  with the dataset's fingerprint; api.build_context has refused a cache of other rows).
  ``progs``: the stage's programs (default: built here, ``DPOStage.programs``)."""
  if progs is None:
    progs = DPOStage().programs(ctx, cfg, fitted=False)
  if cfg.pairs == 'dataset':
    path = preference.cache_path(ctx.workdir)
    cached = preference.load_cache(ctx.workdir, ctx.task)
    build = lambda: add_reference_logps(ctx, cfg, params, ctx.task.pairs, progs)
    policy = reference_policy_fingerprint(ctx, cfg)
    stamp = {'fingerprint': np.asarray(ctx.task.fingerprint), 'policy': np.asarray(policy)}
    if cached is not None:
      cached = dict(cached)
      # No stamp: a cache of a version before it, trusted as it was.
      if str(cached.pop('policy', policy)) != policy:
        # The reference log-probs of another starting policy (a run cut before its first DPO
        # checkpoint, resumed with another model or earlier stage): computed again.
        print(f'[dpo] {path} holds the reference log-probs of another starting policy; '
              f'computing them again.', flush=True)
        cached = None
  else:
    path = fileio.join(ctx.workdir, 'dpo_pairs.npz')
    stamp = {'fingerprint': np.asarray(sampled_pairs_fingerprint(ctx, cfg))}
    cached = fileio.load_npz(path) if fileio.exists(path) else None
    if cached is not None and str(cached.pop('fingerprint', '')) != str(stamp['fingerprint']):
      # Sampled under other settings (a run cut before its first DPO checkpoint, resumed with
      # another config): a cache, not the run's state; sampled again.
      print(f'[dpo] {path} was sampled under other settings; sampling the pairs again.',
            flush=True)
      cached = None
    build = lambda: build_pairs(ctx, cfg, params, progs)
  if cached is not None:
    return cached
  pairs = build()
  if ctx.is_primary:  # atomic
    fileio.save_npz(path, pairs | stamp)
  return pairs


def reference_policy_fingerprint(ctx: context.RunContext, cfg: DPOConfig) -> str:
  """What a preference dataset's reference log-probs are a function of besides its pairs (whose
  fingerprint holds dpo.ref_model): with no dpo.ref_model, the starting policy: the model
  (source, architecture, seed) and the stages before DPO (their checkpoint fingerprints); '' with
  one."""
  if cfg.ref_model:
    return ''
  model = {k: v for k, v in ctx.fingerprint('dpo').items()
           if k in ('model', 'model_source', 'seed')}
  return _hash({'model': model, 'stages': _stage_fingerprints(ctx, through_dpo=False)})


def sampled_pairs_fingerprint(ctx: context.RunContext, cfg: DPOConfig) -> str:
  """What the sampled pairs (``dpo_pairs.npz``) are a function of: every DPO setting (lengths
  included), the stage's checkpoint fingerprint (seed, model, task, data) and those of the stages
  before it (the policy the pairs are sampled from), as a hash."""
  return _hash({'dpo': dataclasses.asdict(cfg),
                'stages': _stage_fingerprints(ctx, through_dpo=True)})


def _stage_fingerprints(ctx: context.RunContext, through_dpo: bool) -> list[dict]:
  """The checkpoint fingerprints of the run's stages before DPO (and DPO's own)."""
  stages = ctx.cfg.stages
  if 'dpo' not in stages:
    return []
  return [ctx.fingerprint(name) for name in stages[:stages.index('dpo') + through_dpo]]


def _hash(described: dict) -> str:
  return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


class PairStream:
  """The stage's micro-batches: pair ``p`` of the training stream is pair ``order_e[p mod N]``
  of epoch ``e = p // N``, ``order_e`` the permutation ``np.random.default_rng([seed, e])`` (the
  pairs' order with ``shuffle=False``), so a batch is a function of its data position alone (a
  resumed run continues exactly)."""

  def __init__(self, pairs: dict[str, np.ndarray], cfg: DPOConfig, seed: int, mesh,
               shuffle: bool = True):
    self.pairs, self.cfg, self.seed, self.mesh, self.shuffle = pairs, cfg, seed, mesh, shuffle
    self.num_pairs = len(pairs['ref_chosen_logps'])
    self._orders = {}
    self._rpo_window = (-1, np.float32(0))  # (window start, its rpo_scale): once per window

  def indices(self, position: int, count: int) -> np.ndarray:
    idx = []
    for p in range(position, position + count):
      epoch, i = divmod(p, self.num_pairs)
      if epoch not in self._orders:
        self._orders[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(
            self.num_pairs) if self.shuffle else np.arange(self.num_pairs))
      idx.append(self._orders[epoch][i])
    return np.asarray(idx)

  def rpo_scale(self, position: int) -> np.float32:
    """RPO's NLL term is a token mean over the whole optimizer-step window (losses.dpo_loss):
    the window's denominator / chosen tokens, from the K micro-batches that hold `position`
    (computed once per window, kept for its other micro-batches)."""
    window = self.cfg.micro_batch_size * self.cfg.grad_accum_steps
    start = position - position % window
    if self._rpo_window[0] != start:
      w = self.indices(start, window)
      count = lambda key: self.pairs[key][w].sum(axis=-1)
      den, chosen = losses.dpo_window_normalizers(
          count('chosen_loss_mask'), count('rejected_loss_mask'), count('chosen_attention_mask'),
          count('rejected_attention_mask'), self.cfg.loss)
      self._rpo_window = (start, np.float32(den / max(chosen, 1.0)))
    return self._rpo_window[1]

  def reference_is_policy(self, position: int) -> bool:
    """Whether the micro-batch at ``position`` trains the reference's own weights: the stage's
    first optimizer window (no update applied yet) without ``dpo.ref_model``. The learner then
    takes its own forward's log-probs as the reference's (learner.dpo_task_loss), so that
    step 1's implicit rewards are exactly 0, as TRL's."""
    window = self.cfg.micro_batch_size * self.cfg.grad_accum_steps
    return not self.cfg.ref_model and position < window

  def batch_at(self, position: int):
    """The micro-batch of ``micro_batch_size`` pairs from data position ``position``, sharded
    (each process builds only its rows)."""
    b = self.cfg.micro_batch_size
    idx = self.indices(position, b)
    extra = {'ref_is_policy': np.full(b, self.reference_is_policy(position))}
    if self.cfg.loss.rpo_alpha:
      extra['rpo_scale'] = np.full(b, self.rpo_scale(position), np.float32)
    return placement.shard_rows(
        lambda rows: {k: v[idx[rows]] for k, v in self.pairs.items()} |
        {k: v[rows] for k, v in extra.items()}, b, self.mesh)


class DPOStage(stage.Stage):
  """Direct preference optimization (``stages=dpo``) on sampled or given pairs."""

  name = 'dpo'
  config_type = DPOConfig

  def validate(self, cfg: RunConfig, dp: int) -> None:
    super().validate(cfg, dp)
    stage.check_rollout_chunk(
        self.name, cfg.dpo.sampling, GENERATION_PROMPTS * cfg.dpo.samples_per_prompt,
        f'the completions sampled at once, {GENERATION_PROMPTS}*samples_per_prompt')

  def choose_lengths(self, cfg, task, tokenizer, model_cfg, measured):
    """dpo.max_length=0: the preference rows' longest pair, rounded up."""
    if cfg.dpo.max_length:
      return cfg, {}
    if not isinstance(task, preference.PreferenceTask):
      raise ConfigError('dpo.max_length=0 measures a preference dataset (dpo.pairs=dataset); '
                        'sampled pairs need it set (their prompt width plus completions).')
    needed = task.longest_pair(tokenizer, cfg.dpo)
    return dataclasses.replace(cfg, dpo=dataclasses.replace(
        cfg.dpo, max_length=stage.rounded_up(needed, model_cfg.max_position_embeddings))), {
            'dpo.max_length': needed}

  def length_limits(self, cfg, task, tokenizer, measured):
    """A pair's sequence fits the model's positions (PreferenceTask.encode fits every row to
    dpo.max_length; sampled pairs are refused past it)."""
    return [], [('dpo.max_length', cfg.dpo.max_length)]

  def check_inputs(self, cfg: RunConfig, task, model_cfg) -> None:
    check_reference(cfg, cfg.dpo, model_cfg)

  def programs(self, ctx: context.RunContext, stage_cfg: DPOConfig, fitted: bool = True):
    """The stage's programs (programs.LearnerPrograms: the learner, the held-out evaluation,
    the pairs' generation and reference pass); ``fitted``: with the memory knobs
    ``jaxrl_ga.fit`` chooses for the learner, compiled and checked against the device's memory
    ('auto' knobs chosen; the generation and reference pass run fit's choice without a limit:
    remat does not apply), else ``programs.build_dpo_programs``'s."""
    build = programs.fitted_dpo_programs if fitted else programs.build_dpo_programs
    return build(ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings, ctx.graphdef, stage_cfg,
                 eos_id=ctx.generation_stops, pad_id=ctx.pad_id,
                 reference=reference_programs_args(ctx, stage_cfg))

  def run(self, ctx: context.RunContext, params) -> tuple[Any, dict[str, Any]]:
    cfg = ctx.cfg.dpo  # lengths of 0: those chosen from the data (api.build_context)
    # dpo.micro_batch_size is checked against the mesh before anything is built (validate).
    part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
    progs = self.programs(ctx, cfg)
    learner = progs.learner
    evaluator = evaluation.Evaluator(ctx, progs.table['evaluation'])
    pairs = load_or_build_pairs(ctx, cfg, params, progs)
    shuffle = ctx.task.shuffle if cfg.pairs == 'dataset' else True  # the task's data.shuffle
    stream = PairStream(pairs, cfg, ctx.cfg.seed, ctx.mesh, shuffle=shuffle)
    n_pairs, b = stream.num_pairs, cfg.micro_batch_size
    batch_at = stream.batch_at

    ckpt = ctx.checkpointer('dpo')
    k = cfg.grad_accum_steps
    state, meta = stage.restore(ctx, ckpt, 'dpo', progs.init_state(params), k)
    if not stage.trains_on('dpo', meta, cfg.num_steps, k):
      return part.policy(state.params), meta['summary']
    summary = meta['summary']
    if 'eval/accuracy_before' not in summary:
      summary['eval/accuracy_before'] = stage.evaluate_or_save(
          ctx, ckpt, state, meta, lambda st: evaluator.accuracy(part.policy(st.params)))
      reporting.report_accuracy(ctx, 'dpo', 0, summary['eval/accuracy_before'],
                                f'before DPO ({n_pairs} pairs)')
    summary['dpo/pairs'] = n_pairs
    if cfg.pairs == 'dataset':
      summary['dpo/dropped_rows'] = ctx.task.dropped
      summary['dpo/truncated_replies'] = ctx.task.truncated
      if ctx.task.dropped or ctx.task.truncated:
        print(f'[dpo] {ctx.task.dropped} preference row(s) dropped (a prompt over the limit), '
              f'{ctx.task.truncated} reply(ies) cut to dpo.max_length={cfg.max_length}', flush=True)

    with stage.StageLoop(ctx, 'dpo', ckpt, meta, num_steps=cfg.num_steps, optimizer_every=k,
                         log_every=cfg.log_every, log_keys=_LOG_KEYS, eval_every=cfg.eval_every,
                         max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite) as loop:
      while not loop.done:
        state, out = learner.step(state, batch_at(meta['data_position']), part.frozen)
        meta['data_position'] += b
        step = loop.micro_step_done(state, out)
        if step:  # an optimizer step fired
          loop.log(step, out, {})
          if loop.eval_due(step):
            loop.report_eval(step, evaluator.accuracy(part.policy(state.params)))
          loop.save_if_due(step, state)
        if loop.stop_requested(state):
          break

    summary['eval/accuracy_after'] = stage.evaluate_or_save(
        ctx, ckpt, state, meta, lambda st: evaluator.accuracy(part.policy(st.params)))
    reporting.report_accuracy(ctx, 'dpo', cfg.num_steps, summary['eval/accuracy_after'],
                              'after DPO')
    stage.finish(ckpt, state, meta, summary)
    return part.policy(state.params), summary
