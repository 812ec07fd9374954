r"""The implicit-bias study: do sequential updates keep the positive/negative gradient alignment
up?

  python studies/implicit_bias/implicit_bias.py --seeds=0,1,2 --rollouts=200 --eval_every=25 \
      --runs_dir=/tmp/implicit_bias_runs200   # ~19 min on a shared 2-core CPU

Results and verdict: studies/implicit_bias/README.md (this folder); the smoke test is smoke_test.py
here, which tests/test_implicit_bias.py collects into the suite.

The claim under test (the blog post "The Implicit Bias of Gradient Accumulation in
RLHF"): splitting one accumulated update into sequential steps, the positive-advantage samples'
step first and then the negative-advantage samples' step, adds an implicit term to the update that
rewards the alignment grad L+ . grad L- of the two parts' losses, so that this scalar product, which
falls during training, falls more slowly under sequential updates than under accumulation.

On the arithmetic task of configs/grpo_arith.py, per seed:

  * one SFT warm start (``trainers.sft.SFTStage.run``, the config's stop at a target probe
    accuracy), whose params start both GRPO arms (each arm has its own workdir and
    checkpointer);
  * arm ``accumulate``: update_mode='accumulate', K micro-batches per optimizer step;
  * arm ``sequential``: update_mode='sequential' (one optimizer step per micro-batch) with
    order_by_advantage_sign=True (each rollout sorted: positive advantages first, negative last)
    and the learning rate times optimizer.sequential_lr_scale (default None: 1/sqrt(K), the
    blog's eta/sqrt(2) for its K=2 split);
  * both arms consume the same rollouts in the same order (same prompts, same sampling seed) and
    the same number of completions: the accumulate arm makes R optimizer steps, the sequential arm
    K*R. The x-axis unit is the rollout (S*B completions): K = S, so one rollout is one
    accumulate optimizer step and K sequential ones.

Why K = S: one accumulate window is then exactly one rollout, trained on-policy, and the
sequential arm's K steps over that rollout are the blog's decomposition of the same update (K = 2:
one step on the sorted rollout's positive end, one on its negative end). With K != S an
accumulate window would straddle rollouts and mix in off-policy slices, which the blog's
comparison does not have.

Alignment, measured the same way in both arms. At every rollout, at the params that generated it
(before any step on it), the script computes g+ and g-, the gradients of the token-mean GRPO loss
restricted to the rollout's positive- and negative-advantage completions (ratio 1, so
g = -sum A grad log pi / tokens), and logs their dot product and cosine. For the accumulate arm
this is exactly the learner's own diagnostic (grpo.align_diagnostic=True: 'align/dot',
'align/cosine' over the optimizer-step window, here the rollout); the script records both and
checks they agree. In the sequential arm the learner's diagnostic is per optimizer step, i.e. per
sign-sorted micro-batch, which usually holds one sign only (cosine of a zero vector, logged as 0):
it is recorded as it comes, but only the per-rollout measure compares the arms.

The one hook: GRPOLoop's public ``on_rollout`` callback reads each fresh rollout (its
micro-batches, advantages, rewards) and the learner's params and optimizer-step counter. Everything
else is the library's public path (api.build_context, SFTStage.run, GRPOLoop.run, metrics.jsonl).

Outputs: a table on stdout, --out (JSON: every per-rollout, per-step and eval series, statistics,
machine, load average) and --plot (PNG). Runs go under --runs_dir (default: a fresh temp dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import machine  # pylint: disable=g-import-not-at-top,wrong-import-position  # benchmarks/machine.py
ARMS = ('accumulate', 'sequential')


@dataclasses.dataclass(frozen=True)
class Study:
  """The study's sizes. K = S = grad_accum_steps; one rollout = S*B completions.

  Attributes:
    seeds: one SFT warm start and one run per arm for each.
    grad_accum_steps: K micro-batches per accumulate optimizer step, and S micro-batches per
      rollout.
    micro_batch_size: B completions per micro-batch; num_generations: G per prompt.
    rollouts: R rollouts per arm (R accumulate optimizer steps, K*R sequential ones).
    eval_every: held-out greedy accuracy every this many rollouts (and before and after).
    learning_rate: GRPO peak learning rate of the accumulate arm.
    sequential_lr_scale: the sequential arm's learning-rate factor; None: 1/sqrt(K).
    config, config_arg: the base config file and its get_config argument ('smoke' for tests).
    eval_examples: held-out problems per evaluation.
    warm_start: run the SFT warm start (False: both arms start from the fresh init; tests).
    smooth: moving-average window of the plot's per-rollout curves, in rollouts.
    runs_dir: where the runs go ('' = a fresh temporary directory).
    compilation_cache: keep XLA executables in runs_dir/compilation_cache, so that later seeds
      and the second arm reuse what the first compiled (same shapes, same programs).
    out, plot: the JSON and PNG paths ('' = do not write).
  """
  seeds: tuple[int, ...] = (0, 1, 2)
  grad_accum_steps: int = 2
  micro_batch_size: int = 64
  num_generations: int = 8
  rollouts: int = 200
  eval_every: int = 25
  learning_rate: float = 1e-4
  sequential_lr_scale: Optional[float] = None
  config: str = os.path.join(ROOT, 'configs', 'grpo_arith.py')
  config_arg: str = ''
  eval_examples: int = 500
  warm_start: bool = True
  smooth: int = 15
  runs_dir: str = ''
  compilation_cache: bool = True
  out: str = os.path.join(HERE, 'results.json')
  plot: str = os.path.join(HERE, 'implicit_bias.png')

  def __post_init__(self):
    k = self.grad_accum_steps
    if k < 2:
      raise ValueError(f'grad_accum_steps={k}: the sequential arm needs K >= 2 micro-batches.')
    if self.rollouts < 4 or self.eval_every < 1:
      raise ValueError('rollouts must be >= 4 (quarters) and eval_every >= 1.')


# -- the per-rollout alignment -------------------------------------------------------------------
def make_alignment_probe(graphdef, task_loss):
  """-> jitted fn(params, batches) over the S micro-batches of one rollout: the dot product and
  cosine of g+ and g-, the gradients of the rollout's token-mean loss restricted to its positive-
  and negative-advantage completions, at ``params`` with ratio 1 (old = current). As the
  learner's 'align/dot' (normalized by the rollout's token count squared) and 'align/cosine'; a
  cosine with an empty side is NaN here, not 0."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import transformer as tfm  # pylint: disable=g-import-not-at-top

  terms = lambda params, batch: task_loss(tfm.merge(graphdef, params), batch)
  grad = jax.grad(lambda params, batch: terms(params, batch).numerator)
  f32_zeros = lambda params: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def probe(params, batches: Sequence[dict]):
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)  # [S, B, ...]

    def one_slice(carry, batch):
      g_pos, g_neg, denom = carry
      batch = dict(batch, has_old=jnp.zeros_like(batch['has_old']))  # on-policy: ratio 1
      adv = batch['advantages']
      masked = lambda keep: dict(batch, completion_mask=batch['completion_mask'] * keep[:, None])
      add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
      return (add(g_pos, grad(params, masked(adv > 0))), add(g_neg, grad(params, masked(adv < 0))),
              denom + terms(params, batch).denominator), None

    init = (f32_zeros(params), f32_zeros(params), jnp.zeros((), jnp.float32))
    (g_pos, g_neg, denom), _ = jax.lax.scan(one_slice, init, stacked)
    dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g_pos), jax.tree.leaves(g_neg)))
    norms = optax.tree.norm(g_pos) * optax.tree.norm(g_neg)
    return {'dot': dot / (denom * denom),
            'cosine': jnp.where(norms > 0, dot / jnp.where(norms > 0, norms, 1.0), jnp.nan)}

  return jax.jit(probe)


def _recording_trainer(grpo_lib):
  """GRPOLoop that records every rollout through its public ``on_rollout`` hook: its sample
  position, the learner's optimizer-step counter, rewards, the advantage signs per micro-batch,
  and the per-rollout alignment."""

  class RecordingTrainer(grpo_lib.GRPOLoop):

    def __init__(self, ctx, cfg, probe, console, label: str):
      super().__init__(ctx, cfg, on_rollout=self._record)
      self.records: list[dict[str, Any]] = []
      self._probe, self.console, self.label = probe, console, label
      self.t0 = time.time()

    def _record(self, event):
      import jax  # pylint: disable=g-import-not-at-top
      sched = self.cfg.schedule
      host = event.host_stats
      batches = [self.engine.micro_batch(event.buffer, j, event.advantages)
                 for j in range(sched.steps_per_generation)]
      align = jax.device_get(self._probe(event.learner.params, batches))
      adv = np.asarray(jax.device_get(event.advantages))  # [S, B] in training order
      self.records.append({
          'micro_step': event.micro_step,
          'samples_before': event.micro_step * sched.micro_batch_size,
          'optimizer_step': int(event.learner.optimizer_step),
          'reward_mean': host['reward/mean'], 'accuracy': host['reward/accuracy'],
          'pos_per_slice': (adv > 0).sum(axis=1).tolist(),
          'neg_per_slice': (adv < 0).sum(axis=1).tolist(),
          'dot': float(align['dot']), 'cosine': float(align['cosine'])})
      n = len(self.records)
      if n == 1 or n % 25 == 0:
        print(f'  [{self.label}] rollout {n}: reward {host["reward/mean"]:.3f} accuracy '
              f'{host["reward/accuracy"]:.3f} cosine {float(align["cosine"]):+.3f} '
              f'({time.time() - self.t0:.0f} s)', file=self.console, flush=True)

  return RecordingTrainer


# -- configs -------------------------------------------------------------------------------------
def base_config_dict(study: Study, seed: int) -> dict:
  """The base config file's values with the study's sizes (shared by SFT and both arms)."""
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  d = load_config_file(study.config, study.config_arg).to_dict()
  k = study.grad_accum_steps
  d['seed'] = seed
  d['grpo']['schedule'].update(micro_batch_size=study.micro_batch_size,
                               num_generations=study.num_generations, steps_per_generation=k,
                               num_iterations=1, grad_accum_steps=k)
  d['grpo']['optimizer']['learning_rate'] = study.learning_rate
  d['grpo'].update(align_diagnostic=True, log_every=1)
  d['eval']['num_examples'] = study.eval_examples
  d['checkpoint']['every_steps'] = 0  # one checkpoint at the end of each stage
  return d


def arm_config(study: Study, base: dict, arm: str):
  """RunConfig of one GRPO arm. Steps and eval period are in optimizer steps: K per rollout in
  the sequential arm, 1 in the accumulate arm (S = K micro-batches per rollout either way)."""
  import copy  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import RunConfig, from_mapping  # pylint: disable=g-import-not-at-top
  d = copy.deepcopy(base)
  k = study.grad_accum_steps
  steps_per_rollout = k if arm == 'sequential' else 1
  d['stages'] = 'grpo'
  d['grpo']['schedule']['update_mode'] = arm
  d['grpo']['advantage']['order_by_advantage_sign'] = arm == 'sequential'
  d['grpo']['optimizer']['sequential_lr_scale'] = study.sequential_lr_scale
  d['grpo'].update(num_steps=study.rollouts * steps_per_rollout,
                   eval_every=study.eval_every * steps_per_rollout)
  return from_mapping(RunConfig, d)


# -- one seed ------------------------------------------------------------------------------------
def run_seed(study: Study, seed: int, runs_dir: str, console) -> dict:
  """SFT once, then both arms from the same params. -> the seed's results."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import plot as plot_lib  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import RunConfig, from_mapping  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import reporting  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo as grpo_lib  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import sft as sft_lib  # pylint: disable=g-import-not-at-top

  base = base_config_dict(study, seed)
  sft_cfg = from_mapping(RunConfig, dict(base, stages='sft'))
  sft_dir = os.path.join(runs_dir, f'seed{seed}', 'sft')
  t0 = time.time()
  with open(os.path.join(_mkdir(sft_dir), 'stdout.log'), 'a') as log, \
      contextlib.redirect_stdout(log):
    ctx, params = api.build_context(sft_cfg, sft_dir)
    sft_summary = {'sft/optimizer_steps': 0, 'eval/accuracy_after_sft': math.nan}
    if study.warm_start:
      params, sft_summary = sft_lib.SFTStage().run(ctx, params)
    ctx.writer.close()
  warm_start = jax.device_get(params)  # each arm gets its own device copy (steps donate)
  del params
  out = {'seed': seed, 'sft': {'optimizer_steps': sft_summary['sft/optimizer_steps'],
                               'eval_accuracy': sft_summary['eval/accuracy_after_sft'],
                               'wall_s': time.time() - t0},
         'arms': {}}
  print(f'[seed {seed}] SFT: {out["sft"]["optimizer_steps"]} steps, held-out accuracy '
        f'{out["sft"]["eval_accuracy"]:.3f} ({out["sft"]["wall_s"]:.0f} s)', file=console,
        flush=True)
  trainer_cls = _recording_trainer(grpo_lib)
  probe = None
  for arm in ARMS:
    cfg = arm_config(study, base, arm)
    api.validate_against_mesh(cfg, ctx.mesh)
    if probe is None:  # the arms differ in schedule and ordering only: one probe serves both
      probe = make_alignment_probe(ctx.graphdef, learner_lib.grpo_task_loss(
          cfg.grpo.loss, cfg.grpo.sampling.max_completion_length, cfg.grpo.sampling.temperature))
    arm_dir = os.path.join(runs_dir, f'seed{seed}', arm)
    load_start = os.getloadavg()
    t0 = time.time()
    with open(os.path.join(_mkdir(arm_dir), 'stdout.log'), 'a') as log, \
        contextlib.redirect_stdout(log):
      # The SFT run's mesh, task, tokenizer and model, with the arm's config and directories.
      arm_ctx = dataclasses.replace(ctx, cfg=cfg, workdir=arm_dir,
                                    writer=reporting.MetricWriter(arm_dir))
      trainer = trainer_cls(arm_ctx, cfg.grpo, probe, console, f'seed {seed} {arm}')
      _, summary = trainer.run(jax.device_put(warm_start, ctx.param_shardings))
      arm_ctx.writer.close()
    wall = time.time() - t0
    series = plot_lib.read_metrics(os.path.join(arm_dir, 'metrics.jsonl'))
    out['arms'][arm] = arm_results(cfg, trainer.records, series, summary, wall)
    out['arms'][arm]['load_avg_start_end'] = [load_start, os.getloadavg()]
    a = out['arms'][arm]
    print(f'[seed {seed}] {arm}: {a["optimizer_steps"]} optimizer steps, {a["samples"]} '
          f'completions, held-out {a["eval"]["accuracy"][0]:.3f} -> '
          f'{a["eval"]["accuracy"][-1]:.3f} ({wall:.0f} s)', file=console, flush=True)
  return out


def arm_results(cfg, records: list[dict], series: dict, summary: dict, wall: float) -> dict:
  """Columns of the per-rollout records, the learner's per-step diagnostic, evals, statistics."""
  sched = cfg.grpo.schedule
  per_step = sched.optimizer_every  # micro-steps per optimizer step
  s = sched.steps_per_generation
  rollouts = {key: [r[key] for r in records] for key in records[0]}
  steps = series['grpo']

  def column(name):  # the learner's per-optimizer-step metric, indexed by optimizer step
    values = dict(steps.get(name, []))
    return [values.get(i, math.nan) for i in range(1, cfg.grpo.num_steps + 1)]

  lib = {'optimizer_step': list(range(1, cfg.grpo.num_steps + 1)),
         'rollout': [i * per_step / s for i in range(1, cfg.grpo.num_steps + 1)],
         'dot': column('align/dot'), 'cosine': column('align/cosine'),
         'loss': column('loss'), 'grad_norm': column('grad_norm')}
  evals = sorted(series.get('grpo_eval', {}).get('accuracy', []))
  micro_steps = cfg.grpo.num_steps * per_step
  out = {
      'update_mode': sched.update_mode,
      'order_by_advantage_sign': cfg.grpo.advantage.order_by_advantage_sign,
      'learning_rate': column('learning_rate')[0],  # as the learner's schedule logged it
      'optimizer_steps': cfg.grpo.num_steps, 'micro_steps': micro_steps,
      'samples': micro_steps * sched.micro_batch_size, 'rollouts_consumed': len(records),
      'wall_s': wall, 'summary': _jsonable(summary),
      'rollouts': rollouts, 'learner_diagnostic': lib,
      'eval': {'rollout': [st * per_step / s for st, _ in evals],
               'accuracy': [acc for _, acc in evals]},
  }
  # Optimizer steps per completion, from the learner's own counter at each rollout.
  opt = np.asarray(rollouts['optimizer_step'], float)
  done = np.asarray(rollouts['samples_before'], float)
  out['optimizer_steps_per_sample'] = float((opt[-1] - opt[0]) / (done[-1] - done[0]))
  out['stats'] = arm_stats(out)
  return out


def _quarters(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  q = max(len(x) // 4, 1)
  return x[:q], x[-q:]


def _slope_per_100(y: np.ndarray) -> float:
  """Least-squares slope of y against the rollout index, per 100 rollouts (NaNs dropped)."""
  x = np.arange(len(y), dtype=float)
  ok = np.isfinite(y)
  if ok.sum() < 2:
    return math.nan
  return float(100 * np.polyfit(x[ok], y[ok], 1)[0])


def arm_stats(arm: dict) -> dict:
  r = arm['rollouts']
  cos, dot = np.asarray(r['cosine'], float), np.asarray(r['dot'], float)
  reward, acc = np.asarray(r['reward_mean'], float), np.asarray(r['accuracy'], float)
  first, last = _quarters(cos)
  dfirst, dlast = _quarters(dot)
  lib = arm['learner_diagnostic']
  lib_cos, lib_dot = np.asarray(lib['cosine'], float), np.asarray(lib['dot'], float)
  # A sign-pure micro-batch: one gradient is zero (cosine NaN, or 0 before the learner's fix).
  one_sided = (lib_dot == 0) & ((lib_cos == 0) | np.isnan(lib_cos))
  return {
      'cosine_first_quarter': float(np.nanmean(first)),
      'cosine_last_quarter': float(np.nanmean(last)),
      'cosine_slope_per_100_rollouts': _slope_per_100(cos),
      'dot_first_quarter': float(np.nanmean(dfirst)),
      'dot_last_quarter': float(np.nanmean(dlast)),
      'dot_slope_per_100_rollouts': _slope_per_100(dot),
      'reward_first_quarter': float(np.mean(_quarters(reward)[0])),
      'reward_last_quarter': float(np.mean(_quarters(reward)[1])),
      'rollout_accuracy_last_quarter': float(np.mean(_quarters(acc)[1])),
      'eval_accuracy_start': arm['eval']['accuracy'][0],
      'eval_accuracy_final': arm['eval']['accuracy'][-1],
      'learner_diagnostic_one_sided_fraction': float(one_sided.mean()),
      'learner_diagnostic_cosine_mean_two_sided': (
          float(np.nanmean(lib_cos[~one_sided])) if (~one_sided).any() else math.nan),
  }


def accumulate_check(arm: dict) -> float:
  """Max |cosine difference| between the per-rollout measure and the learner's window
  diagnostic (the same quantity when K = S in accumulate mode)."""
  probe = np.asarray(arm['rollouts']['cosine'], float)
  lib = np.asarray(arm['learner_diagnostic']['cosine'], float)
  n = min(len(probe), len(lib))
  return float(np.nanmax(np.abs(probe[:n] - lib[:n])))


# -- summary, table, plot ------------------------------------------------------------------------
STAT_KEYS = ('cosine_first_quarter', 'cosine_last_quarter', 'cosine_slope_per_100_rollouts',
             'dot_first_quarter', 'dot_last_quarter', 'dot_slope_per_100_rollouts',
             'reward_first_quarter', 'reward_last_quarter', 'rollout_accuracy_last_quarter',
             'eval_accuracy_start', 'eval_accuracy_final')


def summarize(seeds: list[dict]) -> dict:
  """Mean and std over seeds of each statistic, per arm; the per-seed differences; the cosine
  difference paired by rollout (both arms draw the same prompts at the same rollout index); and
  the cosine at matched training progress (binned by the rollout's sampled accuracy)."""
  out = {}
  for arm in ARMS:
    out[arm] = {k: _mean_std([s['arms'][arm]['stats'][k] for s in seeds]) for k in STAT_KEYS}
  out['sequential_minus_accumulate'] = {
      k: _mean_std([s['arms']['sequential']['stats'][k] - s['arms']['accumulate']['stats'][k]
                    for s in seeds]) for k in STAT_KEYS}
  stat = lambda s, arm, k: s['arms'][arm]['stats'][k]
  out['seeds_where_sequential_slope_is_higher'] = sum(
      stat(s, 'sequential', 'cosine_slope_per_100_rollouts') >
      stat(s, 'accumulate', 'cosine_slope_per_100_rollouts') for s in seeds)
  out['seeds_where_sequential_last_quarter_cosine_is_higher'] = sum(
      stat(s, 'sequential', 'cosine_last_quarter') > stat(s, 'accumulate', 'cosine_last_quarter')
      for s in seeds)
  out['paired_cosine_difference'] = [paired_difference(s) for s in seeds]
  out['cosine_by_rollout_accuracy'] = {arm: binned_by_accuracy(seeds, arm) for arm in ARMS}
  return out


def paired_difference(seed: dict) -> dict:
  """Sequential minus accumulate cosine at the same rollout index, over all rollouts and over
  the second half: mean and standard error (rollouts treated as independent)."""
  d = (np.asarray(seed['arms']['sequential']['rollouts']['cosine'], float) -
       np.asarray(seed['arms']['accumulate']['rollouts']['cosine'], float))
  d = d[1:]  # rollout 0 is the same rollout in both arms (same params, same sampling key)
  half = d[len(d) // 2:]
  se = lambda x: float(np.nanstd(x, ddof=1) / math.sqrt(np.isfinite(x).sum()))
  return {'seed': seed['seed'], 'mean': float(np.nanmean(d)), 'se': se(d),
          'second_half_mean': float(np.nanmean(half)), 'second_half_se': se(half)}


def binned_by_accuracy(seeds: list[dict], arm: str, width: float = 0.1) -> dict:
  """Mean cosine of the rollouts whose sampled accuracy falls in each bin (all seeds pooled)."""
  cos = np.concatenate([np.asarray(s['arms'][arm]['rollouts']['cosine'], float) for s in seeds])
  acc = np.concatenate([np.asarray(s['arms'][arm]['rollouts']['accuracy'], float)
                        for s in seeds])
  out = {'bin_low': [], 'n': [], 'mean': [], 'se': []}
  for lo in np.arange(0.0, 1.0, width):
    sel = (acc >= lo) & (acc < lo + width) & np.isfinite(cos)
    if sel.sum() >= 2:
      out['bin_low'].append(float(round(lo, 3)))
      out['n'].append(int(sel.sum()))
      out['mean'].append(float(cos[sel].mean()))
      out['se'].append(float(cos[sel].std(ddof=1) / math.sqrt(sel.sum())))
  return out


def _mean_std(values: list[float]) -> dict:
  v = np.asarray(values, float)
  return {'mean': float(np.mean(v)), 'std': float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
          'per_seed': v.tolist()}


def table(results: dict) -> str:
  head = ('| seed | arm | opt steps | cos 1st q | cos last q | cos slope/100 | dot 1st q | '
          'dot last q | reward 1st q | reward last q | held-out start | held-out final | wall s |')
  lines = [head, '|' + '---|' * 13]
  for s in results['seeds']:
    for arm in ARMS:
      a = s['arms'][arm]
      st = a['stats']
      lines.append(
          f"| {s['seed']} | {arm} | {a['optimizer_steps']} | {st['cosine_first_quarter']:+.3f} | "
          f"{st['cosine_last_quarter']:+.3f} | {st['cosine_slope_per_100_rollouts']:+.3f} | "
          f"{st['dot_first_quarter']:+.2e} | {st['dot_last_quarter']:+.2e} | "
          f"{st['reward_first_quarter']:.3f} | {st['reward_last_quarter']:.3f} | "
          f"{st['eval_accuracy_start']:.3f} | {st['eval_accuracy_final']:.3f} | "
          f"{a['wall_s']:.0f} |")
  summ = results['summary']
  for arm in (*ARMS, 'sequential_minus_accumulate'):
    m = summ[arm]
    f = lambda k, fmt: f"{m[k]['mean']:{fmt}} ± {m[k]['std']:{fmt.lstrip('+')}}"
    lines.append(
        f"| mean ± sd | {arm} | | {f('cosine_first_quarter', '+.3f')} | "
        f"{f('cosine_last_quarter', '+.3f')} | {f('cosine_slope_per_100_rollouts', '+.3f')} | "
        f"{f('dot_first_quarter', '+.2e')} | {f('dot_last_quarter', '+.2e')} | "
        f"{f('reward_first_quarter', '.3f')} | {f('reward_last_quarter', '.3f')} | "
        f"{f('eval_accuracy_start', '.3f')} | {f('eval_accuracy_final', '.3f')} | |")
  lines.append('')
  lines.append('| seed | cos(seq) - cos(acc), paired by rollout: all | second half | '
               'learner diag one-sided steps (acc / seq) |')
  lines.append('|---|---|---|---|')
  for s, d in zip(results['seeds'], summ['paired_cosine_difference']):
    one = [s['arms'][a]['stats']['learner_diagnostic_one_sided_fraction'] for a in ARMS]
    lines.append(f"| {s['seed']} | {d['mean']:+.3f} ± {d['se']:.3f} | "
                 f"{d['second_half_mean']:+.3f} ± {d['second_half_se']:.3f} | "
                 f"{100 * one[0]:.0f}% / {100 * one[1]:.0f}% |")
  return '\n'.join(lines)


def _smooth(y: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
  """Centered moving average over w points (NaN-aware); -> (x, y) at the window centers."""
  w = max(1, min(w, len(y)))
  ok = np.isfinite(y)
  kernel = np.ones(w)
  num = np.convolve(np.where(ok, y, 0.0), kernel, 'valid')
  den = np.convolve(ok.astype(float), kernel, 'valid')
  x = np.arange(len(num)) + (w - 1) / 2
  return x, np.where(den > 0, num / np.maximum(den, 1), np.nan)


def plot(results: dict, path: str, smooth: int) -> None:
  """Per-rollout curves (moving averages; thin: each seed, thick: mean over seeds), held-out
  accuracy, cosine at matched sampled accuracy, and the learner's per-step diagnostic."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  colors = {'accumulate': 'tab:blue', 'sequential': 'tab:red'}
  seeds = results['seeds']
  study = results['study']
  k, b = study['grad_accum_steps'], study['micro_batch_size']
  fig, axes = plt.subplots(2, 3, figsize=(15, 7.6))

  def curves(ax, get, title, get_x=None):
    for arm in ARMS:
      ys_all = []
      for s in seeds:
        centers, ys = _smooth(np.asarray(get(s['arms'][arm]), float), smooth)
        x = centers if get_x is None else np.interp(
            centers, np.arange(len(get_x(s['arms'][arm]))), get_x(s['arms'][arm]))
        ax.plot(x, ys, color=colors[arm], lw=0.7, alpha=0.35)
        ys_all.append(ys)
      n = min(len(y) for y in ys_all)
      ax.plot(x[:n], np.nanmean([y[:n] for y in ys_all], axis=0), color=colors[arm], lw=2,
              label=arm)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel('rollouts consumed', fontsize=8)

  curves(axes[0, 0], lambda a: a['rollouts']['cosine'],
         f'cos(g+, g-) per fresh rollout (moving avg {smooth})')
  curves(axes[0, 1], lambda a: a['rollouts']['dot'],
         f'g+ · g- per fresh rollout (moving avg {smooth})')
  curves(axes[1, 0], lambda a: a['rollouts']['reward_mean'],
         f'rollout mean reward, correct + 0.1·format (moving avg {smooth})')

  ax = axes[1, 1]
  for arm in ARMS:
    accs = []
    for s in seeds:
      e = s['arms'][arm]['eval']
      ax.plot(e['rollout'], e['accuracy'], color=colors[arm], lw=0.7, alpha=0.35, marker='.',
              ms=3)
      accs.append(e['accuracy'])
    n = min(len(a) for a in accs)
    ax.plot(e['rollout'][:n], np.mean([a[:n] for a in accs], axis=0), color=colors[arm], lw=2,
            marker='o', ms=4, label=arm)
  ax.set_title(f'held-out greedy accuracy ({study["eval_examples"]} problems)', fontsize=9)
  ax.set_xlabel('rollouts consumed', fontsize=8)

  ax = axes[0, 2]
  for arm in ARMS:
    bins = results['summary']['cosine_by_rollout_accuracy'][arm]
    x = np.asarray(bins['bin_low']) + 0.05
    ax.errorbar(x, bins['mean'], yerr=bins['se'], color=colors[arm], marker='o', ms=4,
                capsize=2, label=arm)
  ax.set_title('cos(g+, g-) at matched progress (all seeds, ± s.e.)', fontsize=9)
  ax.set_xlabel('sampled accuracy of the rollout', fontsize=8)

  curves(axes[1, 2], lambda a: a['learner_diagnostic']['cosine'],
         f"learner's align/cosine as logged per optimizer step (moving avg {smooth} steps;\n"
         'sequential: per sign-sorted micro-batch, 0 when one sign is absent)',
         get_x=lambda a: a['learner_diagnostic']['rollout'])
  for ax in axes.flat:
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7)
  lr_scale = seeds[0]['arms']['sequential']['learning_rate'] / study['learning_rate']
  fig.suptitle(
      f'Implicit bias on 2-digit addition: accumulate (K={k} micro-batches of {b} per step) vs '
      f'sequential (one step per sign-sorted micro-batch, lr x {lr_scale:.3f}); seeds '
      f'{", ".join(str(s["seed"]) for s in seeds)}.\nOne rollout = {k * b} completions = '
      f'1 accumulate step = {k} sequential steps; both arms see the same prompts in the same '
      f'order.', fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.savefig(path, dpi=90)
  plt.close(fig)


# -- the study -----------------------------------------------------------------------------------
def run_study(study: Study, console=None) -> dict:
  """Runs every seed and arm; writes study.out (JSON) and study.plot (PNG). -> the results."""
  import jax  # pylint: disable=g-import-not-at-top
  console = console or sys.stdout
  t0 = time.time()
  runs_dir = study.runs_dir or tempfile.mkdtemp(prefix='implicit_bias_')
  if study.compilation_cache:
    jax.config.update('jax_compilation_cache_dir', os.path.join(runs_dir, 'compilation_cache'))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  info = machine_info(jax)
  print(f'runs in {runs_dir}; load average {info["load_avg_start"]}', file=console, flush=True)
  seeds = [run_seed(study, seed, runs_dir, console) for seed in study.seeds]
  info['load_avg_end'] = os.getloadavg()
  results = {'machine': info, 'command': ' '.join(sys.argv), 'runs_dir': runs_dir,
             'study': dataclasses.asdict(study), 'seeds': seeds,
             'base_config': _jsonable(dataclasses.asdict(arm_config(
                 study, base_config_dict(study, study.seeds[0]), 'accumulate')))}
  results['summary'] = summarize(seeds)
  results['accumulate_probe_vs_learner_max_abs_cosine_diff'] = max(
      accumulate_check(s['arms']['accumulate']) for s in seeds)
  results['wall_s'] = time.time() - t0
  print(file=console)
  print(table(results), file=console)
  print(f"\nper-rollout cosine vs the learner's diagnostic (accumulate arm): max |diff| "
        f"{results['accumulate_probe_vs_learner_max_abs_cosine_diff']:.2e}; "
        f"wall {results['wall_s']:.0f} s", file=console, flush=True)
  if study.out:
    os.makedirs(os.path.dirname(study.out) or '.', exist_ok=True)
    with open(study.out, 'w', encoding='utf-8') as f:
      json.dump(_rounded(results), f, indent=1)
    print(f'wrote {study.out}', file=console)
  if study.plot:
    plot(results, study.plot, study.smooth)
    print(f'wrote {study.plot}', file=console)
  return results


def machine_info(jax) -> dict:
  del jax  # imported by the caller already
  return machine.machine_info()


def _mkdir(path: str) -> str:
  os.makedirs(path, exist_ok=True)
  return path


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


def _rounded(x):
  """Floats to 6 significant digits (NaN -> None): a JSON file of readable size."""
  if isinstance(x, float):
    return None if not math.isfinite(x) else float(f'{x:.6g}')
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_rounded(v) for v in x]
  return x


# -- CLI -----------------------------------------------------------------------------------------
def _define_flags():
  """Flags, defined only when run as a program (a test imports this module beside others)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  d = Study()
  flags.DEFINE_list('seeds', [str(s) for s in d.seeds], 'Seeds (one SFT + both arms each).')
  flags.DEFINE_integer('grad_accum_steps', d.grad_accum_steps,
                       'K = S: micro-batches per accumulate step and per rollout.')
  flags.DEFINE_integer('micro_batch_size', d.micro_batch_size, 'B completions per micro-batch.')
  flags.DEFINE_integer('num_generations', d.num_generations, 'G completions per prompt.')
  flags.DEFINE_integer('rollouts', d.rollouts, 'Rollouts per arm (accumulate optimizer steps).')
  flags.DEFINE_integer('eval_every', d.eval_every, 'Held-out evaluation every N rollouts.')
  flags.DEFINE_float('learning_rate', d.learning_rate, 'GRPO learning rate (accumulate arm).')
  flags.DEFINE_float('sequential_lr_scale', None, 'Sequential arm lr factor (default 1/sqrt(K)).')
  flags.DEFINE_string('base_config', d.config, 'Base ml_collections config file.')
  flags.DEFINE_string('base_config_arg', d.config_arg, 'Its get_config argument.')
  flags.DEFINE_integer('eval_examples', d.eval_examples, 'Held-out problems per evaluation.')
  flags.DEFINE_bool('warm_start', d.warm_start, 'Run the SFT warm start (off: fresh init).')
  flags.DEFINE_bool('compilation_cache', d.compilation_cache,
                    'Reuse XLA executables across arms and seeds (RUNS_DIR/compilation_cache).')
  flags.DEFINE_integer('smooth', d.smooth, 'Plot moving-average window, in rollouts.')
  flags.DEFINE_string('runs_dir', '', 'Where the runs go (default: a fresh temp dir).')
  flags.DEFINE_string('out', d.out, 'JSON output ("" to skip).')
  flags.DEFINE_string('plot', d.plot, 'PNG output ("" to skip).')


def main(argv):
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  run_study(Study(
      seeds=tuple(int(s) for s in f.seeds), grad_accum_steps=f.grad_accum_steps,
      micro_batch_size=f.micro_batch_size, num_generations=f.num_generations,
      rollouts=f.rollouts, eval_every=f.eval_every, learning_rate=f.learning_rate,
      sequential_lr_scale=f.sequential_lr_scale, config=f.base_config,
      config_arg=f.base_config_arg, eval_examples=f.eval_examples, warm_start=f.warm_start,
      smooth=f.smooth, runs_dir=f.runs_dir, compilation_cache=f.compilation_cache, out=f.out,
      plot=f.plot))


if __name__ == '__main__':
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
