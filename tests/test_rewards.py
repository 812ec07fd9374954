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


def test_scale_rewards_name_is_validated():
  with pytest.raises(ConfigError, match='advantage.scale_rewards'):
    AdvantageConfig(scale_rewards='std')
