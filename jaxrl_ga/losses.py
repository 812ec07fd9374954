"""SFT, GRPO and DPO losses as (numerator, denominator) pairs, for exact gradient accumulation.

Every loss here is a pure function of arrays (no model, no optimizer) that returns a
:class:`LossTerms`. Over an optimizer-step window of K micro-batches the window loss is

    loss(W) = sum_k numerator_k / sum_k denominator_k,

and the learner differentiates only the numerators, sums their gradients over the window and
divides once by the summed denominator (see ../DESIGN, "Loss normalization"). Each aggregation
therefore chooses (numerator, denominator) so that this ratio is exactly the window loss of the
DESIGN table, whatever K and wherever the micro-batch boundaries fall:

  aggregation         numerator of a micro-batch          denominator of a micro-batch
  token               sum m*l                             sum m
  sequence            sum_i [sum_t m*l / sum_t m]         N_seq (sequences with >= 1 token)
  constant            sum m*l                             N_seq * max_completion_length
  microbatch_token    sum m*l / sum m                     1   (the K-dependent bug of seed 003)

Metrics accumulate the same way: ``mean_metrics[name] = (weighted sum, weight)`` gives the window
mean sum(sums) / sum(weights); ``min_metrics`` and ``max_metrics`` combine with min and max.
:func:`neutral_like` (the accumulator's start), :func:`combine`, :func:`finalize` and
:func:`window_value` do this arithmetic; the learner's accumulator should do the same.

Rows whose mask is all zero (padding rows of a static-shape micro-batch, or completions masked
out) contribute nothing to any numerator, denominator or metric. Values at masked positions may
be arbitrary (even inf or nan): they are replaced before any arithmetic, so they never reach a
sum or a gradient.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import flax
import jax
import jax.numpy as jnp

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
  seq_tokens = jnp.sum(mask, axis=-1)  # [B]
  has_tokens = seq_tokens > 0  # [B]
  num_seqs = jnp.sum(has_tokens.astype(jnp.float32))
  if aggregation == 'sequence':
    seq_mean = jnp.sum(masked, axis=-1) / jnp.where(has_tokens, seq_tokens, 1.0)  # [B]
    return jnp.sum(jnp.where(has_tokens, seq_mean, 0.0)), num_seqs
  if aggregation == 'constant':
    return jnp.sum(masked), num_seqs * float(max_completion_length)
  raise ValueError(f'unknown aggregation {aggregation!r}; choose one of token, sequence, '
                   'constant, microbatch_token.')


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


def grpo_loss(logps: Array,
              old_logps: Array,
              advantages: Array,
              mask: Array,
              cfg: GRPOLossConfig,
              max_completion_length: int,
              ref_logps: Optional[Array] = None,
              entropy: Optional[Array] = None) -> LossTerms:
  """Clipped-surrogate GRPO loss of one micro-batch (TRL semantics), aggregated by cfg.

  Per token, with r the importance ratio (token level: exp(logp - old); sequence level, GSPO:
  exp of the masked mean over t of (logp - old), broadcast to the sequence's tokens, with the
  gradient flowing through the mean):

    l = -min(r~ * A, clip(r, 1 - eps_low, 1 + eps_high) * A)      r~ = min(r, delta) or r
        + beta * (exp(ref - logp) - (ref - logp) - 1)              if beta > 0
        - entropy_coef * entropy                                   if entropy_coef > 0

  On-policy (old = stop_gradient(logp)) r == 1 and the gradient is the plain policy gradient
  -A * grad logp under the chosen aggregation.

  Args:
    logps: [B, T] current policy log-probs of the completion tokens (differentiated).
    old_logps: [B, T] log-probs of the generating policy.
    advantages: [B] one advantage per completion.
    mask: [B, T] completion loss mask in {0, 1}.
    cfg: the loss configuration.
    max_completion_length: L, the per-sequence normalizer of aggregation 'constant'.
    ref_logps: [B, T] reference-policy log-probs; required when cfg.beta > 0.
    entropy: [B, T] per-token policy entropy; required when cfg.entropy_coef > 0, reported as a
      metric whenever given.

  Returns:
    LossTerms. mean_metrics (token-weighted): 'loss' (the window objective), 'clip_ratio/low_mean'
    (r < 1 - eps_low and A < 0), 'clip_ratio/high_mean' (r > 1 + eps_high and A > 0),
    'clip_ratio/region_mean' (either), 'ratio/mean', 'kl' (beta > 0), 'entropy' (if given);
    min_metrics 'ratio/min'; max_metrics 'ratio/max'.
  """
  if cfg.beta > 0 and ref_logps is None:
    raise ValueError(f'grpo_loss: loss.beta={cfg.beta} > 0 needs ref_logps (the reference '
                     'policy log-probs); pass them or set loss.beta=0.')
  if cfg.entropy_coef > 0 and entropy is None:
    raise ValueError(f'grpo_loss: loss.entropy_coef={cfg.entropy_coef} > 0 needs entropy; pass '
                     'the per-token entropy or set loss.entropy_coef=0.')
  logps, old_logps, mask = _f32(logps), _f32(old_logps), _f32(mask)
  advantages = _f32(advantages)
  if logps.ndim != 2:
    raise ValueError(f'logps must be [B, T], got shape {logps.shape}.')
  shape = logps.shape
  _check_shape('old_logps', old_logps, shape)
  _check_shape('mask', mask, shape)
  _check_shape('advantages', advantages, shape[:1])
  valid = mask > 0  # [B, T]

  # Masked entries are replaced before any arithmetic: no inf/nan reaches a sum or a gradient.
  log_ratio = jnp.where(valid, logps - old_logps, 0.0)  # [B, T]
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

  clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)  # [B, T]
  capped = ratio if cfg.delta is None else jnp.minimum(ratio, cfg.delta)  # [B, T]
  per_token = -jnp.minimum(capped * adv, clipped * adv)  # [B, T]

  mean_metrics = {}
  if cfg.beta > 0:
    ref_logps = _f32(ref_logps)
    _check_shape('ref_logps', ref_logps, shape)
    ref_diff = jnp.where(valid, ref_logps - logps, 0.0)  # [B, T]
    kl = jnp.exp(ref_diff) - ref_diff - 1.0  # [B, T]
    per_token = per_token + cfg.beta * kl
    mean_metrics['kl'] = _masked_pair(kl, mask)
  if entropy is not None:
    entropy = _f32(entropy)
    _check_shape('entropy', entropy, shape)
    entropy = jnp.where(valid, entropy, 0.0)  # [B, T]
    if cfg.entropy_coef > 0:
      per_token = per_token - cfg.entropy_coef * entropy
    mean_metrics['entropy'] = _masked_pair(entropy, mask)

  num, den = aggregate(per_token, mask, cfg.aggregation, max_completion_length)

  is_low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)  # [B, T]
  is_high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)  # [B, T]
  mean_metrics.update({
      'loss': (jax.lax.stop_gradient(num), den),
      'clip_ratio/low_mean': _masked_pair(is_low.astype(jnp.float32), mask),
      'clip_ratio/high_mean': _masked_pair(is_high.astype(jnp.float32), mask),
      'clip_ratio/region_mean': _masked_pair((is_low | is_high).astype(jnp.float32), mask),
      'ratio/mean': _masked_pair(ratio, mask),
  })
  return LossTerms(
      numerator=num,
      denominator=den,
      mean_metrics=mean_metrics,
      min_metrics={'ratio/min': _masked_min(ratio, mask)},
      max_metrics={'ratio/max': _masked_max(ratio, mask)},
  )


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


def dpo_pair_losses(logits: Array, cfg: DPOLossConfig) -> Array:
  """Per-pair DPO loss of logits h = (pi_c - ref_c) - (pi_r - ref_r), TRL semantics: [P] -> [P]."""
  bh = cfg.beta * logits  # [P]
  ls = cfg.label_smoothing
  if cfg.loss_type == 'sigmoid':
    return -(1.0 - ls) * jax.nn.log_sigmoid(bh) - ls * jax.nn.log_sigmoid(-bh)
  if cfg.loss_type == 'ipo':
    return (logits - 1.0 / (2.0 * cfg.beta))**2
  if cfg.loss_type == 'hinge':
    return jax.nn.relu(1.0 - bh)
  if cfg.loss_type == 'robust':
    return ((1.0 - ls) * -jax.nn.log_sigmoid(bh) + ls * jax.nn.log_sigmoid(-bh)) / (1.0 - 2.0 * ls)
  raise ValueError(f'unknown DPO loss_type {cfg.loss_type!r}; choose sigmoid, ipo, hinge or '
                   'robust.')


def dpo_loss(chosen_logps: Array,
             rejected_logps: Array,
             ref_chosen_logps: Array,
             ref_rejected_logps: Array,
             chosen_tokens: Array,
             rejected_tokens: Array,
             cfg: DPOLossConfig) -> LossTerms:
  """DPO loss of one micro-batch of P pairs over summed sequence log-probs.

  Each pair i has weight w_i: 1 for aggregation 'pair', n_i = chosen_tokens_i +
  rejected_tokens_i for 'token' (open-instruct's token weighting, made exact over the window);
  a padding pair (n_i == 0) has weight 0 and contributes nothing. Numerator sum_i w_i * loss_i,
  denominator sum_i w_i.

  Args:
    chosen_logps, rejected_logps: [P] policy log-probs summed over each completion (these are
      differentiated).
    ref_chosen_logps, ref_rejected_logps: [P] the reference policy's summed log-probs.
    chosen_tokens, rejected_tokens: [P] completion token counts.
    cfg: the loss configuration.

  Returns:
    With cfg.rpo_alpha > 0 each pair's loss adds rpo_alpha times the chosen completion's
    per-token NLL (-chosen_logps / chosen_tokens), as TRL's rpo_alpha.

    LossTerms with mean_metrics 'loss', 'rewards/chosen' (beta * (pi_c - ref_c)),
    'rewards/rejected', 'rewards/margins', 'logps/chosen', 'logps/rejected' weighted by w, and
    'rewards/accuracies', the mean over (non-padding) pairs of 1[chosen reward > rejected
    reward], always pair-weighted.
  """
  pc, pr = _f32(chosen_logps), _f32(rejected_logps)
  rc, rr = _f32(ref_chosen_logps), _f32(ref_rejected_logps)
  if pc.ndim != 1:
    raise ValueError(f'chosen_logps must be [P], got shape {pc.shape}.')
  for name, x in (('rejected_logps', pr), ('ref_chosen_logps', rc),
                  ('ref_rejected_logps', rr)):
    _check_shape(name, x, pc.shape)
  n = _f32(chosen_tokens) + _f32(rejected_tokens)  # [P]
  _check_shape('chosen_tokens + rejected_tokens', n, pc.shape)
  valid = n > 0  # [P]
  # Padding pairs may hold arbitrary values: replace them before any arithmetic.
  pc, pr, rc, rr = (jnp.where(valid, x, 0.0) for x in (pc, pr, rc, rr))

  # Policy-minus-reference first: those differences are small and exact in float32, whereas
  # pc - pr (sums over hundreds of tokens) would cancel badly.
  losses = dpo_pair_losses((pc - rc) - (pr - rr), cfg)  # [P]
  chosen_nll = -pc / jnp.maximum(_f32(chosen_tokens), 1.0)  # [P] per-token NLL of the chosen
  if cfg.rpo_alpha:
    losses = losses + cfg.rpo_alpha * chosen_nll  # RPO: keeps the chosen likelihood up
  pair_weight = valid.astype(jnp.float32)  # [P]
  if cfg.aggregation == 'pair':
    weight = pair_weight
  elif cfg.aggregation == 'token':
    weight = jnp.where(valid, n, 0.0)
  else:
    raise ValueError(f'unknown DPO aggregation {cfg.aggregation!r}; choose pair or token.')
  num = jnp.sum(weight * losses)
  den = jnp.sum(weight)

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
          'nll/chosen': weighted(chosen_nll),
      },
      min_metrics={},
      max_metrics={},
  )
