r"""Peak memory of a learner micro-step against K: accumulation should cost one gradient buffer.

  python benchmarks/memory.py --out=benchmarks/results/memory.json

CPU only here, so memory is the process's resident set (RSS); on an accelerator the same question
would be asked of device memory. Each configuration runs in a fresh subprocess (this script with
``--child``), which:

  1. imports jax, initializes the params (random, one CPU device) and records RSS: the
     *baseline*;
  2. builds the GRPO programs (``programs.build_grpo_programs``, ``machine.grpo_programs``;
     K micro-steps per optimizer step), makes the learner's starting state (``init_state``; it
     holds the params, AdamW's two moments and MultiSteps' float32 accumulator), compiles the
     table's 'learner' entry (the trainer's micro-step at its abstract arguments) ahead of time
     and records XLA's ``memory_analysis()`` of it (temp, argument, output and aliased bytes:
     deterministic);
  3. runs one micro-step, then resets the peak (``/proc/self/clear_refs``), then runs K more
     micro-steps (so the window's optimizer step is among them), each on a micro-batch moved
     from host numpy arrays to the device just before its step, as a trainer streams slices;
  4. reports the peak RSS over those K micro-steps (``VmHWM``) minus the baseline, and minus the
     RSS just before them (the steps' transient working set).

RSS readings wait 0.5 s first: PjRt frees some buffers on another thread after a computation.
A last table (computed in this process, deterministic) is XLA's temp memory of the optimizer
update alone on the same params, donated: plain AdamW, then clip, apply_if_finite and MultiSteps
added one at a time, to attribute the step's temp memory (optax's transformations jitted here,
not programs the trainer runs: the program table has no entry for them).

glibc returns large blocks to the system only if they were mmapped, and raises its mmap
threshold as blocks are freed; the child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB
(every large XLA buffer is mmapped when allocated and unmapped when freed) and calls
``malloc_trim(0)`` before each reading, so that RSS follows the live buffers rather than the
allocator's cache.

Two series over K in {1, 2, 4, 8}:

  * fixed micro-batch b (default 8): K micro-batches of b accumulated into one optimizer step vs
    one micro-batch of b (K=1). The issue's claim: accumulation costs one gradient buffer, not K
    micro-batches; target: peak(K) <= 1.2 x peak(K=1).
  * fixed window W (default 64 sequences) split into K micro-batches of W/K: what accumulation
    buys, the same optimizer step with a smaller working set.

Model: hidden 512, 8 layers, MLP 1536, 8 heads, vocab 32000 (60M params, 240 MB of float32
params; the learner state holds 4 such trees: params, two AdamW moments, the accumulator), 16 + 16
tokens per sequence.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags
import machine  # benchmarks/machine.py

_K_VALUES = flags.DEFINE_list('k_values', ['1', '2', '4', '8'], 'K values of both series.')
_MICRO_BATCH = flags.DEFINE_integer('micro_batch_size', 8, 'b of the fixed-micro-batch series.')
_WINDOW = flags.DEFINE_integer('window_size', 64, 'W of the fixed-window series (sequences).')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ... (machine.BIG_MODEL_FLAGS)
_VOCAB = flags.DEFINE_integer('vocab_size', 32000, 'Model: vocabulary size.')
_PROMPT = flags.DEFINE_integer('prompt_length', 16, 'Prompt tokens per sequence.')
_COMPLETION = flags.DEFINE_integer('completion_length', 16, 'Completion tokens per sequence.')
_CHILD = flags.DEFINE_string('child', None, 'Internal: run one configuration (JSON) and print its '
                             'result.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/memory.json', 'JSON output.')

_RESULT_PREFIX = 'MEMORY_RESULT '
_MMAP_THRESHOLD = 64 * 1024
_SETTLE_S = 0.5


@dataclasses.dataclass(frozen=True)
class Config:
  series: str  # 'fixed_micro_batch' or 'fixed_window'
  grad_accum_steps: int
  micro_batch_size: int


# -- child: one configuration ----------------------------------------------------------------------
def _status_kib() -> dict[str, int]:
  out = {}
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(('VmRSS:', 'VmHWM:')):
        out[line.split(':')[0]] = int(line.split()[1])
  return out


def _trim() -> None:
  ctypes.CDLL('libc.so.6').malloc_trim(0)


def _rss_mib() -> float:
  """Current RSS once freed buffers are gone: PjRt frees some buffers on another thread after
  the computation is done, so a reading right after block_until_ready may still include them."""
  time.sleep(_SETTLE_S)
  _trim()
  return _status_kib()['VmRSS'] / 1024


def _model_config():
  from jaxrl_ga.models import transformer as tfm  # pylint: disable=g-import-not-at-top
  return tfm.ModelConfig(vocab_size=_VOCAB.value,
                        max_position_embeddings=2 * (_PROMPT.value + _COMPLETION.value),
                        **_BIG_MODEL())


def run_child(cfg: Config) -> dict:
  import jax  # pylint: disable=g-import-not-at-top  (child only)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import placement, sharding  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from jaxrl_ga.config import MeshConfig, OptimizerConfig

  tp, tc, b, k = _PROMPT.value, _COMPLETION.value, cfg.micro_batch_size, cfg.grad_accum_steps
  model = _model_config()
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  rss = {'after_import': _rss_mib()}
  _, params, shardings = sharding.init_params(model, seed=0, mesh=mesh)
  jax.block_until_ready(params)
  rss['baseline_after_params'] = _rss_mib()
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

  rng = np.random.default_rng(0)

  def host_batch() -> dict:  # numpy arrays: moved to the device right before each step
    return machine.random_grpo_batch(rng, b, tp, tc, model.vocab_size)

  host_batches = [host_batch() for _ in range(k + 1)]
  progs = machine.grpo_programs(
      model, mesh, shardings, micro_batch_size=b, prompt_length=tp, completion_length=tc,
      grad_accum_steps=k, optimizer=OptimizerConfig(learning_rate=1e-4, max_grad_norm=1.0))
  state = progs.init_state(params)['learner']
  del params  # the state holds the params now
  jax.block_until_ready(state)
  rss['after_learner_init'] = _rss_mib()
  t0 = time.perf_counter()
  compiled = progs.table['learner'].lower().compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla = {name: int(getattr(mem, name)) for name in (
      'temp_size_in_bytes', 'argument_size_in_bytes', 'output_size_in_bytes',
      'alias_size_in_bytes', 'generated_code_size_in_bytes')}
  rss['after_compile'] = _rss_mib()

  def step(state, i):
    batch = placement.shard_batch(host_batches[i % len(host_batches)], mesh)
    state, out = compiled(state, batch)
    return jax.block_until_ready(state), out

  state, _ = step(state, 0)  # warm-up micro-step (not in the peak)
  rss['before_steps'] = _rss_mib()
  with open('/proc/self/clear_refs', 'w') as f:  # resets VmHWM to the current RSS
    f.write('5')
  rss['at_peak_reset'] = _status_kib()['VmHWM'] / 1024
  t0 = time.perf_counter()
  stepped = 0
  for i in range(1, k + 1):
    state, out = step(state, i)
    stepped += int(out['stepped'])
  steps_s = time.perf_counter() - t0
  peak = _status_kib()['VmHWM'] / 1024
  assert stepped == 1, f'expected one optimizer step among the K micro-steps, got {stepped}'
  return {'config': dataclasses.asdict(cfg), 'window_size': k * b, 'param_count': n_params,
          'params_mib': 4 * n_params / 2**20, 'rss_mib': rss, 'peak_during_steps_mib': peak,
          'peak_minus_baseline_mib': peak - rss['baseline_after_params'],
          'peak_minus_before_steps_mib': peak - rss['before_steps'],
          'xla_memory_analysis': xla, 'compile_s': compile_s, 'steps_s': steps_s}


# -- the optimizer alone: where the step's temp comes from -----------------------------------------
def optimizer_reference() -> dict:
  """XLA temp / aliased bytes (in params-sizes) of an optimizer update + apply on the model's
  params, params and state donated: plain AdamW, then the learner's layers added one by one."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import sharding  # pylint: disable=g-import-not-at-top

  _, shapes, _ = sharding.abstract_model(_model_config())
  params_bytes = sum(4 * int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  adamw = optax.adamw(1e-4, weight_decay=0.01)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), adamw)
  variants = {
      'adamw': adamw,
      'clip + adamw': clipped,
      'apply_if_finite(clip + adamw)': optax.apply_if_finite(clipped, 2**30),
      'MultiSteps(apply_if_finite(clip + adamw), K=4)': optax.MultiSteps(
          optax.apply_if_finite(clipped, 2**30), 4, use_grad_mean=False),
  }
  out = {}
  for name, opt in variants.items():
    def update(params, state, grads, opt=opt):
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    state = jax.eval_shape(opt.init, shapes)
    mem = jax.jit(update, donate_argnums=(0, 1)).lower(shapes, state, shapes).compile() \
        .memory_analysis()
    out[name] = {'temp_params_sizes': mem.temp_size_in_bytes / params_bytes,
                 'aliased_params_sizes': mem.alias_size_in_bytes / params_bytes}
  return out


# -- parent: spawn the children --------------------------------------------------------------------
def configs() -> list[Config]:
  ks = [int(k) for k in _K_VALUES.value]
  out = [Config('fixed_micro_batch', k, _MICRO_BATCH.value) for k in ks]
  for k in ks:
    if _WINDOW.value % k:
      raise app.UsageError(f'--window_size={_WINDOW.value} is not divisible by K={k}.')
    out.append(Config('fixed_window', k, _WINDOW.value // k))
  return out


def spawn(cfg: Config) -> dict:
  """Runs one configuration in a fresh python; returns its result (raises if it failed)."""
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(_MMAP_THRESHOLD))
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                  env.get('PYTHONPATH')) if p)
  passed = [f'--{name}={flags.FLAGS[name].value}' for name in (
      'micro_batch_size', 'window_size', *machine.BIG_MODEL_FLAGS, 'vocab_size', 'prompt_length',
      'completion_length')]
  cmd = [sys.executable, os.path.abspath(__file__), *passed,
         f'--child={json.dumps(dataclasses.asdict(cfg))}']
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(_RESULT_PREFIX)]
  if proc.returncode or not lines:
    raise RuntimeError(f'child {cfg} failed ({proc.returncode}):\n{proc.stderr[-3000:]}')
  result = json.loads(lines[-1][len(_RESULT_PREFIX):])
  result['child_wall_s'] = time.perf_counter() - t0
  result['load_avg_1min_end'] = os.getloadavg()[0]
  return result


def machine_info() -> dict:
  return machine.machine_info(device='cpu (RSS of the process; no accelerator memory)',
                              malloc_mmap_threshold_bytes=_MMAP_THRESHOLD)


def table(results: list[dict]) -> str:
  mib = 2.0 ** 20
  lines = ['| series | K | b | window | XLA temp MiB (× params) | XLA args / out / aliased MiB | '
           'learner state MiB | peak − baseline MiB | vs K=1 | peak − before steps MiB |',
           '|' + '---|' * 10]
  ref = {r['config']['series']: r for r in results if r['config']['grad_accum_steps'] == 1}
  for r in results:
    c, x, rss = r['config'], r['xla_memory_analysis'], r['rss_mib']
    base = ref.get(c['series'])
    ratio = f"{r['peak_minus_baseline_mib'] / base['peak_minus_baseline_mib']:.2f}×" \
        if base else ''
    lines.append(
        f"| {c['series'].replace('_', ' ')} | {c['grad_accum_steps']} | "
        f"{c['micro_batch_size']} | {r['window_size']} | {x['temp_size_in_bytes'] / mib:.0f} "
        f"({x['temp_size_in_bytes'] / mib / r['params_mib']:.2f}×) | "
        f"{x['argument_size_in_bytes'] / mib:.0f} / {x['output_size_in_bytes'] / mib:.0f} / "
        f"{x['alias_size_in_bytes'] / mib:.0f} | "
        f"{rss['after_learner_init'] - rss['baseline_after_params']:.0f} | "
        f"{r['peak_minus_baseline_mib']:.0f} | {ratio} | {r['peak_minus_before_steps_mib']:.0f} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    result = run_child(Config(**json.loads(_CHILD.value)))
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    return
  info = machine_info()
  print(json.dumps(info))
  results, seen = [], {}
  for cfg in configs():
    key = (cfg.grad_accum_steps, cfg.micro_batch_size)
    if key in seen:  # the same run in both series (e.g. K=8, b=8 with W=64)
      results.append(dict(seen[key], config=dataclasses.asdict(cfg)))
      continue
    print(f'== {cfg}', flush=True)
    seen[key] = spawn(cfg)
    results.append(seen[key])
    r = seen[key]
    print(f"   peak - baseline {r['peak_minus_baseline_mib']:.0f} MiB, transient "
          f"{r['peak_minus_before_steps_mib']:.0f} MiB, XLA temp "
          f"{r['xla_memory_analysis']['temp_size_in_bytes'] / 2**20:.0f} MiB "
          f"({r['child_wall_s']:.0f} s)", flush=True)
  info['load_avg_end'] = os.getloadavg()
  reference = optimizer_reference()
  print()
  print(table(results))
  print()
  print('| optimizer update alone (params + state donated) | XLA temp (params-sizes) | '
        'aliased (params-sizes) |')
  print('|---|---|---|')
  for name, d in reference.items():
    print(f"| {name} | {d['temp_params_sizes']:.2f} | {d['aliased_params_sizes']:.2f} |")
  by = {(r['config']['series'], r['config']['grad_accum_steps']): r for r in results}
  ref = by.get(('fixed_micro_batch', 1))
  if ref:
    worst = max(r['peak_minus_baseline_mib'] for (s, _), r in by.items()
                if s == 'fixed_micro_batch') / ref['peak_minus_baseline_mib']
    print(f"fixed micro-batch: the largest peak over K is {worst:.2f}× that of K=1 "
          f"({'meets' if worst <= 1.2 else 'misses'} the 1.2× target).")
  machine.write_json(_OUT.value, {'machine': info, 'flags': {k: flags.FLAGS[k].value for k in (
      'k_values', 'micro_batch_size', 'window_size', *machine.BIG_MODEL_FLAGS, 'vocab_size',
      'prompt_length', 'completion_length')},
      'results': results, 'optimizer_reference': reference})


if __name__ == '__main__':
  machine.run(main)
