"""Independent float64 references for jaxrl_ga.losses, shared by tests/test_losses.py and
tests/test_loss_peers.py: plain-loop per-token objectives, the window losses of docs/design.md's
table, DPO per-pair losses, and the learner's way of combining micro-batches (sum the numerator
gradients, divide once by the summed denominator) to compare against one pass."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import losses

L_MAX = 9  # max_completion_length of the test batches (= T)


def ref_ratios(logps, old, mask, level):
  """[B, T] importance ratios per valid token (nan elsewhere)."""
  b_size, t_size = logps.shape
  out = np.full((b_size, t_size), np.nan)
  for i in range(b_size):
    valid = [t for t in range(t_size) if mask[i, t] > 0]
    if level == 'sequence' and valid:
      seq = sum(float(logps[i, t]) - float(old[i, t]) for t in valid) / len(valid)
    for t in valid:
      lr = seq if level == 'sequence' else float(logps[i, t]) - float(old[i, t])
      out[i, t] = math.exp(lr)
  return out


def ref_vespo_phi(logps, old, mask, adv, cfg, sampler_ratio=None):
  """[B] VESPO's Gamma weight of each sequence (VESPO paper, arXiv 2602.10693, with TRL 1.16's
  clipping, GRPOTrainer.get_gamma_weights): phi(w) = exp(lambda + k log w - lambda w), w the
  product of the token ratios, k and lambda those of the advantage's sign (A >= 0: _pos).
  ``sampler_ratio`` [B, T]: the sampler-side token IS ratios, whose logs (clipped to
  [log 1e-8, 20], a 0 counting as 1e-8) TRL adds to log w."""
  out = np.zeros(logps.shape[0])
  for i in range(logps.shape[0]):
    s = sum(min(max(float(logps[i, t]) - float(old[i, t]), -20.0), 20.0)
            for t in range(logps.shape[1]) if mask[i, t] > 0)
    if sampler_ratio is not None:
      s += sum(min(max(math.log(max(float(sampler_ratio[i, t]), 1e-300)), math.log(1e-8)), 20.0)
               for t in range(logps.shape[1]) if mask[i, t] > 0)
    log_w = min(max(s, math.log(1e-8)), 20.0)
    pos = float(adv[i]) >= 0
    k = cfg.vespo_k_pos if pos else cfg.vespo_k_neg
    lam = max(cfg.vespo_lambda_pos if pos else cfg.vespo_lambda_neg, 1e-4)
    out[i] = math.exp(lam + k * log_w - lam * math.exp(log_w))
  return out


def ref_entropy_keep(ent, mask, rho):
  """[B, T] 1 where a valid token's entropy is at or above the (1 - rho) quantile of the valid
  tokens' entropies (numpy's linear quantile; 'Beyond the 80/20 rule', arXiv 2506.01939)."""
  e = np.asarray(ent, np.float64)
  threshold = np.quantile(e[mask > 0], 1.0 - rho)
  return ((mask > 0) & (np.where(mask > 0, e, -np.inf) >= threshold)).astype(np.float64)


def ref_per_token(logps, old, adv, mask, cfg, ref=None, ent=None, frozen=None, keep=None,
                  weights=None, vespo_sampler_ratio=None):
  """[B, T] per-token GRPO loss (0 at masked positions), cfg.objective written out per paper:
  clip (PPO/GRPO), cispo (MiniMax-M1, arXiv 2506.13585), sapo (arXiv 2511.20347), vespo
  (arXiv 2602.10693). ``frozen``: the log-probs of the stop-gradient factors (CISPO's capped
  ratio, VESPO's phi), held fixed when finite differences move ``logps``; default ``logps``.
  ``keep``: top_entropy_quantile's token selection (ref_entropy_keep), on the policy term and
  the entropy bonus, not the KL. ``weights`` [B, T] multiply the policy term only (the
  sampler-side weights of ref_sampler_weights); ``vespo_sampler_ratio``: the sampler-side
  token ratios VESPO folds into its w (ref_vespo_phi)."""
  frozen = logps if frozen is None else frozen
  ratios = ref_ratios(logps, old, mask, cfg.importance_level)
  frozen_ratios = ref_ratios(frozen, old, mask, cfg.importance_level)
  objective = getattr(cfg, 'objective', 'clip')
  if objective == 'vespo':
    phi = ref_vespo_phi(frozen, old, mask, adv, cfg, vespo_sampler_ratio)
  out = np.zeros(logps.shape)
  for i in range(logps.shape[0]):
    a = float(adv[i])
    for t in range(logps.shape[1]):
      if mask[i, t] == 0:
        continue
      r = ratios[i, t]
      lp = float(logps[i, t])
      if objective == 'clip':
        r_clip = min(max(r, 1 - cfg.epsilon_low), 1 + cfg.epsilon_high)
        r_cap = r if cfg.delta is None else min(r, cfg.delta)
        value = -min(r_cap * a, r_clip * a)
      elif objective == 'cispo':
        value = -min(frozen_ratios[i, t], cfg.epsilon_high) * a * lp
      elif objective == 'sapo':
        tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
        value = -4 / tau / (1 + math.exp(-tau * (r - 1))) * a
      else:
        value = -phi[i] * a * lp
      k = 1.0 if keep is None else float(keep[i, t])
      value *= k
      if weights is not None:
        value *= float(weights[i, t])
      if cfg.beta > 0:
        d = float(ref[i, t]) - lp
        value += cfg.beta * (math.exp(d) - d - 1) * (
            r if getattr(cfg, 'use_bias_correction_kl', False) else 1.0)
      if cfg.entropy_coef > 0:
        value -= cfg.entropy_coef * float(ent[i, t]) * k
      out[i, t] = value
  return out


def ref_sampler_weights(logps, old, sampler, adv, mask, cfg):
  """[B, T] weights of the policy term, TRL 1.16's vLLM importance sampling and off-policy
  sequence mask written out (GRPOTrainer._generate_and_score_completions, _compute_loss).
  -> (weights, {metric: value}) with the metrics over this whole batch."""
  b_size, t_size = logps.shape
  w = np.ones((b_size, t_size))
  metrics = {}
  cells = lambda i: [t for t in range(t_size) if mask[i, t] > 0]
  if cfg.off_policy_mask_threshold is not None:
    dropped = 0
    for i in range(b_size):
      kl = sum(float(sampler[i, t]) - float(logps[i, t]) for t in cells(i)) / max(len(cells(i)), 1)
      if not (adv[i] >= 0 or kl <= cfg.off_policy_mask_threshold):
        w[i, :] = 0.0
        dropped += 1
    metrics['sampling/off_policy_masked_fraction'] = dropped / b_size
  if cfg.sampler_is_correction:
    lo = -math.inf if cfg.sampler_is_clip_min is None else cfg.sampler_is_clip_min
    hi = math.inf if cfg.sampler_is_clip_max is None else cfg.sampler_is_clip_max
    sequence = cfg.sampler_is_mode.startswith('sequence')
    truncate = cfg.sampler_is_mode.endswith('truncate')
    values, masked, diffs = [], 0, []
    for i in range(b_size):
      d = {t: float(old[i, t]) - float(sampler[i, t]) for t in cells(i)}
      diffs += [abs(v) for v in d.values()]
      units = [sum(d.values())] if sequence else [d[t] for t in cells(i)]
      rs = []
      for lr in units:
        r = math.exp(lr)
        if truncate:
          r = min(max(r, lo), hi)
        elif r < lo or r > hi:
          r, masked = 0.0, masked + 1
        rs.append(r)
      values += rs
      for t in range(t_size):
        w[i, t] *= rs[0] if sequence else (rs[cells(i).index(t)] if t in cells(i) else 1.0)
    name = 'sampling/importance_sampling_ratio/'
    metrics.update({name + 'min': min(values), name + 'mean': sum(values) / len(values),
                    name + 'max': max(values),
                    'sampling/sampling_logp_difference/mean': sum(diffs) / len(diffs),
                    'sampling/sampling_logp_difference/max': max(diffs)})
    if not truncate:
      metrics['sampling/importance_sampling_masked_fraction'] = masked / len(values)
  return w, metrics


def ref_window_loss(per_token, mask, aggregation, bounds=None):
  """The design doc's one-pass window loss; bounds (micro-batch row ranges) only for
  microbatch_token."""
  rows = range(per_token.shape[0])
  cells = lambda i: [t for t in range(per_token.shape[1]) if mask[i, t] > 0]
  total = sum(per_token[i, t] for i in rows for t in cells(i))
  tokens = sum(len(cells(i)) for i in rows)
  seqs = [i for i in rows if cells(i)]
  n_rows = per_token.shape[0]  # TRL's grpo and dr_grpo count a row without tokens too
  if aggregation == 'token':
    return total / tokens
  if aggregation == 'sequence':
    return sum(sum(per_token[i, t] for t in cells(i)) / len(cells(i)) for i in seqs) / n_rows
  if aggregation == 'constant':
    return total / (n_rows * L_MAX)
  if aggregation == 'sequence_sum':  # TRL's luspo: (ptl * mask).sum(-1).mean()
    return total / n_rows
  assert aggregation == 'microbatch_token'
  means = []
  for lo, hi in bounds:
    n = sum(len(cells(i)) for i in range(lo, hi))
    s = sum(per_token[i, t] for i in range(lo, hi) for t in cells(i))
    means.append(s / n if n else 0.0)
  return sum(means) / len(means)


def fd_grad(f, x, h=1e-6):
  """Central finite differences of scalar f at x, in float64."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (f(xp) - f(xm)) / (2 * h)
  return g


def make_grpo_batch(seed=0, lengths=(0, 9, 3, 1, 7, 5, 9, 2), t_size=L_MAX):
  """A batch with variable lengths (one empty row) and nan garbage at masked positions."""
  rng = np.random.default_rng(seed)
  b_size = len(lengths)
  mask = np.zeros((b_size, t_size), np.float32)
  for i, n in enumerate(lengths):
    mask[i, :n] = 1
  logps = -rng.uniform(0.05, 3.0, (b_size, t_size)).astype(np.float32)
  log_ratio = rng.uniform(-0.6, 0.6, (b_size, 1)) + rng.normal(0, 0.2, (b_size, t_size))
  old = (logps - log_ratio).astype(np.float32)
  adv = rng.normal(size=b_size).astype(np.float32)
  ref = (logps + rng.normal(0, 0.3, (b_size, t_size))).astype(np.float32)
  ent = rng.uniform(0, 2, (b_size, t_size)).astype(np.float32)
  for x in (old, ref, ent):
    x[mask == 0] = np.nan
  return dict(logps=logps, old=old, adv=adv, mask=mask, ref=ref, ent=ent)


def assert_away_from_kinks(batch, cfg, margin=1e-4):
  """Finite differences need every ratio away from the clip boundaries and delta."""
  r = ref_ratios(batch['logps'], batch['old'], batch['mask'], cfg.importance_level)
  kinks = [1 - cfg.epsilon_low, 1 + cfg.epsilon_high] + ([cfg.delta] if cfg.delta else [])
  for k in kinks:
    assert np.nanmin(np.abs(r - k)) > margin


CFG_FULL = dict(epsilon_low=0.2, epsilon_high=0.28, delta=1.5, beta=0.04, entropy_coef=0.01)


def grpo_terms(batch, cfg, lo=0, hi=None, logps=None):
  """grpo_loss on rows [lo, hi) of batch, optionally with other logps (full batch)."""
  logps = batch['logps'] if logps is None else logps
  sl = slice(lo, hi)
  return losses.grpo_loss(
      logps[sl], batch['old'][sl], batch['adv'][sl], batch['mask'][sl], cfg, L_MAX,
      ref_logps=batch['ref'][sl], entropy=batch['ent'][sl])


def bounds_of(split):
  edges = np.concatenate([[0], np.cumsum(split)])
  return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def accumulated(terms_fn, x, split):
  """(window loss, window metrics, gradient) the learner's way: sum numerator grads, divide."""
  terms, grad = [], jnp.zeros_like(x)
  for lo, hi in bounds_of(split):
    grad = grad + jax.grad(lambda y: terms_fn(y, lo, hi).numerator)(x)
    terms.append(terms_fn(x, lo, hi))
  loss, metrics = losses.window_value(terms)
  den = sum(t.denominator for t in terms)
  return loss, metrics, grad / den


def one_pass(terms_fn, x, n):
  """(loss, gradient) of num/den over the whole batch in one call."""
  f = lambda y: (lambda t: t.numerator / t.denominator)(terms_fn(y, 0, n))
  return jax.value_and_grad(f)(x)


def log_sigmoid(x):
  return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_dpo_pair(pc, pr, rc, rr, cfg, nc=1.0, nr=1.0):
  h = (pc - pr) - (rc - rr)
  bh, ls = cfg.beta * h, cfg.label_smoothing
  if cfg.loss_type == 'sigmoid':
    return -(1 - ls) * log_sigmoid(bh) - ls * log_sigmoid(-bh)
  if cfg.loss_type == 'ipo':  # TRL 1.16: each log-ratio divided by its completion length
    return ((pc - rc) / max(nc, 1.0) - (pr - rr) / max(nr, 1.0) - 1 / (2 * cfg.beta))**2
  if cfg.loss_type == 'hinge':
    return max(0.0, 1 - bh)
  return (-(1 - ls) * log_sigmoid(bh) + ls * log_sigmoid(-bh)) / (1 - 2 * ls)


def ref_dpo_window(d, cfg, pc=None, pr=None):
  """One-pass window loss and metrics (weighted per cfg.aggregation) over all pairs."""
  pc = d['pc'] if pc is None else pc
  pr = d['pr'] if pr is None else pr
  sums, weight, pairs, correct, nll, chosen_tokens = {}, 0.0, 0, 0, 0.0, 0.0
  for i in range(len(pc)):
    n = float(d['nc'][i] + d['nr'][i])
    if n == 0:
      continue
    w = 1.0 if cfg.aggregation == 'pair' else n
    chosen = cfg.beta * (pc[i] - d['rc'][i])
    rejected = cfg.beta * (pr[i] - d['rr'][i])
    values = {
        'loss': ref_dpo_pair(pc[i], pr[i], d['rc'][i], d['rr'][i], cfg, float(d['nc'][i]),
                             float(d['nr'][i])),
        'rewards/chosen': chosen, 'rewards/rejected': rejected,
        'rewards/margins': chosen - rejected, 'logps/chosen': pc[i], 'logps/rejected': pr[i],
    }
    nll -= float(pc[i])
    chosen_tokens += float(d['nc'][i])
    for k, v in values.items():
      sums[k] = sums.get(k, 0.0) + w * float(v)
    weight += w
    pairs += 1
    correct += int(chosen > rejected)
  metrics = {k: v / weight for k, v in sums.items()}
  metrics['rewards/accuracies'] = correct / pairs
  metrics['nll/chosen'] = nll / chosen_tokens  # token mean, whatever the aggregation
  return metrics


def make_dpo_batch(seed=7, p=8):
  rng = np.random.default_rng(seed)
  nc = rng.integers(1, 40, p).astype(np.float32)
  nr = rng.integers(1, 40, p).astype(np.float32)
  nc[3] = nr[3] = 0  # a padding pair, with garbage values
  d = dict(nc=nc, nr=nr)
  for k, scale in (('pc', nc), ('pr', nr)):
    d[k] = (-scale * rng.uniform(0.5, 2.0, p)).astype(np.float32)
    d['r' + k[1]] = (d[k] + rng.normal(0, 3.0, p)).astype(np.float32)
  for k in ('pc', 'pr', 'rc', 'rr'):
    d[k][3] = np.nan
  return d


def dpo_terms(d, cfg, lo=0, hi=None, pc=None, pr=None):
  sl = slice(lo, hi)
  pc = d['pc'] if pc is None else pc
  pr = d['pr'] if pr is None else pr
  return losses.dpo_loss(pc[sl], pr[sl], d['rc'][sl], d['rr'][sl], d['nc'][sl], d['nr'][sl],
                         cfg)

