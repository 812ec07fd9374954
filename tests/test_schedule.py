"""The static schedule table (docs/design.md, "Schedule semantics") and the explain CLI.

The reference is a brute-force walk: counters for slice, iteration and rollout advance one
micro-step at a time, a policy-version counter increments when an optimizer step fires, and each
rollout remembers the version that generated it. It shares no formula with schedule.py.
"""

import collections
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_ga import schedule
from jaxrl_ga.config import ConfigError, ScheduleConfig

REPO = pathlib.Path(__file__).resolve().parents[1]


def simulate(cfg: ScheduleConfig, num_micro_steps: int):
  """Walks ``num_micro_steps`` micro-steps; returns per-step rows and per-rollout/slice needs."""
  num_slices, mu = cfg.steps_per_generation, cfg.num_iterations
  every = 1 if cfg.update_mode == 'sequential' else cfg.grad_accum_steps
  version, since_update = 0, 0
  rollout, slice_idx, iteration = -1, num_slices - 1, mu - 1  # the first step starts rollout 0
  generated_by, versions_used = {}, collections.defaultdict(list)
  rows = []
  for s in range(num_micro_steps):
    slice_idx += 1
    if slice_idx == num_slices:
      slice_idx, iteration = 0, iteration + 1
    if iteration == mu:
      iteration, rollout = 0, rollout + 1
      generated_by[rollout] = version
    versions_used[rollout, slice_idx].append(version)
    since_update += 1
    fires = since_update == every
    rows.append(dict(s=s, rollout=rollout, slice=slice_idx, iteration=iteration,
                     policy_version=version, off_policy=version != generated_by[rollout],
                     optimizer_step_after=fires))
    if fires:
      version, since_update = version + 1, 0
  slice_needs = {key: any(v != generated_by[key[0]] for v in used)
                 for key, used in versions_used.items()}
  return rows, slice_needs


def _cfg(k, s, mu, mode='accumulate', b=2, g=2):
  return ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s,
                        num_iterations=mu, grad_accum_steps=k, update_mode=mode)


schedules = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12),
                      st.sampled_from(['accumulate', 'sequential']))


@settings(max_examples=150, deadline=None)
@given(schedules)
def test_table_matches_brute_force_over_three_periods(params):
  k, s, mu, mode = params
  cfg = _cfg(k, s, mu, mode)
  table = schedule.build_table(cfg)
  every = 1 if mode == 'sequential' else k
  period, num_rollouts = table.period_micro_steps, table.period_rollouts
  assert period == math.lcm(every, s * mu)
  assert num_rollouts * s * mu == period
  rows, slice_needs = simulate(cfg, 3 * period)
  versions_per_period = period // every
  for row in rows:
    p, i = divmod(row['s'], period)
    assert row['rollout'] == p * num_rollouts + table.rollout[i]
    assert row['slice'] == table.slice[i]
    assert row['iteration'] == table.iteration[i]
    assert row['policy_version'] == p * versions_per_period + table.policy_version[i]
    assert row['off_policy'] == table.off_policy[i]
    assert row['optimizer_step_after'] == table.optimizer_step_after[i]
  # The trainer looks up slice_recompute[rollout_counter % period_rollouts].
  for r in range(3 * num_rollouts):
    needs = [slice_needs[r, j] for j in range(s)]
    np.testing.assert_array_equal(table.slice_recompute[r % num_rollouts], needs)
    assert table.rollout_recompute[r % num_rollouts] == any(needs)
  first = range(num_rollouts)
  assert table.counts == dict(
      trl_static=num_rollouts * s if every % (s * mu) else 0,
      rollout_rule=s * sum(any(slice_needs[r, j] for j in range(s)) for r in first),
      slice_rule=sum(slice_needs[r, j] for r in first for j in range(s)))


@settings(max_examples=150, deadline=None)
@given(schedules)
def test_counts_are_ordered_and_vanish_exactly_when_aligned(params):
  k, s, mu, mode = params
  counts = schedule.build_table(_cfg(k, s, mu, mode)).counts
  assert 0 <= counts['slice_rule'] <= counts['rollout_rule'] <= counts['trl_static']
  every = 1 if mode == 'sequential' else k
  aligned = every % (s * mu) == 0
  assert all((c == 0) == aligned for c in counts.values())


@settings(max_examples=100, deadline=None)
@given(schedules)
def test_off_policy_slices_recompute_and_on_policy_slices_do_not(params):
  table = schedule.build_table(_cfg(*params))
  off = np.zeros_like(table.slice_recompute)
  for r, j, is_off in zip(table.rollout, table.slice, table.off_policy):
    off[r, j] |= is_off
  np.testing.assert_array_equal(table.slice_recompute, off)
  np.testing.assert_array_equal(table.rollout_recompute, off.any(axis=1))


def test_seed_001_rollout_rule_recomputes_2_of_6_rollouts_trl_6_of_6():
  # TRL issue #5770: steps_per_generation=2, num_iterations=1, grad_accum=3.
  table = schedule.build_table(_cfg(k=3, s=2, mu=1, b=4, g=4))
  rollouts = np.arange(6)
  rollout_rule = table.rollout_recompute[rollouts % table.period_rollouts]
  assert rollout_rule.sum() == 2
  trl_units_per_rollout = table.counts['trl_static'] / table.period_rollouts
  assert trl_units_per_rollout == 2  # S units: every rollout recomputes, 6 of 6
  assert table.counts == dict(trl_static=6, rollout_rule=2, slice_rule=1)  # design doc example
  np.testing.assert_array_equal(table.slice_recompute, [[0, 0], [0, 1], [0, 0]])


def test_seed_000_slices_after_the_first_optimizer_step_are_off_policy():
  # TRL PR #3493's diagram: B = 2 GPUs x 3, G = 2, steps_per_generation=3, grad_accum=4.
  table = schedule.build_table(_cfg(k=4, s=3, mu=1, b=6, g=2))
  np.testing.assert_array_equal(table.rollout[:6], [0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(table.slice[:6], [0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(table.policy_version[:6], [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(table.optimizer_step_after[:6], [0, 0, 0, 1, 0, 0])
  # "first off-policy slice (data from pi0, grads on pi1)", "still off-policy":
  np.testing.assert_array_equal(table.off_policy[:6], [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(table.slice_recompute[1], [False, True, True])


def test_table_is_read_only_and_json_serializable():
  table = schedule.build_table(_cfg(k=3, s=2, mu=1))
  with pytest.raises(ValueError):
    table.off_policy[0] = True
  d = json.loads(json.dumps(table.to_json_dict()))
  assert d['period_micro_steps'] == 6 and d['period_rollouts'] == 3
  assert d['rollout_recompute'] == [False, True, False]
  assert d['slice_recompute'] == [[False, False], [False, True], [False, False]]
  assert d['counts'] == dict(trl_static=6, rollout_rule=2, slice_rule=1)
  assert d['micro_steps'][3] == dict(s=3, rollout=1, slice=1, iteration=0, policy_version=1,
                                     off_policy=True, optimizer_step_after=False)


def test_build_table_rejects_off_policy_when_strict():
  with pytest.raises(ConfigError, match='strict_on_policy'):
    schedule.build_table(ScheduleConfig(grad_accum_steps=3, steps_per_generation=2,
                                        strict_on_policy=True))
  table = schedule.build_table(ScheduleConfig(grad_accum_steps=4, steps_per_generation=2,
                                              strict_on_policy=True))
  assert not table.off_policy.any()


# --- the explain CLI, through a subprocess ---


def explain(*args):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  return subprocess.run([sys.executable, '-m', 'jaxrl_ga.explain', *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)


SEED_000 = ['--micro_batch_size=6', '--num_generations=2', '--steps_per_generation=3',
            '--num_iterations=1', '--grad_accum_steps=4']


def test_explain_text_draws_seed_000():
  result = explain(*SEED_000)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith('opt step'))
  rows = lines[header + 1:header + 8]
  # opt step, micro-step, rollout, slice, iteration, policy, mark.
  assert rows[0].split()[:7] == ['0', '0', '0', '0', '0', 'π0', 'ON']
  assert rows[3].split()[:7] == ['0', '3', '1', '0', '0', 'π0', 'ON']
  assert 'optimizer step 0 → π1' in rows[4]
  assert rows[5].split()[:7] == ['1', '4', '1', '1', '0', 'π1', 'OFF']
  assert rows[6].split()[:7] == ['1', '5', '1', '2', '0', 'π1', 'OFF']
  assert 'data from π0' in rows[6]
  out = result.stdout
  assert 'period 2' in out  # at least two periods by default
  assert 'slice rule:   3 of 12 slices recompute (rollout 1 slices 1, 2; rollout 2 slice 2)' in out
  table = [line.split() for line in out.splitlines() if line.strip().startswith(
      ('TRL static', 'rollout rule (', 'slice rule ('))]
  assert [row[-3] for row in table] == ['12', '6', '3']
  assert 'Samples per optimizer step: 24 completions' in out
  assert 'Samples per rollout: 18 completions' in out and '9 prompts' in out


def test_explain_json_matches_build_table():
  result = explain(*SEED_000, '--format=json')
  assert result.returncode == 0, result.stderr
  d = json.loads(result.stdout)
  expected = schedule.build_table(_cfg(k=4, s=3, mu=1, b=6, g=2)).to_json_dict()
  for key in ('period_micro_steps', 'period_rollouts', 'rollout_recompute', 'slice_recompute',
              'micro_steps', 'counts'):
    assert d[key] == expected[key], key
  assert [m['off_policy'] for m in d['micro_steps'][:6]] == [False] * 4 + [True] * 2


@pytest.mark.parametrize('args, names', [
    (['--micro_batch_size=3'], ['steps_per_generation*micro_batch_size', 'num_generations']),
    (['--grad_accum_steps=0'], ['grad_accum_steps']),
    (['--steps_per_generation=2', '--grad_accum_steps=3', '--strict_on_policy'],
     ['make grad_accum_steps a multiple of steps_per_generation*num_iterations = 2: 2 or 4']),
    (['--micro_batch_size=6', '--num_generations=2', '--data_parallel_size=4'],
     ['micro_batch_size = 6', 'data*fsdp = 4']),
])
def test_explain_invalid_config_exits_with_message(args, names):
  result = explain(*args)
  assert result.returncode == 2
  assert result.stderr.startswith('error: ')
  assert 'Traceback' not in result.stderr + result.stdout
  for name in names:
    assert name in result.stderr


def test_explain_config_file_and_mesh(tmp_path):
  path = tmp_path / 'cfg.py'
  path.write_text(textwrap.dedent('''\
      import ml_collections

      def get_config():
        config = ml_collections.ConfigDict()
        config.grpo = ml_collections.ConfigDict()
        config.grpo.schedule = ml_collections.ConfigDict(dict(
            micro_batch_size=6, num_generations=2, steps_per_generation=3, num_iterations=1,
            grad_accum_steps=4))
        config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
        return config
      '''))
  ok = explain(f'--config={path}', '--format=json')  # -1 mesh size, no --num_devices: no check
  assert ok.returncode == 0, ok.stderr
  assert json.loads(ok.stdout)['counts'] == dict(trl_static=12, rollout_rule=6, slice_rule=3)
  override = explain(f'--config={path}', '--grad_accum_steps=6', '--num_devices=6',
                     '--format=json')
  assert override.returncode == 0, override.stderr
  d = json.loads(override.stdout)
  assert d['config']['grad_accum_steps'] == 6 and d['data_parallel_size'] == 6
  bad_mesh = explain(f'--config={path}', '--num_devices=4')
  assert bad_mesh.returncode == 2 and 'Traceback' not in bad_mesh.stderr
  assert 'micro_batch_size' in bad_mesh.stderr and 'data*fsdp = 4' in bad_mesh.stderr
  path.write_text(path.read_text().replace('grad_accum_steps=4', 'grad_acum_steps=4'))
  typo = explain(f'--config={path}')
  assert typo.returncode == 2 and 'Traceback' not in typo.stderr
  assert 'grpo.schedule.grad_acum_steps' in typo.stderr
