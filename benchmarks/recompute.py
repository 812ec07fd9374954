r"""Old-log-prob forward passes and wall time per schedule period under three recompute rules.

  python benchmarks/recompute.py --out=benchmarks/results/recompute.json

When K (grad_accum_steps) is not a multiple of S*mu (steps_per_generation * num_iterations), some
slices of a rollout are trained by a newer policy than the one that generated them and need the
generating policy's log-probs: one extra forward pass over the slice (a *unit*: B completions).
Three rules decide where to pay for it (``jaxrl_ga.schedule``):

  * ``trl_static``: every rollout, whenever K % (S*mu) != 0 (TRL's GRPOTrainer today);
  * ``rollout_rule``: every slice of a rollout inside which an optimizer step fires (TRL #5770);
  * ``slice_rule``: only the slices whose last use is by a newer policy (jaxrl_ga's default).

The rollout step reads its per-slice marks from the schedule table (``table.slice_recompute``), so
each rule is a table with other marks: ``rule_table`` derives the rollout rule's and TRL's marks
from the table's own ``rollout_recompute`` and ``counts`` (no library option is needed). Each rule
is a real GRPO run of the library's trainer (``api.build_context``, ``grpo.GRPOLoop(...,
table=rule_table(...))``: the programs ``jaxrl_ga.programs`` builds for the trainer and for
``plan``), with configs/grpo_arith.py's task, rewards and settings at the sizes below, for
``warmup_periods + rounds`` periods of lcm(K, S*mu) micro-steps. The trainer's hooks time it:
``on_rollout`` gives each rollout's step (generation + the marked slices' old log-probs, waited
for), ``on_micro_step`` marks each learner step (waited for in the hook), so a period's wall time,
rollout time and learner time are read off; the first ``warmup_periods`` (compilation) are not
timed. The rules run one after the other, each a whole run (the load may drift between them:
the JSON records the load average per rule).

Checks: the forward passes counted by the rollout state (in slice units) equal, per rule,
``periods x`` that rule's count from the table; and the slice rule's equal the minimum found by an
independent brute-force walk of the micro-steps (count the slices that some micro-step trains with a
policy version other than the generating one; no formula shared with ``schedule.py``). The cost of
one forward pass over one slice is timed on its own, to predict the differences between rules:
``logprobs.completion_logps`` with the run's engine's learner options (remat off), jitted here.
That pass is a reference, not a program of the table (``programs.build_grpo_programs``): the
trainer computes old log-probs only inside its 'rollout' step (the marked slices, with
generation) or its 'reorder' step (the whole buffer), neither of which runs one slice alone.

Sizes: ``tiny`` is configs/grpo_arith.py's model (hidden 128, 2 layers; B=64, G=8, 8+5 tokens);
``big`` is hidden 512, 8 layers, MLP 1536, 8 heads (B=8, same lengths), char vocabulary (17).
Completions end at the tokenizer's EOS as in training (the rules' runs sample the same rows: the
same seed, and their params differ by float rounding at most).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import tempfile
import time
from typing import Any

from absl import app
from absl import flags
import jax
import numpy as np

from jaxrl_ga import api
from jaxrl_ga import logprobs
from jaxrl_ga import schedule
from jaxrl_ga.config import RunConfig, ScheduleConfig, from_mapping, load_config_file
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.trainers import grpo
from jaxrl_ga.trainers import text
import machine  # benchmarks/machine.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Which model sizes to run: tiny, big.')
_TINY_SCHEDULES = flags.DEFINE_list(
    'tiny_schedules', ['3:2:1', '4:3:1', '3:2:2', '4:3:2'], 'Tiny: K:S:mu schedules to run.')
_BIG_SCHEDULES = flags.DEFINE_list('big_schedules', ['3:2:1', '4:3:1'],
                                   'Big: K:S:mu schedules to run.')
_TINY_ROUNDS = flags.DEFINE_integer('tiny_rounds', 4, 'Tiny: timed periods per rule.')
_BIG_ROUNDS = flags.DEFINE_integer('big_rounds', 3, 'Big: timed periods per rule.')
_WARMUP = flags.DEFINE_integer('warmup_periods', 1, 'Untimed periods per rule (compilation).')
_G = flags.DEFINE_integer('num_generations', 8, 'G: completions per prompt.')
_TINY_BATCH = flags.DEFINE_integer('tiny_micro_batch_size', 64, 'Tiny: B.')
_BIG_BATCH = flags.DEFINE_integer('big_micro_batch_size', 8, 'Big: B.')
_PROMPT_LEN = flags.DEFINE_integer('max_prompt_length', 8, 'Prompt tokens (left-padded).')
_COMPLETION_LEN = flags.DEFINE_integer('max_completion_length', 5, 'Completion tokens.')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ...
_PASS_REPS = flags.DEFINE_integer('pass_reps', 10, 'Timings of one slice forward pass alone.')
_EVAL_EXAMPLES = flags.DEFINE_integer('eval_examples', 16, 'Held-out examples evaluated before '
                                      'and after each run (not timed).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/recompute.json', 'JSON output.')

RULES = ('trl_static', 'rollout_rule', 'slice_rule')
SEED = 0


@dataclasses.dataclass(frozen=True)
class Size:
  name: str
  model: dict  # model.* overrides of configs/grpo_arith.py
  micro_batch_size: int
  schedules: tuple[tuple[int, int, int], ...]  # (K, S, mu)
  rounds: int


def sizes() -> list[Size]:
  big = _BIG_MODEL()
  parse = lambda specs: tuple(tuple(int(x) for x in s.split(':')) for s in specs)
  out = [Size('tiny', {}, _TINY_BATCH.value, parse(_TINY_SCHEDULES.value), _TINY_ROUNDS.value),
         Size('big', big, _BIG_BATCH.value, parse(_BIG_SCHEDULES.value), _BIG_ROUNDS.value)]
  return [s for s in out if s.name in _SIZES.value]


def run_config(size: Size, sched: ScheduleConfig, num_steps: int) -> RunConfig:
  """configs/grpo_arith.py, GRPO only, at ``size`` and ``sched``, on one device, for
  ``num_steps`` optimizer steps; no periodic evaluation or checkpoint."""
  c = load_config_file(os.path.join(REPO, 'configs', 'grpo_arith.py')).to_dict()
  c['stages'] = 'grpo'
  c['seed'] = SEED
  c['model'].update(size.model)
  c['mesh'].update(data=1, fsdp=1, tensor=1)
  c['grpo'].update(num_steps=num_steps, log_every=10**6, eval_every=0)
  c['grpo']['schedule'].update(dataclasses.asdict(sched))
  c['grpo']['sampling'].update(max_prompt_length=_PROMPT_LEN.value,
                               max_completion_length=_COMPLETION_LEN.value)
  c['eval'].update(num_examples=_EVAL_EXAMPLES.value, batch_size=_EVAL_EXAMPLES.value)
  c['checkpoint'].update(every_steps=0)
  return from_mapping(RunConfig, c)


# -- the three rules as tables ---------------------------------------------------------------------
def rule_table(table: schedule.ScheduleTable, rule: str) -> schedule.ScheduleTable:
  """``table`` with the slice marks of ``rule``: the rollout rule marks every slice of a marked
  rollout; TRL's static rule every slice whenever its count is non-zero."""
  s = table.config.steps_per_generation
  if rule == 'slice_rule':
    marks = table.slice_recompute
  elif rule == 'rollout_rule':
    marks = np.repeat(table.rollout_recompute[:, None], s, axis=1)
  elif rule == 'trl_static':
    marks = np.full(table.slice_recompute.shape, table.counts['trl_static'] > 0)
  else:
    raise ValueError(f'unknown rule {rule!r}; choose one of {", ".join(RULES)}.')
  marks = np.ascontiguousarray(marks)
  marks.setflags(write=False)
  assert int(marks.sum()) == table.counts[rule], (rule, marks, table.counts)
  return dataclasses.replace(table, slice_recompute=marks)


def brute_force_minimum(cfg: ScheduleConfig, num_micro_steps: int) -> int:
  """Slices (of the rollouts started within ``num_micro_steps``) that some micro-step trains with
  a policy version other than the one that generated them: a walk with counters only."""
  version, since_step, generated_by = 0, 0, {}
  used = collections.defaultdict(set)
  slice_index, iteration, rollout = cfg.steps_per_generation - 1, cfg.num_iterations - 1, -1
  for _ in range(num_micro_steps):
    slice_index += 1
    if slice_index == cfg.steps_per_generation:
      slice_index, iteration = 0, iteration + 1
    if iteration == cfg.num_iterations:
      iteration, rollout = 0, rollout + 1
      generated_by[rollout] = version
    used[rollout, slice_index].add(version)
    since_step += 1
    if since_step == cfg.grad_accum_steps:
      version, since_step = version + 1, 0
  return sum(any(v != generated_by[r] for v in vs) for (r, _), vs in used.items())


# -- one schedule ----------------------------------------------------------------------------------
class PeriodClock:
  """The trainer's hooks -> per period: wall, rollout and learner seconds (learner steps are
  waited for in the hook, so that a period's end is its last step's).

  Attributes:
    period: micro-steps per schedule period.
    periods: one dict per finished period (wall, rollout, learn seconds, 1-minute load).
    current: the period being timed: its start time and its rollout and learn seconds so far.
  """

  def __init__(self, period: int):
    self.period, self.periods = period, []
    self.current = {'start': None, 'rollout': 0.0, 'learn': 0.0}

  def on_rollout(self, event: grpo.RolloutEvent):
    self.current['rollout'] += event.generate_s

  def on_micro_step(self, micro_step: int, started: float, out: dict):
    jax.block_until_ready(out)
    now = time.perf_counter()
    if self.current['start'] is None:
      self.current['start'] = started
    self.current['learn'] += now - started
    if (micro_step + 1) % self.period == 0:
      self.periods.append({'wall': now - self.current['start'], 'rollout': self.current['rollout'],
                           'learn': self.current['learn'], 'load_avg_1min': os.getloadavg()[0]})
      self.current = {'start': now, 'rollout': 0.0, 'learn': 0.0}


def run_rule(size: Size, sched: ScheduleConfig, table: schedule.ScheduleTable, rule: str,
             periods: int) -> dict[str, Any]:
  """One rule's GRPO run of ``periods`` schedule periods. -> its clock, summary and params."""
  cfg = run_config(size, sched, periods * table.period_micro_steps // sched.optimizer_every)
  with tempfile.TemporaryDirectory() as workdir:
    ctx, params = api.build_context(cfg, workdir)
    clock = PeriodClock(table.period_micro_steps)
    trainer = grpo.GRPOLoop(ctx, cfg.grpo, on_rollout=clock.on_rollout,
                            on_micro_step=clock.on_micro_step, table=rule_table(table, rule))
    initial = jax.device_get(params)  # the run donates its own
    t0 = time.perf_counter()
    final, summary = trainer.run(params)
    return {'clock': clock, 'summary': summary, 'params': jax.device_get(final), 'ctx': ctx,
            'trainer': trainer, 'initial': initial, 'run_s': time.perf_counter() - t0}


def one_pass_seconds(run: dict, b: int, reps: int) -> float:
  """Median time of one old-log-prob forward pass over one slice of B completions alone, with
  the engine's own forward options (a reference jitted here: no table entry runs one slice alone;
  module docstring)."""
  ctx, engine = run['ctx'], run['trainer'].engine
  task = ctx.task
  g = engine.sched.num_generations
  ids = [text.encode_prompt(ctx.tokenizer, task.train_example(i, SEED).prompt)
         for i in range(-(-b // g))]
  tokens, mask = text.left_pad(ids, _PROMPT_LEN.value, ctx.pad_id, 'max_prompt_length')
  pt, pm = np.repeat(tokens, g, axis=0)[:b], np.repeat(mask, g, axis=0)[:b]
  rng = np.random.default_rng(SEED)
  ct = rng.integers(3, ctx.model_cfg.vocab_size, (b, _COMPLETION_LEN.value)).astype(np.int32)
  cm = np.ones_like(ct)
  options = dataclasses.replace(engine.learner_options, remat='none')
  fn = jax.jit(lambda p, *xs: logprobs.completion_logps(tfm.merge(ctx.graphdef, p), *xs,
                                                        options)[0])
  machine.timed(fn, run['initial'], pt, pm, ct, cm)
  return statistics.median(machine.timed(fn, run['initial'], pt, pm, ct, cm)[1]
                           for _ in range(reps))


def run_schedule(size: Size, k: int, s: int, mu: int) -> dict[str, Any]:
  b, g = size.micro_batch_size, _G.value
  sched = ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s,
                         num_iterations=mu, grad_accum_steps=k)
  table = schedule.build_table(sched)
  period = table.period_micro_steps
  total_periods = _WARMUP.value + size.rounds
  runs = {rule: run_rule(size, sched, table, rule, total_periods) for rule in RULES}
  minimum = brute_force_minimum(sched, total_periods * period)
  one_pass = one_pass_seconds(runs['slice_rule'], b, _PASS_REPS.value)
  result = {'K': k, 'S': s, 'mu': mu, 'B': b, 'G': g, 'period_micro_steps': period,
            'period_rollouts': table.period_rollouts,
            'period_optimizer_steps': period // k, 'timed_periods': size.rounds,
            'warmup_periods': _WARMUP.value, 'table_counts_per_period': dict(table.counts),
            'brute_force_minimum_per_period': minimum / total_periods,
            'one_pass_ms': 1e3 * one_pass, 'rules': {}}
  slice_params = runs['slice_rule']['params']
  for rule, run in runs.items():
    passes = int(run['summary']['grpo/old_logprob_forward_passes'])
    per_period = passes / total_periods
    timed = run['clock'].periods[_WARMUP.value:]
    rows = np.asarray([[p['wall'], p['rollout'], p['learn']] for p in timed])
    med = np.median(rows, axis=0)
    diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(run['params']), jax.tree.leaves(slice_params)))
    result['rules'][rule] = {
        'forward_passes_total': passes, 'forward_passes_per_period': per_period,
        'expected_per_period': table.counts[rule],
        'period_ms_median': 1e3 * med[0], 'rollout_ms_median': 1e3 * med[1],
        'learn_ms_median': 1e3 * med[2],
        'period_ms_p25_p75': [1e3 * float(np.percentile(rows[:, 0], q)) for q in (25, 75)],
        'run_s': run['run_s'],
        'load_avg_1min': {'median': statistics.median(p['load_avg_1min'] for p in timed),
                          'max': max(p['load_avg_1min'] for p in timed)},
        'params_max_abs_diff_vs_slice_rule': diff,
        'raw_ms': (1e3 * rows).round(3).tolist(),
    }
    assert per_period == table.counts[rule], (rule, passes, total_periods, table.counts)
  assert result['rules']['slice_rule']['forward_passes_per_period'] == minimum / total_periods, (
      result['rules']['slice_rule'], minimum)
  base = result['rules']['slice_rule']
  for rule in RULES:
    d = result['rules'][rule]
    d['rollout_ms_over_slice_rule'] = d['rollout_ms_median'] - base['rollout_ms_median']
    d['predicted_ms_over_slice_rule'] = ((d['expected_per_period'] - base['expected_per_period'])
                                         * result['one_pass_ms'])
  return result


# -- output ----------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
  return machine.machine_info(jax_devices=str(jax.devices()))


def table_text(results: list[dict[str, Any]]) -> str:
  lines = ['| size | K | S | μ | period (micro-steps / rollouts) | rule | old-log-prob passes / '
           'period (measured = table) | brute-force minimum | rollout ms / period | '
           'Δ vs slice rule (predicted) | period ms (median, IQR) | learner ms / period | '
           'max abs Δparams vs slice rule |',
           '|' + '---|' * 13]
  for size_result in results:
    for r in size_result['schedules']:
      for rule in RULES:
        d = r['rules'][rule]
        lo, hi = d['period_ms_p25_p75']
        delta = ('' if rule == 'slice_rule' else
                 f"{d['rollout_ms_over_slice_rule']:+.0f} "
                 f"({d['predicted_ms_over_slice_rule']:+.0f})")
        lines.append(
            f"| {size_result['size']} | {r['K']} | {r['S']} | {r['mu']} | "
            f"{r['period_micro_steps']} / {r['period_rollouts']} | {rule} | "
            f"{d['forward_passes_per_period']:g} = {d['expected_per_period']} | "
            f"{r['brute_force_minimum_per_period']:g} | {d['rollout_ms_median']:.0f} | {delta} | "
            f"{d['period_ms_median']:.0f} ({lo:.0f}-{hi:.0f}) | {d['learn_ms_median']:.0f} | "
            f"{d['params_max_abs_diff_vs_slice_rule']:.1e} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  info = machine_info()
  print(json.dumps(info), flush=True)
  results = []
  for size in sizes():
    size_result = {'size': size.name, 'model': size.model, 'micro_batch_size':
                   size.micro_batch_size, 'schedules': []}
    for k, s, mu in size.schedules:
      print(f'== {size.name}: K={k} S={s} mu={mu}', flush=True)
      r = run_schedule(size, k, s, mu)
      size_result['schedules'].append(r)
      print('   ' + ', '.join(
          f"{rule} {d['forward_passes_per_period']:g} passes {d['rollout_ms_median']:.0f} ms "
          f"rollouts / {d['period_ms_median']:.0f} ms period" for rule, d in r['rules'].items()),
          flush=True)
    results.append(size_result)
  info['load_avg_end'] = os.getloadavg()
  print()
  print(table_text(results))
  flag_names = ('sizes', 'tiny_schedules', 'big_schedules', 'tiny_rounds', 'big_rounds',
                'warmup_periods', 'num_generations', 'tiny_micro_batch_size',
                'big_micro_batch_size', 'max_prompt_length', 'max_completion_length',
                *machine.BIG_MODEL_FLAGS, 'pass_reps', 'eval_examples')
  machine.write_json(_OUT.value, {'machine': info, 'results': results,
                                  'flags': {n: flags.FLAGS[n].value for n in flag_names}})


if __name__ == '__main__':
  machine.run(main)
