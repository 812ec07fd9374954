"""Loss names mean what the peers mean (issue 19).

Each reference below is the peer's formula as its code writes it, in float64 numpy, never our
code: TRL 1.16 (trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, the loss_type branches;
trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss, the loss_type loop) and open-instruct at
PR #1447 (open_instruct/olmo_core_train_modules.py, DPOTrainModule.train_batch: each
micro-batch's `losses.mean()` times micro_tokens / total_tokens, tokens from the attention
masks). "Over a window" means the peer's per-batch formula applied to the whole optimizer-step
window, with its normalizers summed over the window; our K-micro-batch accumulation must give
that value and gradient. Crafted windows exercise the differences: an empty GRPO row, chosen
completions of different lengths, long and short pairs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import losses
from jaxrl_ga.config import DPOLossConfig, GRPOLossConfig

from learner_refs import TC, run_learner, synthetic_dpo_batch, synthetic_rollout, token_logps
from loss_refs import (CFG_FULL, L_MAX, accumulated, bounds_of, fd_grad, grpo_terms,
                       log_sigmoid, make_grpo_batch, one_pass, ref_per_token)

RTOL = 1e-5


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------
# GRPO: TRL 1.16's loss_type branches, per_token_loss [B, T] and mask [B, T] of one batch
# ---------------------------------------------------------------------------------------------


def trl_grpo(per_token_loss, mask, loss_type, max_completion_length=L_MAX):
  """TRL's formula for one batch (here: the whole window), float64."""
  ptl, m = np.asarray(per_token_loss, np.float64), np.asarray(mask, np.float64)
  if loss_type == 'grpo':  # ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return np.mean((ptl * m).sum(-1) / np.maximum(m.sum(-1), 1.0))
  if loss_type == 'dr_grpo':  # (ptl * mask).sum() / (ptl.size(0) * max_completion_length)
    return (ptl * m).sum() / (ptl.shape[0] * max_completion_length)
  if loss_type == 'dapo':  # (ptl * mask).sum() / num_items_in_batch, at K = S: window tokens
    return (ptl * m).sum() / max(m.sum(), 1.0)
  raise ValueError(loss_type)


def trl_bnpo(per_token_loss, mask, bounds):
  """TRL's bnpo over K micro-batches: each (ptl * mask).sum() / mask.sum().clamp(min=1), / K."""
  ptl, m = np.asarray(per_token_loss, np.float64), np.asarray(mask, np.float64)
  return sum((ptl[lo:hi] * m[lo:hi]).sum() / max(m[lo:hi].sum(), 1.0)
             for lo, hi in bounds) / len(bounds)


@pytest.mark.parametrize('ours,trl', [('sequence', 'grpo'), ('constant', 'dr_grpo'),
                                      ('token', 'dapo'), ('microbatch_token', 'bnpo')])
def test_grpo_names_equal_trl_with_an_empty_row(ours, trl):
  """One row of eight has no completion token (mask_truncated_completions): TRL's grpo and
  dr_grpo count it; so do ours. Loss and gradient (w.r.t. the log-probs) over K = 1, 2, 4."""
  b = make_grpo_batch(seed=5, lengths=(9, 0, 3, 1, 7, 5, 9, 2))
  cfg = GRPOLossConfig(aggregation=ours, **CFG_FULL)
  ref = lambda lp: ref_per_token(lp, b['old'], b['adv'], b['mask'], cfg, b['ref'], b['ent'])
  terms_fn = lambda lp, lo, hi: grpo_terms(b, cfg, lo, hi, logps=lp)
  for split in ((8,), (4, 4), (2, 2, 2, 2)):
    if trl == 'bnpo':
      peer = lambda lp: trl_bnpo(ref(lp), b['mask'], bounds_of(split))
    else:
      peer = lambda lp: trl_grpo(ref(lp), b['mask'], trl)
    loss, _, grad = accumulated(terms_fn, b['logps'], split)
    np.testing.assert_allclose(loss, peer(b['logps']), rtol=RTOL)
    want = fd_grad(peer, b['logps'])
    assert rel(grad, want) < RTOL, (split, rel(grad, want))
  if trl in ('grpo', 'dr_grpo'):
    # The empty row's weight in the mean: dropping it (the old definition) scales by 8/7.
    per_token = ref(b['logps'])
    nonempty = b['mask'].sum(-1) > 0
    old_def = (trl_grpo(per_token[nonempty], b['mask'][nonempty], trl))
    np.testing.assert_allclose(peer(b['logps']) / old_def, 7 / 8, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# DPO: TRL 1.16's loss_type loop and open-instruct's micro-batch weighting
# ---------------------------------------------------------------------------------------------

T_DPO = 12


def make_dpo_window(seed=11, p=8, t=T_DPO, long_short=True):
  """Per-token policy log-probs [P, T] of chosen and rejected completions of different lengths
  (1 .. t; long and short pairs), summed reference log-probs, prompt lengths."""
  rng = np.random.default_rng(seed)
  if long_short:  # half the pairs long, half short: the weightings differ
    nc = np.where(np.arange(p) % 2 == 0, rng.integers(9, t + 1, p), rng.integers(1, 4, p))
  else:
    nc = rng.integers(1, t + 1, p)
  nr = rng.integers(1, t + 1, p)
  mc = (np.arange(t)[None] < nc[:, None]).astype(np.float64)
  mr = (np.arange(t)[None] < nr[:, None]).astype(np.float64)
  lpc = -rng.uniform(0.05, 2.0, (p, t))
  lpr = -rng.uniform(0.05, 2.0, (p, t))
  rc = (lpc * mc).sum(-1) + rng.normal(0, 0.5 * np.sqrt(nc))
  rr = (lpr * mr).sum(-1) + rng.normal(0, 0.5 * np.sqrt(nr))
  prompt = rng.integers(2, 7, p)
  return dict(lp=np.stack([lpc, lpr]), mc=mc, mr=mr, rc=rc, rr=rr, nc=nc.astype(np.float64),
              nr=nr.astype(np.float64), prompt=prompt.astype(np.float64))


def trl_dpo(d, lp, cfg):
  """TRL 1.16 DPOTrainer._compute_loss on one batch (the window): loss_type, then 'sft' with
  loss_weights [1, rpo_alpha]. lp: [2, P, T] per-token policy log-probs (chosen, rejected)."""
  lpc, lpr = np.asarray(lp[0], np.float64), np.asarray(lp[1], np.float64)
  chosen_logps = (lpc * d['mc']).sum(1)  # per_token_logps.sum(dim=1), masked
  rejected_logps = (lpr * d['mr']).sum(1)
  chosen_scores = chosen_logps - d['rc']  # reverse_kl: the log-ratios
  rejected_scores = rejected_logps - d['rr']
  delta = chosen_scores - rejected_scores
  beta, ls = cfg.beta, cfg.label_smoothing
  lsig = np.vectorize(log_sigmoid)
  if cfg.loss_type == 'sigmoid':
    per_seq = -lsig(beta * delta)
  elif cfg.loss_type == 'hinge':
    per_seq = np.maximum(0.0, 1 - beta * delta)
  elif cfg.loss_type == 'ipo':
    avg = (chosen_scores / np.maximum(d['mc'].sum(1), 1.0) -
           rejected_scores / np.maximum(d['mr'].sum(1), 1.0))
    per_seq = (avg - 1 / (2 * beta))**2
  elif cfg.loss_type == 'robust':
    clean = -(1 - ls) * lsig(beta * delta)
    flipped = -ls * lsig(-beta * delta)
    per_seq = (clean - flipped) / (1 - 2 * ls)
  loss = per_seq.mean()
  if cfg.rpo_alpha:  # 'sft': -chosen_per_token_logps[chosen_mask.bool()].mean()
    loss += cfg.rpo_alpha * -lpc[d['mc'] > 0].mean()
  return loss


def open_instruct_dpo(d, lp, cfg, bounds):
  """open-instruct at PR #1447, one rank: sum_k losses_k.mean() * micro_tokens_k / total_tokens,
  tokens = chosen_attention_mask.sum() + rejected_attention_mask.sum() (prompt included)."""
  per_pair = [trl_dpo(_rows(d, i, i + 1), lp[:, i:i + 1], cfg) for i in range(len(d['nc']))]
  tokens = d['prompt'] * 2 + d['nc'] + d['nr']  # attention mask of chosen + rejected
  total = tokens.sum()
  return sum(np.mean(per_pair[lo:hi]) * tokens[lo:hi].sum() / total for lo, hi in bounds)


def ours_token_weighting(d, lp, cfg):
  """Our split-invariant 'token': each pair weighted by its chosen + rejected completion tokens."""
  per_pair = np.array([trl_dpo(_rows(d, i, i + 1), lp[:, i:i + 1], cfg)
                       for i in range(len(d['nc']))])
  w = d['nc'] + d['nr']
  return float((w * per_pair).sum() / w.sum())


def _rows(d, lo, hi):
  return {k: (v[:, lo:hi] if k == 'lp' else v[lo:hi]) for k, v in d.items()}


def dpo_terms_fn(d, cfg, rpo_window=True):
  """terms_fn(lp, lo, hi) for accumulated(): our dpo_loss on pairs [lo, hi), with the window's
  rpo_scale (dpo_window_normalizers over all pairs) unless rpo_window is False."""
  lengths = d['prompt'] + np.stack([d['nc'], d['nr']])  # attention-mask tokens per side
  den, chosen = losses.dpo_window_normalizers(d['nc'], d['nr'], lengths[0], lengths[1], cfg)
  scale = den / chosen if rpo_window else None

  def terms_fn(lp, lo, hi):
    sl = slice(lo, hi)
    pc = jnp.sum(lp[0, sl] * d['mc'][sl], axis=1)
    pr = jnp.sum(lp[1, sl] * d['mr'][sl], axis=1)
    f32 = lambda x: np.asarray(x[sl], np.float32)
    return losses.dpo_loss(pc, pr, f32(d['rc']), f32(d['rr']), f32(d['nc']), f32(d['nr']), cfg,
                           chosen_lengths=f32(lengths[0]), rejected_lengths=f32(lengths[1]),
                           rpo_scale=scale)

  return terms_fn


DPO_CASES = [
    dict(loss_type='sigmoid'), dict(loss_type='hinge', beta=0.05), dict(loss_type='ipo'),
    dict(loss_type='robust', label_smoothing=0.1), dict(loss_type='sigmoid', rpo_alpha=1.0),
    dict(loss_type='ipo', rpo_alpha=0.5),
]


@pytest.mark.parametrize('kwargs', DPO_CASES, ids=lambda k: '-'.join(map(str, k.values())))
def test_dpo_names_equal_trl_over_the_window(kwargs):
  """TRL 1.16's sigmoid, hinge, ipo (length-normalized), robust and the 'sft' term (the token
  mean of the chosen NLL) on a window of long and short pairs, at K = 1, 2, 4."""
  cfg = DPOLossConfig(**{'beta': 0.1, 'aggregation': 'pair', **kwargs})
  d = make_dpo_window()
  x = np.asarray(d['lp'], np.float32)
  peer = lambda lp: trl_dpo(d, lp, cfg)
  want_grad = fd_grad(peer, x)
  for split in ((8,), (4, 4), (2, 2, 2, 2)):
    loss, _, grad = accumulated(dpo_terms_fn(d, cfg), x, split)
    np.testing.assert_allclose(loss, peer(x), rtol=RTOL)
    assert rel(grad, want_grad) < RTOL, (split, rel(grad, want_grad))


def test_rpo_nll_is_the_window_token_mean():
  """Chosen completions of different lengths: TRL's 'sft' term (token mean) differs from the
  pair mean of per-token NLLs (the old rpo_alpha) by more than 10%; over K micro-batches without
  the window's rpo_scale each micro-batch takes its own token mean (what TRL's accumulation
  does), which also differs; with it, the window's token mean."""
  cfg = DPOLossConfig(beta=0.1, rpo_alpha=1.0)
  d = make_dpo_window(seed=12)
  d['lp'][0, 1::2] *= 3  # the short chosen completions are the unlikely ones
  x = np.asarray(d['lp'], np.float32)
  token_mean = -(x[0] * d['mc']).sum() / d['mc'].sum()
  pair_mean = np.mean(-(x[0] * d['mc']).sum(1) / d['mc'].sum(1))
  assert abs(token_mean - pair_mean) > 0.1 * abs(token_mean)
  no_rpo = dataclass_replace(cfg, rpo_alpha=0.0)
  dpo_only = trl_dpo(d, x, no_rpo)
  split = (1, 7)  # a long pair alone, then the rest
  with_scale, metrics, _ = accumulated(dpo_terms_fn(d, cfg), x, split)
  np.testing.assert_allclose(with_scale - dpo_only, token_mean, rtol=RTOL)
  np.testing.assert_allclose(metrics['nll/chosen'], token_mean, rtol=RTOL)
  per_micro, _, _ = accumulated(dpo_terms_fn(d, cfg, rpo_window=False), x, split)
  trl_accumulated = sum(
      (hi - lo) / 8 * -(x[0, lo:hi] * d['mc'][lo:hi]).sum() / d['mc'][lo:hi].sum()
      for lo, hi in bounds_of(split))  # pair-weighted mean of per-micro-batch token means
  np.testing.assert_allclose(per_micro - dpo_only, trl_accumulated, rtol=RTOL)
  assert abs(trl_accumulated - token_mean) > 1e-2 * abs(token_mean)


def dataclass_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


def test_microbatch_token_equals_open_instruct():
  """open-instruct's weighting, written as its train_batch does, at K = 1, 2, 4, 8: loss and
  gradient."""
  cfg = DPOLossConfig(beta=0.1, aggregation='microbatch_token')
  d = make_dpo_window(seed=13)
  x = np.asarray(d['lp'], np.float32)
  for split in ((8,), (4, 4), (2, 2, 2, 2), (1,) * 8):
    peer = lambda lp: open_instruct_dpo(d, lp, cfg, bounds_of(split))
    loss, _, grad = accumulated(dpo_terms_fn(d, cfg), x, split)
    np.testing.assert_allclose(loss, peer(x), rtol=RTOL)
    want = fd_grad(peer, x)
    assert rel(grad, want) < RTOL, (split, rel(grad, want))


def split_dependence(p=64, spreads=(0, 4, 11), ks=(1, 2, 4, 8), seed=21):
  """Relative gradient differences (w.r.t. the per-token log-probs) for the notes and the
  notebook. Per length spread (prompt, chosen and rejected lengths each drawn from a range of
  spread + 1 tokens) and K: -> (open-instruct's weighting at K vs itself in one pass (K = 1),
  open-instruct's at K vs our split-invariant 'token' weighting in one pass, our 'token' at K vs
  its one pass)."""
  out = {}
  for spread in spreads:
    rng = np.random.default_rng(seed + spread)
    t = 1 + spread
    nc, nr = 1 + rng.integers(0, spread + 1, p), 1 + rng.integers(0, spread + 1, p)
    d = dict(lp=-rng.uniform(0.05, 2.0, (2, p, t)),
             mc=(np.arange(t)[None] < nc[:, None]).astype(np.float64),
             mr=(np.arange(t)[None] < nr[:, None]).astype(np.float64),
             nc=nc.astype(np.float64), nr=nr.astype(np.float64),
             prompt=(3 + rng.integers(0, spread + 1, p)).astype(np.float64))
    d['rc'] = (d['lp'][0] * d['mc']).sum(-1) + rng.normal(0, 0.5 * np.sqrt(nc))
    d['rr'] = (d['lp'][1] * d['mr']).sum(-1) + rng.normal(0, 0.5 * np.sqrt(nr))
    # Every spread padded to one width (masked: the same sums, zero gradients there), so that
    # the eager gradients below compile their ops for one shape per K, not one per spread and K.
    pad = max(spreads) - spread
    d['mc'], d['mr'] = (np.pad(d[key], ((0, 0), (0, pad))) for key in ('mc', 'mr'))
    d['lp'] = np.pad(d['lp'], ((0, 0), (0, 0), (0, pad)))
    x = np.asarray(d['lp'], np.float32)
    oi = DPOLossConfig(beta=0.1, aggregation='microbatch_token')
    tok = DPOLossConfig(beta=0.1, aggregation='token')
    _, g_oi_1 = one_pass(dpo_terms_fn(d, oi), x, p)
    _, g_tok_1 = one_pass(dpo_terms_fn(d, tok), x, p)
    for k in ks:
      split = (p // k,) * k
      _, _, g_oi = accumulated(dpo_terms_fn(d, oi), x, split)
      _, _, g_tok = accumulated(dpo_terms_fn(d, tok), x, split)
      out[spread, k] = (rel(g_oi, g_oi_1), rel(g_oi, g_tok_1), rel(g_tok, g_tok_1))
  return out


def test_open_instruct_weighting_depends_on_the_split_ours_does_not():
  """Equal lengths (spread 0): open-instruct's weighting is split-invariant too. With a spread,
  its gradient moves away from its one-pass value as K grows; ours stays at rounding."""
  table = split_dependence()
  for (spread, k), (oi_vs_one_pass, _, ours) in sorted(table.items()):
    print(f'spread {spread:2d} K {k}: open-instruct vs its K=1 {oi_vs_one_pass:.3e}, '
          f'vs split-invariant token {table[spread, k][1]:.3e}; ours {ours:.2e}')
    assert ours < 1e-6
    if spread == 0 or k == 1:
      assert oi_vs_one_pass < 1e-5
  for spread in (4, 11):
    errs = [table[spread, k][0] for k in (2, 4, 8)]
    assert errs[0] > 1e-3 and errs[0] < errs[1] < errs[2], errs
  assert table[11, 8][0] > table[4, 8][0]


# ---------------------------------------------------------------------------------------------
# Through the learner: the accumulated K-step gradient is the one-pass gradient
# ---------------------------------------------------------------------------------------------


def _ref_grpo_on_policy(cfg):
  """TRL's grpo / dr_grpo over the concatenated window, on-policy (ratio 1): written out."""
  def ref(graphdef, params, b):
    from jaxrl_ga.models import transformer as tfm
    model = tfm.merge(graphdef, params)
    tokens = jnp.concatenate([b['prompt_tokens'], b['completion_tokens']], 1)
    mask = jnp.concatenate([b['prompt_mask'], b['completion_mask']], 1)
    tp = b['prompt_tokens'].shape[1]
    logits = model(tokens, mask)[:, tp - 1:-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), b['completion_tokens'][..., None],
                               -1)[..., 0]
    per_tok = -jnp.exp(logp - jax.lax.stop_gradient(logp)) * b['advantages'][:, None]
    m = b['completion_mask'].astype(jnp.float32)
    if cfg.aggregation == 'sequence':
      return jnp.mean(jnp.sum(m * per_tok, 1) / jnp.maximum(jnp.sum(m, 1), 1.0))
    return jnp.sum(m * per_tok) / (m.shape[0] * TC)
  return ref


@pytest.mark.slow
@pytest.mark.parametrize('aggregation', ['sequence', 'constant'])
def test_learner_grpo_with_empty_rows_is_exact(aggregation):
  cfg = GRPOLossConfig(aggregation=aggregation)

  def make(rng, s):
    b = synthetic_rollout(rng, 4)
    b['completion_mask'][s % 4] = 0  # an empty row in every micro-batch
    b['completion_tokens'] *= b['completion_mask']
    b['old_logps'] = np.zeros((4, TC), np.float32)
    b['has_old'] = np.zeros(4, bool)
    return b

  errs, outs, _, _ = run_learner(learner_lib.grpo_task_loss(cfg, TC), _ref_grpo_on_policy(cfg), make, 3)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5, atol=1e-7)


def _ref_dpo_peer(cfg):
  """One pass over the window: TRL's per-pair loss (ipo length-normalized) and 'sft' term, or
  open-instruct's micro-batch weighting (micro-batches of 4 pairs), written out."""
  def ref(graphdef, params, b):
    both = lambda key: jnp.concatenate([b[f'chosen_{key}'], b[f'rejected_{key}']])
    m = both('loss_mask')[:, 1:].astype(jnp.float32)  # [2P, T-1], chosen rows first
    summed = jnp.sum(m * token_logps(graphdef, params, both('tokens'), both('attention_mask')), 1)
    (c, r), (nc, nr) = jnp.split(summed, 2), jnp.split(jnp.sum(m, 1), 2)
    cs, rs = c - b['ref_chosen_logps'], r - b['ref_rejected_logps']
    if cfg.loss_type == 'ipo':
      per_pair = (cs / jnp.maximum(nc, 1) - rs / jnp.maximum(nr, 1) - 1 / (2 * cfg.beta))**2
    else:
      per_pair = -jax.nn.log_sigmoid(cfg.beta * (cs - rs))
    if cfg.aggregation == 'microbatch_token':
      tokens = jnp.sum(b['chosen_attention_mask'] + b['rejected_attention_mask'], 1)
      tokens_k = tokens.reshape(-1, 4).sum(1)
      loss = jnp.sum(per_pair.reshape(-1, 4).mean(1) * tokens_k) / jnp.sum(tokens_k)
    else:
      loss = jnp.mean(per_pair)
    if cfg.rpo_alpha:
      loss += cfg.rpo_alpha * -jnp.sum(c) / jnp.sum(nc)
    return loss
  return ref


@pytest.mark.slow
def test_learner_dpo_peer_losses_are_exact():
  # The three changed DPO definitions in one learner run: IPO length-normalized, RPO's window
  # token mean, open-instruct's micro-batch weighting (its value depends on the micro-batches,
  # 4 pairs each, which the reference splits the same way).
  cfg = DPOLossConfig(loss_type='ipo', rpo_alpha=1.0, aggregation='microbatch_token')
  k = 3
  windows = {}

  def make(rng, s):
    if s % k == 0:  # the host builds the whole window first (as trainers/dpo.py does)
      mbs = [synthetic_dpo_batch(rng, 4) for _ in range(k)]
      count = lambda key: np.concatenate([mb[key] for mb in mbs]).sum(-1)
      den, chosen = losses.dpo_window_normalizers(
          count('chosen_loss_mask'), count('rejected_loss_mask'),
          count('chosen_attention_mask'), count('rejected_attention_mask'), cfg)
      for mb in mbs:
        mb['rpo_scale'] = np.full(4, den / chosen, np.float32)
      windows[s // k] = mbs
    return windows[s // k][s % k]

  errs, outs, _, _ = run_learner(learner_lib.dpo_task_loss(cfg), _ref_dpo_peer(cfg), make, k)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5)
