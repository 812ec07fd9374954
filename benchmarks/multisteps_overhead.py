r"""What optax.MultiSteps' eager inner optimizer costs per micro-step, and what lazy_inner saves.

  python benchmarks/multisteps_overhead.py --out=benchmarks/results/multisteps_overhead.json

``optax.MultiSteps.update`` runs its inner optimizer (here normalize -> clip -> AdamW, wrapped in
apply_if_finite) at every micro-step and keeps the result only on the last micro-step of a window.
``Learner(..., lazy_inner=True)`` (the default; "lazy" below) runs it under a ``lax.cond`` only when
a step fires; ``lazy_inner=False`` ("eager") is plain ``MultiSteps.update``.
This script builds the GRPO (token aggregation) programs on a random-init model for each variant
(``programs.build_grpo_programs``' table, ``machine.grpo_programs``, with ``lazy_inner`` True or
False: the trainer's learner micro-step and the same step with plain ``MultiSteps.update``),
compiles both table 'learner' entries, then times micro-steps with ``jax.block_until_ready``,
one K-micro-step window of
each variant per round in alternating order (eager, lazy / lazy, eager / ...), and reports medians:

  * non-emit: micro-steps that only accumulate; emit: the micro-step that fires the optimizer;
  * mean/step: the mean micro-step over one window (the cost of an optimizer step divided by K);
  * overhead = (eager - lazy) / eager of mean/step, from the medians and paired per round;
  * inner alone: the inner optimizer's update on the params tree, jitted on its own (the learner's
    exact inner transformation, ``progs.learner.optimizer.inner_opt``, and a plain clip + AdamW),
    as a sanity reference for the overhead: optax alone, not a trainer program, so jitted here.

Both variants consume the same micro-batches, so at the end their whole train states must agree;
the script checks that (bitwise, else the max abs difference), after a window made non-finite on
purpose (skipped by apply_if_finite in both) and further normal windows.

Sizes: tiny is the CPU default model (hidden 128, 2 layers, vocab 32; B=32, 8+8 tokens). big is
hidden 512, 8 layers, MLP 1536, 8 heads, vocab 32000 (60M params) with B=8 and 16+16 tokens: at
64+64 tokens one micro-step takes ~4 s on a shared 2-core CPU, too slow for enough rounds in a
few minutes. The inner optimizer's cost is fixed per micro-step (it scales with the params) while
the forward/backward scales with the tokens, so the overhead fraction falls as micro-batches grow;
`--big_prompt_length=64 --big_completion_length=64 --big_rounds=3` measures the larger case.
`--sizes=tiny` runs only the small model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, OptimizerConfig
from jaxrl_ga.models import transformer as tfm
import machine  # benchmarks/machine.py

_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Which model sizes to run: tiny, big.')
_K = flags.DEFINE_integer('grad_accum_steps', 4, 'K: micro-steps per optimizer step.')
_TINY_ROUNDS = flags.DEFINE_integer('tiny_rounds', 150, 'Timed windows per variant, tiny model.')
_BIG_ROUNDS = flags.DEFINE_integer('big_rounds', 14, 'Timed windows per variant, big model.')
_WARMUP = flags.DEFINE_integer('warmup_windows', 2, 'Untimed windows per variant after compile.')
_INNER_REPS = flags.DEFINE_integer('inner_reps', 2, 'Inner-optimizer timings per round.')
_CHECK_WINDOWS = flags.DEFINE_integer(
    'check_windows', 1, 'Normal windows after the non-finite one before comparing the variants.')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ...
_BIG_VOCAB = flags.DEFINE_integer('big_vocab_size', 32000, 'Big model: vocabulary size.')
_BIG_BATCH = flags.DEFINE_integer('big_micro_batch_size', 8, 'Big model: B completions.')
_BIG_PROMPT = flags.DEFINE_integer('big_prompt_length', 16, 'Big model: prompt tokens.')
_BIG_COMPLETION = flags.DEFINE_integer('big_completion_length', 16,
                                       'Big model: completion tokens.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/multisteps_overhead.json', 'JSON output.')

VARIANTS = ('eager', 'lazy')  # lazy_inner=False (plain MultiSteps.update) / True
OPT = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)
LOSS = GRPOLossConfig(aggregation='token')


Size = machine.Size


def sizes() -> list[Size]:
  tiny = Size('tiny', tfm.ModelConfig(
      vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
      micro_batch_size=32, prompt_length=8, completion_length=8, rounds=_TINY_ROUNDS.value)
  big = Size('big', tfm.ModelConfig(
      vocab_size=_BIG_VOCAB.value, **_BIG_MODEL(),
      max_position_embeddings=2 * (_BIG_PROMPT.value + _BIG_COMPLETION.value)),
      micro_batch_size=_BIG_BATCH.value, prompt_length=_BIG_PROMPT.value,
      completion_length=_BIG_COMPLETION.value, rounds=_BIG_ROUNDS.value)
  return [s for s in (tiny, big) if s.name in _SIZES.value]


def random_batch(rng, size: Size, nonfinite: bool = False) -> dict:
  return machine.random_grpo_batch(rng, size.micro_batch_size, size.prompt_length,
                                   size.completion_length, size.model.vocab_size, nonfinite)


def run_size(size: Size, mesh) -> dict:
  k = _K.value
  rng = np.random.default_rng(0)
  put = lambda tree: placement.shard_batch(tree, mesh)
  batches = [put(random_batch(rng, size)) for _ in range(2 * k + 1)]

  learners, states, optimizers, compile_s, n_params = {}, {}, {}, {}, 0
  for variant in VARIANTS:
    # Same seed: identical initial params, born separately (each state is donated on step).
    _, params, shardings = sharding.init_params(size.model, seed=0, mesh=mesh)
    n_params = machine.param_count(params)
    progs = machine.grpo_programs(
        size.model, mesh, shardings, micro_batch_size=size.micro_batch_size,
        prompt_length=size.prompt_length, completion_length=size.completion_length,
        grad_accum_steps=k, loss=LOSS, optimizer=OPT, lazy_inner=(variant == 'lazy'))
    step = progs.table['learner'].fn
    state = progs.init_state(params)['learner']
    # The first call is trace + compile + one step.
    (state, _), compile_s[variant] = machine.timed(step, state, batches[0])
    learners[variant], states[variant] = step, state
    optimizers[variant] = progs.learner.optimizer
  initial_params = jax.device_get(sharding.init_params(size.model, seed=0, mesh=mesh)[1])
  n_steps = {v: 1 for v in VARIANTS}

  def window(variant):
    """Runs the next k micro-steps of `variant`; returns their wall times [k] in seconds."""
    step, times = learners[variant], []
    for _ in range(k):
      batch = batches[n_steps[variant] % len(batches)]
      (states[variant], out), dt = machine.timed(step, states[variant], batch)
      times.append(dt)
      n_steps[variant] += 1
    assert bool(out['stepped']), 'windows must end on the emitting micro-step'
    return times

  for variant in VARIANTS:  # finish the first window, then warm up
    for _ in range(k - 1):
      states[variant], _ = learners[variant](states[variant], batches[n_steps[variant]])
      n_steps[variant] += 1
    for _ in range(_WARMUP.value):
      window(variant)

  # Inner optimizer alone, on a gradient-like tree the size of the params.
  inner_fns = inner_optimizer_fns(optimizers['lazy'], states['lazy'].params)
  for fn, args in inner_fns.values():
    machine.timed(fn, *args)  # compile

  times = {v: [] for v in VARIANTS}
  inner_times = {name: [] for name in inner_fns}
  loads = []
  t_start = time.perf_counter()
  for r in range(size.rounds):
    order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
    for variant in order:
      times[variant].append(window(variant))
    for name, (fn, args) in inner_fns.items():
      for _ in range(_INNER_REPS.value):
        inner_times[name].append(machine.timed(fn, *args)[1])
    loads.append(os.getloadavg()[0])
  timing_s = time.perf_counter() - t_start

  result = summarize(size, times, inner_times, compile_s, loads, timing_s)
  result['param_count'] = n_params
  result['check'] = check_same_state(size, learners, states, batches, n_steps, rng, put,
                                     initial_params)
  return result


def inner_optimizer_fns(optimizer: optax.MultiSteps, params) -> dict:
  """name -> (jitted update, args): the learner's inner transformation (``optimizer``: its
  MultiSteps) and a plain clip+AdamW."""
  params = jax.tree.map(lambda p: jnp.array(p, copy=True), params)  # the learner's are donated
  grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p, jnp.float32), params)
  inner = optimizer.inner_opt
  plain = optax.chain(optax.clip_by_global_norm(OPT.max_grad_norm),
                      optax.adamw(OPT.learning_rate, weight_decay=OPT.weight_decay))

  def learner_inner(g, s, p):
    return inner.update(g, s, p, denominator=jnp.float32(100.0))

  return {'learner_inner': (jax.jit(learner_inner), (grads, inner.init(params), params)),
          'clip_adamw': (jax.jit(plain.update), (grads, plain.init(params), params))}


def check_same_state(size, learners, states, batches, n_steps, rng, put, initial_params) -> dict:
  """Runs a non-finite window and more normal windows on both variants, then compares states."""
  k = _K.value
  bad = put(random_batch(rng, size, nonfinite=True))
  skipped_before = {v: int(states[v].nonfinite_skipped) for v in VARIANTS}
  for variant in VARIANTS:
    for i in range((1 + _CHECK_WINDOWS.value) * k):
      batch = bad if i == 1 else batches[n_steps[variant] % len(batches)]
      states[variant], out = learners[variant](states[variant], batch)
      n_steps[variant] += 1
    assert bool(out['stepped'])
  eager, lazy = (jax.device_get(states[v]) for v in VARIANTS)

  def max_abs_diff(a, b):  # equal entries (inf == inf, nan == nan included) count as 0
    def diff(x, y):
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      same = (x == y) | (np.isnan(x) & np.isnan(y))
      with np.errstate(invalid='ignore'):  # inf - inf where both are inf: masked by `same`
        return float(np.max(np.where(same, 0.0, np.abs(x - y)), initial=0.0))
    return max(diff(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  def bitwise(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  param_diff = max_abs_diff(eager.params, lazy.params)
  return {
      'micro_steps': n_steps['eager'],
      'optimizer_steps': int(eager.optimizer_step),
      'nonfinite_windows_skipped': {v: int(states[v].nonfinite_skipped) - skipped_before[v]
                                    for v in VARIANTS},
      'params_bitwise_equal': bitwise(eager.params, lazy.params),
      'state_bitwise_equal': bitwise(eager, lazy),
      'params_max_abs_diff': param_diff,
      'state_max_abs_diff': max_abs_diff(eager, lazy),
      'params_moved_max_abs': max_abs_diff(eager.params, initial_params),
      'ok': bool(param_diff <= 1e-7 and int(eager.optimizer_step) == int(lazy.optimizer_step)
                 and all(int(states[v].nonfinite_skipped) - skipped_before[v] == 1
                         for v in VARIANTS)),
  }


def summarize(size, times, inner_times, compile_s, loads, timing_s) -> dict:
  ms = lambda xs: 1e3 * statistics.median(xs)
  q = lambda xs, p: float(1e3 * np.percentile(xs, p))
  out = {'size': size.name, 'model': dataclasses.asdict(size.model),
         'micro_batch_size': size.micro_batch_size, 'prompt_length': size.prompt_length,
         'completion_length': size.completion_length, 'grad_accum_steps': _K.value,
         'rounds': size.rounds, 'timing_wall_s': timing_s,
         'load_avg_1min': {'median': statistics.median(loads), 'max': max(loads)},
         'variants': {}}
  for v in VARIANTS:
    w = np.asarray(times[v])  # [rounds, K] seconds
    means = w.mean(axis=1)
    out['variants'][v] = {
        'compile_first_call_s': compile_s[v],
        'non_emit_ms_median': ms(w[:, :-1].ravel()),
        'emit_ms_median': ms(w[:, -1]),
        'mean_step_ms_median': ms(means),
        'mean_step_ms_p25_p75': [q(means, 25), q(means, 75)],
        'raw_window_ms': (1e3 * w).round(3).tolist(),
    }
  e, l = (np.asarray(times[v]).mean(axis=1) for v in VARIANTS)
  med_e, med_l = statistics.median(e), statistics.median(l)
  paired = (e - l) / e
  out['overhead'] = {
      'mean_step_from_medians': (med_e - med_l) / med_e,
      'mean_step_paired_median': float(np.median(paired)),
      'mean_step_paired_p25_p75': [float(np.percentile(paired, 25)),
                                   float(np.percentile(paired, 75))],
      'non_emit_from_medians': 1 - (out['variants']['lazy']['non_emit_ms_median']
                                    / out['variants']['eager']['non_emit_ms_median']),
  }
  out['inner_alone_ms_median'] = {name: ms(t) for name, t in inner_times.items()}
  # What the eager path should waste per micro-step: (K-1) inner updates per window of K steps.
  out['predicted_overhead_from_inner'] = ((_K.value - 1) / _K.value
                                          * out['inner_alone_ms_median']['learner_inner']
                                          / (1e3 * med_e))
  return out


def machine_info() -> dict:
  return machine.machine_info()


def table(results: list[dict]) -> str:
  head = ('| size | params | variant | compile s | non-emit ms | emit ms | mean/step ms | '
          'overhead of eager |')
  lines = [head, '|' + '---|' * 8]
  for r in results:
    o = r['overhead']
    for v in VARIANTS:
      d = r['variants'][v]
      lo, hi = o['mean_step_paired_p25_p75']
      over = (f"{100 * o['mean_step_from_medians']:+.1f}% "
              f"(paired {100 * o['mean_step_paired_median']:+.1f}%, "
              f"IQR {100 * lo:+.1f}..{100 * hi:+.1f}%)" if v == 'eager' else '')
      lines.append(f"| {r['size']} | {r['param_count'] / 1e6:.2f}M | {v} | "
                   f"{d['compile_first_call_s']:.1f} | {d['non_emit_ms_median']:.2f} | "
                   f"{d['emit_ms_median']:.2f} | {d['mean_step_ms_median']:.2f} | {over} |")
  lines.append('')
  lines.append('| size | inner alone ms (learner inner / clip+adamw) | predicted overhead '
               '(K-1)/K·inner/eager step | rounds | load avg (median, max) | same state |')
  lines.append('|' + '---|' * 6)
  for r in results:
    i, c, la = r['inner_alone_ms_median'], r['check'], r['load_avg_1min']
    same = ('bitwise' if c['state_bitwise_equal'] else
            'params bitwise' if c['params_bitwise_equal'] else
            f"max |Δparams| {c['params_max_abs_diff']:.1e}")
    lines.append(f"| {r['size']} | {i['learner_inner']:.2f} / {i['clip_adamw']:.2f} | "
                 f"{100 * r['predicted_overhead_from_inner']:.1f}% | {r['rounds']} | "
                 f"{la['median']:.2f}, {la['max']:.2f} | {same}, "
                 f"{c['optimizer_steps']} opt steps, skipped "
                 f"{c['nonfinite_windows_skipped']['eager']}/"
                 f"{c['nonfinite_windows_skipped']['lazy']} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  unknown = sorted(set(_SIZES.value) - {'tiny', 'big'})
  if unknown or not _SIZES.value:
    raise machine.BadInput(f'--sizes={",".join(_SIZES.value)}: use tiny and/or big.')
  info = machine_info()
  print(json.dumps(info))
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  results = []
  for size in sizes():
    print(f'== {size.name}: {size.model}', flush=True)
    results.append(run_size(size, mesh))
    c = results[-1]['check']
    print(f"   same-state check: {json.dumps({k: v for k, v in c.items()})}", flush=True)
  info['load_avg_end'] = os.getloadavg()
  print()
  print(table(results))
  for r in results:
    verdict = 'exceeds' if r['overhead']['mean_step_from_medians'] > 0.05 else 'is under'
    print(f"{r['size']}: eager MultiSteps overhead {verdict} 5% of a micro-step.")
  machine.write_json(_OUT.value, {'machine': info, 'flags': {k: flags.FLAGS[k].value for k in (
      'sizes', 'grad_accum_steps', 'tiny_rounds', 'big_rounds', 'warmup_windows',
      'inner_reps', 'check_windows')}, 'results': results})
  if not all(r['check']['ok'] for r in results):
    raise SystemExit('the eager and lazy variants disagree (see the same-state check)')


if __name__ == '__main__':
  machine.run(main)
