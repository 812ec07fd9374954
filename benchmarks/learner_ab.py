r"""Before/after of a learner change in one process: another checkout's learner module vs this one.

  git worktree add /tmp/before <commit>
  python benchmarks/learner_ab.py --before_root=/tmp/before \
      --out=benchmarks/results/learner_ab.json

Loads ``<before_root>/jaxrl_ga/learner.py`` as a separate module (everything else — model, losses,
sharding, optax — is this checkout's). "after" is this checkout's GRPO (token aggregation) learner
micro-step as the trainer runs it: the 'learner' entry of ``programs.build_grpo_programs``' table
(``machine.grpo_programs``). "before" builds a ``Learner`` from the loaded module with the same
arguments (the defaults the table's learner has at this config: lr scale 1, the default forward
options): another checkout's code cannot come from this checkout's table, so that arm is built
here, through the loaded module's public constructor. Both run on the same random-init model and
micro-batches, K-micro-step windows of the two timed in alternating order. Reported per side:
XLA's temp memory of the compiled micro-step, the median
accumulating and emitting (optimizer-step) micro-step, and the emit step's before/after ratio
paired per round. Both sides consume the same micro-batches from the same initial state, so the
script also reports whether their train states end bitwise equal (a change meant to keep the
semantics must keep that). Model: hidden 512, 8 layers, MLP 1536, 8 heads, vocab 32000 (60M
params), B = 8, 16 + 16 tokens, as in multisteps_overhead.py's big size.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
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

_BEFORE = flags.DEFINE_string('before_root', None,
                               'Checkout whose jaxrl_ga/learner.py is "before".')
_K = flags.DEFINE_integer('grad_accum_steps', 2, 'K: micro-steps per optimizer step.')
_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Timed windows per side.')
_BATCH = flags.DEFINE_integer('micro_batch_size', 8, 'B completions per micro-step.')
_PROMPT = flags.DEFINE_integer('prompt_length', 16, 'Prompt tokens.')
_COMPLETION = flags.DEFINE_integer('completion_length', 16, 'Completion tokens.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/learner_ab.json', 'JSON output.')

MODEL = tfm.ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                        max_position_embeddings=128)
OPT = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)
LOSS = GRPOLossConfig(aggregation='token')
SIDES = ('before', 'after')


def load_before(root: str):
  path = os.path.join(root, 'jaxrl_ga', 'learner.py')
  if not os.path.isfile(path):
    raise machine.BadInput(f'--before_root={root}: no {path}; point it at a checkout of jaxrl_ga '
                           '(e.g. git worktree add /tmp/before <commit>).')
  spec = importlib.util.spec_from_file_location('learner_before', path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
  spec.loader.exec_module(module)
  return module


def micro_batches(rng: np.random.Generator, k: int, mesh) -> list[dict]:
  return [placement.shard_batch(machine.random_grpo_batch(
      rng, _BATCH.value, _PROMPT.value, _COMPLETION.value, MODEL.vocab_size), mesh)
          for _ in range(k)]


def main(argv):
  del argv
  if not _BEFORE.value:
    raise machine.BadInput('--before_root is required (a checkout of the "before" commit).')
  before_lib = load_before(_BEFORE.value)
  k = _K.value
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  batches = micro_batches(np.random.default_rng(0), k, mesh)
  learners, states, temp = {}, {}, {}
  for side in SIDES:
    graphdef, params, shardings = sharding.init_params(MODEL, seed=0, mesh=mesh)
    if side == 'after':  # the trainer's step, from the program table
      progs = machine.grpo_programs(MODEL, mesh, shardings, micro_batch_size=_BATCH.value,
                                    prompt_length=_PROMPT.value,
                                    completion_length=_COMPLETION.value, grad_accum_steps=k,
                                    loss=LOSS, optimizer=OPT)
      step, state = progs.table['learner'].fn, progs.init_state(params)['learner']
    else:  # the other checkout's Learner, the same arguments
      task = before_lib.grpo_task_loss(LOSS, _COMPLETION.value)
      lrn = before_lib.Learner(graphdef, task, OPT, mesh, shardings, optimizer_every=k)
      state = lrn.init(params, batches[0])
      step = lrn.step_fn
    temp[side] = step.lower(state, batches[0]).compile().memory_analysis() \
        .temp_size_in_bytes / 2**20
    for b in batches:  # compile + one untimed window
      state, _ = step(state, b)
    learners[side], states[side] = step, jax.block_until_ready(state)
    print(f'{side}: compiled; XLA temp {temp[side]:.0f} MiB', flush=True)

  times = {s: {'accumulate': [], 'emit': []} for s in SIDES}
  loads = []
  for r in range(_ROUNDS.value):
    for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
      state = states[side]
      for i, b in enumerate(batches):
        t0 = time.perf_counter()
        state, _ = learners[side](state, b)
        jax.block_until_ready(state)
        times[side]['emit' if i == k - 1 else 'accumulate'].append(time.perf_counter() - t0)
      states[side] = state
    loads.append(os.getloadavg()[0])
  before, after = (jax.device_get(states[s]) for s in SIDES)
  bitwise = all(np.array_equal(x, y)
                for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  paired = [b / a for b, a in zip(times['before']['emit'], times['after']['emit'])]
  med = lambda xs: 1e3 * statistics.median(xs)
  rows = {s: {'xla_temp_mib': temp[s], 'accumulate_ms': med(times[s]['accumulate']),
              'emit_ms': med(times[s]['emit'])} for s in SIDES}
  lines = ['| side | XLA temp MiB | accumulate ms | emit ms | emit before/after (paired, IQR) |',
           '|---|---|---|---|---|']
  q = np.percentile(paired, [25, 50, 75])
  for s in SIDES:
    ratio = f'{q[1]:.2f}× ({q[0]:.2f}..{q[2]:.2f})' if s == 'after' else ''
    lines.append(f"| {s} | {rows[s]['xla_temp_mib']:.0f} | {rows[s]['accumulate_ms']:.1f} | "
                 f"{rows[s]['emit_ms']:.1f} | {ratio} |")
  print('\n' + '\n'.join(lines))
  print(f'\nrounds {_ROUNDS.value}, K={k}, load avg median {statistics.median(loads):.2f}; '
        f'final train states bitwise equal: {bitwise}')
  out = {'machine': machine.machine_info(before_root=os.path.abspath(_BEFORE.value),
                                         grad_accum_steps=k, rounds=_ROUNDS.value),
         'sides': rows, 'emit_before_over_after_paired': paired, 'times_s': times,
         'load_avg': loads, 'states_bitwise_equal': bitwise}
  machine.write_json(_OUT.value, out)


if __name__ == '__main__':
  machine.run(main)
