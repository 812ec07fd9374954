"""SFT, GRPO and DPO losses as (numerator, denominator) pairs, for exact gradient accumulation.

Every loss here is a pure function of arrays (no model, no optimizer) that returns a
:class:`LossTerms`. Over an optimizer-step window of K micro-batches the window loss is

    loss(W) = sum_k numerator_k / sum_k denominator_k,

and the learner differentiates only the numerators, sums their gradients over the window and
divides once by the summed denominator (the design doc, docs/design, "Exactness"). Each
aggregation therefore chooses (numerator, denominator) so that this ratio is exactly the window
loss of the design doc's table, whatever K and wherever the micro-batch boundaries fall:

  aggregation         numerator of a micro-batch          denominator of a micro-batch
  token               sum m*l                             sum m
  sequence            sum_i [sum_t m*l / max(sum_t m, 1)] B (every row, empty ones too)
  constant            sum m*l                             B * max_completion_length
  sequence_sum        sum m*l                             B (every row)
  microbatch_token    sum m*l / sum m                     1   (the K-dependent bug; docs/design)

Each name means what TRL 1.16's GRPOTrainer means by its loss_type (docs/design.md, "Loss
peers"): 'token' is dapo (at K = S, where TRL's normalizer is the window's token count),
'sequence' is grpo and 'constant' is dr_grpo, both counting a row whose completion mask is all
zero (mask_truncated_completions) as a sequence, 'sequence_sum' is luspo (each sequence's
summed loss, averaged over rows) and 'microbatch_token' is bnpo (one process). TRL's cispo and
vespo normalize as dapo does, sapo as grpo does (GRPOLossConfig.objective).
TRL's per-micro-batch formula is applied to the whole window: normalizers are summed over the
K micro-batches instead of averaging K separately normalized losses.

Metrics accumulate the same way: ``mean_metrics[name] = (weighted sum, weight)`` gives the window
mean sum(sums) / sum(weights); ``min_metrics`` and ``max_metrics`` combine with min and max.
:func:`neutral_like` (the accumulator's start), :func:`combine`, :func:`finalize` and
:func:`window_value` do this arithmetic; the learner's accumulator should do the same.

A GRPO row whose mask is all zero (a completion masked out) contributes nothing to any
numerator or metric, and counts in the 'sequence' and 'constant' denominators as TRL counts it
(GRPO micro-batches have no padding rows). A DPO pair with no tokens is a padding pair and counts
nowhere. Values at masked positions may be arbitrary (even inf or nan): they are replaced before
any arithmetic, so they never reach a sum or a gradient.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga.config import DPOLossConfig, GRPOLossConfig

Array = jax.Array


@flax.struct.dataclass
class LossTerms:
  """One micro-batch's contribution to the loss and metrics of its optimizer-step window.

  Attributes:
    numerator: scalar f32, the un-normalized contribution to the window loss; the only field
      the learner differentiates.
    denominator: scalar f32, the contribution to the window normalizer (no gradient).
    mean_metrics: name -> (weighted sum, weight); the window mean is sum(sums) / sum(weights).
    min_metrics: name -> this micro-batch's minimum (+inf when it has no element).
    max_metrics: name -> this micro-batch's maximum (-inf when it has no element).
  """
  numerator: Array
  denominator: Array
  mean_metrics: dict[str, tuple[Array, Array]]
  min_metrics: dict[str, Array]
  max_metrics: dict[str, Array]


# ---------------------------------------------------------------------------------------------
# Window arithmetic
# ---------------------------------------------------------------------------------------------


def combine(a: LossTerms, b: LossTerms) -> LossTerms:
  """Adds two micro-batches' terms: sums numerators, denominators and metric pairs; min/max."""
  for field in ('mean_metrics', 'min_metrics', 'max_metrics'):
    if set(getattr(a, field)) != set(getattr(b, field)):
      raise ValueError(f'cannot combine LossTerms with different {field}: '
                       f'{sorted(getattr(a, field))} vs {sorted(getattr(b, field))}.')
  return LossTerms(
      numerator=a.numerator + b.numerator,
      denominator=a.denominator + b.denominator,
      mean_metrics={
          k: (s + b.mean_metrics[k][0], w + b.mean_metrics[k][1])
          for k, (s, w) in a.mean_metrics.items()
      },
      min_metrics={k: jnp.minimum(v, b.min_metrics[k]) for k, v in a.min_metrics.items()},
      max_metrics={k: jnp.maximum(v, b.max_metrics[k]) for k, v in a.max_metrics.items()},
  )


def neutral_like(terms: LossTerms) -> LossTerms:
  """The identity of :func:`combine` with the structure of ``terms``: zero sums and counts,
  +inf minima, -inf maxima. The starting value of a window accumulator."""
  zero = lambda x: jnp.zeros_like(x, jnp.float32)
  return LossTerms(
      numerator=zero(terms.numerator),
      denominator=zero(terms.denominator),
      mean_metrics={k: (zero(s), zero(w)) for k, (s, w) in terms.mean_metrics.items()},
      min_metrics={k: jnp.full_like(v, jnp.inf, jnp.float32) for k, v in terms.min_metrics.items()},
      max_metrics={k: jnp.full_like(v, -jnp.inf, jnp.float32)
                   for k, v in terms.max_metrics.items()},
  )


def _window_div(num: Array, den: Array) -> Array:
  """num / den, and nan where den == 0 (a window with nothing to average)."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


def finalize(terms: LossTerms) -> tuple[Array, dict[str, Array]]:
  """Window loss and metrics from accumulated terms (nan for a mean over nothing)."""
  loss = _window_div(terms.numerator, terms.denominator)
  metrics = {k: _window_div(s, w) for k, (s, w) in terms.mean_metrics.items()}
  for extra in (terms.min_metrics, terms.max_metrics):
    clash = set(extra) & set(metrics)
    if clash:
      raise ValueError(f'metric names used twice: {sorted(clash)}.')
    metrics.update(extra)
  return loss, metrics


def window_value(terms_list: Sequence[LossTerms]) -> tuple[Array, dict[str, Array]]:
  """Loss and metrics of a window, combining its micro-batches' terms as the learner does.

  Args:
    terms_list: the LossTerms of the window's micro-batches, in any order.

  Returns:
    (sum numerator / sum denominator, {name: window mean, min or max}).
  """
  if not terms_list:
    raise ValueError('window_value needs at least one LossTerms.')
  return finalize(functools.reduce(combine, terms_list))


# ---------------------------------------------------------------------------------------------
# Per-token quantities from logits
# ---------------------------------------------------------------------------------------------


def token_logps(logits: Array, targets: Array) -> Array:
  """log softmax(logits)[targets], computed in float32.

  Args:
    logits: [B, T, V] next-token logits (any float dtype).
    targets: [B, T] int token ids.

  Returns:
    [B, T] float32 log-probabilities of the targets.
  """
  logits = logits.astype(jnp.float32)  # [B, T, V]
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)  # [B, T]


def token_entropy(logits: Array) -> Array:
  """Entropy of softmax(logits) per position, computed in float32: [B, T, V] -> [B, T]."""
  logits = logits.astype(jnp.float32)  # [B, T, V]
  logz = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [B, T, 1]
  probs = jnp.exp(logits - logz)  # [B, T, V]
  return logz[..., 0] - jnp.sum(probs * logits, axis=-1)  # [B, T]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _f32(x) -> Array:
  return jnp.asarray(x, jnp.float32)


def _check_shape(name: str, x: Array, shape: tuple[int, ...]) -> None:
  if x.shape != shape:
    raise ValueError(f'{name} has shape {x.shape}, expected {shape}.')


def _masked_pair(x: Array, mask: Array) -> tuple[Array, Array]:
  """(sum mask*x, sum mask) of a masked token quantity, gradient-free, for mean_metrics."""
  x = jax.lax.stop_gradient(x)
  return jnp.sum(jnp.where(mask > 0, mask * x, 0.0)), jnp.sum(mask)


def _masked_min(x: Array, mask: Array) -> Array:
  return jnp.min(jnp.where(mask > 0, jax.lax.stop_gradient(x), jnp.inf), initial=jnp.inf)


def _masked_max(x: Array, mask: Array) -> Array:
  return jnp.max(jnp.where(mask > 0, jax.lax.stop_gradient(x), -jnp.inf), initial=-jnp.inf)


def aggregate(per_token_loss: Array, mask: Array, aggregation: str,
              max_completion_length: int) -> tuple[Array, Array]:
  """(numerator, denominator) of a per-token loss for one micro-batch; see the module table.

  Args:
    per_token_loss: [B, T] finite per-token loss (its masked entries are ignored).
    mask: [B, T] loss mask in {0, 1}.
    aggregation: 'token', 'sequence', 'constant' or 'microbatch_token'.
    max_completion_length: L, the 'constant' normalizer per sequence.

  Returns:
    Scalar float32 (numerator, denominator).
  """
  masked = jnp.where(mask > 0, mask * per_token_loss, 0.0)  # [B, T]
  tokens = jnp.sum(mask)
  if aggregation == 'token':
    return jnp.sum(masked), tokens
  if aggregation == 'microbatch_token':
    return jnp.sum(masked) / jnp.where(tokens > 0, tokens, 1.0), jnp.ones((), jnp.float32)
  num_rows = float(mask.shape[0])  # TRL counts every row, one without tokens too
  if aggregation == 'sequence':
    seq_tokens = jnp.sum(mask, axis=-1)  # [B]
    seq_mean = jnp.sum(masked, axis=-1) / jnp.maximum(seq_tokens, 1.0)  # [B]; 0 for an empty row
    return jnp.sum(seq_mean), jnp.asarray(num_rows, jnp.float32)
  if aggregation == 'constant':
    return jnp.sum(masked), jnp.asarray(num_rows * float(max_completion_length), jnp.float32)
  if aggregation == 'sequence_sum':
    return jnp.sum(masked), jnp.asarray(num_rows, jnp.float32)
  raise ValueError(f'unknown aggregation {aggregation!r}; choose one of token, sequence, '
                   'constant, microbatch_token, sequence_sum.')


def entropy_threshold(entropy: Array, mask: Array, top_quantile: float) -> Array:
  """The (1 - top_quantile) quantile of the entropies of the valid tokens, TRL 1.16's
  (GRPOTrainer.get_high_entropy_mask: torch.quantile, linear interpolation between the two
  nearest ranks). Scalar float32; +inf when no token is valid (then no token is kept).

  Args:
    entropy: [..., T] per-token entropies (values at masked positions are ignored).
    mask: the same shape, in {0, 1}.
    top_quantile: rho in [0, 1], the share of tokens (by entropy) to keep.
  """
  valid = (mask > 0).reshape(-1)
  values = jnp.sort(jnp.where(valid, _f32(entropy).reshape(-1), jnp.inf))  # valid ones first
  n = jnp.sum(valid.astype(jnp.int32))
  rank = jnp.float32(1.0 - top_quantile) * jnp.maximum(n - 1, 0).astype(jnp.float32)
  lo = jnp.floor(rank)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0).astype(jnp.float32))
  a, b = values[lo.astype(jnp.int32)], values[hi.astype(jnp.int32)]
  w = rank - lo
  threshold = jnp.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))  # torch.lerp
  return jax.lax.stop_gradient(jnp.where(n > 0, threshold, jnp.inf))


def vespo_weights(token_log_ratio: Array, mask: Array, advantages: Array,
                  cfg: GRPOLossConfig, sampler_ratio: Optional[Array] = None) -> Array:
  """VESPO's per-sequence Gamma weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1), with w
  the sequence's importance ratio exp(sum_t m * (logp - old)), as TRL 1.16 computes it
  (GRPOTrainer.get_gamma_weights: token log-ratios clipped to +-20, log w to [log 1e-8, 20],
  k and lambda by the sign of A (A >= 0: the _pos pair), non-finite phi -> 0). No gradient.

  With the sampler-side correction (a token mode; TRL refuses the sequence modes with vespo) TRL
  folds its ratio into w instead of multiplying the loss by it: log w gains
  sum_t clip(log w_is_t, log 1e-8, 20) (a masked token's 0 counts as 1e-8). The sum runs over
  the valid tokens; TRL's runs over the padding too, whose ratio is 1 (log 0) unless
  1 is outside [C_min, C_max].

  Args:
    token_log_ratio: [B, T] logp - old (0 at masked positions).
    mask: [B, T] in {0, 1}.
    advantages: [B].
    cfg: the loss configuration (vespo_k_pos, ...).
    sampler_ratio: [B, T] the sampler-side IS ratio (:func:`sampler_is_ratio`), or None.

  Returns:
    [B, 1] float32 weights.
  """
  token_log_ratio = jax.lax.stop_gradient(token_log_ratio)
  seq = jnp.sum(jnp.clip(token_log_ratio, -20.0, 20.0) * mask, axis=-1, keepdims=True)  # [B, 1]
  if sampler_ratio is not None:
    log_is = jnp.clip(jnp.log(jax.lax.stop_gradient(sampler_ratio)), np.log(1e-8), 20.0)
    seq = seq + jnp.sum(jnp.where(mask > 0, log_is, 0.0), axis=-1, keepdims=True)
  log_w = jnp.clip(seq, np.log(1e-8), 20.0)
  nonneg = advantages[:, None] >= 0  # [B, 1]
  k = jnp.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
  lam = jnp.maximum(jnp.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))  # [B, 1]
  return jnp.where(jnp.isfinite(phi), phi, 0.0)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------


def sft_loss(logps: Array, mask: Array) -> LossTerms:
  """Token-level cross-entropy: window loss = sum_W m * (-logp) / sum_W m.

  Args:
    logps: [B, T] log-probabilities of the target tokens.
    mask: [B, T] loss mask in {0, 1}.

  Returns:
    LossTerms with mean_metrics {'loss'} (token-weighted).
  """
  logps, mask = _f32(logps), _f32(mask)
  _check_shape('mask', mask, logps.shape)
  nll = -jnp.where(mask > 0, logps, 0.0)  # [B, T]
  num, den = aggregate(nll, mask, 'token', 0)
  return LossTerms(
      numerator=num,
      denominator=den,
      mean_metrics={'loss': (jax.lax.stop_gradient(num), den)},
      min_metrics={},
      max_metrics={},
  )


# ---------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------


def sampler_is_ratio(old_logps: Array, sampler_logps: Array, mask: Array, cfg: GRPOLossConfig):
  """TRL 1.16's vllm importance-sampling ratio (cfg.sampler_is_mode): with d = old - sampler per
  valid token (0 elsewhere), exp(d) per token or exp(sum_t d) per row, clipped to
  [C_min, C_max] ('*_truncate') or 0 outside it ('*_mask'). No gradient.

  Returns:
    (ratio [B, T] or [B, 1], d [B, T], the masked entries (bool, like ratio) or None).
  """
  diff = jnp.where(mask > 0, jax.lax.stop_gradient(old_logps) - sampler_logps, 0.0)  # [B, T]
  sequence = cfg.sampler_is_mode.startswith('sequence')
  log_ratio = jnp.sum(diff, axis=-1, keepdims=True) if sequence else diff  # [B, 1] or [B, T]
  ratio = jnp.exp(log_ratio)
  lo, hi = cfg.sampler_is_clip_min, cfg.sampler_is_clip_max
  lo = -jnp.inf if lo is None else lo
  hi = jnp.inf if hi is None else hi
  if cfg.sampler_is_mode.endswith('_truncate'):
    return jnp.clip(ratio, lo, hi), diff, None
  out = (ratio < lo) | (ratio > hi)
  return jnp.where(out, 0.0, ratio), diff, out


def sampler_weights(logps: Array, old_logps: Array, sampler_logps: Array, advantages: Array,
                    mask: Array, cfg: GRPOLossConfig):
  """The weight of each token's policy term from the sampler's log-probs (TRL 1.16's
  vllm_importance_sampling_correction and off_policy_mask_threshold; docs/design.md,
  "Sampler-side importance sampling"). Data, not params: no gradient flows through it.

  Importance sampling (cfg.sampler_is_correction): with d = old - sampler per valid token, the
  ratio is exp(d) per token ('token_*' modes) or exp(sum_t d) per row ('sequence_*'), then
  clipped to [C_min, C_max] ('*_truncate') or set to 0 outside it ('*_mask'). Off-policy mask
  (cfg.off_policy_mask_threshold = delta): a row is kept when its advantage is >= 0 or the mean
  over its tokens of (sampler - logps) is <= delta, and dropped (weight 0) otherwise. Neither
  changes the mask: a token weighted 0 still counts in the normalizer, as in TRL. With
  cfg.objective 'vespo' the IS ratio is left out of the weight: TRL folds it into VESPO's
  sequence ratio instead (:func:`vespo_weights`).

  Args:
    logps: [B, T] current log-probs (only their value is read).
    old_logps: [B, T] the learner's old log-probs (stop_gradient of logps where on-policy).
    sampler_logps: [B, T] the sampler's log-probs of the same tokens.
    advantages: [B].
    mask: [B, T] loss mask in {0, 1}.
    cfg: the loss configuration.

  Returns:
    (weight [B, T], mean_metrics, min_metrics, max_metrics): TRL's metric names
    'sampling/importance_sampling_ratio/{min,mean,max}' (over tokens, or over every row in the
    sequence modes, after truncation or masking), 'sampling/sampling_logp_difference/{mean,max}'
    (|old - sampler| over tokens), and ours 'sampling/importance_sampling_masked_fraction' (the
    *_mask modes: tokens or rows set to 0) and 'sampling/off_policy_masked_fraction' (rows).
  """
  sg = jax.lax.stop_gradient
  valid = mask > 0  # [B, T]
  weight = jnp.ones(logps.shape, jnp.float32)
  means, mins, maxes = {}, {}, {}
  if cfg.off_policy_mask_threshold is not None:
    kl = jnp.where(valid, sampler_logps - sg(logps), 0.0)  # [B, T]
    seq_kl = jnp.sum(kl, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)  # [B]
    keep = (advantages >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)  # [B]
    weight = weight * keep[:, None]
    rows = jnp.ones(keep.shape, jnp.float32)
    means['sampling/off_policy_masked_fraction'] = _masked_pair(1.0 - keep, rows)
  if cfg.sampler_is_correction:
    ratio, diff, out = sampler_is_ratio(old_logps, sampler_logps, mask, cfg)
    sequence = cfg.sampler_is_mode.startswith('sequence')
    # TRL's metrics: over the valid tokens, or over every row in the sequence modes.
    over = jnp.ones(ratio.shape, jnp.float32) if sequence else mask
    if cfg.sampler_is_mode.endswith('_mask'):
      means['sampling/importance_sampling_masked_fraction'] = _masked_pair(
          out.astype(jnp.float32), over)
    name = 'sampling/importance_sampling_ratio/'
    means[name + 'mean'] = _masked_pair(ratio, over)
    mins[name + 'min'] = _masked_min(ratio, over)
    maxes[name + 'max'] = _masked_max(ratio, over)
    name = 'sampling/sampling_logp_difference/'
    means[name + 'mean'] = _masked_pair(jnp.abs(diff), mask)
    maxes[name + 'max'] = _masked_max(jnp.abs(diff), mask)
    if cfg.objective != 'vespo':  # VESPO folds it into its w (vespo_weights), as TRL
      weight = weight * sg(ratio)
  # 0 off the mask: a sequence ratio broadcast there may be inf, and 0 * inf is nan, also in
  # the backward of the masked sums.
  return jnp.where(valid, weight, 0.0), means, mins, maxes


def grpo_loss(logps: Array,
              old_logps: Array,
              advantages: Array,
              mask: Array,
              cfg: GRPOLossConfig,
              max_completion_length: int,
              ref_logps: Optional[Array] = None,
              entropy: Optional[Array] = None,
              entropy_threshold_value: Optional[Array] = None,
              sampler_logps: Optional[Array] = None) -> LossTerms:
  """GRPO loss of one micro-batch (TRL 1.16 semantics): cfg.objective, aggregated by cfg.

  Per token, with r the importance ratio (token level: exp(logp - old); sequence level, GSPO:
  exp of the masked mean over t of (logp - old), broadcast to the sequence's tokens, with the
  gradient flowing through the mean), sg = stop_gradient:

    p = -min(r~ * A, clip(r, 1 - eps_low, 1 + eps_high) * A)   'clip', r~ = min(r, delta) or r
        -sg(min(r, eps_high)) * A * logp                       'cispo' (MiniMax-M1, ScaleRL)
        -sigmoid(tau (r - 1)) * 4 / tau * A                    'sapo', tau = tau_pos if A > 0
                                                               else tau_neg
        -phi(w) * A * logp                                     'vespo' (vespo_weights; no
                                                               gradient through phi)
    l = e * p                                e = 1[entropy >= threshold] if top_entropy_quantile
                                             < 1 (else 1)
        + beta * c * (exp(ref - logp) - (ref - logp) - 1)    if beta > 0; c = r with
                                                             use_bias_correction_kl, else 1
        - e * entropy_coef * entropy                           if entropy_coef > 0

  where the policy term p is multiplied by w: 1, or with loss.sampler_is_correction /
  loss.off_policy_mask_threshold the sampler-side weight of :func:`sampler_weights` (no
  gradient), applied where TRL applies it.

  The threshold is :func:`entropy_threshold` of this micro-batch's valid tokens (TRL's
  per-micro-batch quantile), or ``entropy_threshold_value`` when given (e.g. the window's, which
  makes the token selection independent of the micro-batch split). Masked-out tokens still count
  in every denominator, as in TRL.

  On-policy (old = stop_gradient(logp)) r == 1 and the gradient of 'clip' is the plain policy
  gradient -A * grad logp under the chosen aggregation.

  Args:
    logps: [B, T] current policy log-probs of the completion tokens (differentiated).
    old_logps: [B, T] log-probs of the generating policy.
    advantages: [B] one advantage per completion.
    mask: [B, T] completion loss mask in {0, 1}.
    cfg: the loss configuration.
    max_completion_length: L, the per-sequence normalizer of aggregation 'constant'.
    ref_logps: [B, T] reference-policy log-probs; required when cfg.beta > 0.
    entropy: [B, T] per-token policy entropy; required when cfg.entropy_coef > 0 or
      cfg.top_entropy_quantile < 1, reported as a metric whenever given.
    entropy_threshold_value: scalar, the top_entropy_quantile threshold to use instead of this
      micro-batch's.
    sampler_logps: [B, T] the sampler's log-probs; required by cfg.sampler_is_correction and
      cfg.off_policy_mask_threshold (their metrics: :func:`sampler_weights`).

  Returns:
    LossTerms. mean_metrics (token-weighted): 'loss' (the window objective), 'ratio/mean', 'kl'
    (beta > 0; times r with use_bias_correction_kl, as TRL logs it), 'entropy' (if given); for
    'clip': 'clip_ratio/low_mean' (r < 1 - eps_low and A < 0), 'clip_ratio/high_mean'
    (r > 1 + eps_high and A > 0), 'clip_ratio/region_mean' (either); for 'cispo':
    'cispo_clip_ratio' (r > eps_high and A > 0); for 'vespo': 'vespo/phi_seq_mean' (the mean of
    phi over the rows, every row counted, as TRL's); min_metrics 'ratio/min'; max_metrics
    'ratio/max'.
  """
  if cfg.beta > 0 and ref_logps is None:
    raise ValueError(f'grpo_loss: loss.beta={cfg.beta} > 0 needs ref_logps (the reference '
                     'policy log-probs); pass them or set loss.beta=0.')
  if (cfg.entropy_coef > 0 or cfg.top_entropy_quantile < 1) and entropy is None:
    raise ValueError(f'grpo_loss: loss.entropy_coef={cfg.entropy_coef} > 0 or '
                     f'loss.top_entropy_quantile={cfg.top_entropy_quantile} < 1 needs entropy; '
                     'pass the per-token entropy or set them to 0 and 1.')
  logps, old_logps, mask = _f32(logps), _f32(old_logps), _f32(mask)
  advantages = _f32(advantages)
  if logps.ndim != 2:
    raise ValueError(f'logps must be [B, T], got shape {logps.shape}.')
  shape = logps.shape
  _check_shape('old_logps', old_logps, shape)
  _check_shape('mask', mask, shape)
  _check_shape('advantages', advantages, shape[:1])
  valid = mask > 0  # [B, T]
  if entropy is not None:
    entropy = _f32(entropy)
    _check_shape('entropy', entropy, shape)
    entropy = jnp.where(valid, entropy, 0.0)  # [B, T]

  # Masked entries are replaced before any arithmetic: no inf/nan reaches a sum or a gradient.
  log_ratio = token_log_ratio = jnp.where(valid, logps - old_logps, 0.0)  # [B, T]
  if cfg.importance_level == 'sequence':
    seq_tokens = jnp.sum(mask, axis=-1, keepdims=True)  # [B, 1]
    seq_log_ratio = (jnp.sum(mask * log_ratio, axis=-1, keepdims=True) /
                     jnp.where(seq_tokens > 0, seq_tokens, 1.0))  # [B, 1]
    log_ratio = jnp.broadcast_to(seq_log_ratio, shape)  # [B, T]
  elif cfg.importance_level != 'token':
    raise ValueError(f'unknown importance_level {cfg.importance_level!r}; choose token or '
                     'sequence.')
  ratio = jnp.exp(log_ratio)  # [B, T]
  adv = jnp.where(valid, advantages[:, None], 0.0)  # [B, T]

  mean_metrics = {}
  sg = jax.lax.stop_gradient
  if cfg.objective == 'clip':
    clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)  # [B, T]
    capped = ratio if cfg.delta is None else jnp.minimum(ratio, cfg.delta)  # [B, T]
    per_token = -jnp.minimum(capped * adv, clipped * adv)  # [B, T]
    is_low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)  # [B, T]
    is_high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)  # [B, T]
    mean_metrics.update({
        'clip_ratio/low_mean': _masked_pair(is_low.astype(jnp.float32), mask),
        'clip_ratio/high_mean': _masked_pair(is_high.astype(jnp.float32), mask),
        'clip_ratio/region_mean': _masked_pair((is_low | is_high).astype(jnp.float32), mask),
    })
  elif cfg.objective == 'cispo':
    per_token = -sg(jnp.minimum(ratio, cfg.epsilon_high)) * adv * jnp.where(valid, logps, 0.0)
    is_clipped = (ratio > cfg.epsilon_high) & (adv > 0)  # [B, T]
    mean_metrics['cispo_clip_ratio'] = _masked_pair(is_clipped.astype(jnp.float32), mask)
  elif cfg.objective == 'sapo':
    tau = jnp.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)  # [B, T]
    per_token = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
  elif cfg.objective == 'vespo':
    sampler_ratio = None  # TRL folds the sampler-side ratio into w (token modes only)
    if cfg.sampler_is_correction and sampler_logps is not None:
      sampler_ratio = sampler_is_ratio(old_logps, _f32(sampler_logps), mask, cfg)[0]
    phi = vespo_weights(token_log_ratio, mask, advantages, cfg, sampler_ratio)  # [B, 1]
    per_token = -phi * adv * jnp.where(valid, logps, 0.0)
    mean_metrics['vespo/phi_seq_mean'] = (jnp.sum(phi), jnp.asarray(shape[0], jnp.float32))
  else:
    raise ValueError(f'unknown objective {cfg.objective!r}; choose clip, cispo, sapo or vespo.')

  keep = None  # top_entropy_quantile: the tokens that train the policy term
  if cfg.top_entropy_quantile < 1:
    threshold = (entropy_threshold(entropy, mask, cfg.top_entropy_quantile)
                 if entropy_threshold_value is None else sg(_f32(entropy_threshold_value)))
    keep = (valid & (sg(entropy) >= threshold)).astype(jnp.float32)  # [B, T]
    per_token = per_token * keep

  min_metrics, max_metrics = {}, {}
  if cfg.sampler_is_correction or cfg.off_policy_mask_threshold is not None:
    if sampler_logps is None:
      raise ValueError('grpo_loss: loss.sampler_is_correction / loss.off_policy_mask_threshold '
                       'need sampler_logps (the sampler\'s log-probs).')
    sampler_logps = _f32(sampler_logps)
    _check_shape('sampler_logps', sampler_logps, shape)
    weight, is_mean, min_metrics, max_metrics = sampler_weights(
        logps, old_logps, sampler_logps, advantages, mask, cfg)
    per_token = per_token * weight
    mean_metrics.update(is_mean)
  if cfg.beta > 0:
    ref_logps = _f32(ref_logps)
    _check_shape('ref_logps', ref_logps, shape)
    ref_diff = jnp.where(valid, ref_logps - logps, 0.0)  # [B, T]
    kl = jnp.exp(ref_diff) - ref_diff - 1.0  # [B, T]
    if cfg.use_bias_correction_kl:
      kl = kl * ratio
    per_token = per_token + cfg.beta * kl
    mean_metrics['kl'] = _masked_pair(kl, mask)
  if entropy is not None:
    if cfg.entropy_coef > 0:
      bonus = entropy if keep is None else entropy * keep
      per_token = per_token - cfg.entropy_coef * bonus
    mean_metrics['entropy'] = _masked_pair(entropy, mask)

  num, den = aggregate(per_token, mask, cfg.aggregation, max_completion_length)

  mean_metrics.update({
      'loss': (jax.lax.stop_gradient(num), den),
      'ratio/mean': _masked_pair(ratio, mask),
  })
  return LossTerms(
      numerator=num,
      denominator=den,
      mean_metrics=mean_metrics,
      min_metrics={'ratio/min': _masked_min(ratio, mask), **min_metrics},
      max_metrics={'ratio/max': _masked_max(ratio, mask), **max_metrics},
  )


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


def dpo_pair_losses(chosen_logratios: Array, rejected_logratios: Array, chosen_tokens: Array,
                    rejected_tokens: Array, cfg: DPOLossConfig) -> Array:
  """Per-pair DPO loss, as TRL 1.16's DPOTrainer defines each loss_type: [P] -> [P].

  With c = pi_c - ref_c and r = pi_r - ref_r (summed completion log-probs) and h = c - r:

    sigmoid  -(1 - ls) log sig(beta h) - ls log sig(-beta h)     (TRL's sigmoid at ls = 0;
             ls > 0 is cDPO, TRL's sigmoid before 1.0: TRL 1.16's sigmoid ignores ls)
    ipo      (c / n_c - r / n_r - 1 / (2 beta))^2   n: completion tokens (at least 1); TRL
             normalizes each log-ratio by its length, the form of the IPO paper's results
    hinge    relu(1 - beta h)
    robust   ((1 - ls) (-log sig(beta h)) + ls log sig(-beta h)) / (1 - 2 ls)

  Args:
    chosen_logratios, rejected_logratios: [P] policy minus reference summed log-probs.
    chosen_tokens, rejected_tokens: [P] completion token counts (used by 'ipo').
    cfg: the loss configuration.
  """
  h = chosen_logratios - rejected_logratios  # [P]
  bh = cfg.beta * h  # [P]
  ls = cfg.label_smoothing
  if cfg.loss_type == 'sigmoid':
    return -(1.0 - ls) * jax.nn.log_sigmoid(bh) - ls * jax.nn.log_sigmoid(-bh)
  if cfg.loss_type == 'ipo':
    h_per_token = (chosen_logratios / jnp.maximum(_f32(chosen_tokens), 1.0) -
                   rejected_logratios / jnp.maximum(_f32(rejected_tokens), 1.0))  # [P]
    return (h_per_token - 1.0 / (2.0 * cfg.beta))**2
  if cfg.loss_type == 'hinge':
    return jax.nn.relu(1.0 - bh)
  if cfg.loss_type == 'robust':
    return ((1.0 - ls) * -jax.nn.log_sigmoid(bh) + ls * jax.nn.log_sigmoid(-bh)) / (1.0 - 2.0 * ls)
  raise ValueError(f'unknown DPO loss_type {cfg.loss_type!r}; choose sigmoid, ipo, hinge or '
                   'robust.')


def dpo_window_normalizers(chosen_tokens, rejected_tokens, chosen_lengths, rejected_lengths,
                           cfg: DPOLossConfig) -> tuple[float, float]:
  """Host-side (numpy) window totals of a DPO window: (its loss denominator, its chosen tokens).

  What :func:`dpo_loss` needs to make RPO's NLL term exact over an optimizer-step window: pass
  ``rpo_scale = denominator / chosen_tokens`` of the whole window to each of its micro-batches.

  Args:
    chosen_tokens, rejected_tokens: [P_W] completion token counts of every pair of the window.
    chosen_lengths, rejected_lengths: [P_W] attention-mask lengths (prompt included); used by
      'microbatch_token'.
    cfg: the loss configuration.

  Returns:
    (sum over the window of dpo_loss's denominators, total chosen completion tokens).
  """
  nc, nr = np.asarray(chosen_tokens, np.float64), np.asarray(rejected_tokens, np.float64)
  valid = (nc + nr) > 0
  if cfg.aggregation == 'pair':
    den = float(np.sum(valid))
  elif cfg.aggregation == 'token':
    den = float(np.sum(np.where(valid, nc + nr, 0.0)))
  else:  # microbatch_token: every micro-batch with a valid pair contributes its attention tokens
    lengths = np.asarray(chosen_lengths, np.float64) + np.asarray(rejected_lengths, np.float64)
    den = float(np.sum(np.where(valid, lengths, 0.0)))
  return den, float(np.sum(np.where(valid, nc, 0.0)))


def dpo_loss(chosen_logps: Array,
             rejected_logps: Array,
             ref_chosen_logps: Array,
             ref_rejected_logps: Array,
             chosen_tokens: Array,
             rejected_tokens: Array,
             cfg: DPOLossConfig,
             chosen_lengths: Optional[Array] = None,
             rejected_lengths: Optional[Array] = None,
             rpo_scale: Optional[Array] = None) -> LossTerms:
  """DPO loss of one micro-batch of P pairs over summed sequence log-probs.

  Each pair i has a weight w_i; a padding pair (n_i = chosen_tokens_i + rejected_tokens_i = 0)
  has weight 0 and contributes nothing. Numerator sum_i w_i * loss_i, denominator sum_i w_i:

    'pair'              w_i = 1: the mean over the window's pairs (TRL's per_sequence_loss.mean())
    'token'             w_i = n_i: each pair weighted by its own completion tokens; does not
                        depend on the micro-batch split (our definition)
    'microbatch_token'  w_i = N_k / P_k: open-instruct's token weighting (PR #1447): the pair
                        mean of micro-batch k weighted by N_k, its attention-mask tokens (prompt
                        included) of chosen + rejected. Depends on the split; kept to show it.

  RPO (cfg.rpo_alpha > 0) adds TRL's 'sft' term, rpo_alpha times the token mean of the chosen
  completions' NLL over the window: loss(W) = sum_W w*loss / sum_W w + rpo_alpha *
  sum_W (-chosen_logps) / sum_W chosen_tokens. With one denominator per window, the NLL is added
  to the numerator scaled by rpo_scale = (window denominator) / (window chosen tokens), the
  window totals of :func:`dpo_window_normalizers`, which the host knows before the window runs.
  Without rpo_scale the micro-batch's own totals are used: exact when the micro-batch is the
  whole window, and over K micro-batches what TRL's per-micro-batch mean gives.

  Args:
    chosen_logps, rejected_logps: [P] policy log-probs summed over each completion (these are
      differentiated).
    ref_chosen_logps, ref_rejected_logps: [P] the reference policy's summed log-probs.
    chosen_tokens, rejected_tokens: [P] completion token counts.
    cfg: the loss configuration.
    chosen_lengths, rejected_lengths: [P] attention-mask token counts (prompt included);
      required by aggregation 'microbatch_token'.
    rpo_scale: scalar or [P] (equal entries), the window's denominator / chosen tokens.

  Returns:
    LossTerms with mean_metrics 'loss', 'rewards/chosen' (beta * (pi_c - ref_c)),
    'rewards/rejected', 'rewards/margins', 'logps/chosen', 'logps/rejected' weighted by w,
    'rewards/accuracies', the mean over (non-padding) pairs of 1[chosen reward > rejected
    reward], always pair-weighted, and 'nll/chosen', the token mean of the chosen NLL.
  """
  pc, pr = _f32(chosen_logps), _f32(rejected_logps)
  rc, rr = _f32(ref_chosen_logps), _f32(ref_rejected_logps)
  if pc.ndim != 1:
    raise ValueError(f'chosen_logps must be [P], got shape {pc.shape}.')
  for name, x in (('rejected_logps', pr), ('ref_chosen_logps', rc),
                  ('ref_rejected_logps', rr)):
    _check_shape(name, x, pc.shape)
  nc, nr = _f32(chosen_tokens), _f32(rejected_tokens)
  n = nc + nr  # [P]
  _check_shape('chosen_tokens + rejected_tokens', n, pc.shape)
  valid = n > 0  # [P]
  # Padding pairs may hold arbitrary values: replace them before any arithmetic.
  pc, pr, rc, rr = (jnp.where(valid, x, 0.0) for x in (pc, pr, rc, rr))
  nc = jnp.where(valid, nc, 0.0)

  # Policy-minus-reference first: those differences are small and exact in float32, whereas
  # pc - pr (sums over hundreds of tokens) would cancel badly.
  losses = dpo_pair_losses(pc - rc, pr - rr, nc, nr, cfg)  # [P]
  pair_weight = valid.astype(jnp.float32)  # [P]
  if cfg.aggregation == 'pair':
    weight = pair_weight
  elif cfg.aggregation == 'token':
    weight = jnp.where(valid, n, 0.0)
  elif cfg.aggregation == 'microbatch_token':
    if chosen_lengths is None or rejected_lengths is None:
      raise ValueError("dpo_loss: aggregation 'microbatch_token' needs chosen_lengths and "
                       'rejected_lengths (attention-mask token counts).')
    lengths = jnp.where(valid, _f32(chosen_lengths) + _f32(rejected_lengths), 0.0)  # [P]
    _check_shape('chosen_lengths + rejected_lengths', lengths, pc.shape)
    num_pairs = jnp.sum(pair_weight)
    weight = pair_weight * jnp.sum(lengths) / jnp.maximum(num_pairs, 1.0)
  else:
    raise ValueError(f'unknown DPO aggregation {cfg.aggregation!r}; choose pair, token or '
                     'microbatch_token.')
  num = jnp.sum(weight * losses)
  den = jnp.sum(weight)
  chosen_nll_sum = -jnp.sum(pc)  # sum of the chosen completions' token NLLs
  chosen_token_sum = jnp.sum(nc)
  if cfg.rpo_alpha:
    if rpo_scale is None:
      scale = den / jnp.maximum(chosen_token_sum, 1.0)
    else:
      scale = jnp.max(_f32(rpo_scale))  # equal entries; max also takes a scalar
    num = num + cfg.rpo_alpha * jax.lax.stop_gradient(scale) * chosen_nll_sum

  sg = jax.lax.stop_gradient
  chosen_rewards = cfg.beta * sg(pc - rc)  # [P]
  rejected_rewards = cfg.beta * sg(pr - rr)  # [P]
  correct = (chosen_rewards > rejected_rewards).astype(jnp.float32)  # [P]

  def weighted(x):
    return jnp.sum(weight * sg(x)), den

  return LossTerms(
      numerator=num,
      denominator=den,
      mean_metrics={
          'loss': (sg(num), den),
          'rewards/chosen': weighted(chosen_rewards),
          'rewards/rejected': weighted(rejected_rewards),
          'rewards/margins': weighted(chosen_rewards - rejected_rewards),
          'rewards/accuracies': (jnp.sum(pair_weight * correct), jnp.sum(pair_weight)),
          'logps/chosen': weighted(pc),
          'logps/rejected': weighted(pr),
          'nll/chosen': (sg(chosen_nll_sum), chosen_token_sum),
      },
      min_metrics={},
      max_metrics={},
  )
