"""Tests of jaxrl_ga.losses against independent float64 numpy references written as loops.

The references below never call the code under test: per-token GRPO objectives, the window
losses of the design doc's table (docs/design.md, "Loss normalization"), DPO per-pair losses,
and their gradients (central finite differences of the float64 references). The exactness tests
split a batch with variable-length masks into K micro-batches and combine them the way the learner
does: sum the numerator gradients, divide once by the summed denominator.
"""

import dataclasses
import math

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import losses
from jaxrl_ga.config import DPOLossConfig, GRPOLossConfig

from loss_refs import (CFG_FULL, L_MAX, accumulated, assert_away_from_kinks, bounds_of, dpo_terms,
                       fd_grad, grpo_terms, make_dpo_batch, make_grpo_batch, one_pass, ref_dpo_pair,
                       ref_dpo_window, ref_per_token, ref_ratios, ref_window_loss)

AGGREGATIONS = ('token', 'sequence', 'constant')
# K = 2, 3, 4 over B = 8 rows, even and uneven. Few distinct part sizes keep the number of
# eager-mode compilations (the bulk of this file's run time) small.
SPLITS = ((4, 4), (2, 2, 4), (2, 4, 2), (4, 2, 2), (2, 2, 2, 2))

# ---------------------------------------------------------------------------------------------
# Independent references (float64, plain loops)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Test data
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_token_logps_and_entropy(dtype):
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 3, (2, 4, 11)), dtype)
  targets = rng.integers(0, 11, (2, 4))
  lp, ent = losses.token_logps(logits, targets), losses.token_entropy(logits)
  assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32 and lp.shape == (2, 4)
  x = np.asarray(logits.astype(jnp.float32), np.float64)
  for b in range(2):
    for t in range(4):
      z = math.log(sum(math.exp(v) for v in x[b, t]))
      np.testing.assert_allclose(lp[b, t], x[b, t, targets[b, t]] - z, rtol=1e-6, atol=1e-6)
      h = -sum(math.exp(v - z) * (v - z) for v in x[b, t])
      np.testing.assert_allclose(ent[b, t], h, rtol=1e-6, atol=1e-6)
  if dtype == jnp.float32:  # d logp / d logits = onehot - softmax
    grad = jax.grad(lambda lg: losses.token_logps(lg, targets)[1, 2])(logits)
    z = math.log(sum(math.exp(v) for v in x[1, 2]))
    expected = np.zeros(x.shape)
    expected[1, 2] = [float(k == targets[1, 2]) - math.exp(v - z) for k, v in enumerate(x[1, 2])]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# GRPO per-token objective
# ---------------------------------------------------------------------------------------------

OBJECTIVE_CASES = [
    dict(importance_level='token', epsilon_low=0.2, epsilon_high=0.28),
    dict(importance_level='token', **CFG_FULL),
    dict(importance_level='sequence', epsilon_low=0.2, epsilon_high=0.28),
    dict(importance_level='sequence', **CFG_FULL),
]


@pytest.mark.parametrize('kwargs', OBJECTIVE_CASES)
def test_grpo_objective_values_and_gradient(kwargs):
  cfg = GRPOLossConfig(aggregation='token', **kwargs)
  batch = make_grpo_batch()
  assert_away_from_kinks(batch, cfg)
  b = batch
  per_token = ref_per_token(b['logps'], b['old'], b['adv'], b['mask'], cfg, b['ref'], b['ent'])

  # The batch really exercises both clip sides (and the delta cap when set).
  r = ref_ratios(b['logps'], b['old'], b['mask'], cfg.importance_level)
  a = np.broadcast_to(b['adv'][:, None], r.shape)
  with np.errstate(invalid='ignore'):
    assert np.sum((r > 1 + cfg.epsilon_high) & (a > 0)) > 0
    assert np.sum((r < 1 - cfg.epsilon_low) & (a < 0)) > 0
    if cfg.delta:
      assert np.sum((r > cfg.delta) & (a < 0)) > 0

  # Per-sequence sums of the objective: one call per row mask (vmapped).
  row_masks = np.eye(len(b['adv']), dtype=np.float32)[:, :, None] * b['mask']  # [B, B, T]
  per_row = jax.vmap(lambda m: losses.grpo_loss(
      b['logps'], b['old'], b['adv'], m, cfg, L_MAX, b['ref'], b['ent']).numerator)(row_masks)
  np.testing.assert_allclose(per_row, per_token.sum(-1), rtol=1e-6, atol=1e-6)

  if cfg.importance_level == 'token':  # per-token values: one call per one-hot mask
    idx = np.argwhere(b['mask'] > 0)
    onehots = np.zeros((len(idx),) + b['mask'].shape, np.float32)
    onehots[np.arange(len(idx)), idx[:, 0], idx[:, 1]] = 1
    per_tok = jax.vmap(lambda m: losses.grpo_loss(
        b['logps'], b['old'], b['adv'], m, cfg, L_MAX, b['ref'], b['ent']).numerator)(onehots)
    np.testing.assert_allclose(per_tok, per_token[idx[:, 0], idx[:, 1]], rtol=1e-6, atol=1e-6)

  # Gradient of the token-aggregated numerator (sum m*l) w.r.t. logps.
  grad = jax.grad(lambda lp: grpo_terms(b, cfg, logps=lp).numerator)(b['logps'])
  ref_grad = fd_grad(lambda lp: ref_per_token(
      lp, b['old'], b['adv'], b['mask'], cfg, b['ref'], b['ent']).sum(), b['logps'])
  np.testing.assert_allclose(grad, ref_grad, rtol=2e-6, atol=1e-7)
  assert np.all(np.asarray(grad)[b['mask'] == 0] == 0)
  if cfg.entropy_coef:  # the bonus's gradient w.r.t. the entropy input (nan where masked)
    grad_ent = jax.grad(lambda e: losses.grpo_loss(
        b['logps'], b['old'], b['adv'], b['mask'], cfg, L_MAX, b['ref'], e).numerator)(b['ent'])
    np.testing.assert_allclose(grad_ent, -cfg.entropy_coef * b['mask'], rtol=1e-6)


def test_grpo_requires_ref_and_entropy():
  b = make_grpo_batch()
  with pytest.raises(ValueError, match='ref_logps'):
    losses.grpo_loss(b['logps'], b['old'], b['adv'], b['mask'], GRPOLossConfig(beta=0.1), L_MAX)
  with pytest.raises(ValueError, match='entropy'):
    losses.grpo_loss(b['logps'], b['old'], b['adv'], b['mask'],
                     GRPOLossConfig(entropy_coef=0.1), L_MAX)
  with pytest.raises(ValueError, match='advantages'):
    losses.grpo_loss(b['logps'], b['old'], b['adv'][:3], b['mask'], GRPOLossConfig(), L_MAX)


# ---------------------------------------------------------------------------------------------
# Exactness over micro-batch splits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('level', ['token', 'sequence'])
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_grpo_window_exact_over_microbatches(aggregation, level):
  cfg = GRPOLossConfig(aggregation=aggregation, importance_level=level, **CFG_FULL)
  b = make_grpo_batch(seed=2)
  assert_away_from_kinks(b, cfg)
  n = len(b['adv'])
  terms_fn = lambda lp, lo, hi: grpo_terms(b, cfg, lo, hi, logps=lp)

  def ref_loss(lp):
    per_token = ref_per_token(lp, b['old'], b['adv'], b['mask'], cfg, b['ref'], b['ent'])
    return ref_window_loss(per_token, b['mask'], aggregation)

  expected_loss = ref_loss(b['logps'])
  one_loss, one_grad = one_pass(terms_fn, b['logps'], n)
  np.testing.assert_allclose(one_loss, expected_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(one_grad, fd_grad(ref_loss, b['logps']), rtol=2e-6, atol=1e-8)
  for split in SPLITS:
    loss, metrics, grad = accumulated(terms_fn, b['logps'], split)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(metrics['loss'], one_loss, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(grad, one_grad, rtol=1e-6, atol=1e-9)


def test_microbatch_token_depends_on_split():
  cfg_bug = GRPOLossConfig(aggregation='microbatch_token', **CFG_FULL)
  cfg_tok = dataclasses.replace(cfg_bug, aggregation='token')
  b = make_grpo_batch(seed=3, lengths=(9, 9, 8, 7, 1, 1, 0, 3))
  token_fn = lambda lp, lo, hi: grpo_terms(b, cfg_tok, lo, hi, logps=lp)
  bug_fn = lambda lp, lo, hi: grpo_terms(b, cfg_bug, lo, hi, logps=lp)
  per_token = ref_per_token(b['logps'], b['old'], b['adv'], b['mask'], cfg_bug, b['ref'],
                            b['ent'])
  token_loss, token_grad = one_pass(token_fn, b['logps'], 8)

  # Unequal token counts (33 | 5): the per-micro-batch normalization is biased.
  split = (4, 4)
  loss, _, grad = accumulated(bug_fn, b['logps'], split)
  np.testing.assert_allclose(
      loss, ref_window_loss(per_token, b['mask'], 'microbatch_token', bounds_of(split)),
      rtol=1e-6, atol=1e-7)
  assert abs(loss - token_loss) > 1e-2 * abs(token_loss)
  assert np.max(np.abs(grad - token_grad)) > 1e-2 * np.max(np.abs(token_grad))

  # Equal token counts (23 | 23): the per-micro-batch mean equals the window mean.
  b_eq = make_grpo_batch(seed=3, lengths=(9, 1, 5, 8, 2, 6, 7, 8))
  bug_fn = lambda lp, lo, hi: grpo_terms(b_eq, cfg_bug, lo, hi, logps=lp)
  token_fn = lambda lp, lo, hi: grpo_terms(b_eq, cfg_tok, lo, hi, logps=lp)
  token_loss, token_grad = one_pass(token_fn, b_eq['logps'], 8)
  loss, _, grad = accumulated(bug_fn, b_eq['logps'], (4, 4))
  np.testing.assert_allclose(loss, token_loss, rtol=1e-6, atol=2e-7)
  np.testing.assert_allclose(grad, token_grad, rtol=1e-6, atol=1e-9)


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(
    lengths=st.lists(st.integers(0, L_MAX), min_size=8, max_size=8),
    cuts=st.sets(st.integers(1, 7), max_size=4),
    level=st.sampled_from(['token', 'sequence']),
)
def test_grpo_exact_any_split_static_shapes(lengths, cuts, level):
  """Static-shape micro-batches: every micro-batch holds all 8 rows, those outside it masked
  out and filled with garbage (nan) old log-probs, advantages, reference log-probs and
  entropies. Only 'token': 'sequence' and 'constant' count every row, as TRL does, so a
  masked-out row is an empty completion to them, not padding (GRPO micro-batches have none)."""
  aggregation = 'token'
  hypothesis.assume(sum(lengths) > 0)
  split = np.diff([0] + sorted(cuts) + [8]).tolist()
  cfg = GRPOLossConfig(aggregation=aggregation, importance_level=level, **CFG_FULL)
  b = make_grpo_batch(seed=sum(lengths), lengths=lengths)

  def padded_fn(lp, lo, hi):
    keep = np.zeros((8, 1), np.float32)
    keep[lo:hi] = 1
    junk = lambda x: np.where(keep > 0, x, np.nan).astype(np.float32)
    return losses.grpo_loss(lp, junk(b['old']), junk(b['adv'][:, None])[:, 0], b['mask'] * keep,
                            cfg, L_MAX, junk(b['ref']), junk(b['ent']))

  one_loss, one_grad = one_pass(lambda lp, lo, hi: grpo_terms(b, cfg, lo, hi, logps=lp),
                                b['logps'], 8)
  loss, metrics, grad = accumulated(padded_fn, b['logps'], split)
  np.testing.assert_allclose(loss, one_loss, rtol=1e-6, atol=2e-7)
  np.testing.assert_allclose(grad, one_grad, rtol=1e-6, atol=1e-9)
  assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize('level', ['token', 'sequence'])
@pytest.mark.parametrize('aggregation', AGGREGATIONS)
def test_on_policy_gradient_is_policy_gradient(aggregation, level):
  cfg = GRPOLossConfig(aggregation=aggregation, importance_level=level, delta=1.5)
  b = make_grpo_batch(seed=4)
  mask, adv = b['mask'], b['adv']

  def terms_fn(lp, lo, hi):
    sl = slice(lo, hi)
    lp = lp[sl]
    return losses.grpo_loss(lp, jax.lax.stop_gradient(lp), adv[sl], mask[sl], cfg, L_MAX)

  # Plain policy gradient of the window loss of -A * logp, per token (numpy loops).
  n_seq = len(adv)  # every row, the empty one too (TRL's grpo / dr_grpo)
  expected = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[i, t] > 0:
        norm = {'token': mask.sum(), 'sequence': mask[i].sum() * n_seq,
                'constant': n_seq * L_MAX}[aggregation]
        expected[i, t] = -adv[i] / norm
  for split in ((8,), (2, 2, 4), (4, 4)):
    _, metrics, grad = accumulated(terms_fn, b['logps'], split)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-9)
    assert metrics['ratio/min'] == 1 and metrics['ratio/max'] == 1
    assert metrics['ratio/mean'] == 1 and metrics['clip_ratio/region_mean'] == 0


def test_grpo_metrics_window():
  cfg = GRPOLossConfig(aggregation='sequence', **CFG_FULL)
  # The first micro-batch has no token at all.
  b = make_grpo_batch(seed=5, lengths=(0, 0, 9, 3, 1, 7, 5, 9))
  terms = [grpo_terms(b, cfg, lo, hi) for lo, hi in bounds_of((2, 2, 4))]
  assert terms[0].min_metrics['ratio/min'] == np.inf
  assert terms[0].max_metrics['ratio/max'] == -np.inf
  _, metrics = losses.window_value(terms)

  r = ref_ratios(b['logps'], b['old'], b['mask'], 'token')
  rows, cols = np.nonzero(b['mask'])
  vals = {'ratio': [], 'kl': [], 'entropy': [], 'low': [], 'high': []}
  for i, t in zip(rows, cols):
    d = float(b['ref'][i, t]) - float(b['logps'][i, t])
    vals['ratio'].append(r[i, t])
    vals['kl'].append(math.exp(d) - d - 1)
    vals['entropy'].append(float(b['ent'][i, t]))
    vals['low'].append(float(r[i, t] < 1 - cfg.epsilon_low and b['adv'][i] < 0))
    vals['high'].append(float(r[i, t] > 1 + cfg.epsilon_high and b['adv'][i] > 0))
  expected = {
      'ratio/mean': np.mean(vals['ratio']), 'ratio/min': np.min(vals['ratio']),
      'ratio/max': np.max(vals['ratio']), 'kl': np.mean(vals['kl']),
      'entropy': np.mean(vals['entropy']), 'clip_ratio/low_mean': np.mean(vals['low']),
      'clip_ratio/high_mean': np.mean(vals['high']),
      'clip_ratio/region_mean': np.mean(np.add(vals['low'], vals['high'])),
  }
  assert 0 < expected['clip_ratio/low_mean'] and 0 < expected['clip_ratio/high_mean']
  for name, value in expected.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-6, err_msg=name)
  assert set(metrics) == set(expected) | {'loss'}


def test_loss_terms_is_a_pytree_and_jits():
  cfg = GRPOLossConfig(aggregation='sequence', **CFG_FULL)
  b = make_grpo_batch()
  args = (b['logps'], b['old'], b['adv'], b['mask'])
  eager = losses.grpo_loss(*args, cfg, L_MAX, b['ref'], b['ent'])
  jitted = jax.jit(losses.grpo_loss, static_argnames=('cfg', 'max_completion_length'))(
      *args, cfg=cfg, max_completion_length=L_MAX, ref_logps=b['ref'], entropy=b['ent'])
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), eager, jitted)
  window = jax.jit(lambda ts: losses.window_value(ts))([eager, jitted])
  np.testing.assert_allclose(window[0], eager.numerator / eager.denominator, rtol=1e-6)
  # neutral_like is the identity of combine (the start of a window accumulator).
  start = jax.eval_shape(losses.neutral_like, eager)
  assert jax.tree.structure(start) == jax.tree.structure(eager)
  same = losses.combine(losses.neutral_like(eager), eager)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), same, eager)
  # A window with nothing in it: nan means, +-inf extrema, not a silent 0.
  loss, metrics = losses.window_value([losses.neutral_like(eager)])
  assert np.isnan(loss) and np.isnan(metrics['ratio/mean'])
  assert metrics['ratio/min'] == np.inf and metrics['ratio/max'] == -np.inf


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------


def test_sft_loss_exact_over_microbatches():
  rng = np.random.default_rng(6)
  logits = rng.normal(0, 2, (8, L_MAX, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (8, L_MAX))
  mask = np.zeros((8, L_MAX), np.float32)
  for i, n in enumerate((5, 0, 2, 9, 1, 3, 7, 8)):
    mask[i, :n] = 1

  total, count = 0.0, 0
  for i in range(8):
    for t in range(L_MAX):
      if mask[i, t]:
        x = logits[i, t].astype(np.float64)
        total += math.log(np.sum(np.exp(x))) - x[targets[i, t]]
        count += 1
  terms_fn = lambda lp, lo, hi: losses.sft_loss(lp[lo:hi], mask[lo:hi])
  logps = losses.token_logps(logits, targets)
  one_loss, one_grad = one_pass(terms_fn, logps, 8)
  np.testing.assert_allclose(one_loss, total / count, rtol=1e-6)
  for split in ((4, 4), (2, 2, 4)):
    loss, metrics, grad = accumulated(terms_fn, logps, split)
    np.testing.assert_allclose(loss, total / count, rtol=1e-6)
    np.testing.assert_allclose(metrics['loss'], total / count, rtol=1e-6)
    np.testing.assert_allclose(grad, one_grad, rtol=1e-6, atol=1e-9)
  # d loss / d logp = -m / sum m, and nan log-probs at masked positions change nothing.
  logps = np.where(mask > 0, -1.0, np.nan).astype(np.float32)
  loss, grad_lp = jax.value_and_grad(lambda lp: (lambda t: t.numerator / t.denominator)(
      losses.sft_loss(lp, mask)))(logps)
  np.testing.assert_allclose(loss, 1.0, rtol=1e-6)
  np.testing.assert_allclose(grad_lp, -mask / count, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('aggregation', ['pair', 'token'])
@pytest.mark.parametrize('loss_type,label_smoothing', [
    ('sigmoid', 0.0), ('sigmoid', 0.1), ('ipo', 0.0), ('hinge', 0.0), ('robust', 0.1)])
def test_dpo_losses_vs_numpy_and_exact_over_microbatches(loss_type, label_smoothing,
                                                         aggregation):
  cfg = DPOLossConfig(loss_type=loss_type, beta=0.3, label_smoothing=label_smoothing,
                      aggregation=aggregation)
  d = make_dpo_batch()
  if loss_type == 'hinge':  # finite differences need 1 - beta*h away from 0
    h = (d['pc'] - d['rc']) - (d['pr'] - d['rr'])
    assert np.nanmin(np.abs(1 - cfg.beta * h)) > 1e-3
    assert 0 < np.sum(1 - cfg.beta * h > 0) < 7  # pairs on both sides of the hinge
  expected = ref_dpo_window(d, cfg)

  # Per-pair losses.
  per_pair = losses.dpo_pair_losses(d['pc'] - d['rc'], d['pr'] - d['rr'], d['nc'], d['nr'], cfg)
  for i in range(8):
    if i != 3:
      ref = ref_dpo_pair(*(float(d[k][i]) for k in ('pc', 'pr', 'rc', 'rr')), cfg,
                         float(d['nc'][i]), float(d['nr'][i]))
      np.testing.assert_allclose(per_pair[i], ref, rtol=1e-6, atol=1e-7)

  # Gradients w.r.t. the chosen and rejected summed log-probs, vs finite differences.
  x = np.stack([d['pc'], d['pr']])  # [2, P]
  terms_fn = lambda y, lo, hi: dpo_terms(d, cfg, lo, hi, pc=y[0], pr=y[1])
  one_loss, one_grad = one_pass(terms_fn, x, 8)
  np.testing.assert_allclose(one_loss, expected['loss'], rtol=1e-6, atol=1e-7)
  x_clean = np.where(np.isnan(x), 0, x)
  ref_grad = fd_grad(lambda y: ref_dpo_window(d, cfg, y[0], y[1])['loss'], x_clean)
  np.testing.assert_allclose(one_grad, ref_grad, rtol=2e-6, atol=1e-8)

  for split in ((4, 4), (2, 2, 4), (4, 2, 2), (2, 2, 2, 2)):
    loss, metrics, grad = accumulated(terms_fn, x, split)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(grad, one_grad, rtol=1e-6, atol=1e-9)
    assert set(metrics) == set(expected)
    for k, v in expected.items():
      np.testing.assert_allclose(metrics[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize('aggregation', ['pair', 'token'])
def test_dpo_accuracy_is_mean_over_pairs_not_comparison_of_means(aggregation):
  cfg = DPOLossConfig(beta=0.5, aggregation=aggregation)
  # Rewards: chosen (5, -1, -1), rejected (0, 0, 0). Mean chosen 1 > mean rejected 0, yet only
  # one pair of three prefers its chosen completion.
  pc = np.array([10., -2., -2.], np.float32)
  zeros = np.zeros(3, np.float32)
  tokens = np.array([1., 30., 50.], np.float32)
  terms = [losses.dpo_loss(pc[sl], zeros[sl], zeros[sl], zeros[sl], tokens[sl], tokens[sl], cfg)
           for sl in (slice(0, 1), slice(1, 3))]
  _, metrics = losses.window_value(terms)
  np.testing.assert_allclose(metrics['rewards/accuracies'], 1 / 3, rtol=1e-6)
  if aggregation == 'pair':
    assert metrics['rewards/chosen'] > metrics['rewards/rejected']
