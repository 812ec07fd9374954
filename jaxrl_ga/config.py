"""Typed, validated configuration.

Library code takes these frozen dataclasses, never an ``ml_collections.ConfigDict``: the CLI
converts with :func:`from_mapping`, which rejects unknown keys, and every dataclass validates
itself in ``__post_init__`` so a bad value fails before anything is compiled.

Every error is a :class:`ConfigError` whose message names the offending setting(s), the value,
and a concrete fix.

Symbols of the design doc (docs/design, "Symbols"; global counts over the whole mesh, not per
device):
  B = micro_batch_size, G = num_generations, S = steps_per_generation, mu = num_iterations,
  K = grad_accum_steps, E = S * mu micro-steps between rollouts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import json
import math
import numbers
import os
import re
import types
import typing
from typing import Any, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from jaxrl_ga import tasks
from jaxrl_ga.errors import ConfigError  # re-exported: jaxrl_ga.config.ConfigError

# The architecture (re-exported here for users): models/config.py.
from jaxrl_ga.models.config import (  # pylint: disable=unused-import
    ARCHITECTURES, LAYER_TYPES, LORA_TARGETS, MODEL_DTYPES, ROPE_TYPES, LoRAConfig, ModelConfig,
    RopeScaling)


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


def _is_int(value: Any) -> bool:
  """Python or numpy integer, but not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_int(obj: Any, *names: str, prefix: str = '') -> None:
  for name in names:
    value = getattr(obj, name)
    _require(
        _is_int(value) and value > 0,
        f'{prefix}{name} must be a positive integer, got {value!r}; '
        f'set {prefix}{name} to 1 or more.')


def _one_of(obj: Any, name: str, choices: tuple[str, ...], prefix: str = '',
            aliases: Optional[Mapping[str, str]] = None) -> None:
  """Checks that a name-valued setting is one of ``choices``; ``aliases`` maps other projects'
  names (e.g. TRL's) to ours, so the message can say which one was meant."""
  value = getattr(obj, name)
  if value in choices:
    return
  hint = ''
  if aliases and value in aliases:
    hint = f" (TRL's {value!r} is {aliases[value]!r} here)"
  elif isinstance(value, str):
    close = ([c for c in choices if value and c.startswith(value)]
             or difflib.get_close_matches(value, choices, n=1))
    if close:
      hint = f' (did you mean {close[0]!r}?)'
  raise ConfigError(
      f'{prefix}{name}={value!r} is not a known value{hint}; '
      f'set {prefix}{name} to one of {", ".join(repr(c) for c in choices)}.')


def nearest_multiples(value: int, step: int) -> list[int]:
  """The positive multiples of ``step`` nearest to ``value``: ``[value]`` if it is one, else the
  one below (when positive) and the one above. Used to suggest fixes in error messages."""
  below = value // step * step
  if below == value:
    return [value]
  return [m for m in (below, below + step) if m > 0]


def or_join(values: list[int]) -> str:
  """[3, 6] -> '3 or 6' (the suggestions of an error message)."""
  return ' or '.join(str(v) for v in values)


UPDATE_MODES = ('accumulate', 'sequential')
GRPO_AGGREGATIONS = ('token', 'sequence', 'constant', 'microbatch_token', 'sequence_sum')
# TRL's loss_type names for the same aggregations (docs/design, "Loss normalization").
TRL_AGGREGATION_NAMES = {'dapo': 'token', 'grpo': 'sequence', 'dr_grpo': 'constant',
                         'bnpo': 'microbatch_token', 'luspo': 'sequence_sum'}
# The per-token objective: 'clip' is the clipped surrogate of TRL's grpo, dapo, dr_grpo, bnpo and
# luspo; the others are TRL 1.16's loss_type of the same name, each with the aggregation TRL
# normalizes it by (docs/design.md, "Loss peers").
GRPO_OBJECTIVES = ('clip', 'cispo', 'sapo', 'vespo')
TRL_OBJECTIVE_AGGREGATION = {'cispo': 'token', 'sapo': 'sequence', 'vespo': 'token'}
# TRL 1.16's loss_type values (GRPOLossConfig.loss_type) -> our (objective, aggregation).
TRL_LOSS_TYPES = {**{name: ('clip', agg) for name, agg in TRL_AGGREGATION_NAMES.items()},
                  **{name: (name, agg) for name, agg in TRL_OBJECTIVE_AGGREGATION.items()}}
MULTI_OBJECTIVE_AGGREGATIONS = ('sum_then_normalize', 'normalize_then_sum')
DPO_AGGREGATIONS = ('pair', 'token', 'microbatch_token')
DPO_LOSS_TYPES = ('sigmoid', 'ipo', 'hinge', 'robust')
DPO_PAIRS = ('sampled', 'dataset')
DPO_LONG_PROMPTS = ('error', 'drop', 'truncate')
IMPORTANCE_LEVELS = ('token', 'sequence')
# TRL 1.16's vllm_importance_sampling_mode values (GRPOLossConfig.sampler_is_mode).
SAMPLER_IS_MODES = ('token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask')
SCALE_REWARDS = ('group', 'batch', 'none')
OLD_LOGPROB_SOURCES = ('recompute', 'sampler')
LR_SCHEDULES = ('constant', 'cosine', 'linear')


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """When rollouts happen, which slices they feed, and when the optimizer steps.

  Attributes:
    micro_batch_size: B, completions per micro-step over the whole mesh.
    num_generations: G, completions per prompt (a group).
    steps_per_generation: S, micro-steps that one rollout's slices feed; a rollout holds S*B
      completions, i.e. S*B/G prompts.
    num_iterations: mu, passes over each rollout.
    grad_accum_steps: K, micro-steps per optimizer step.
    update_mode: 'accumulate' (one optimizer step per K micro-steps) or 'sequential' (one
      optimizer step per micro-step, learning rate scaled; docs/design, "Implicit bias").
    strict_on_policy: reject any configuration in which some slice is consumed off-policy.
  """
  micro_batch_size: int = 8
  num_generations: int = 4
  steps_per_generation: int = 2
  num_iterations: int = 1
  grad_accum_steps: int = 3
  update_mode: str = 'accumulate'
  strict_on_policy: bool = False

  def __post_init__(self):
    _positive_int(self, 'micro_batch_size', 'num_generations', 'steps_per_generation',
                  'num_iterations', 'grad_accum_steps')
    for name in ('micro_batch_size', 'num_generations', 'steps_per_generation', 'num_iterations',
                 'grad_accum_steps'):
      object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int
    _one_of(self, 'update_mode', UPDATE_MODES)
    _require(isinstance(self.strict_on_policy, bool),
             f'strict_on_policy must be True or False, got {self.strict_on_policy!r}.')
    b, g, s = self.micro_batch_size, self.num_generations, self.steps_per_generation
    if (s * b) % g:
      fixes = [f'micro_batch_size to {or_join(nearest_multiples(b, g // math.gcd(g, s)))}',
               f'steps_per_generation to {or_join(nearest_multiples(s, g // math.gcd(g, b)))}']
      divisors = [d for d in range(2, s * b + 1) if (s * b) % d == 0]
      if divisors:
        below = [d for d in divisors if d < g][-1:]
        above = [d for d in divisors if d > g][:1]
        fixes.append(f'num_generations to {or_join(below + above)}')
      raise ConfigError(
          f'steps_per_generation*micro_batch_size = {s}*{b} = {s * b} completions per rollout '
          f'is not divisible by num_generations = {g}: the G completions of one prompt (a group) '
          f'must lie inside one rollout. Fix: set {", or ".join(fixes)}.')

  @property
  def micro_steps_per_rollout(self) -> int:
    """E = S * mu."""
    return self.steps_per_generation * self.num_iterations

  @property
  def optimizer_every(self) -> int:
    """Micro-steps between optimizer steps (K, or 1 in sequential mode)."""
    return 1 if self.update_mode == 'sequential' else self.grad_accum_steps

  @property
  def completions_per_rollout(self) -> int:
    return self.steps_per_generation * self.micro_batch_size

  @property
  def prompts_per_rollout(self) -> int:
    return self.completions_per_rollout // self.num_generations


def _check_sampler_is(cfg: 'GRPOLossConfig', p: str) -> None:
  """The sampler-side importance-sampling settings (TRL 1.16's ranges)."""
  _one_of(cfg, 'sampler_is_mode', SAMPLER_IS_MODES, p)
  lo, hi = cfg.sampler_is_clip_min, cfg.sampler_is_clip_max
  _require(lo is None or (_is_number(lo) and lo >= 0),
           f'{p}sampler_is_clip_min={lo!r} must be None or a number >= 0 (C_min).')
  _require(hi is None or (_is_number(hi) and hi > 0),
           f'{p}sampler_is_clip_max={hi!r} must be None or a number > 0 (C_max).')
  _require(lo is None or hi is None or lo < hi,
           f'{p}sampler_is_clip_min={lo!r} must be below {p}sampler_is_clip_max={hi!r}.')
  _require(not (cfg.sampler_is_correction and cfg.sampler_is_mode.endswith('_truncate')
                and lo is None and hi is None),
           f'{p}sampler_is_mode={cfg.sampler_is_mode!r} needs {p}sampler_is_clip_min or '
           f'{p}sampler_is_clip_max; set one (TRL\'s default C_max is 3.0).')
  _require(not (cfg.sampler_is_correction and cfg.objective == 'vespo'
                and cfg.sampler_is_mode.startswith('sequence')),
           f"{p}sampler_is_mode={cfg.sampler_is_mode!r} with {p}objective='vespo': VESPO folds "
           f"the sampler's ratio into its own sequence ratio per token (TRL 1.16 refuses the "
           f"sequence modes too); set {p}sampler_is_mode='token_truncate' or 'token_mask'.")
  t = cfg.off_policy_mask_threshold
  _require(t is None or (_is_number(t) and t >= 0),
           f'{p}off_policy_mask_threshold={t!r} must be None or a number >= 0 (a mean KL in '
           'nats, e.g. 0.5).')


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
  """The GRPO per-token objective and its aggregation over an optimizer-step window.

  Attributes:
    aggregation: TRL 1.16's loss_type definitions over the window (docs/design.md, "Loss
      peers"): 'token' (dapo), 'sequence' (grpo: mean over every row, one with an all-zero mask
      too), 'constant' (dr_grpo: B * max_completion_length per micro-batch, every row),
      'sequence_sum' (luspo: each sequence's summed loss over every row) or
      'microbatch_token' (bnpo: normalized per micro-batch; depends on K, kept to demonstrate
      the per-micro-batch normalization bug, docs/design "Why per-micro-batch normalization is
      wrong"). TRL's names of these: ``loss_type``.
    epsilon_low, epsilon_high: ratio clipping to [1 - epsilon_low, 1 + epsilon_high]
    delta: optional upper cap on the ratio for negative advantages (two-sided clipping).
    importance_level: 'token' ratios, or 'sequence' (GSPO: the length-normalized sequence ratio).
    sampler_is_correction: TRL 1.16's vllm_importance_sampling_correction (off by default): the
      policy term of each token is multiplied by w = pi_old / pi_sampler, the learner's old
      log-probs against the sampler's, per token or per sequence (the sum of the token log-ratios),
      truncated or masked by ``sampler_is_mode`` (docs/design.md, "Sampler-side importance
      sampling"). Needs sampling.old_logprob_source='recompute' (with 'sampler' w would be 1).
    sampler_is_mode: TRL's vllm_importance_sampling_mode: 'token_truncate' (w clipped to
      [clip_min, clip_max]), 'token_mask' (w set to 0 outside it), 'sequence_truncate',
      'sequence_mask' (TRL's default); the masked tokens still count in the normalizer, as in TRL.
    sampler_is_clip_min, sampler_is_clip_max: TRL's vllm_importance_sampling_clip_min/max, the
      bounds C_min / C_max (None: unbounded on that side; TRL's defaults None, 3.0).
    off_policy_mask_threshold: TRL's (DeepSeek-V3.2's off-policy sequence mask, Eq. 9): a row
      with a negative advantage whose mean over its tokens of (sampler - current) log-probs
      exceeds this is left out of the policy term (None disables).
    beta: weight of the k3 KL estimate to the reference policy (0 disables the reference).
    entropy_coef: weight of an entropy bonus (0 disables): -entropy_coef * H added to each
      token's loss and aggregated as the policy term, so TRL 1.16's scale (the token mean of
      H) only with aggregation 'token' and top_entropy_quantile 1 (docs/design.md).
    objective: the per-token policy term (losses.grpo_loss): 'clip' (the clipped surrogate),
      or TRL 1.16's 'cispo' (ratio capped at epsilon_high, stop-gradient, times A log pi),
      'sapo' (soft sigmoid gate) or 'vespo' (a Gamma weight of the sequence ratio). TRL's
      loss_type='cispo'/'vespo' is this with aggregation 'token', 'sapo' with 'sequence', and
      'luspo' is objective 'clip' with aggregation 'sequence_sum' (``loss_type`` sets both).
    sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for A > 0 and A <= 0.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's Gamma weight
      phi(w) = e^lambda w^k e^(-lambda w) for A >= 0 and A < 0.
    top_entropy_quantile: rho: only tokens whose entropy is at or above the (1 - rho) quantile of
      the micro-batch's completion tokens train the policy term (TRL's; 1 keeps every token).
    use_bias_correction_kl: multiply the KL term by the importance ratio (TRL's, whose default is
      True; False here, deliberately: a run saved before the setting existed resumes with the
      objective it was trained with, see docs/design.md, "Loss peers").
    loss_type: TRL 1.16's loss_type (grpo, dr_grpo, bnpo, dapo, cispo, sapo, luspo, vespo), or
      None (default): sets ``objective`` and ``aggregation`` to the pair it names
      (TRL_LOSS_TYPES) and is then None again, so the config (and a checkpoint's fingerprint)
      is the one of that pair. Refused when ``objective`` or ``aggregation`` is set to another
      value than its default and the pair's.
  """
  aggregation: str = 'token'
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  delta: Optional[float] = None
  importance_level: str = 'token'
  sampler_is_correction: bool = False
  sampler_is_mode: str = 'sequence_mask'
  sampler_is_clip_min: Optional[float] = None
  sampler_is_clip_max: Optional[float] = 3.0
  off_policy_mask_threshold: Optional[float] = None
  beta: float = 0.0
  entropy_coef: float = 0.0
  objective: str = 'clip'
  sapo_temperature_pos: float = 1.0
  sapo_temperature_neg: float = 1.05
  vespo_k_pos: float = 2.0
  vespo_lambda_pos: float = 3.0
  vespo_k_neg: float = 3.0
  vespo_lambda_neg: float = 2.0
  top_entropy_quantile: float = 1.0
  use_bias_correction_kl: bool = False
  loss_type: Optional[str] = None

  def __post_init__(self):
    p = 'loss.'
    if self.loss_type is not None:
      self._set_trl_loss_type(p)
    # TRL's loss_type names both; say which setting takes it (TRL's names of aggregations:
    # _one_of's hint).
    for name, ours in (('aggregation', GRPO_AGGREGATIONS + tuple(TRL_AGGREGATION_NAMES)),
                       ('objective', GRPO_OBJECTIVES)):
      value = getattr(self, name)
      if value in TRL_LOSS_TYPES and value not in ours:
        raise ConfigError(f"{p}{name}={value!r} is TRL's loss_type {value!r}; set "
                          f'{p}loss_type={value!r} (objective={TRL_LOSS_TYPES[value][0]!r}, '
                          f'aggregation={TRL_LOSS_TYPES[value][1]!r}).')
    _one_of(self, 'aggregation', GRPO_AGGREGATIONS, p, aliases=TRL_AGGREGATION_NAMES)
    _one_of(self, 'objective', GRPO_OBJECTIVES, p)
    for name in ('sapo_temperature_pos', 'sapo_temperature_neg', 'vespo_lambda_pos',
                 'vespo_lambda_neg'):
      value = getattr(self, name)
      _require(isinstance(value, numbers.Real) and math.isfinite(value) and value > 0,
               f'{p}{name} must be a finite number > 0, got {value!r}.')
    for name in ('vespo_k_pos', 'vespo_k_neg'):
      value = getattr(self, name)
      _require(isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0,
               f'{p}{name} must be a finite number >= 0, got {value!r}.')
    q = self.top_entropy_quantile
    _require(isinstance(q, numbers.Real) and 0 <= q <= 1,
             f'{p}top_entropy_quantile must be in [0, 1] (1 keeps every token; the paper uses '
             f'0.2), got {q!r}.')
    _require(isinstance(self.use_bias_correction_kl, bool),
             f'{p}use_bias_correction_kl must be True or False, got '
             f'{self.use_bias_correction_kl!r}.')
    _require(self.objective != 'cispo' or self.epsilon_high >= 1,
             f"{p}epsilon_high={self.epsilon_high} with {p}objective='cispo' is the cap of the "
             f'importance ratio (epsilon_max) and must be >= 1; set {p}epsilon_high=5.0 '
             '(ScaleRL\'s, TRL\'s recommendation).')
    _one_of(self, 'importance_level', IMPORTANCE_LEVELS, p)
    _check_sampler_is(self, p)
    _require(self.epsilon_low >= 0 and self.epsilon_high >= 0,
             f'{p}epsilon_low/epsilon_high must be >= 0, got {self.epsilon_low}, '
             f'{self.epsilon_high}.')
    _require(self.delta is None or self.delta > 1.0,
             f'{p}delta must be None or > 1 (an upper cap on the ratio), got {self.delta}.')
    _require(self.beta >= 0, f'{p}beta must be >= 0, got {self.beta}.')

  def _set_trl_loss_type(self, p: str) -> None:
    """TRL's ``loss_type`` -> ``objective`` and ``aggregation``; ``loss_type`` back to None."""
    _one_of(self, 'loss_type', tuple(TRL_LOSS_TYPES), p)
    pair = dict(zip(('objective', 'aggregation'), TRL_LOSS_TYPES[self.loss_type]))
    for name, value in pair.items():
      given = getattr(self, name)
      default = GRPOLossConfig.__dataclass_fields__[name].default
      _require(given in (value, default),
               f'{p}loss_type={self.loss_type!r} means {p}objective={pair["objective"]!r} with '
               f'{p}aggregation={pair["aggregation"]!r}, but {p}{name}={given!r} is set; drop '
               f'one of the two.')
      object.__setattr__(self, name, value)
    object.__setattr__(self, 'loss_type', None)


@dataclasses.dataclass(frozen=True)
class DPOLossConfig:
  """DPO over summed sequence log-probs.

  Attributes:
    loss_type: 'sigmoid', 'ipo', 'hinge' or 'robust', as TRL 1.16 defines them ('ipo' divides
      each log-ratio by its completion length; see losses.dpo_pair_losses).
    beta: inverse temperature of the implicit reward.
    label_smoothing: assumed label-noise rate for 'robust' (and cDPO 'sigmoid', which TRL 1.16's
      sigmoid ignores; the default 0 is TRL's sigmoid).
    aggregation: 'pair' (mean over pairs, TRL's; default), 'token' (each pair weighted by its
      chosen+rejected completion tokens; ours, split-invariant) or 'microbatch_token'
      (open-instruct's weighting, PR #1447: each micro-batch's pair mean weighted by its
      attention-mask tokens; depends on the micro-batch split, kept to show it).
    rpo_alpha: weight of TRL's 'sft' loss term (loss_type=[..., 'sft'], loss_weights=[1, alpha];
      older TRL's rpo_alpha): the token mean of the chosen completions' NLL over the
      optimizer-step window (RPO); counters DPO lowering the chosen likelihood too. 0 disables.
  """
  loss_type: str = 'sigmoid'
  beta: float = 0.1
  label_smoothing: float = 0.0
  aggregation: str = 'pair'
  rpo_alpha: float = 0.0

  def __post_init__(self):
    p = 'dpo.'
    _one_of(self, 'loss_type', DPO_LOSS_TYPES, p)
    _one_of(self, 'aggregation', DPO_AGGREGATIONS, p)
    _require(self.beta > 0, f'{p}beta must be > 0, got {self.beta}.')
    _require(self.rpo_alpha >= 0, f'{p}rpo_alpha must be >= 0 (0 disables), got {self.rpo_alpha}.')
    _require(0 <= self.label_smoothing < 0.5,
             f'{p}label_smoothing must be in [0, 0.5), got {self.label_smoothing}.')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with a schedule and global-norm clipping (optax).

  Attributes:
    learning_rate: peak learning rate.
    lr_schedule: 'constant', 'cosine' or 'linear' decay after warmup.
    weight_decay: AdamW's decoupled weight decay, on every weight but the norms' scales and
      the biases (as transformers' Trainer, so TRL, decays).
    b1, b2: AdamW's moment decay rates.
    eps: AdamW's denominator epsilon.
    warmup_steps: linear warmup, in optimizer steps.
    total_steps: optimizer steps the decay spans (needed by 'cosine' and 'linear').
    max_grad_norm: clip the (window-normalized) gradient to this global norm; 0 disables.
    sequential_lr_scale: learning-rate factor in update_mode='sequential'; None means
      1/sqrt(grad_accum_steps) as in the blog post "The Implicit Bias of Gradient Accumulation
      in RLHF" (docs/design, "Implicit bias").
    max_consecutive_nonfinite: a window whose gradient is not finite is skipped (params and
      AdamW untouched); after this many skipped windows in a row the run stops with an error,
      its last checkpoint being from before the first of them.
  """
  learning_rate: float = 1e-5
  lr_schedule: str = 'constant'
  warmup_steps: int = 0
  total_steps: int = 0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  sequential_lr_scale: Optional[float] = None
  max_consecutive_nonfinite: int = 3

  def __post_init__(self):
    p = 'optimizer.'
    _require(isinstance(self.learning_rate, numbers.Real) and math.isfinite(self.learning_rate)
             and self.learning_rate > 0,
             f'{p}learning_rate must be a finite number > 0, got {self.learning_rate}.')
    _positive_int(self, 'max_consecutive_nonfinite', prefix=p)
    _one_of(self, 'lr_schedule', LR_SCHEDULES, p)
    _require(self.warmup_steps >= 0, f'{p}warmup_steps must be >= 0, got {self.warmup_steps}.')
    _require(self.lr_schedule == 'constant' or self.total_steps > self.warmup_steps,
             f'{p}lr_schedule={self.lr_schedule!r} needs {p}total_steps > {p}warmup_steps '
             f'(got {self.total_steps} and {self.warmup_steps}); set {p}total_steps to the '
             f'number of optimizer steps of the run.')
    _require(self.max_grad_norm >= 0, f'{p}max_grad_norm must be >= 0 (0 disables).')
    for name in ('b1', 'b2'):
      _require(0 <= getattr(self, name) < 1,
               f'{p}{name}={getattr(self, name)!r} must be in [0, 1) (AdamW\'s decay rates).')
    for name in ('eps', 'weight_decay'):
      _require(0 <= getattr(self, name) < math.inf,
               f'{p}{name}={getattr(self, name)!r} must be a finite number >= 0.')
    _require(self.sequential_lr_scale is None or 0 < self.sequential_lr_scale < math.inf,
             f'{p}sequential_lr_scale={self.sequential_lr_scale!r} must be a finite number > 0, '
             f'or None (update_mode=\'sequential\'s default).')


def device_slice(setting: str, value: str) -> Optional[tuple[int, int]]:
  """A role's devices, ``'start:stop'`` (a slice of ``jax.devices()``, e.g. '4:8'), as
  (start, stop); None for '' (the setting's default). Anything else is a ConfigError naming
  ``setting``. Whether the slice exists is checked against the devices (sharding.role_meshes)."""
  if value == '':
    return None
  m = re.fullmatch(r'\s*(\d+)\s*:\s*(\d+)\s*', value) if isinstance(value, str) else None
  _require(m is not None and int(m.group(1)) < int(m.group(2)),
           f'{setting}={value!r} must be a slice start:stop of jax.devices() with start < stop, '
           f"e.g. '4:8' (devices 4 to 7), or '' (the default).")
  return int(m.group(1)), int(m.group(2))


def _check_mesh_sizes(name: str, data, fsdp, tensor) -> None:
  sizes = (data, fsdp, tensor)
  _require(all(isinstance(s, int) and (s > 0 or s == -1) for s in sizes),
           f'{name} sizes must be positive integers or -1, got data={data}, fsdp={fsdp}, '
           f'tensor={tensor}.')
  _require(sum(s == -1 for s in sizes) <= 1,
           f'at most one {name} size may be -1, got data={data}, fsdp={fsdp}, tensor={tensor}.')


@dataclasses.dataclass(frozen=True)
class RoleMeshConfig:
  """The mesh of a GRPO run's rollout or reference role (``mesh.rollout``, ``mesh.reference``):
  its own devices and sizes, or (devices '') its default mesh.

  Attributes:
    devices: the role's devices, a slice start:stop of jax.devices() (e.g. '4:8'); '' (default):
      the rollout on the actor's mesh, the reference on the rollout's (its sizes below must then
      stay at their defaults).
    data: pure data parallelism on the role's devices (one size may be -1: the rest).
    fsdp: data parallelism with params sharded over it, on the role's devices.
    tensor: tensor parallelism on the role's devices.
  """
  devices: str = ''
  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh sizes. One size may be -1: it takes the devices that are left.

  A GRPO run has three roles (docs/design.md, "Roles"): the actor (the learner and the old
  log-probs) on this mesh, the rollout (generation) on ``rollout``'s, and the reference (the
  reference log-probs) on ``reference``'s; by default all three share this mesh.

  Attributes:
    data: pure data parallelism (params replicated over it).
    fsdp: data parallelism with params sharded over it (ZeRO-3 style).
    tensor: tensor parallelism (heads, mlp and vocab sharded over it).
    device_memory_gib: the memory one device has for a step, in GiB; 0 (default): what the
      backend reports (``memory_stats()['bytes_limit']`` on GPU and TPU, else a TPU chip's HBM),
      none on a CPU. Every compiled step is checked against it before the first step runs
      (``jaxrl_ga.fit``: 'auto' memory knobs choose, explicit ones that do not fit are an error).
    devices: the actor's devices, a slice start:stop of jax.devices() (e.g. '0:4'); '' (default):
      all of them.
    rollout: the rollout role's mesh (RoleMeshConfig: devices, data, fsdp, tensor); its devices
      '' (default): the actor's mesh.
    reference: the reference role's mesh (RoleMeshConfig); its devices '' (default): the
      rollout's, whose step then computes the reference log-probs; else a reference step of its
      own runs there.
  """
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  device_memory_gib: float = 0.0
  devices: str = ''
  rollout: RoleMeshConfig = RoleMeshConfig()
  reference: RoleMeshConfig = RoleMeshConfig()

  def __post_init__(self):
    _require(isinstance(self.device_memory_gib, numbers.Real)
             and math.isfinite(self.device_memory_gib) and self.device_memory_gib >= 0,
             f'mesh.device_memory_gib={self.device_memory_gib!r} must be a number >= 0 (GiB per '
             'device; 0: what the backend reports).')
    _check_mesh_sizes('mesh', self.data, self.fsdp, self.tensor)
    device_slice('mesh.devices', self.devices)
    for role, default in (('rollout', "the actor's"), ('reference', "the rollout's")):
      r, name = getattr(self, role), f'mesh.{role}'
      _require(isinstance(r, RoleMeshConfig), f'{name} must be a section (devices, data, '
               f'fsdp, tensor), got {r!r}.')
      _check_mesh_sizes(name, r.data, r.fsdp, r.tensor)
      if device_slice(f'{name}.devices', r.devices) is None:
        changed = [f'{name}.{k}={getattr(r, k)}' for k in ('data', 'fsdp', 'tensor')
                   if getattr(r, k) != getattr(RoleMeshConfig(), k)]
        _require(not changed, f'{", ".join(changed)} is set but {name}.devices is not: the '
                 f"{role} then uses {default} mesh; set {name}.devices (e.g. '4:8') or leave "
                 'the sizes at their defaults.')


# A GRPO run's roles, each with its mesh (MeshConfig; sharding.role_meshes): the actor
# (learner, old log-probs), the rollout (generation), the reference (reference log-probs).
ROLES = ('actor', 'rollout', 'reference')


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Generation settings of the rollout step.

  Attributes:
    max_prompt_length: prompts are left-padded (or rejected) to this many tokens; 0 (default):
      the longest prompt of the data (every row of data.train, the held-out set; a built-in
      task: its bound), rounded up to a multiple of 8, measured before anything compiles
      (``api.validate_lengths``; the trainer's first prompt line prints it).
    max_completion_length: L, generated tokens per completion (GRPO: also the 'constant'
      normalizer).
    temperature: softmax temperature (> 0).
    top_k: keep the k most likely tokens (0 disables).
    top_p: nucleus sampling mass (1.0 disables).
    rollout_micro_batch_size: completions generated at once, to bound KV-cache memory
      (0 means the whole rollout at once).
    old_logprob_source: GRPO: 'recompute' (a learner forward pass, only for the slices the
      schedule marks) or 'sampler' (the sampler's own log-probs, free with generation). Either
      way they are log-probs under the tempered but untruncated softmax,
      log_softmax(logits / temperature), what the learner computes: top-k / top-p only choose
      which token is drawn.
    decode_slots: 0 decodes the rollout's rows in batches of rollout_micro_batch_size, each
      until its longest row finishes; > 0 decodes them in a pool of this many slots, a slot
      taking the next row as soon as its row finishes (``jaxrl_ga.sampling``, "Slot pool"): the
      rollout takes about (its tokens / slots) steps instead of (longest reply x batches).
      Rows draw from their own keys, so their completions do not depend on the slot count.
      Off by default: measured 2.59x the batched sampler on SmolLM2's uneven replies up to 512
      tokens (BENCHMARKS.md, uneven_rollout.py), but not yet at the short completions of the
      shipped configs nor on a multi-device mesh, where its prefill of the whole rollout's
      prompts and its per-row scatters have not been timed.
  """
  max_prompt_length: int = 0
  max_completion_length: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  rollout_micro_batch_size: int = 0
  old_logprob_source: str = 'recompute'
  decode_slots: int = 0

  def __post_init__(self):
    p = 'sampling.'
    _positive_int(self, 'max_completion_length', prefix=p)
    _require(_is_int(self.max_prompt_length) and self.max_prompt_length >= 0,
             f'{p}max_prompt_length must be >= 0 (0: the data\'s longest prompt), got '
             f'{self.max_prompt_length!r}.')
    _require(self.temperature > 0, f'{p}temperature must be > 0, got {self.temperature}.')
    _require(self.top_k >= 0, f'{p}top_k must be >= 0 (0 disables), got {self.top_k}.')
    _require(0 < self.top_p <= 1, f'{p}top_p must be in (0, 1], got {self.top_p}.')
    _require(self.rollout_micro_batch_size >= 0,
             f'{p}rollout_micro_batch_size must be >= 0 (0: whole rollout at once).')
    _one_of(self, 'old_logprob_source', OLD_LOGPROB_SOURCES, p)
    _require(self.decode_slots >= 0, f'{p}decode_slots must be >= 0 (0: decode in batches), '
             f'got {self.decode_slots}.')


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """From rewards to advantages (GRPO).

  Attributes:
    scale_rewards: divide the group-centered reward by the std of the 'group' (GRPO), of the
      'batch' (rollout), or not at all ('none', Dr. GRPO).
    mask_truncated_completions: exclude completions that hit max_completion_length without EOS
      from the loss (DAPO).
    order_by_advantage_sign: reorder each rollout so that positive-advantage completions come
      first and negative ones last (the sequential study, docs/design "Implicit bias").
    multi_objective_aggregation: how several reward functions combine, TRL 1.16's
      (rewards.group_advantages): 'sum_then_normalize' (the weighted sum, then scale_rewards) or
      'normalize_then_sum' (GDPO: each function group-normalized, the weighted sum normalized
      over the rollout; scale_rewards is not used).
  """
  scale_rewards: str = 'group'
  mask_truncated_completions: bool = False
  order_by_advantage_sign: bool = False
  multi_objective_aggregation: str = 'sum_then_normalize'

  def __post_init__(self):
    _one_of(self, 'scale_rewards', SCALE_REWARDS, 'advantage.')
    _one_of(self, 'multi_objective_aggregation', MULTI_OBJECTIVE_AGGREGATIONS, 'advantage.')


REMAT = ('none', 'save_dots', 'full')  # least recompute first (jaxrl_ga.fit's order)
AUTO_CHUNK = -1  # model.logprob_chunk_size='auto' (jaxrl_ga.fit)
# model.attention: 'auto' (resolved once per run) or one of models/attention.ATTENTION_IMPLS
ATTENTION = ('auto', 'einsum', 'xla', 'splash', 'cudnn', 'flash')
# The architecture of model.* where a config sets none of its fields: a tiny model built from
# scratch, its vocabulary from the task's tokenizer.
FRESH_MODEL = ModelConfig(vocab_size=0, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          attention_bias=True, tie_word_embeddings=True,
                          max_position_embeddings=512)
_ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


# apply_chat_template's own arguments, which the callers set: not chat-template keyword arguments.
_TEMPLATE_CALL_ARGS = ('conversation', 'tools', 'documents', 'chat_template',
                       'add_generation_prompt', 'continue_final_message', 'tokenize', 'padding',
                       'truncation', 'max_length', 'return_tensors', 'return_dict',
                       'return_assistant_tokens_mask', 'tokenizer_kwargs')


def template_kwargs_json(value: Any, setting: str) -> str:
  """``value`` (a JSON object's text, a mapping, or '' / None for none) as canonical JSON text
  (sorted keys; '' for none). Anything else is a ConfigError naming ``setting``."""
  if value is None or value == '':
    return ''
  how = f'give a JSON object, e.g. {setting}=\'{{"enable_thinking": false}}\''
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError:
      raise ConfigError(f'{setting}={value!r} is not JSON; {how}.') from None
  if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
    raise ConfigError(f'{setting}={value!r} is not a JSON object of keyword arguments; {how}.')
  taken = sorted(set(value) & set(_TEMPLATE_CALL_ARGS))
  if taken:
    raise ConfigError(f'{setting}: {", ".join(taken)} {"is" if len(taken) == 1 else "are"} '
                      f'apply_chat_template\'s own argument(s), which the run sets; give only the '
                      f'template\'s variables (e.g. enable_thinking).')
  try:
    return json.dumps(dict(value), sort_keys=True)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'{setting}: {e}; {how}.') from None


@dataclasses.dataclass(frozen=True, init=False)
class ModelSpec:
  """The run's model (``model.*``): its architecture (``arch``, a ModelConfig), where the policy
  comes from and how its training forward runs.

  The architecture's fields are settings of ``model.*`` themselves, flat beside the others
  (docs/design, "Families and the model's settings"): config files and ``--config.model.<field>``
  set them so (``model.hidden_size=256``; ``arch`` is marked ``flat``, see :func:`settings`), and
  ``ModelSpec(hidden_size=256, hf_path=...)`` and ``spec.hidden_size`` take and read them so.

  Attributes:
    arch: the architecture, a ModelConfig: its fields (HF names) are set and read flat, as
      ``model.hidden_size``; by default a tiny model built from scratch (FRESH_MODEL). With
      ``hf_path`` set, training takes the checkpoint's own architecture and ignores them.
    hf_path: where the weights, tokenizer and architecture come from: an HF model directory
      (local or gs://, which is copied to $JAXRL_GA_MODEL_CACHE; or a hub id), a ``.gguf`` file, or ``pkg:<package>`` (the one GGUF file inside an installed
      package). Empty: a fresh model of the architecture fields, its vocabulary from the task's
      tokenizer.
    vocab_size: 0 when training (sized from the checkpoint or the tokenizer); configs for
      ``python -m jaxrl_ga.plan``, which reads no hub, write it with the checkpoint's shapes.
    remat: per-decoder-layer rematerialization of the training forward: 'none', 'full' (keep
      each layer's input, recompute the layer in the backward), 'save_dots' (keep the weight
      matmuls' outputs; see models/transformer.py) or 'auto' (default): the least recompute
      whose compiled steps fit the device's memory (``jaxrl_ga.fit``; 'none' where no limit is
      known, e.g. a CPU). Measure with ``python -m jaxrl_ga.plan``.
    logprob_chunk_size: completion positions whose float32 logits are computed at once for the
      log-probs, in the learner and the rollout's old-log-prob pass (0: all Tc at once; see
      jaxrl_ga/logprobs.py); -1 (default, 'auto'): 0 if the steps fit the device's memory, else
      the largest power of two that does (``jaxrl_ga.fit``; 0 where no limit is known).
    scan_layers: the training forward (learners, old and reference log-probs) runs the decoder
      layers as one ``lax.scan`` over the stacked params (True: compile time independent of
      depth, the choice for deep models and TPUs) or unrolled (False: no per-layer slices of the
      stacked params and gradient buffers; on this project's 2-core CPU a GRPO learner window
      was 1.24x faster at 2 layers, 1.10x at 8 and 1.03x at SmolLM2's 30, see
      benchmarks/scan_layers.py). Same arithmetic, but XLA may round the two programs
      differently. The CPU arithmetic configs set False.
    share_prompt_prefix: GRPO's G completions of one prompt share its forward: in the learner and
      the old- and reference-log-prob passes each prompt's positions run once per R rows that
      hold it (R = gcd(G, B / data-parallel shards), ``rollout.prompt_share``), and the rollout
      prefills each prompt once. The same values (float32 rounding aside); the prompt positions'
      share of the work is divided by R. Off with advantage.order_by_advantage_sign's reordered
      rows (learner and old log-probs only).
    attention: the attention of the training forward (learners, old and reference log-probs)
      and of the rollout's prefill: 'auto' (the default: resolved once per run, before anything
      compiles, and printed in one line: 'flash' on GPUs; 'splash' on TPU; on CPU the fastest
      measured, the einsum), 'einsum' (two einsums and a softmax over a dense mask),
      'xla' (``jax.nn.dot_product_attention(implementation='xla')``, the same arithmetic as jax
      stages it), 'splash' (TPU only: the Pallas splash-attention kernel, compiled by libtpu;
      measure with ``python -m jaxrl_ga.plan``), 'cudnn' (cuDNN's fused attention: refused for
      now, it failed this project's GPU check on an H200, models/attention.CUDNN_FAILED) or
      'flash' (FlashAttention's algorithm in pure JAX, every backend: blocked over keys, the
      backward recomputed, no [B, N, T, S] tensor kept; models/attention.flash_attention,
      benchmarks/learner_memory.py). The decode steps keep their filled-cache attention. What an
      implementation cannot express runs the einsum ('flash' under 'splash'; models/attention.py);
      benchmarks/attention.py compares them. Not in the checkpoint fingerprint (an
      implementation choice): a run may resume with another value.
    dtype: 'float32' or 'bfloat16', the compute dtype.
    param_dtype: 'float32' or 'bfloat16', the storage dtype of the params.
    lora: LoRAConfig, ``model.lora.rank`` > 0 trains low-rank adapters only (docs/lora.md).
    chat_template_kwargs: keyword arguments for every chat-template rendering of the run, as a
      JSON object (the Python API also takes a dict), e.g. '{"enable_thinking": false}' for
      Qwen3: GRPO's prompts, tool turns and reward models' texts (TRL 1.16's
      ``GRPOConfig.chat_template_kwargs``), the held-out evaluation's prompts, and SFT's and
      DPO's rows, where a row's own ``chat_template_kwargs`` column overrides a key it also
      sets. '' (default): none. Needs a tokenizer with a chat template.
  """
  arch: ModelConfig = dataclasses.field(default=FRESH_MODEL, metadata={'flat': True})
  hf_path: str = ''
  remat: str = 'auto'
  logprob_chunk_size: int = AUTO_CHUNK
  scan_layers: bool = True
  share_prompt_prefix: bool = True
  attention: str = 'auto'
  chat_template_kwargs: str = ''

  def __init__(self, arch: Optional[ModelConfig] = None, **settings: Any):
    """``arch`` (default FRESH_MODEL) with the ModelConfig fields among ``settings`` replaced,
    and this class's own settings; a bad value is a ConfigError naming ``model.<setting>``."""
    own = {f.name: f.default for f in dataclasses.fields(ModelSpec) if f.name != 'arch'}
    unknown = sorted(set(settings) - set(own) - set(_ARCH_FIELDS))
    if unknown:
      raise TypeError(f'ModelSpec() got unexpected keyword argument(s) {", ".join(unknown)}')
    for name, default in own.items():
      object.__setattr__(self, name, settings.pop(name, default))
    base = FRESH_MODEL if arch is None else arch
    values = {name: settings.get(name, getattr(base, name)) for name in _ARCH_FIELDS}
    self._validate(types.SimpleNamespace(**values))
    try:
      object.__setattr__(self, 'arch', ModelConfig(**values))
    except ValueError as e:  # ModelConfig's own checks (layer types, family settings)
      raise ConfigError(f'model.{e}') from None

  def _validate(self, arch: Any) -> None:
    """ConfigErrors naming model.*, ``arch`` the architecture's values before ModelConfig's own
    checks."""
    p = 'model.'
    _one_of(arch, 'architecture', ARCHITECTURES, p)
    _one_of(self, 'attention', ATTENTION, p)
    _one_of(arch, 'dtype', MODEL_DTYPES, p)
    _one_of(arch, 'param_dtype', MODEL_DTYPES, p)
    _one_of(self, 'remat', REMAT + ('auto',), p)
    for name in ('scan_layers', 'share_prompt_prefix'):
      _require(isinstance(getattr(self, name), bool),
               f'{p}{name}={getattr(self, name)!r} must be True or False.')
    object.__setattr__(self, 'chat_template_kwargs',
                       template_kwargs_json(self.chat_template_kwargs, f'{p}chat_template_kwargs'))
    if self.logprob_chunk_size == 'auto':
      object.__setattr__(self, 'logprob_chunk_size', AUTO_CHUNK)
    _require(_is_int(self.logprob_chunk_size) and self.logprob_chunk_size >= AUTO_CHUNK,
             f'{p}logprob_chunk_size={self.logprob_chunk_size!r} must be an integer >= 0 '
             '(0: no chunking) or -1 (auto: the largest that fits the device).')
    if not self.hf_path:
      _positive_int(arch, 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                    'num_attention_heads', 'num_key_value_heads', prefix=p)
      _require(arch.num_attention_heads % arch.num_key_value_heads == 0,
               f'{p}num_attention_heads={arch.num_attention_heads} must be a multiple of '
               f'{p}num_key_value_heads={arch.num_key_value_heads}.')
      _require(arch.hidden_size % arch.num_attention_heads == 0,
               f'{p}hidden_size={arch.hidden_size} must be a multiple of '
               f'{p}num_attention_heads={arch.num_attention_heads}.')
      for name in ('rope_theta', 'rms_norm_eps'):
        _require(getattr(arch, name) > 0,
                 f'{p}{name}={getattr(arch, name)!r} must be > 0 (default '
                 f'{getattr(ModelConfig, name)!r}).')

  def template_kwargs(self) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict ({} when unset)."""
    return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

  def __getattr__(self, name: str) -> Any:
    """The architecture's fields and properties read through: ``spec.hidden_size``,
    ``spec.head_size`` (only called for names the spec itself lacks)."""
    if name.startswith('_') or (name not in _ARCH_FIELDS and not hasattr(ModelConfig, name)):
      raise AttributeError(f'{type(self).__name__!r} object has no attribute {name!r}')
    return getattr(self.arch, name)

  def architecture_config(self, vocab_size: Optional[int] = None) -> ModelConfig:
    """The architecture (``arch``), with ``vocab_size`` when given."""
    if vocab_size is None:
      return self.arch
    return dataclasses.replace(self.arch, vocab_size=vocab_size)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """The task (prompts, answers, rewards): a name from ``jaxrl_ga.tasks`` and its options.

  Attributes:
    name: the task, a key of ``jaxrl_ga.tasks.TASKS`` (arithmetic, gsm8k, number_questions).
    options: the task's config fields (config files set them with ``config.set_task``).
  """
  name: str = 'arithmetic'
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Your own rows instead of the built-in task (``jaxrl_ga.data``): GRPO's prompts, SFT's
  conversations alone (``jaxrl_ga.sft_data``), or DPO's preference rows with
  ``dpo.pairs='dataset'`` (``jaxrl_ga.preference``).

  Attributes:
    train: a .jsonl/.json/.csv/.parquet file (local or gs://), a ``datasets.save_to_disk``
      directory or a hub dataset id; '' uses the built-in task ``task.name``.
    eval: the held-out rows, the same kinds; '' holds out ``eval_fraction`` of ``train``.
    train_split, eval_split: the split of a hub dataset or of a saved DatasetDict.
    columns: column renames 'source:target,...', e.g. 'question:prompt'.
    eval_fraction: share of ``train`` held out (seeded) when ``eval`` is ''.
    shuffle: a seeded shuffle per epoch (False: file order).
  """
  train: str = ''
  eval: str = ''
  train_split: str = 'train'
  eval_split: str = 'test'
  columns: str = ''
  eval_fraction: float = 0.1
  shuffle: bool = True

  def __post_init__(self):
    if isinstance(self.columns, Mapping):  # the Python API may pass {'question': 'prompt'}
      object.__setattr__(self, 'columns', ','.join(f'{k}:{v}' for k, v in self.columns.items()))
    _require(0.0 < self.eval_fraction < 1.0,
             f'data.eval_fraction must be in (0, 1), got {self.eval_fraction}.')


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out exact-match evaluation with greedy decoding.

  Attributes:
    num_examples: held-out examples evaluated (0: all the task offers).
    batch_size: prompts decoded at once.
    max_completion_length: generated tokens per answer.
    metric: 'module:function', a metric(prompts, completions, **columns) returning one float per
      completion (or a dict of such lists) whose means each evaluation of your data reports
      (``jaxrl_ga.trainers.evaluation``); '' none.
  """
  num_examples: int = 256
  batch_size: int = 64
  max_completion_length: int = 8
  metric: str = ''

  def __post_init__(self):
    _require(self.num_examples >= 0, f'eval.num_examples must be >= 0, got {self.num_examples}.')
    _positive_int(self, 'batch_size', 'max_completion_length', prefix='eval.')


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints under WORKDIR/checkpoints/<stage>.

  Attributes:
    every_steps: save every this many optimizer steps (0: only at the end and on SIGTERM).
    max_to_keep: keep the newest N checkpoints of a stage.
  """
  every_steps: int = 50
  max_to_keep: int = 2

  def __post_init__(self):
    _require(self.every_steps >= 0, 'checkpoint.every_steps must be >= 0 (0: end of stage only).')
    _positive_int(self, 'max_to_keep', prefix='checkpoint.')


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised fine-tuning: token cross-entropy on the task's reference completions, or on your
  data's rows (data.train with stages=sft: ``jaxrl_ga.sft_data``).

  Attributes:
    num_steps: optimizer steps.
    micro_batch_size: sequences (packed: rows) per micro-step (global).
    grad_accum_steps: K, micro-steps per optimizer step.
    max_length: tokens per row (prompt + completion + eos; packed: several examples), padded;
      a longer example is rejected (your data: as too_long says). 0: your data's (data.train)
      longest row or held-out prompt, rounded up to 8 (a built-in task needs a value).
    log_every: log metrics every this many optimizer steps.
    eval_every: held-out evaluation every this many optimizer steps (0: at the end only).
    target_accuracy: stop early once greedy accuracy on a probe set of training problems
      (never the held-out set) reaches this, checked every ``probe_every`` steps; 0 disables.
      Leaves a warm start "in the middle" whatever the seed.
    probe_every: optimizer steps between the target_accuracy probes.
    probe_examples: training problems in the target_accuracy probe set.
    optimizer: AdamW, schedule and clipping of this stage.
    packing: several examples per row of max_length tokens (attention and positions never cross
      an example's boundary); micro_batch_size then counts packed rows. The loss is normalized
      per token over the optimizer-step window either way (``jaxrl_ga.sft_data``).
    too_long: a data.train row over max_length: 'error' (naming it), 'drop' (left out, counted)
      or 'truncate' (its first max_length tokens).
    eval_before: a held-out evaluation before the first step too (eval/accuracy_before_sft).
    assistant_only_loss: your data's ``messages`` rows: the loss on the assistant turns only
      (True) or on every token of the conversation (False, TRL 1.16's default of the same name).
    completion_only_loss: your data's ``prompt``/``completion`` rows: the loss on the completion
      only (True, TRL's default for such rows) or on the prompt too (False).
  """
  num_steps: int = 200
  micro_batch_size: int = 64
  grad_accum_steps: int = 1
  max_length: int = 16
  log_every: int = 20
  eval_every: int = 0
  target_accuracy: float = 0.0
  probe_every: int = 25
  probe_examples: int = 200
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=3e-3, max_grad_norm=1.0)
  packing: bool = False
  too_long: str = 'error'
  eval_before: bool = False
  assistant_only_loss: bool = True
  completion_only_loss: bool = True

  def __post_init__(self):
    _positive_int(self, 'num_steps', 'micro_batch_size', 'grad_accum_steps', 'log_every',
                  prefix='sft.')
    _require(_is_int(self.max_length) and self.max_length >= 0,
             f'sft.max_length must be >= 0 (0: the longest row of data.train), got '
             f'{self.max_length!r}.')
    _require(self.too_long in ('error', 'drop', 'truncate'),
             f'sft.too_long must be error, drop or truncate, got {self.too_long!r}.')
    _require(self.eval_every >= 0, 'sft.eval_every must be >= 0 (0: at the end only).')
    _require(0.0 <= self.target_accuracy <= 1.0,
             f'sft.target_accuracy must be in [0, 1] (0 disables), got {self.target_accuracy}.')
    _positive_int(self, 'probe_every', 'probe_examples', prefix='sft.')


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Online RL with group-relative advantages.

  Attributes:
    num_steps: optimizer steps.
    schedule: B, G, S, mu, K (see ScheduleConfig and ``python -m jaxrl_ga.explain``).
    align_diagnostic: log the alignment of positive- and negative-advantage gradients (docs/design,
      "Implicit bias"; costs two extra backward passes per micro-step).
    eval_every: held-out evaluation every this many optimizer steps (0: before and after only).
    sampling: how rollouts are sampled (temperature, top_p, lengths).
    loss: the per-token objective and its aggregation.
    advantage: how rewards become advantages.
    optimizer: AdamW, schedule and clipping of this stage.
    log_every: log metrics every this many optimizer steps.
    reward_funcs: reward functions, 'module:function[=weight],...', built-in names
      (``jaxrl_ga.rewards``) or reward models, 'path[=weight]': a sequence classifier's HF
      directory (local or gs://), .gguf file or pkg: source (``jaxrl_ga.reward_model``); '' keeps
      the task's own. Required with ``data.train``.
    completions_every: every this many rollouts, ``completions_logged`` of the rollout's prompts,
      completions, rewards and advantages go to WORKDIR/completions.jsonl and TensorBoard text
      (process 0's rows; 0: never).
    completions_logged: completions logged per logged rollout (see ``completions_every``).
    tools: tools the model may call in multi-turn episodes, 'module:function,...' (TRL's
      ``tools``; each with type hints and a docstring; ``jaxrl_ga.tools``). '' (default): none.
    environment: an environment class, 'module:Class' (TRL's ``environment_factory``: its
      methods are tools, ``reset(**row)`` text is appended to the prompt, an optional
      ``get_reward()`` is a reward named after it), or 'name=module:Class,...' chosen per row by
      the ``environment`` column. '' (default): none.
    max_tool_calls: assistant turns whose tool calls are run, per episode (TRL's
      ``max_tool_calling_iterations``); 0: no limit but ``sampling.max_completion_length``.
    tool_timeout_s: a tool call running longer fails (its message is the tool turn).
    length_buckets: the learner computes each micro-batch's completions up to its longest one
      only, padded to the shortest of this many widths (evenly spaced up to
      ``sampling.max_completion_length``, multiples of 8) that holds it, so that its cost follows
      the tokens generated; the positions cut are padding, so the update is the same (docs/design,
      "Learner width"). Every width's learner step is compiled before the first rollout (the
      trainer prints how long it took): worth it for runs with long, uneven completions.
      1 (default): always the full width, one compile.
    sync_ref_model: TRL's (TR-DPO): every ``ref_model_sync_steps`` optimizer steps the reference
      becomes ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference (TRL's
      SyncRefModelCallback); the reference params are in every checkpoint. Needs loss.beta > 0
      and no LoRA (whose reference is the base weights).
    ref_model_sync_steps: TRL's tau (default 512), optimizer steps between syncs.
    ref_model_mixup_alpha: TRL's alpha in [0, 1] (default 0.6).
  """
  num_steps: int = 60
  schedule: ScheduleConfig = ScheduleConfig()
  sampling: SamplingConfig = SamplingConfig()
  loss: GRPOLossConfig = GRPOLossConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
  align_diagnostic: bool = False
  log_every: int = 5
  eval_every: int = 0
  reward_funcs: str = ''
  completions_every: int = 0
  completions_logged: int = 8
  length_buckets: int = 1
  tools: str = ''
  environment: str = ''
  max_tool_calls: int = 0
  tool_timeout_s: float = 30.0
  sync_ref_model: bool = False
  ref_model_sync_steps: int = 512
  ref_model_mixup_alpha: float = 0.6

  def __post_init__(self):
    _positive_int(self, 'num_steps', 'log_every', 'completions_logged', 'length_buckets',
                  'ref_model_sync_steps', prefix='grpo.')
    alpha = self.ref_model_mixup_alpha
    _require(_is_number(alpha) and 0 <= alpha <= 1,
             f'grpo.ref_model_mixup_alpha={alpha!r} must be in [0, 1].')
    _require(not self.sync_ref_model or self.loss.beta > 0,
             f'grpo.sync_ref_model=True with grpo.loss.beta={self.loss.beta}: there is no '
             'reference to sync; set grpo.loss.beta > 0 or grpo.sync_ref_model=False.')
    _require(self.max_tool_calls >= 0, 'grpo.max_tool_calls must be >= 0 (0: no limit but '
             'grpo.sampling.max_completion_length).')
    _require(self.tool_timeout_s > 0, f'grpo.tool_timeout_s={self.tool_timeout_s} must be > 0 '
             '(seconds a tool call may run).')
    _require(not (self.loss.sampler_is_correction
                  and self.sampling.old_logprob_source == 'sampler'),
             "grpo.loss.sampler_is_correction=True with grpo.sampling.old_logprob_source="
             "'sampler': the old log-probs are then the sampler's and the ratio is 1; set "
             "old_logprob_source='recompute'.")
    _require(self.completions_every >= 0, 'grpo.completions_every must be >= 0 (0: never).')
    _require(self.eval_every >= 0, 'grpo.eval_every must be >= 0 (0: before and after only).')


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """Offline preference optimization on pairs sampled from the current (SFT) policy, or read from
  a preference dataset (``pairs='dataset'``).

  Pairs ('sampled'): for each prompt, ``samples_per_prompt`` completions are sampled; a correct
  and an incorrect one make a (chosen, rejected) pair. Pairs ('dataset'): the rows of
  ``data.train``, each ``prompt`` + ``chosen`` + ``rejected`` (strings or chat messages; without
  ``prompt``, the turns chosen and rejected share; ``jaxrl_ga.preference``). Either way the
  reference log-probs (the policy at the start of the stage) are computed once and cached in the
  workdir.

  Attributes:
    num_steps: optimizer steps.
    micro_batch_size: pairs per micro-step (global).
    grad_accum_steps: K, micro-steps per optimizer step.
    pairs: 'sampled' (the policy's own correct and incorrect completions of the task's prompts)
      or 'dataset' (the preference rows of ``data.train``).
    num_prompts: prompts sampled to build pairs ('sampled').
    samples_per_prompt: completions sampled per prompt to find a correct and an incorrect one
      ('sampled').
    max_length: tokens per sequence (prompt + completion); 'dataset': a longer completion is cut
      at its end to fit; 0 ('dataset' only): the longest prompt plus its longer reply over every
      row, rounded up to 8.
    max_prompt_length: 'dataset': tokens a prompt may have (0: up to ``max_length - 1``).
    long_prompts: 'dataset': a prompt over ``max_prompt_length`` is an 'error' naming its row, is
      'drop'ped (the count is printed and in the summary as ``dpo/dropped_rows``) or 'truncate'd
      on ``truncation_side``.
    truncation_side: 'left' (keep a long prompt's last tokens) or 'right' (its first); the
      prompt only (TRL 1.16's truncation_mode cuts the whole prompt + reply to max_length).
    ref_model: the reference policy of the log-ratios: '' the policy at the start of the stage,
      else a model like ``model.hf_path`` takes (HF directory, .gguf, pkg:, hub id) with the
      policy's vocabulary; its log-probs are computed once, before training.
    reference_as_chosen: when no sampled completion of a prompt is correct, pair the task's
      reference completion (chosen) with an incorrect sample (rejected).
    sampling: how the pairs' completions are sampled.
    loss: the DPO loss and its aggregation.
    optimizer: AdamW, schedule and clipping of this stage.
    log_every: log metrics every this many optimizer steps.
    eval_every: held-out evaluation every this many optimizer steps (0: before and after only).
  """
  num_steps: int = 60
  micro_batch_size: int = 16
  grad_accum_steps: int = 2
  pairs: str = 'sampled'
  num_prompts: int = 512
  samples_per_prompt: int = 8
  reference_as_chosen: bool = False
  max_length: int = 16
  max_prompt_length: int = 0
  long_prompts: str = 'error'
  truncation_side: str = 'left'
  ref_model: str = ''
  sampling: SamplingConfig = SamplingConfig(temperature=1.0)
  loss: DPOLossConfig = DPOLossConfig()
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
  log_every: int = 5
  eval_every: int = 0

  def __post_init__(self):
    _require(self.eval_every >= 0, 'dpo.eval_every must be >= 0 (0: before and after only).')
    _positive_int(self, 'num_steps', 'micro_batch_size', 'grad_accum_steps', 'num_prompts',
                  'samples_per_prompt', 'log_every', prefix='dpo.')
    _require(_is_int(self.max_length) and self.max_length >= 0,
             f'dpo.max_length must be >= 0 (0: the longest pair of a preference dataset), got '
             f'{self.max_length!r}.')
    _one_of(self, 'pairs', DPO_PAIRS, 'dpo.')
    _one_of(self, 'long_prompts', DPO_LONG_PROMPTS, 'dpo.')
    _one_of(self, 'truncation_side', ('left', 'right'), 'dpo.')
    _require(self.max_prompt_length >= 0,
             f'dpo.max_prompt_length must be >= 0 (0: max_length - 1), got '
             f'{self.max_prompt_length}.')


REPORT_TO = ('tensorboard', 'wandb', 'none')


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """Where a run's metrics go besides WORKDIR/metrics.jsonl, which every run writes (process 0
  logs; docs/running.md, "What a run writes").

  Attributes:
    report_to: comma-separated: 'tensorboard' (WORKDIR/tensorboard), 'wandb' (a Weights & Biases
      run with the same scalars and the run's config; ``pip install 'jaxrl_ga[wandb]'``;
      WANDB_MODE=offline writes a local run directory without network) or 'none'.
    wandb_project: the W&B project ('': WANDB_PROJECT, else 'jaxrl_ga').
    wandb_entity: the W&B team or user ('': WANDB_ENTITY, else your default entity).
    wandb_run_name: the W&B run's name ('': WANDB_NAME, else the workdir's last component).
  """
  report_to: tuple[str, ...] = ('tensorboard',)
  wandb_project: str = ''
  wandb_entity: str = ''
  wandb_run_name: str = ''

  def __post_init__(self):
    names = (self.report_to.split(',') if isinstance(self.report_to, str)
             else list(self.report_to))  # the Python API may pass ['tensorboard', 'wandb']
    names = tuple(dict.fromkeys(n.strip() for n in names)) or ('',)
    object.__setattr__(self, 'report_to', names)
    given = ",".join(names)
    for name in names:
      close = difflib.get_close_matches(name, REPORT_TO, n=1)
      _require(name in REPORT_TO,
               f'log.report_to={given!r}: {name!r} is not a known value'
               f'{f" (did you mean {close[0]!r}?)" if close else ""}; set log.report_to to '
               f'a comma-separated list of tensorboard, wandb, or to none.')
    _require('none' not in names or len(names) == 1,
             f'log.report_to={given!r}: none stands alone; set log.report_to to none or to a '
             f'comma-separated list of tensorboard, wandb.')
    _require('wandb' not in names or _installed('wandb'),
             "log.report_to names wandb, which is not installed; pip install 'jaxrl_ga[wandb]' "
             "(or pip install wandb), or drop wandb from log.report_to.")


def _installed(module: str) -> bool:
  """Whether ``module`` can be imported, without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (blocked)
    return False


STAGES = ('sft', 'grpo', 'dpo')


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run: stages chained in order (e.g. ('sft', 'grpo')), each resuming from the last.

  Attributes:
    seed: seeds the model's init, the data order and the sampler.
    stages: comma-separated stages run in order, each starting from the last one's policy.
  """
  seed: int = 0
  stages: tuple[str, ...] = ('sft', 'grpo')
  task: TaskSpec = TaskSpec()
  data: DataConfig = DataConfig()
  model: ModelSpec = ModelSpec()
  mesh: MeshConfig = MeshConfig()
  sft: SFTConfig = SFTConfig()
  grpo: GRPOConfig = GRPOConfig()
  dpo: DPOConfig = DPOConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  log: LogConfig = LogConfig()

  def __post_init__(self):
    stages = tuple(self.stages.split(',')) if isinstance(self.stages, str) else tuple(
        self.stages)
    object.__setattr__(self, 'stages', stages)
    bad = [s for s in stages if s not in STAGES]
    _require(stages and not bad,
             f'stages={",".join(stages)!r}: unknown stage(s) {bad}; use a comma-separated list '
             f'of {", ".join(STAGES)} (e.g. "sft,grpo").')
    twice = sorted({s for s in stages if stages.count(s) > 1})
    _require(not twice, f'stages={",".join(stages)!r}: {", ".join(twice)} is given twice; a '
                        f'stage runs once per run (its checkpoints are one directory).')
    _require(_is_int(self.seed) and self.seed >= 0,
             f'seed={self.seed!r} must be an integer >= 0 (jax.random.key takes no negative '
             f'seed).')


def settings(cls: type) -> dict[str, tuple[Any, type]]:
  """The settings of config dataclass ``cls`` as config files and ``--config.<path>`` name them:
  {name: (type, the dataclass that declares it)}, its fields in order, those of a field marked
  ``metadata={'flat': True}`` in its place (``ModelSpec.arch``: ``model.hidden_size``)."""
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    if f.metadata.get('flat'):
      out.update(settings(hints[f.name]))
    else:
      out[f.name] = (hints[f.name], cls)
  return out


def settings_dict(obj: Any) -> dict[str, Any]:
  """Config dataclass ``obj`` as nested dicts of its :func:`settings` (``dataclasses.asdict``
  with a ``flat`` field's fields in its place): what config files write, and
  :func:`from_mapping` takes back."""
  out = {}
  for name in settings(type(obj)):
    value = getattr(obj, name)
    out[name] = settings_dict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
  return out


def from_mapping(cls: type, values: Mapping[str, Any], prefix: str = ''):
  """Builds dataclass ``cls`` from a mapping (e.g. a ConfigDict section) of its
  :func:`settings`, rejecting unknown keys.

  Nested dataclass fields (an optional one too) are built recursively from nested mappings.
  """
  fields = settings(cls)
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(
        f'unknown setting(s) {", ".join(prefix + u for u in unknown)} for {cls.__name__}; '
        f'known settings: {", ".join(prefix + f for f in fields)}.')
  kwargs = {}
  for name, value in values.items():
    hint = fields[name][0]
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = inner[0] if len(inner) == 1 else hint  # Optional[X] -> X
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
      value = from_mapping(hint, value, prefix=f'{prefix}{name}.')
    else:
      value = _checked_type(f'{prefix}{name}', fields[name][0], value)
    kwargs[name] = value
  try:
    return cls(**kwargs)
  except ConfigError as e:
    if not prefix or str(e).startswith(prefix):
      raise
    raise ConfigError(f'in {prefix.rstrip(".")}: {e}') from None


_SCALARS = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'a string'}


def _checked_type(setting: str, hint: Any, value: Any) -> Any:
  """``value`` (a numpy scalar as its Python value), or a ConfigError naming ``setting`` when it
  is not of its scalar type (``hint``: bool, int, float, str, or Optional of one; others are the
  dataclass's to check). The CLI's values are typed by ml_collections already; this catches the
  Python API's (``api.make_config``, ``trl_args``), which would otherwise fail in a comparison
  with a TypeError."""
  inner = [a for a in typing.get_args(hint) if a is not type(None)]
  optional = len(inner) == 1 and type(None) in typing.get_args(hint)
  scalar = inner[0] if optional else hint
  if scalar not in _SCALARS or (optional and value is None):
    return value
  if scalar is float and isinstance(value, numbers.Real) and math.isnan(value):
    raise ConfigError(f'{setting}=nan is not a number; give a finite value.')
  if scalar is bool:
    ok = isinstance(value, (bool, np.bool_))
  elif scalar is str:
    ok = isinstance(value, str)
  elif scalar is int:
    ok = _is_int(value)
  else:
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
  if not ok:
    raise ConfigError(f'{setting}={value!r} must be {_SCALARS[scalar]}'
                      f'{" or None" if optional else ""}; set it to one.')
  return value.item() if isinstance(value, np.generic) else value


def to_config_dict(obj: Any):
  """A dataclass instance as an ``ml_collections.ConfigDict`` of its :func:`settings` (nested
  dataclasses as nested ConfigDicts, tuples comma-joined); optional fields whose value is None
  become typed placeholders, so that ``--config.<path>=<value>`` can set them too."""
  out = {}
  for name, (hint, _) in settings(type(obj)).items():
    value = getattr(obj, name)
    if dataclasses.is_dataclass(value):
      value = to_config_dict(value)
    elif value is None:
      inner = [a for a in typing.get_args(hint) if a is not type(None)]
      value = ml_collections.config_dict.placeholder(inner[0] if inner else object)
    elif isinstance(value, tuple):
      value = ','.join(value)
    elif isinstance(value, Mapping):
      value = ml_collections.ConfigDict(dict(value))
    out[name] = value
  return ml_collections.ConfigDict(out)


def default_config_dict():
  """RunConfig's defaults as an ``ml_collections.ConfigDict``: config files start from it, so
  every field exists and can be overridden with ``--config.<path>=<value>`` (optional fields
  whose default is None are typed placeholders, so they can be set too). Config files choose
  their task with :func:`set_task`, which lists every option of that task."""
  return to_config_dict(RunConfig())


def set_task(config, name: str, **options: Any) -> None:
  """Sets ``config.task`` to task ``name`` with every option of its config dataclass (defaults,
  updated by ``options``), so that each can be overridden with ``--config.task.options.<field>``
  and an unknown field is an error naming the valid ones. Raises ConfigError for an unknown task
  or option."""
  if name not in tasks.TASKS:
    raise ConfigError(f'unknown task {name!r}; known tasks: {", ".join(sorted(tasks.TASKS))}.')
  option_cls = tasks.TASKS[name][1]
  known = {f.name for f in dataclasses.fields(option_cls)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ConfigError(f'task {name!r} has no option(s) {", ".join(unknown)}; its options: '
                      f'{", ".join(sorted(known))}.')
  config.task.name = name
  config.task.options = to_config_dict(option_cls(**options))


def unknown_config_arg(path: str, arg: str, known: Sequence[str]) -> ConfigError:
  """The error a config file raises for an argument (``--config=<file>:<arg>``) it does not
  know: one line naming the ones it knows."""
  names = ', '.join(repr(k) if k == '' else k for k in known)
  return ConfigError(f'{os.path.basename(path)} knows no argument {arg!r}; its arguments: '
                     f'{names} (--config={path}:<argument>).')


def config_dirs() -> list[str]:
  """Where the project's configs/ files are besides the current directory: installed with the
  package (setup.py installs configs/ as jaxrl_ga/configs) and, in a checkout, beside jaxrl_ga/."""
  package = os.path.dirname(os.path.abspath(__file__))
  return [d for d in (os.path.join(package, 'configs'),
                      os.path.join(os.path.dirname(package), 'configs')) if os.path.isdir(d)]


def resolve_config_path(path: str) -> str:
  """``path`` if that file exists; else, for ``configs/<name>.py``, the project's own copy (see
  :func:`config_dirs`), so ``--config=configs/grpo_arith.py`` works from any directory after a
  ``pip install``. Raises ConfigError naming the path when neither exists."""
  if os.path.isfile(path):
    return path
  folder, name = os.path.split(os.path.normpath(path))
  if folder == 'configs':
    for d in config_dirs():
      if os.path.isfile(os.path.join(d, name)):
        return os.path.join(d, name)
  known = sorted({f'configs/{f}' for d in config_dirs() for f in os.listdir(d)
                  if f.endswith('.py') and not f.startswith('_')})
  raise ConfigError(f'config file {path} not found in {os.getcwd()}'
                    + (f' nor among the project\'s configs ({", ".join(known)})' if known else '')
                    + '; fix the path.')


def resolve_config_argv(argv: list[str], flag: str = 'config') -> list[str]:
  """``argv`` with the file of ``--config=<file>[:<arg>]`` (or ``--config <file>...``) passed through
  :func:`resolve_config_path`, for a CLI whose ml_collections flag opens the file itself. A missing
  file raises ConfigError naming --config."""
  out = list(argv)
  for i in range(1, len(out)):
    for name in (f'--{flag}', f'-{flag}'):
      if out[i].startswith(name + '='):
        prefix, value = name + '=', out[i][len(name) + 1:]
      elif out[i] == name and i + 1 < len(out):
        prefix, value, i = '', out[i + 1], i + 1
      else:
        continue
      path, sep, arg = value.partition(':')
      try:
        out[i] = prefix + resolve_config_path(path) + sep + arg
      except ConfigError as e:
        raise ConfigError(f'--{flag}={value}: {e}') from None
      break
  return out


def load_config_file(path: str, arg: str = ''):
  """``get_config(arg)`` of an ml_collections config file (configs may build on each other);
  ``path`` goes through :func:`resolve_config_path`."""
  path = resolve_config_path(path)
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
