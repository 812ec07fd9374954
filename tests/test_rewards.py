"""Rewards and group advantages, against hand-computed values."""

import numpy as np
import pytest

from jaxrl_ga import rewards as R
from jaxrl_ga.config import AdvantageConfig, ConfigError


def test_all_equal_group_gives_zero_advantage_never_nan():
  adv = R.group_advantages(np.array([1., 1., 1., 1., 0., 0., 0., 0.]), 4)
  np.testing.assert_array_equal(adv, np.zeros(8))
  for scale in ('group', 'batch', 'none'):
    assert np.all(np.isfinite(R.group_advantages(np.zeros(4), 4, scale)))


def test_single_nonzero_reward():
  adv = R.group_advantages(np.array([0., 2., 0., 0.]), 4)
  # mean 0.5, sample std sqrt(((-.5)^2*3 + 1.5^2)/3) = 1
  np.testing.assert_allclose(adv, np.array([-0.5, 1.5, -0.5, -0.5]) / (1.0 + 1e-4), rtol=1e-6)
  np.testing.assert_allclose(R.group_advantages(np.array([0., 2., 0., 0.]), 4, 'none'),
                             [-0.5, 1.5, -0.5, -0.5])


def test_batch_scaling_uses_the_whole_rollout_std():
  r = np.array([0., 1., 3., 3.])
  adv = R.group_advantages(r, 2, 'batch')
  std = np.std(r, ddof=1)
  np.testing.assert_allclose(adv, np.array([-0.5, 0.5, 0., 0.]) / (std + 1e-4), rtol=1e-6)


def test_weighted_sum_and_fields():
  def exact(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]
  def length(prompts, completions, **_):
    return [len(c) for c in completions]
  total, per = R.compute_rewards(
      [R.WeightedReward('exact', exact, 1.0), R.WeightedReward('len', length, 0.5)],
      ['p', 'p'], ['12', '3'], {'answer': ['12', '4']})
  np.testing.assert_allclose(total, [1 + 0.5 * 2, 0 + 0.5 * 1])
  assert set(per) == {'exact', 'len'}


def test_nan_reward_names_the_function():
  def bad(prompts, completions, **_):
    return [1.0, float('nan')]
  with pytest.raises(R.RewardError, match=r"reward function 'parse_answer' returned nan for "
                                          r"completion 1"):
    R.compute_rewards([R.WeightedReward('parse_answer', bad)], ['a', 'b'], ['x', 'y'])


def test_raising_reward_names_the_function():
  def boom(prompts, completions, **_):
    raise KeyError('answer')
  with pytest.raises(R.RewardError, match=r"reward function 'needs_answer' raised KeyError"):
    R.compute_rewards([R.WeightedReward('needs_answer', boom)], ['a'], ['x'])


def test_wrong_length_names_the_function():
  with pytest.raises(R.RewardError, match=r"'short' returned 1 values for 2 completions"):
    R.compute_rewards([R.WeightedReward('short', lambda p, c: [0.0])], ['a', 'b'], ['x', 'y'])


@pytest.mark.parametrize('values, shown', [
    ([[1.0], [0.0]], r"\[1.0\] \(list\) for completion 0"),  # TRL: a shape mismatch
    (np.zeros((2, 1)), r"array\(\[0.\]\) \(ndarray\) for completion 0"),
    (['1', '0.5'], r"'1' \(str\) for completion 0"),  # TRL: torch.tensor refuses strings
    ([[1.0, 0.0]], r"1 values for 2 completions"),  # TRL: "returned 1 rewards"
    (3.0, r"float, not a sequence"),
])
def test_a_value_that_is_not_one_number_per_completion_is_refused_as_trl_refuses_it(values,
                                                                                    shown):
  """TRL 1.16 makes torch.tensor(values, dtype=float32) of a function's result: a nested list,
  a column array or numeric strings fail there. They were flattened or parsed here, so a
  function returning one list per completion trained without a word."""
  with pytest.raises(R.RewardError, match=rf"^reward function 'odd' returned {shown}"):
    R.compute_rewards([R.WeightedReward('odd', lambda p, c: values)], ['a', 'b'], ['x', 'y'])
  # What TRL takes, taken: numpy scalars, ints, bools, 0-d arrays and None.
  total, _ = R.compute_rewards(
      [R.WeightedReward('ok', lambda p, c: [np.float64(0.5), True]),
       R.WeightedReward('ok2', lambda p, c: (np.array(2.0), None))], ['a', 'b'], ['x', 'y'])
  np.testing.assert_array_equal(total, [2.5, 1.0])


def test_scale_rewards_name_is_validated():
  with pytest.raises(ConfigError, match='advantage.scale_rewards'):
    AdvantageConfig(scale_rewards='std')


def _trl_sum_then_normalize(per_fn, weights, g, scale):
  """TRL 1.16's sum_then_normalize (grpo_trainer.py, _generate_and_score_completions), written
  out loop by loop: weighted nansum, unscorable rows (every function None) NaN, group nanmean,
  nanstd (sample; NaN under 2 values) of the group or the batch, NaN advantages -> 0."""
  def nanstd(xs):
    xs = [x for x in xs if not np.isnan(x)]
    if len(xs) < 2:
      return np.nan
    m = sum(xs) / len(xs)
    return (sum((x - m)**2 for x in xs) / (len(xs) - 1))**0.5
  n = len(per_fn)
  total = [sum(w * v for w, v in zip(weights, row) if not np.isnan(v)) for row in per_fn]
  total = [np.nan if np.isnan(row).all() else t for row, t in zip(per_fn, total)]
  out = []
  for start in range(0, n, g):
    group = total[start:start + g]
    valid = [x for x in group if not np.isnan(x)]
    mean = sum(valid) / len(valid) if valid else np.nan
    std = nanstd(group) if scale == 'group' else nanstd(total)
    for x in group:
      a = x - mean if scale == 'none' else (x - mean) / (std + 1e-4)
      out.append(0.0 if np.isnan(a) else a)
  return np.asarray(out)


@pytest.mark.parametrize('scale', ['group', 'batch', 'none'])
def test_unscorable_completions_are_left_out_as_trl_does(scale):
  """A completion every reward function scores None: advantage 0 and out of its group's mean
  and std (and of the batch std), as TRL 1.16; a group with one scored completion (its sample
  std NaN) and one with none scored get 0 under 'group'. Rows with no None are unchanged."""
  rng = np.random.default_rng(3)
  g = 4
  per_fn = np.stack([rng.integers(0, 2, 16).astype(np.float64), rng.normal(0, 2, 16)], 1)
  per_fn[1, 0] = np.nan  # one function does not apply: the other's value counts
  per_fn[3] = np.nan  # unscorable
  per_fn[8:11] = np.nan  # the third group: one scored completion
  per_fn[12:16] = np.nan  # the fourth: none
  weights = [1.0, 0.5]
  total = np.nansum(per_fn * np.asarray(weights), 1)
  unscored = R.unscorable(per_fn)
  np.testing.assert_array_equal(np.flatnonzero(unscored), [3, 8, 9, 10, 12, 13, 14, 15])
  got = R.group_advantages(np.where(unscored, np.nan, total), g, scale)
  want = _trl_sum_then_normalize(per_fn, weights, g, scale)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(got[unscored] == 0)
  assert got[0] != 0 and got[4] != 0
  # The old rule (unscorable rows as reward 0 in the statistics) gives other advantages.
  assert np.abs(R.group_advantages(total, g, scale) - want).max() > 0.05
  # Without any None the NaN path is not taken: the same values as before.
  full = np.nan_to_num(per_fn[:8], nan=1.0)
  np.testing.assert_allclose(R.group_advantages(full @ np.asarray(weights), g, scale),
                             _trl_sum_then_normalize(full, weights, g, scale), rtol=1e-5,
                             atol=1e-6)


def test_unscorable_needs_a_function():
  assert not R.unscorable(np.zeros((3, 0))).any()
  np.testing.assert_array_equal(R.unscorable(np.array([[np.nan, 1.0], [np.nan, np.nan]])),
                                [False, True])


def test_an_async_reward_is_awaited_also_beside_a_running_loop():
  """TRL 1.16 awaits async reward functions; here too, and inside a running event loop (a
  notebook's) as well."""
  import asyncio  # pylint: disable=import-outside-toplevel

  async def exact(prompts, completions, answer):
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]

  r = R.WeightedReward('exact', exact)
  total, _ = R.compute_rewards([r], ['p', 'p'], ['4', '5'], {'answer': ['4', '4']})
  np.testing.assert_array_equal(total, [1.0, 0.0])

  async def in_a_loop():
    return R.compute_rewards([r], ['p'], ['4'], {'answer': ['4']})[0]
  np.testing.assert_array_equal(asyncio.run(in_a_loop()), [1.0])


def test_trl_style_reward_functions_get_what_trl_passes():
  """TRL 1.16 calls a reward function with keywords (prompts=, completions=, the columns,
  completion_ids, trainer_state, log_extra, log_metric): a TRL-style function that names only
  completions (the rest in **kwargs) gets the right values, not the prompts as completions; a
  function written for columns alone (no **kwargs) keeps working without the new keywords."""
  log = R.RewardLog()
  keywords = R.trl_keywords([[5, 6], [7]], R.TrainerState(3, 10), log)
  seen = {}

  def reward_len(completions, **kwargs):  # TRL's docs' style
    seen.update(kwargs)
    kwargs['log_metric']('len/mean', sum(len(c) for c in completions) / len(completions))
    kwargs['log_extra']('len', [len(c) for c in completions])
    return [-float(len(c)) for c in completions]

  def shaped(completions, answer=None, trainer_state=None, **unused):
    w = trainer_state.global_step / trainer_state.max_steps
    return [w * float(c == a) for c, a in zip(completions, answer)]

  def plain(prompts, completions, answer):  # no **kwargs: gets only the columns
    return [float(c == a) for c, a in zip(completions, answer)]

  total, per_fn = R.compute_rewards(
      [R.WeightedReward('len', reward_len), R.WeightedReward('shaped', shaped),
       R.WeightedReward('plain', plain)], ['p1', 'p2'], ['4', '55'], {'answer': ['4', '5']},
      keywords)
  assert per_fn['len'].tolist() == [-1.0, -2.0]
  assert per_fn['shaped'].tolist() == pytest.approx([0.3, 0.0])
  assert per_fn['plain'].tolist() == [1.0, 0.0]
  assert seen['prompts'] == ['p1', 'p2'] and seen['answer'] == ['4', '5']
  assert seen['completion_ids'] == [[5, 6], [7]] and seen['trainer_state'].global_step == 3
  assert log.means() == {'len/mean': 1.5} and log.extra == {'len': [1, 2]}
  assert total.tolist() == pytest.approx([-1 + 0.3 + 1, -2.0])


def test_log_extra_appends_as_trl_does():
  """TRL 1.16's log_extra extends the column (``_pending_extra_logs[column].extend``): a
  function that logs one row at a time fills it row by row; it was replaced, so the column held
  the last call's values."""
  log = R.RewardLog()

  def per_row(completions, log_extra, **unused):
    for c in completions:
      log_extra('chars', [len(c)])
    return [0.0] * len(completions)

  R.compute_rewards([R.WeightedReward('per_row', per_row)], ['p'] * 3, ['a', 'bb', 'ccc'],
                    keywords=R.trl_keywords([[1]] * 3, R.TrainerState(), log))
  assert log.extra == {'chars': [1, 2, 3]}


@pytest.mark.parametrize('funcs', ['final_answer=nan', 'final_answer=inf',
                                   [(R.BUILTIN['final_answer'], float('nan'))]])
def test_a_weight_that_is_not_finite_is_refused(funcs):
  """A nan weight made every total reward nan (loss 0, grad_norm 0: nothing trained, rc 0)."""
  with pytest.raises(ConfigError, match=r"weight (nan|inf) is not a finite number"):
    R.resolve(funcs)
