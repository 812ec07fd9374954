r"""Compiles per step function over a real SFT + GRPO run: each step function compiles once.

  python benchmarks/compile_count.py --out=benchmarks/results/compile_count.json

Runs the stages of ``configs/grpo_arith.py:smoke`` (SFT warm start, then GRPO with the
non-aligned schedule K=3, S=2, B=8, G=4) stretched to ``--grpo_steps`` optimizer steps (36
micro-steps = 18 rollouts by default: several schedule periods, one off-policy slice in every
six micro-steps), with held-out evaluation every ``--eval_every`` steps, orbax checkpoints every 2
steps, on ``--num_cpu_devices`` simulated CPU devices (mesh data=-1: the batch-sharded path).

jax's compile log (``jax.log_compiles``: one "Compiling jit(NAME) ..." record per XLA compile,
then "Finished XLA compilation of jit(NAME) in S sec") is captured by a logging handler, as in
``tests/conftest.py``. The stages run through the public API (``api.build_context``,
``SFTStage.run``, ``grpo.GRPOLoop``), so the script knows which stage a compile belongs to, and
GRPOLoop's ``on_rollout`` / ``on_micro_step`` hooks count the rollouts and learner steps
before it. Nothing in the library is wrapped or patched.

Checks (the script exits non-zero if one fails):

  * every step function compiles exactly once per stage that calls it: the learner micro-step
    (``jit(_micro_step)``, one Learner per stage), the rollout step (``jit(_rollout)``), the slice
    extraction (``jit(_micro_batch)``) and the greedy evaluation generate (``jit(fn)``, one
    Evaluator per stage);
  * no compile of any kind after the first schedule period of GRPO (lcm(K, S) micro-steps = 6,
    before the periodic evaluations, checkpoints and the off-policy slices that follow): the
    steady state compiles nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import time

from absl import app
from absl import flags
import machine  # benchmarks/machine.py

_DEVICES = flags.DEFINE_integer('num_cpu_devices', 8, 'Simulated CPU devices (XLA flag), set '
                                'before jax is imported; 1 = this machine as it is.')
_GRPO_STEPS = flags.DEFINE_integer('grpo_steps', 12, 'GRPO optimizer steps (K=3 micro-steps '
                                   'each).')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 4, 'GRPO held-out evaluation every N steps.')
_SFT_STEPS = flags.DEFINE_integer('sft_steps', 4, 'SFT optimizer steps.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/compile_count.json', 'JSON output.')

STEP_FUNCTIONS = {  # compiled name -> what it is
    'jit(_micro_step)': 'learner micro-step',
    'jit(_rollout)': 'rollout step (generate + old/ref log-probs)',
    'jit(_micro_batch)': 'rollout slice -> learner micro-batch',
    'jit(fn)': 'greedy evaluation generate',
}


class CompileLog(logging.Handler):
  """Records every XLA compile from jax's log: name, stage, progress counters, seconds."""

  def __init__(self):
    super().__init__(level=logging.DEBUG)
    self.stage = 'setup'
    self.calls = collections.Counter()  # (stage, what) -> calls so far
    self.records: list[dict] = []

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith('Compiling '):
      self.records.append({'name': msg.split()[1], 'stage': self.stage,
                           'learner_steps_before': self.calls[self.stage, 'learner_step'],
                           'rollouts_before': self.calls[self.stage, 'rollout'],
                           'seconds': None})
    elif msg.startswith('Finished XLA compilation of '):
      name, seconds = msg.split()[4], float(msg.split()[-2])
      for r in reversed(self.records):
        if r['name'] == name and r['seconds'] is None:
          r['seconds'] = seconds
          break


def run_config(workdir: str, log: CompileLog):
  """The smoke config's SFT and GRPO stages, run through the public API (``api.build_context``,
  ``SFTStage.run``, ``grpo.GRPOLoop`` with its ``on_rollout`` / ``on_micro_step`` hooks) so that
  every compile is labelled with its stage and with the GRPO calls made before it."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo, sft  # pylint: disable=g-import-not-at-top
  c = load_config_file('configs/grpo_arith.py', 'smoke')
  c.sft.num_steps = _SFT_STEPS.value
  c.grpo.num_steps = _GRPO_STEPS.value
  c.grpo.eval_every = _EVAL_EVERY.value
  cfg = api.load_run_config(c)

  def count(what):
    def hook(*_):
      log.calls[log.stage, what] += 1
    return hook

  ctx, params = api.build_context(cfg, workdir)
  log.stage = 'sft'
  params, summary = sft.SFTStage().run(ctx, params)
  log.stage = 'grpo'
  trainer = grpo.GRPOLoop(ctx, cfg.grpo, on_rollout=count('rollout'),
                          on_micro_step=count('learner_step'))
  _, grpo_summary = trainer.run(params)
  ctx.writer.close()
  return cfg, summary | grpo_summary, c.to_dict()


def summarize(log: CompileLog, cfg) -> dict:
  from jaxrl_ga import schedule  # pylint: disable=g-import-not-at-top
  sched = cfg.grpo.schedule
  table = schedule.build_table(sched)
  period = table.period_rollouts * sched.micro_steps_per_rollout  # micro-steps
  per = collections.defaultdict(lambda: {'compiles': 0, 'seconds': 0.0, 'at_learner_steps': []})
  for r in log.records:
    d = per[r['stage'], r['name']]
    d['compiles'] += 1
    d['seconds'] += r['seconds'] or 0.0
    d['at_learner_steps'].append(r['learner_steps_before'])
  checks = []
  for stage in ('sft', 'grpo'):
    for name, what in STEP_FUNCTIONS.items():
      if stage == 'sft' and name in ('jit(_rollout)', 'jit(_micro_batch)'):
        continue
      n = per[stage, name]['compiles'] if (stage, name) in per else 0
      checks.append({'stage': stage, 'function': name, 'what': what, 'compiles': n,
                     'ok': n == 1})
  steady = [r for r in log.records
            if r['stage'] == 'grpo' and r['learner_steps_before'] >= period]
  grpo_calls = {what: log.calls['grpo', what] for what in ('learner_step', 'rollout')}
  return {
      'per_function': [{'stage': s, 'name': n, **d} for (s, n), d in sorted(per.items())],
      'checks': checks,
      'steady_state': {'after_learner_steps': period,
                       'compiles': [r['name'] for r in steady], 'ok': not steady},
      'calls': {f'{s}/{w}': n for (s, w), n in sorted(log.calls.items())},
      'grpo_calls': grpo_calls,
      'schedule': {'micro_batch_size': sched.micro_batch_size,
                   'num_generations': sched.num_generations,
                   'steps_per_generation': sched.steps_per_generation,
                   'grad_accum_steps': sched.grad_accum_steps,
                   'period_micro_steps': period,
                   'off_policy_slices_per_period': int(table.slice_recompute.sum())},
      'total_compiles': len(log.records),
      'total_compile_s': sum(r['seconds'] or 0.0 for r in log.records),
  }


def machine_info() -> dict:
  return machine.machine_info()


def tables(s: dict) -> str:
  lines = ['| stage | step function | what | compiles | check |', '|---|---|---|---|---|']
  for c in s['checks']:
    lines.append(f"| {c['stage']} | `{c['function']}` | {c['what']} | {c['compiles']} | "
                 f"{'ok' if c['ok'] else 'FAIL'} |")
  st = s['steady_state']
  lines += ['', f"GRPO: {s['grpo_calls']['learner_step']} learner micro-steps, "
            f"{s['grpo_calls']['rollout']} rollouts; "
            f"compiles after micro-step {st['after_learner_steps']} (one schedule period): "
            f"{len(st['compiles'])}"
            f"{' ' + str(st['compiles']) if st['compiles'] else ''}.", '',
            '| stage | compiled function (all) | compiles | compile s | at learner step(s) |',
            '|---|---|---|---|---|']
  for d in s['per_function']:
    steps = d['at_learner_steps']
    at = ', '.join(map(str, steps[:6])) + (', ...' if len(steps) > 6 else '')
    lines.append(f"| {d['stage']} | `{d['name']}` | {d['compiles']} | {d['seconds']:.2f} | "
                 f"{at} |")
  return '\n'.join(lines)


def run() -> int:
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS is set)
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's per-save INFO lines
  info = machine_info()
  print(json.dumps(info), flush=True)
  log = CompileLog()
  logger = logging.getLogger('jax')
  logger.addHandler(log)
  logger.setLevel(logging.DEBUG)
  logger.propagate = False  # the records go to the handler only, not to the console
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir, jax.log_compiles(True):
    cfg, summary, config_dict = run_config(workdir, log)
  wall = time.perf_counter() - t0
  logger.removeHandler(log)
  s = summarize(log, cfg)
  info['load_avg_end'] = os.getloadavg()
  print()
  print(tables(s))
  ok = all(c['ok'] for c in s['checks']) and s['steady_state']['ok']
  print(f"{s['total_compiles']} compiles in all ({s['total_compile_s']:.1f} s of XLA compile "
        f"time) over a {wall:.0f} s run; step functions compile once, steady state compiles "
        f"nothing: {'yes' if ok else 'NO'}.")
  machine.write_json(_OUT.value, {'machine': info, 'flags': {k: flags.FLAGS[k].value for k in (
      'num_cpu_devices', 'grpo_steps', 'eval_every', 'sft_steps')}, 'config': config_dict,
      'run_wall_s': wall, 'run_summary': summary, 'result': s, 'compile_records': log.records})
  return 0 if ok else 1


def main(argv):
  del argv
  if _DEVICES.value > 1:  # before jax is imported (absl has parsed the flags by now)
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_'
                               f'device_count={_DEVICES.value}').strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  return run()


if __name__ == '__main__':
  machine.run(main)
