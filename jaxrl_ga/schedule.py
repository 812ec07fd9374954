"""The static schedule table: which slice each micro-step trains on, under which policy, and where
old log-probs must be computed. Pure numpy; built once from the config, it is a compile-time
constant of the rollout step.

The rules (the design doc, docs/design, "Schedule semantics"). E = S*mu micro-steps between
rollouts, and n = cfg.optimizer_every micro-steps between optimizer steps (K, or 1 in
update_mode='sequential'):

  micro-step s      rollout r(s) = s // E, slice(s) = s % S, iteration(s) = (s % E) // S
  optimizer step    fires after s iff (s + 1) % n == 0; policy version v(s) = s // n
  rollout r         generated at micro-step a_r = r*E by policy v(a_r)
  off-policy        the slice trained at s is off-policy iff v(s) != v(a_r(s))
  rollout rule      rollout r needs old log-probs iff v(a_r + E - 1) != v(a_r)   (TRL #5770)
  slice rule        slice j of rollout r needs them iff v(a_r + (mu-1)*S + j) != v(a_r)
  TRL static rule   every rollout recomputes iff n % E != 0                     (TRL today)

v never decreases, so the last micro-step that trains on a slice decides the slice, and the last
micro-step of a rollout decides the rollout: every off-policy slice gets old log-probs from its
generating policy, and no slice that is only trained on-policy pays for a forward pass.

Everything repeats after lcm(n, E) micro-steps = lcm(n, E)/E rollouts (the policy version then
has advanced by lcm(n, E)/n), so the table covers one period and the trainer looks up rollout
``rollout_counter % period_rollouts``. Forward-pass counts are in slice units: one forward pass
over one slice of B completions; recomputing a whole rollout costs S units.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from jaxrl_ga.config import ScheduleConfig, nearest_multiples, or_join
from jaxrl_ga.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
  """One period of the schedule. Arrays are read-only.

  Attributes:
    period_micro_steps: P = lcm(optimizer_every, S*mu).
    period_rollouts: P / (S*mu).
    rollout, slice, iteration: [P] int, what micro-step s trains on (rollout relative to the
      period start).
    policy_version: [P] int, v(s) = s // optimizer_every (first period).
    off_policy: [P] bool, v(s) differs from the version that generated the slice.
    optimizer_step_after: [P] bool, an optimizer step fires after micro-step s.
    rollout_recompute: [period_rollouts] bool, the rollout rule.
    slice_recompute: [period_rollouts, S] bool, the slice rule.
    counts: old-log-prob forward passes per period in slice units, under 'trl_static',
      'rollout_rule' and 'slice_rule'.
    config: the ScheduleConfig the table was built from.
  """
  period_micro_steps: int
  period_rollouts: int
  rollout: np.ndarray
  slice: np.ndarray
  iteration: np.ndarray
  policy_version: np.ndarray
  off_policy: np.ndarray
  optimizer_step_after: np.ndarray
  rollout_recompute: np.ndarray
  slice_recompute: np.ndarray
  counts: dict[str, int]
  config: ScheduleConfig

  def to_json_dict(self) -> dict[str, Any]:
    """Plain Python types only, for ``json.dumps``."""
    cfg = self.config
    micro_steps = [
        dict(s=s, rollout=int(self.rollout[s]), slice=int(self.slice[s]),
             iteration=int(self.iteration[s]), policy_version=int(self.policy_version[s]),
             off_policy=bool(self.off_policy[s]),
             optimizer_step_after=bool(self.optimizer_step_after[s]))
        for s in range(self.period_micro_steps)
    ]
    return dict(
        config=dataclasses.asdict(cfg),
        micro_steps_per_rollout=cfg.micro_steps_per_rollout,
        optimizer_every=cfg.optimizer_every,
        period_micro_steps=self.period_micro_steps,
        period_rollouts=self.period_rollouts,
        period_optimizer_steps=self.period_micro_steps // cfg.optimizer_every,
        samples_per_optimizer_step=cfg.optimizer_every * cfg.micro_batch_size,
        samples_per_rollout=cfg.completions_per_rollout,
        prompts_per_rollout=cfg.prompts_per_rollout,
        rollout_recompute=[bool(x) for x in self.rollout_recompute],
        slice_recompute=[[bool(x) for x in row] for row in self.slice_recompute],
        micro_steps=micro_steps,
        counts=dict(self.counts),
        count_unit='forward passes over one slice (micro_batch_size completions) per period',
    )


def build_table(cfg: ScheduleConfig) -> ScheduleTable:
  """The schedule table for one period of ``cfg`` (see the module docstring for the rules).

  Raises ConfigError if ``cfg.strict_on_policy`` and some slice would be trained off-policy.
  """
  if cfg.strict_on_policy:
    check_strict_on_policy(cfg)
  num_slices, mu, every = cfg.steps_per_generation, cfg.num_iterations, cfg.optimizer_every
  per_rollout = cfg.micro_steps_per_rollout  # E
  period = math.lcm(every, per_rollout)
  num_rollouts = period // per_rollout

  s = np.arange(period)
  version = s // every
  rollout = s // per_rollout
  generated_by = (rollout * per_rollout) // every  # v(a_r(s))

  start = np.arange(num_rollouts) * per_rollout  # a_r
  start_version = start // every
  last_use = start[:, None] + (mu - 1) * num_slices + np.arange(num_slices)[None, :]
  slice_recompute = last_use // every != start_version[:, None]  # [R, S]
  rollout_recompute = (start + per_rollout - 1) // every != start_version  # [R]

  counts = dict(
      trl_static=num_rollouts * num_slices if every % per_rollout else 0,
      rollout_rule=int(rollout_recompute.sum()) * num_slices,
      slice_rule=int(slice_recompute.sum()),
  )
  return ScheduleTable(
      period_micro_steps=period,
      period_rollouts=num_rollouts,
      rollout=_frozen(rollout),
      slice=_frozen(s % num_slices),
      iteration=_frozen((s % per_rollout) // num_slices),
      policy_version=_frozen(version),
      off_policy=_frozen(version != generated_by),
      optimizer_step_after=_frozen((s + 1) % every == 0),
      rollout_recompute=_frozen(rollout_recompute),
      slice_recompute=_frozen(slice_recompute),
      counts=counts,
      config=cfg,
  )


def _frozen(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  a.setflags(write=False)
  return a


def validate(cfg: ScheduleConfig, data_parallel_size: Optional[int] = None) -> None:
  """All schedule checks beyond ScheduleConfig's own: the strict on-policy check when
  ``cfg.strict_on_policy``, and the mesh check when the data-parallel size is known."""
  if cfg.strict_on_policy:
    check_strict_on_policy(cfg)
  if data_parallel_size is not None:
    validate_for_mesh(cfg, data_parallel_size)


def validate_for_mesh(cfg: ScheduleConfig, data_parallel_size: int) -> None:
  """Raises ConfigError unless micro_batch_size splits evenly over the data-parallel shards.

  ``data_parallel_size`` is the mesh's data*fsdp size (the batch is sharded over both).
  """
  g, s = cfg.num_generations, cfg.steps_per_generation
  check_micro_batch(cfg.micro_batch_size, data_parallel_size, group_step=g // math.gcd(g, s),
                    num_generations=g)


def check_micro_batch(b: int, data_parallel_size: int, *, name: str = 'micro_batch_size',
                      group_step: int = 1, num_generations: int = 1) -> None:
  """Raises ConfigError unless the micro-batch ``b`` (setting ``name``) splits evenly over the
  data-parallel shards; the fix keeps multiples of ``group_step`` (whole GRPO groups per
  rollout). SFT and DPO call it with their own ``name`` and no groups."""
  dp = data_parallel_size
  if isinstance(dp, bool) or not isinstance(dp, (int, np.integer)) or dp < 1:
    raise ConfigError(f'the data-parallel size (mesh data*fsdp) must be a positive integer, '
                      f'got {dp!r}.')
  if b % dp == 0:
    return
  step = math.lcm(dp, group_step)
  keeps_groups = '' if step == dp else (
      f' (multiples of {step}, so that a rollout still holds whole groups of '
      f'num_generations = {num_generations})')
  divisors = [d for d in range(1, b + 1) if b % d == 0]
  shards = [d for d in divisors if d < dp][-1:] + [d for d in divisors if d > dp][:1]
  raise ConfigError(
      f'{name} = {b} is not divisible by the data-parallel size of the mesh '
      f'(mesh data*fsdp = {dp}): every data shard must get the same number of rows per '
      f'micro-step. Fix: set {name} to {or_join(nearest_multiples(b, step))}{keeps_groups}, '
      f'or use a mesh whose data*fsdp divides {b} (e.g. {or_join(shards)}).')


def check_strict_on_policy(cfg: ScheduleConfig) -> None:
  """Raises ConfigError if any slice is trained off-policy, i.e. unless optimizer_every is a
  multiple of S*mu; the message suggests the nearest aligned grad_accum_steps and, where one
  exists, steps_per_generation."""
  num_slices, mu, every = cfg.steps_per_generation, cfg.num_iterations, cfg.optimizer_every
  per_rollout = num_slices * mu
  if every % per_rollout == 0:
    return
  period = math.lcm(every, per_rollout)
  s = np.arange(period)
  num_off = int(np.sum(s // every != (s // per_rollout * per_rollout) // every))
  head = (f'strict_on_policy=True, but some slices are trained off-policy (at {num_off} of '
          f'every {period} micro-steps, after an optimizer step has changed the policy that '
          f'generated them)')
  if cfg.update_mode == 'sequential':
    raise ConfigError(
        f"{head}: update_mode='sequential' steps the optimizer after every micro-step, and "
        f'steps_per_generation*num_iterations = {num_slices}*{mu} = {per_rollout} > 1. Fix: set '
        f"update_mode='accumulate' with grad_accum_steps a multiple of {per_rollout}, or "
        f'steps_per_generation = num_iterations = 1, or strict_on_policy=False.')
  k = cfg.grad_accum_steps
  fixes = [f'make grad_accum_steps a multiple of steps_per_generation*num_iterations = '
           f'{per_rollout}: {or_join(nearest_multiples(k, per_rollout))}']
  if k % mu == 0:  # S*mu divides K for some S
    b, g = cfg.micro_batch_size, cfg.num_generations
    aligned = [d for d in range(1, k // mu + 1)
               if (k // mu) % d == 0 and (d * b) % g == 0]  # keep whole groups per rollout
    nearest = [d for d in aligned if d < num_slices][-1:] + [
        d for d in aligned if d > num_slices][:1]
    if nearest:
      fixes.append(f'set steps_per_generation to {or_join(nearest)} (so that '
                   f'steps_per_generation*num_iterations divides grad_accum_steps = {k})')
  raise ConfigError(
      f'{head}: grad_accum_steps = {k} is not a multiple of steps_per_generation*num_iterations '
      f'= {num_slices}*{mu} = {per_rollout}. Fix: {"; or ".join(fixes)}; or set '
      f'strict_on_policy=False to train those slices with recomputed old log-probs.')

