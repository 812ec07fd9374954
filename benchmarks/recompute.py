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
gets its own ``RolloutEngine`` (compiled once) and learner state; one ``Learner`` (compiled once)
serves all three. A period is lcm(K, S*mu) micro-steps: its rollouts (generation + the marked
slices' old log-probs, one jitted step each, waited for) and its micro-steps (micro-batch
extraction + the learner step, waited for). Rounds run one period of every rule, in rotating
order; the first ``warmup_periods`` (compilation) are not timed. Advantages are drawn at random
(rewards do not change the cost); prompts are the arithmetic task's; every completion is generated
to max_completion_length (an EOS id outside the vocabulary) so that all rules do the same work
apart from the old log-probs.

Checks: the forward passes counted by the rollout state (in slice units) equal, per rule,
``periods x`` that rule's count from the table; and the slice rule's equal the minimum found by an
independent brute-force walk of the micro-steps (count the slices that some micro-step trains with a
policy version other than the generating one; no formula shared with ``schedule.py``). The cost of
one forward pass over one slice is timed on its own, to predict the differences between rules.

Sizes: ``tiny`` is configs/grpo_arith.py's model (hidden 128, 2 layers; B=64, G=8, 8+5 tokens);
``big`` is hidden 512, 8 layers, MLP 1536, 8 heads (B=8, same lengths), char vocabulary (17).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import time
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import schedule
from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import (GRPOLossConfig, MeshConfig, OptimizerConfig, SamplingConfig,
                             ScheduleConfig, load_config_file)
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import arithmetic
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
_BIG_HIDDEN = flags.DEFINE_integer('big_hidden_size', 512, 'Big model: hidden size.')
_BIG_LAYERS = flags.DEFINE_integer('big_layers', 8, 'Big model: decoder layers.')
_BIG_INTERMEDIATE = flags.DEFINE_integer('big_intermediate_size', 1536, 'Big model: MLP width.')
_BIG_HEADS = flags.DEFINE_integer('big_heads', 8, 'Big model: attention heads.')
_BIG_KV_HEADS = flags.DEFINE_integer('big_kv_heads', 8, 'Big model: key/value heads.')
_PASS_REPS = flags.DEFINE_integer('pass_reps', 10, 'Timings of one slice forward pass alone.')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/recompute.json', 'JSON output.')

RULES = ('trl_static', 'rollout_rule', 'slice_rule')
SEED = 0


@dataclasses.dataclass(frozen=True)
class Size:
  name: str
  model: tfm.ModelConfig
  micro_batch_size: int
  schedules: tuple[tuple[int, int, int], ...]  # (K, S, mu)
  rounds: int


def sizes(vocab_size: int) -> list[Size]:
  spec = load_config_file(os.path.join(REPO, 'configs', 'grpo_arith.py')).model
  max_len = _PROMPT_LEN.value + _COMPLETION_LEN.value
  common_fields = dict(vocab_size=vocab_size, attention_bias=spec.attention_bias,
                       tie_word_embeddings=spec.tie_word_embeddings, rope_theta=spec.rope_theta,
                       max_position_embeddings=max(spec.max_position_embeddings, max_len))
  tiny = tfm.ModelConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                         num_hidden_layers=spec.num_hidden_layers,
                         num_attention_heads=spec.num_attention_heads,
                         num_key_value_heads=spec.num_key_value_heads, **common_fields)
  big = tfm.ModelConfig(hidden_size=_BIG_HIDDEN.value, intermediate_size=_BIG_INTERMEDIATE.value,
                        num_hidden_layers=_BIG_LAYERS.value, num_attention_heads=_BIG_HEADS.value,
                        num_key_value_heads=_BIG_KV_HEADS.value, **common_fields)
  parse = lambda specs: tuple(tuple(int(x) for x in s.split(':')) for s in specs)
  out = [Size('tiny', tiny, _TINY_BATCH.value, parse(_TINY_SCHEDULES.value), _TINY_ROUNDS.value),
         Size('big', big, _BIG_BATCH.value, parse(_BIG_SCHEDULES.value), _BIG_ROUNDS.value)]
  return [s for s in out if s.name in _SIZES.value]


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
def timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


class RuleRunner:
  """One rule: its engine, rollout state, learner state and the current rollout."""

  def __init__(self, rule, sched, table, size, mesh, graphdef, shardings, params, learner,
               prompts, eos_id, pad_id):
    self.rule, self.sched, self.learner, self.prompts = rule, sched, learner, prompts
    sampling_cfg = SamplingConfig(max_prompt_length=_PROMPT_LEN.value,
                                  max_completion_length=_COMPLETION_LEN.value)
    self.engine = rollout_lib.RolloutEngine(
        graphdef, rule_table(table, rule), sampling_cfg, GRPOLossConfig(epsilon_high=0.28),
        mesh, shardings, eos_id=eos_id, pad_id=pad_id)
    self.rstate = self.engine.init_state(SEED)
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)
    self.lstate = None
    self._init_params = copy(params)
    self._adv_rng = np.random.default_rng(SEED)
    self.micro_step = 0
    self.periods: list[dict[str, float]] = []
    self.size = size

  def init_learner(self, example_batch):
    self.lstate = self.learner.init(self._init_params, example_batch)
    del self._init_params

  def example_batch(self):
    """A micro-batch from a throwaway rollout (the rule's own state is left untouched)."""
    s, b = self.sched.steps_per_generation, self.sched.micro_batch_size
    tokens, mask = self.prompts(0)
    buffer, _, _ = self.engine.rollout(self._init_params, None, self.engine.init_state(SEED),
                                       tokens, mask)
    adv = placement.put(np.zeros((s, b), np.float32), self.engine.advantage_sharding)
    return self.engine.micro_batch(buffer, 0, adv)

  def run_period(self, period_micro_steps: int) -> dict[str, float]:
    """One schedule period; -> wall seconds of its rollouts and its learner micro-steps."""
    sched = self.sched
    s, e = sched.steps_per_generation, sched.micro_steps_per_rollout
    t_rollout = t_learn = 0.0
    t0 = time.perf_counter()
    for _ in range(period_micro_steps):
      if self.micro_step % e == 0:
        tokens, mask = self.prompts(self.micro_step // e)
        (self.buffer, self.rstate, _), dt = timed(self.engine.rollout, self.lstate.params, None,
                                                  self.rstate, tokens, mask)
        t_rollout += dt
        adv = self._adv_rng.normal(size=(s, sched.micro_batch_size)).astype(np.float32)
        self.advantages = placement.put(adv, self.engine.advantage_sharding)
      t1 = time.perf_counter()
      batch = self.engine.micro_batch(self.buffer, self.micro_step % s, self.advantages)
      self.lstate, out = self.learner.step(self.lstate, batch)
      jax.block_until_ready(out)
      t_learn += time.perf_counter() - t1
      self.micro_step += 1
    assert bool(out['stepped']), 'a period ends with an optimizer step'
    return {'wall': time.perf_counter() - t0, 'rollout': t_rollout, 'learn': t_learn}


def one_pass_seconds(graphdef, params, prompts, b: int, vocab_size: int, reps: int) -> float:
  """Median time of one old-log-prob forward pass over one slice of B completions alone."""
  tokens, mask = prompts(0)
  g = _G.value
  pt = np.repeat(tokens, g, axis=0)[:b]
  pm = np.repeat(mask, g, axis=0)[:b]
  rng = np.random.default_rng(SEED)
  ct = rng.integers(3, vocab_size, (b, _COMPLETION_LEN.value)).astype(np.int32)
  cm = np.ones_like(ct)
  fn = jax.jit(lambda p, *xs: learner_lib.completion_logps(tfm.merge(graphdef, p), *xs)[0])
  timed(fn, params, pt, pm, ct, cm)
  return statistics.median(timed(fn, params, pt, pm, ct, cm)[1] for _ in range(reps))


def run_schedule(size: Size, k: int, s: int, mu: int, mesh, tokenizer, task) -> dict[str, Any]:
  b, g = size.micro_batch_size, _G.value
  sched = ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s,
                         num_iterations=mu, grad_accum_steps=k)
  table = schedule.build_table(sched)
  period = table.period_micro_steps
  graphdef, params, shardings = sharding.init_params(size.model, SEED, mesh)
  learner = learner_lib.Learner(
      graphdef, learner_lib.grpo_task_loss(GRPOLossConfig(epsilon_high=0.28),
                                           _COMPLETION_LEN.value),
      OptimizerConfig(learning_rate=1e-4), mesh, shardings,
      optimizer_every=sched.optimizer_every)

  def prompts(rollout: int):
    n = sched.prompts_per_rollout
    ids = [text.encode(tokenizer, task.train_example(rollout * n + i, SEED).prompt)
           for i in range(n)]
    return text.left_pad(ids, _PROMPT_LEN.value, tokenizer.pad_token_id, 'max_prompt_length')

  runners = {rule: RuleRunner(rule, sched, table, size, mesh, graphdef, shardings, params,
                              learner, prompts, eos_id=size.model.vocab_size,
                              pad_id=tokenizer.pad_token_id) for rule in RULES}
  example = runners['slice_rule'].example_batch()
  for r in runners.values():
    r.init_learner(example)

  compile_s = {}
  for rule, r in runners.items():
    t0 = time.perf_counter()
    for _ in range(_WARMUP.value):
      r.run_period(period)
    compile_s[rule] = time.perf_counter() - t0
  before = {rule: int(r.rstate.forward_passes) for rule, r in runners.items()}
  loads = []
  for i in range(size.rounds):
    order = RULES[i % len(RULES):] + RULES[:i % len(RULES)]
    for rule in order:
      runners[rule].periods.append(runners[rule].run_period(period))
    loads.append(os.getloadavg()[0])

  total_periods = _WARMUP.value + size.rounds
  minimum = brute_force_minimum(sched, total_periods * period)
  one_pass = one_pass_seconds(graphdef, params, prompts, b, size.model.vocab_size,
                              _PASS_REPS.value)
  slice_params = jax.device_get(runners['slice_rule'].lstate.params)
  result = {'K': k, 'S': s, 'mu': mu, 'B': b, 'G': g, 'period_micro_steps': period,
            'period_rollouts': table.period_rollouts,
            'period_optimizer_steps': period // k, 'timed_periods': size.rounds,
            'warmup_periods': _WARMUP.value, 'table_counts_per_period': dict(table.counts),
            'brute_force_minimum_per_period': minimum / total_periods,
            'one_pass_ms': 1e3 * one_pass,
            'load_avg_1min': {'median': statistics.median(loads), 'max': max(loads)},
            'rules': {}}
  for rule, r in runners.items():
    passes = int(r.rstate.forward_passes)
    per_period = passes / total_periods
    rows = np.asarray([[p['wall'], p['rollout'], p['learn']] for p in r.periods])
    med = np.median(rows, axis=0)
    diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(jax.device_get(r.lstate.params)),
                               jax.tree.leaves(slice_params)))
    result['rules'][rule] = {
        'forward_passes_total': passes, 'forward_passes_per_period': per_period,
        'forward_passes_timed': passes - before[rule],
        'expected_per_period': table.counts[rule],
        'period_ms_median': 1e3 * med[0], 'rollout_ms_median': 1e3 * med[1],
        'learn_ms_median': 1e3 * med[2],
        'period_ms_p25_p75': [1e3 * float(np.percentile(rows[:, 0], q)) for q in (25, 75)],
        'warmup_s': compile_s[rule],
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
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  task = arithmetic.ArithmeticTask()
  tokenizer = task.tokenizer()
  results = []
  for size in sizes(len(tokenizer)):
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        sharding.abstract_model(size.model)[1]))
    size_result = {'size': size.name, 'model': dataclasses.asdict(size.model),
                   'param_count': params, 'schedules': []}
    for k, s, mu in size.schedules:
      print(f'== {size.name}: K={k} S={s} mu={mu}', flush=True)
      r = run_schedule(size, k, s, mu, mesh, tokenizer, task)
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
                'big_hidden_size', 'big_layers', 'big_intermediate_size', 'big_heads',
                'big_kv_heads', 'pass_reps')
  machine.write_json(_OUT.value, {'machine': info, 'results': results,
                                  'flags': {n: flags.FLAGS[n].value for n in flag_names}})


if __name__ == '__main__':
  app.run(main)
