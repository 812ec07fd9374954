"""Reward functions and group-normalized advantages (host side, numpy).

A reward function is a plain Python callable

    fn(prompts: list[str], completions: list[str], **fields) -> Sequence[float]

where ``fields`` holds the dataset's extra columns, one list entry per completion (a prompt's
fields are repeated for each of its G completions). Several functions combine with weights.
A function that raises, returns the wrong number of values, or returns NaN gets a clear error that
names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
  """A reward function failed; the message names it."""


@dataclasses.dataclass(frozen=True)
class WeightedReward:
  name: str
  fn: RewardFn
  weight: float = 1.0


def compute_rewards(rewards: Sequence[WeightedReward], prompts: Sequence[str],
                    completions: Sequence[str], fields: Mapping[str, Sequence[Any]] | None = None
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Weighted sum of the reward functions. -> (total [N] float32, {name: [N] float32})."""
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f'{len(prompts)} prompts for {n} completions; pass one prompt per completion.')
  fields = dict(fields or {})
  per_fn: dict[str, np.ndarray] = {}
  total = np.zeros(n, np.float32)
  for r in rewards:
    try:
      values = r.fn(list(prompts), list(completions), **fields)
    except Exception as e:  # pylint: disable=broad-except
      raise RewardError(f'reward function {r.name!r} raised {type(e).__name__}: {e}') from e
    try:
      arr = np.asarray(values, np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
      raise RewardError(f'reward function {r.name!r} returned non-numeric values: {e}') from e
    if arr.shape != (n,):
      raise RewardError(f'reward function {r.name!r} returned {arr.size} values for {n} '
                        f'completions; return one float per completion.')
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
      raise RewardError(
          f'reward function {r.name!r} returned {arr[bad[0]]} for completion {bad[0]} '
          f'({completions[bad[0]]!r}) and {bad.size - 1} more; return finite floats (e.g. 0.0 '
          f'for an unparsable completion).')
    per_fn[r.name] = arr
    total += np.float32(r.weight) * arr
  return total, per_fn


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str = 'group',
                     eps: float = 1e-4) -> np.ndarray:
  """Advantages of consecutive groups of ``num_generations`` completions.

  A_i = (r_i - mean(group)) / (std + eps), where std is the group's (``scale_rewards='group'``,
  sample std as in TRL), the whole batch's (``'batch'``), or 1 with no eps (``'none'``, Dr. GRPO).
  A group whose rewards are all equal gets advantage exactly 0, never NaN.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1 or r.size % num_generations:
    raise ValueError(f'{r.size} rewards do not form groups of num_generations={num_generations}.')
  groups = r.reshape(-1, num_generations)
  centered = groups - groups.mean(axis=1, keepdims=True)
  ddof = 1 if num_generations > 1 else 0
  if scale_rewards == 'group':
    adv = centered / (groups.std(axis=1, ddof=ddof, keepdims=True) + eps)
  elif scale_rewards == 'batch':
    adv = centered / (r.std(ddof=1 if r.size > 1 else 0) + eps)
  elif scale_rewards == 'none':
    adv = centered
  else:
    raise ValueError(f'scale_rewards={scale_rewards!r}; choose group, batch or none.')
  # Exactly zero for all-equal groups (the centered values are already exact zeros).
  adv = np.where(np.all(groups == groups[:, :1], axis=1, keepdims=True), 0.0, adv)
  return adv.reshape(-1).astype(np.float32)
