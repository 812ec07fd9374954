"""TRL 1.16's newer GRPO objectives and options (issue 45): cispo, sapo, luspo, vespo,
top_entropy_quantile, use_bias_correction_kl, multi_objective_aggregation.

Two independent references for each: (a) the loss written out from the paper / TRL formula in
float64 (tests/loss_refs.py), differentiated by central finite differences, over the whole
window in one pass; (b) TRL 1.16's own ``GRPOTrainer._compute_loss`` on the same inputs, saved by
tests/fixtures/make_trl_loss_fixtures.py (run in a separate venv with torch and trl; this file
never imports them) to tests/fixtures/trl_grpo_losses.npz. Ours is always the learner's
combination of K micro-batches: sum the numerator gradients, divide once by the summed
denominator.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import losses
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga.config import GRPOLossConfig

from loss_refs import (L_MAX, accumulated, assert_away_from_kinks, bounds_of, fd_grad,
                       make_grpo_batch, ref_entropy_keep, ref_per_token, ref_window_loss)

RTOL = 1e-5
FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'trl_grpo_losses.npz')
# TRL's loss_type -> (our objective, our aggregation); docs/design.md, "Loss peers".
TRL_LOSS_TYPES = {'cispo': ('cispo', 'token'), 'sapo': ('sapo', 'sequence'),
                  'luspo': ('clip', 'sequence_sum'), 'vespo': ('vespo', 'token'),
                  'dapo': ('clip', 'token'), 'grpo': ('clip', 'sequence')}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def terms_fn(batch, cfg, threshold=None):
  """terms_fn(logps, lo, hi) for loss_refs.accumulated: grpo_loss on rows [lo, hi)."""
  def fn(logps, lo, hi):
    sl = slice(lo, hi)
    return losses.grpo_loss(logps[sl], batch['old'][sl], batch['adv'][sl], batch['mask'][sl],
                            cfg, L_MAX, ref_logps=batch['ref'][sl], entropy=batch['ent'][sl],
                            entropy_threshold_value=threshold)
  return fn


# ---------------------------------------------------------------------------------------------
# (b) TRL 1.16's _compute_loss
# ---------------------------------------------------------------------------------------------


def _fixture():
  data = np.load(FIXTURE)
  cases = {}
  for key in data.files:
    name, rest = key.split('/', 1)
    cases.setdefault(name, {})[rest] = data[key]
  return cases


CASES = _fixture()


def config_of(case):
  """Our GRPOLossConfig for a fixture case's GRPOConfig values (TRL's names)."""
  c = {k[4:]: v.item() for k, v in case.items() if k.startswith('cfg/')}
  objective, aggregation = TRL_LOSS_TYPES[c.pop('loss_type')]
  eps = c.pop('epsilon')
  eps_high = c.pop('epsilon_high')
  return GRPOLossConfig(
      objective=objective, aggregation=aggregation, epsilon_low=eps,
      epsilon_high=eps if eps_high == '' else eps_high,
      delta=None if c.pop('delta') == '' else c['delta'],
      importance_level=c.pop('importance_sampling_level'), **c)


@pytest.mark.parametrize('name', sorted(CASES))
def test_equals_trl_compute_loss(name):
  """Loss, gradient w.r.t. the log-probs and metrics equal TRL's (one micro-batch per generation
  batch, where TRL is exact), ours accumulated over K = 1 and K = 3 (uneven) micro-batches. With
  top_entropy_quantile, K = 3 gets the window's threshold (our default is the micro-batch's,
  TRL's; both are the same set at K = 1): the selected tokens equal TRL's entropy mask."""
  case = CASES[name]
  cfg = config_of(case)
  batch = {k: case[k] for k in ('old', 'adv', 'mask', 'ref', 'ent')}
  x = case['logps']
  threshold = None
  if cfg.top_entropy_quantile < 1:
    threshold = losses.entropy_threshold(batch['ent'], batch['mask'], cfg.top_entropy_quantile)
    keep = (batch['mask'] > 0) & (batch['ent'] >= np.asarray(threshold))
    np.testing.assert_array_equal(keep, case['entropy_mask'] > 0)
    assert 0 < keep.sum() < batch['mask'].sum()
  for split in ((10,), (3, 3, 4)):
    loss, metrics, grad = accumulated(
        terms_fn(batch, cfg, threshold if len(split) > 1 else None), x, split)
    np.testing.assert_allclose(loss, case['loss'], rtol=RTOL, atol=1e-7)
    assert rel(grad, case['grad']) < RTOL, (split, rel(grad, case['grad']))
    for key in ('cispo_clip_ratio', 'vespo/phi_seq_mean', 'kl', 'entropy',
                'clip_ratio/low_mean', 'clip_ratio/high_mean', 'clip_ratio/region_mean'):
      if f'metric/{key}' not in case:
        assert key not in metrics or key == 'entropy', key
        continue
      if cfg.importance_level == 'sequence' and key != 'kl':
        continue  # TRL averages a sequence-level quantity over rows, ours over tokens
      np.testing.assert_allclose(metrics[key], case[f'metric/{key}'], rtol=1e-5, atol=1e-7,
                                 err_msg=key)


def test_fixture_covers_every_new_name():
  loss_types = {str(c['cfg/loss_type']) for c in CASES.values()}
  assert {'cispo', 'sapo', 'luspo', 'vespo'} <= loss_types
  assert any(c['cfg/top_entropy_quantile'] < 1 for c in CASES.values())
  assert any(bool(c['cfg/use_bias_correction_kl']) for c in CASES.values())
  # The cases exercise what they test: CISPO's cap binds, VESPO's weights are not all 1.
  assert CASES['cispo']['metric/cispo_clip_ratio'] > 0.1
  assert 0.1 < CASES['vespo']['metric/vespo/phi_seq_mean'] < 0.9


# ---------------------------------------------------------------------------------------------
# (a) the paper's / TRL's formula in float64, one pass over the window
# ---------------------------------------------------------------------------------------------

NEW = {
    'cispo': dict(objective='cispo', epsilon_high=1.3),
    'cispo_seq': dict(objective='cispo', epsilon_high=1.1, importance_level='sequence'),
    'sapo': dict(objective='sapo', aggregation='sequence'),
    'sapo_token': dict(objective='sapo', sapo_temperature_pos=2.0, sapo_temperature_neg=0.5,
                       beta=0.04),
    'luspo': dict(aggregation='sequence_sum', importance_level='sequence', epsilon_high=0.28),
    'vespo': dict(objective='vespo', vespo_k_neg=2.0, entropy_coef=0.01),
    'top_entropy': dict(top_entropy_quantile=0.3, entropy_coef=0.01, beta=0.04),
    'top_entropy_cispo': dict(objective='cispo', epsilon_high=2.0, top_entropy_quantile=0.5,
                              aggregation='constant'),
    'bias_kl': dict(beta=0.04, use_bias_correction_kl=True, aggregation='sequence'),
    'bias_kl_seq': dict(beta=0.1, use_bias_correction_kl=True, importance_level='sequence',
                        delta=1.5),
}


@pytest.mark.parametrize('name', sorted(NEW))
def test_window_exact_against_formula(name):
  """An empty row, NaN garbage at masked positions, K = 1, 3 (uneven), 4: loss and gradient equal
  the float64 one-pass formula (stop-gradient factors frozen at the evaluation point)."""
  cfg = GRPOLossConfig(**NEW[name])
  b = make_grpo_batch(seed=31)
  b['old'][1:3] -= 0.3  # larger ratios: CISPO's cap binds on some tokens
  if cfg.objective == 'clip':
    assert_away_from_kinks(b, cfg)
  keep, threshold = None, None
  if cfg.top_entropy_quantile < 1:
    keep = ref_entropy_keep(b['ent'], b['mask'], cfg.top_entropy_quantile)
    threshold = np.float32(np.quantile(b['ent'][b['mask'] > 0].astype(np.float64),
                                       1 - cfg.top_entropy_quantile))
  x0 = b['logps']
  ref = lambda lp: ref_window_loss(
      ref_per_token(lp, b['old'], b['adv'], b['mask'], cfg, b['ref'], b['ent'], frozen=x0,
                    keep=keep), b['mask'], cfg.aggregation)
  batch = {'old': b['old'], 'adv': b['adv'], 'mask': b['mask'], 'ref': b['ref'], 'ent': b['ent']}
  want = fd_grad(ref, x0)
  for split in ((8,), (3, 1, 4), (2, 2, 2, 2)):
    loss, _, grad = accumulated(terms_fn(batch, cfg, threshold), x0, split)
    np.testing.assert_allclose(loss, ref(x0), rtol=RTOL)
    assert rel(grad, want) < RTOL, (split, rel(grad, want))


def test_nothing_changes_by_default():
  """The new settings' defaults are the clipped surrogate as before: an explicit default config
  gives bitwise the same terms as GRPOLossConfig()."""
  b = make_grpo_batch(seed=2)
  explicit = GRPOLossConfig(objective='clip', top_entropy_quantile=1.0,
                            use_bias_correction_kl=False, beta=0.04)
  for cfg in (GRPOLossConfig(beta=0.04), explicit):
    t = losses.grpo_loss(b['logps'], b['old'], b['adv'], b['mask'], cfg, L_MAX,
                         ref_logps=b['ref'], entropy=b['ent'])
    ref = ref_window_loss(ref_per_token(b['logps'], b['old'], b['adv'], b['mask'], cfg,
                                        b['ref'], b['ent']), b['mask'], 'token')
    np.testing.assert_allclose(t.numerator / t.denominator, ref, rtol=RTOL)
    assert 'cispo_clip_ratio' not in t.mean_metrics and 'clip_ratio/region_mean' in t.mean_metrics


def test_bias_correction_changes_the_on_policy_kl_gradient():
  """On-policy (old = logp) the ratio is 1 but differentiable: with use_bias_correction_kl the
  KL gradient gains beta * kl per token (TRL's documented behaviour)."""
  b = make_grpo_batch(seed=4)
  b['old'] = np.where(b['mask'] > 0, b['logps'], np.nan).astype(np.float32)
  batch = {k: b[k] for k in ('old', 'adv', 'mask', 'ref', 'ent')}
  grads = {}
  for on in (False, True):
    cfg = GRPOLossConfig(beta=0.5, use_bias_correction_kl=on)
    _, _, grads[on] = accumulated(terms_fn(batch, cfg), b['logps'], (8,))
  d = np.where(b['mask'] > 0, b['ref'] - b['logps'], 0.0).astype(np.float64)
  kl = np.exp(d) - d - 1
  np.testing.assert_allclose(np.asarray(grads[True]) - np.asarray(grads[False]),
                             0.5 * kl * b['mask'] / b['mask'].sum(), rtol=1e-4, atol=1e-7)


def test_entropy_threshold_is_torch_quantile():
  """Linear-interpolation quantile of the valid entropies (numpy's default = torch's), at sizes
  where the rank falls between and on tokens; an all-masked batch keeps nothing."""
  rng = np.random.default_rng(3)
  for n_valid, rho in ((1, 0.2), (7, 0.2), (11, 0.5), (36, 0.2), (40, 0.0), (40, 1.0)):
    ent = rng.uniform(0, 3, (5, 8)).astype(np.float32)
    mask = np.zeros((5, 8), np.float32)
    mask.reshape(-1)[rng.permutation(40)[:n_valid]] = 1
    got = float(losses.entropy_threshold(ent, mask, rho))
    want = np.quantile(ent[mask > 0].astype(np.float64), 1 - rho)
    np.testing.assert_allclose(got, want, rtol=1e-6)
  assert np.isinf(losses.entropy_threshold(ent, np.zeros_like(mask), 0.2))


# ---------------------------------------------------------------------------------------------
# Where TRL's accumulation is inexact
# ---------------------------------------------------------------------------------------------


def trl_k3_s2_error(seed=0, b_size=4):
  """K = 3, S = 2, mu = 1: TRL's cispo/vespo (and dapo) normalizer of a micro-batch is its
  rollout's token count times K / S; ours the window's token count. -> relative difference of
  the two window gradients w.r.t. the log-probs (CISPO on-policy: d l / d logp = -A / N)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 17, (2, 2 * b_size))  # two rollouts of S*B rows, 1..16 tokens
  adv = rng.normal(size=(2, 2 * b_size))
  window = [(0, slice(0, b_size)), (0, slice(b_size, 2 * b_size)), (1, slice(0, b_size))]
  per_row_trl, per_row_ours = [], []
  n_window = sum(lengths[r, sl].sum() for r, sl in window)
  for r, sl in window:
    n_trl = lengths[r].sum() * 3 / 2
    for length, a in zip(lengths[r, sl], adv[r, sl]):
      per_row_trl.append(np.full(length, -a / n_trl))
      per_row_ours.append(np.full(length, -a / n_window))
  return rel(np.concatenate(per_row_trl), np.concatenate(per_row_ours))


def top_entropy_split_dependence(seed=0, rho=0.2, k=3, b_size=4, t=16):
  """Per-micro-batch thresholds (TRL's, and ours by default) against the window's: -> (share of
  the window's tokens whose selection differs, relative gradient difference), on-policy clip."""
  rng = np.random.default_rng(seed)
  n = k * b_size
  lengths = rng.integers(1, t + 1, n)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  ent = rng.gamma(2.0, 0.5, (n, t)).astype(np.float32) * rng.uniform(0.3, 1.5, (n, 1))
  adv = rng.normal(size=n)
  window = ref_entropy_keep(ent, mask, rho)
  per_mb = np.concatenate([ref_entropy_keep(ent[lo:hi], mask[lo:hi], rho)
                           for lo, hi in bounds_of((b_size,) * k)])
  g = lambda keep: -adv[:, None] * keep / mask.sum()
  return float(np.abs(per_mb - window).sum() / mask.sum()), rel(g(per_mb), g(window))


def test_trl_accumulation_error_at_k3_s2():
  """Numbers for docs/design.md ("Loss peers"): TRL's cispo/vespo normalizer at K = 3, S = 2,
  and the split dependence of a per-micro-batch entropy threshold at K = 3."""
  errs = [trl_k3_s2_error(seed) for seed in range(5)]
  flips, gerrs = zip(*(top_entropy_split_dependence(seed) for seed in range(5)))
  print(f'TRL cispo/vespo K=3 S=2 gradient error: {np.mean(errs):.3f} mean, {max(errs):.3f} max; '
        f'per-micro-batch entropy threshold (rho 0.2, K=3): {np.mean(flips):.3f} of tokens '
        f'selected differently, gradient error {np.mean(gerrs):.3f}')
  assert min(errs) > 1e-2
  assert min(gerrs) > 1e-2


# ---------------------------------------------------------------------------------------------
# multi_objective_aggregation
# ---------------------------------------------------------------------------------------------


def trl_nanstd(v):
  """trl.trainer.utils.nanstd: Bessel-corrected, NaN under 2 values."""
  v = [x for x in v if not np.isnan(x)]
  if len(v) < 2:
    return np.nan
  m = sum(v) / len(v)
  return (sum((x - m)**2 for x in v) / (len(v) - 1))**0.5


def trl_normalized_sum(per_fn, weights, g):
  """normalize_then_sum's first step in TRL 1.16, loops: each function normalized in its group,
  weighted, summed; NaN where no function applies."""
  n, f = per_fn.shape
  summed = np.zeros(n)
  for k in range(f):
    for start in range(0, n, g):
      col = per_fn[start:start + g, k]
      valid = [x for x in col if not np.isnan(x)]
      mean = sum(valid) / len(valid) if valid else np.nan
      std = trl_nanstd(col) if g > 1 else 0.0
      for i in range(g):
        v = (col[i] - mean) / (std + 1e-4) * weights[k]
        summed[start + i] += 0.0 if np.isnan(v) else v
  summed[np.isnan(per_fn).all(1)] = np.nan
  return summed


def trl_normalize_then_sum(per_fn, weights, g):
  """TRL 1.16's normalize_then_sum branch (GRPOTrainer._generate_and_score_completions), loops."""
  summed = trl_normalized_sum(per_fn, weights, g)
  valid = summed[~np.isnan(summed)]
  mean, std = valid.mean(), trl_nanstd(summed)
  adv = (summed - mean) / (std + 1e-4)
  return np.where(np.isnan(adv), 0.0, adv)


def test_normalize_then_sum_equals_trl():
  """Two reward functions on different scales, a None (NaN) value, a completion no function
  scores, a group where one function is constant: equals TRL's branch written out; and differs
  from sum_then_normalize (group_advantages of the weighted sum)."""
  rng = np.random.default_rng(5)
  g = 4
  per_fn = np.stack([rng.integers(0, 2, 16).astype(np.float64),
                     rng.normal(0, 30, 16)], 1)
  per_fn[4:8, 0] = 1.0  # constant in its group
  per_fn[9, 1] = np.nan
  per_fn[13] = np.nan  # unscorable
  weights = [1.0, 0.5]
  got = rewards_lib.normalize_then_sum_advantages(per_fn, weights, g)
  want = trl_normalize_then_sum(per_fn, weights, g)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got[13] == 0
  summed = np.nansum(per_fn * np.asarray(weights), 1)
  assert rel(rewards_lib.group_advantages(summed, g), want) > 0.1


def test_grpo_loop_uses_normalize_then_sum():
  """GRPOLoop._advantages with advantage.multi_objective_aggregation='normalize_then_sum' takes
  the per-function rewards _score gathered; the default keeps group_advantages of the total."""
  import types

  import jax

  from jaxrl_ga.config import AdvantageConfig, ScheduleConfig
  from jaxrl_ga.trainers.grpo import GRPOLoop

  rng = np.random.default_rng(6)
  per_fn = np.stack([rng.integers(0, 2, 8).astype(np.float64), rng.normal(0, 5, 8)], 1)
  weights = [1.0, 0.3]
  total = (per_fn * weights).sum(1).astype(np.float32)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=4, steps_per_generation=2)
  got = {}
  for how in ('sum_then_normalize', 'normalize_then_sum'):
    stub = types.SimpleNamespace(
        cfg=types.SimpleNamespace(schedule=sched, advantage=AdvantageConfig(
            multi_objective_aggregation=how)),
        engine=types.SimpleNamespace(
            advantage_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
        rewards=[types.SimpleNamespace(weight=w) for w in weights],
        _rewards_per_function=per_fn)
    _, adv_dev, got[how] = GRPOLoop._advantages(stub, {}, None, total)
    np.testing.assert_array_equal(np.asarray(adv_dev).reshape(-1), got[how])
  np.testing.assert_allclose(got['normalize_then_sum'], trl_normalize_then_sum(per_fn, weights, 4),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got['sum_then_normalize'],
                                rewards_lib.group_advantages(total, 4))
  # A completion no function scores: the default path leaves it out of its group (TRL 1.16).
  per_fn[2] = np.nan
  total[2] = 0.0  # what compute_rewards sums for it
  stub.cfg.advantage = AdvantageConfig()
  _, _, adv = GRPOLoop._advantages(stub, {}, None, total)
  scored = [0, 1, 3]
  want = (total[scored] - total[scored].mean()) / (np.std(total[scored], ddof=1) + 1e-4)
  np.testing.assert_allclose(adv[scored], want, rtol=1e-5)
  assert adv[2] == 0


@pytest.mark.parametrize('kwargs,message', [
    (dict(objective='ppo'), r"loss.objective='ppo' is not a known value.*'clip', 'cispo'"),
    (dict(objective='luspo'), r"loss.objective='luspo' is TRL's loss_type 'luspo'; set "
                              r"loss.loss_type='luspo' \(objective='clip', "
                              r"aggregation='sequence_sum'\)"),
    (dict(aggregation='vespo'), r"loss.aggregation='vespo' is TRL's loss_type 'vespo'; set "
                                r"loss.loss_type='vespo' \(objective='vespo', aggregation='token'"),
    (dict(aggregation='luspo'), r"TRL's 'luspo' is 'sequence_sum' here"),
    (dict(loss_type='ppo'), r"loss.loss_type='ppo' is not a known value.*'dr_grpo'.*'vespo'"),
    (dict(loss_type='sapo', aggregation='sequence_sum'),
     r"loss.loss_type='sapo' means loss.objective='sapo' with loss.aggregation='sequence', but "
     r"loss.aggregation='sequence_sum' is set; drop one of the two"),
    (dict(loss_type='dapo', objective='sapo'),
     r"loss.loss_type='dapo' means loss.objective='clip' .*but loss.objective='sapo' is set"),
    (dict(objective='cispo'), r'loss.epsilon_high=0.2 .*must be >= 1; set loss.epsilon_high=5.0'),
    (dict(sapo_temperature_pos=0.0), r'loss.sapo_temperature_pos must be a finite number > 0'),
    (dict(sapo_temperature_neg=float('inf')), r'loss.sapo_temperature_neg must be a finite'),
    (dict(vespo_lambda_neg=-1.0), r'loss.vespo_lambda_neg must be a finite number > 0'),
    (dict(vespo_k_pos=-0.5), r'loss.vespo_k_pos must be a finite number >= 0'),
    (dict(top_entropy_quantile=1.2), r'loss.top_entropy_quantile must be in \[0, 1\]'),
    (dict(top_entropy_quantile=-0.1), r'loss.top_entropy_quantile must be in \[0, 1\]'),
    (dict(use_bias_correction_kl='yes'), r'loss.use_bias_correction_kl must be True or False'),
])
def test_bad_values_name_the_setting(kwargs, message):
  from jaxrl_ga.config import ConfigError
  with pytest.raises(ConfigError, match=message):
    GRPOLossConfig(**kwargs)


def test_bad_multi_objective_aggregation():
  from jaxrl_ga.config import AdvantageConfig, ConfigError
  with pytest.raises(ConfigError, match=r"advantage.multi_objective_aggregation='mean'.*"
                                        r"'sum_then_normalize', 'normalize_then_sum'"):
    AdvantageConfig(multi_objective_aggregation='mean')


# ---------------------------------------------------------------------------------------------
# Through the learner
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_learner_cispo_with_top_entropy_and_bias_kl_is_exact():
  """The learner over K = 3 micro-batches of 4 rows, off-policy old log-probs, a reference:
  CISPO (cap binding), top_entropy_quantile = 0.5 with the micro-batch thresholds the learner
  uses (the reference takes jnp.quantile of each group of 4 rows), bias-corrected KL, luspo's
  sequence_sum normalization. The applied update equals the one-pass gradient of the window
  loss written out."""
  import jax

  from jaxrl_ga import learner as learner_lib
  from jaxrl_ga.models import transformer as tfm

  from learner_refs import MODEL, TC, TP, run_learner, synthetic_rollout

  cfg = GRPOLossConfig(objective='cispo', epsilon_high=1.02, top_entropy_quantile=0.5, beta=0.1,
                       use_bias_correction_kl=True, aggregation='sequence_sum')

  def make(rng, s):
    b = synthetic_rollout(rng, 4)
    b['old_logps'] = (-np.log(MODEL.vocab_size) + rng.normal(0, 0.1, (4, TC))).astype(np.float32)
    b['has_old'] = np.ones(4, bool)
    b['ref_logps'] = (-np.log(MODEL.vocab_size) + rng.normal(0, 0.1, (4, TC))).astype(np.float32)
    return b

  def ref(graphdef, params, b):
    tokens = jnp.concatenate([b['prompt_tokens'], b['completion_tokens']], 1)
    mask = jnp.concatenate([b['prompt_mask'], b['completion_mask']], 1)
    logits = tfm.merge(graphdef, params)(tokens, mask)[:, TP - 1:-1]
    logz = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logz, b['completion_tokens'][..., None], -1)[..., 0]
    ent = jax.lax.stop_gradient(-jnp.sum(jnp.exp(logz) * logz, -1))
    m = b['completion_mask'].astype(jnp.float32)
    ratio = jnp.exp(logp - b['old_logps'])
    a = b['advantages'][:, None]
    keep = []
    for lo in range(0, m.shape[0], 4):  # the learner's micro-batches
      e, mm = ent[lo:lo + 4], m[lo:lo + 4]
      keep.append((mm > 0) & (e >= jnp.nanquantile(jnp.where(mm > 0, e, jnp.nan), 0.5)))
    keep = jnp.concatenate(keep).astype(jnp.float32)
    policy = -jax.lax.stop_gradient(jnp.minimum(ratio, cfg.epsilon_high)) * a * logp * keep
    d = b['ref_logps'] - logp
    per_tok = policy + cfg.beta * ratio * (jnp.exp(d) - d - 1)
    return jnp.sum(m * per_tok) / m.shape[0]

  errs, outs, _, _ = run_learner(learner_lib.grpo_task_loss(cfg, TC), ref, make, 3)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5, atol=1e-7)
    assert 0 < o['cispo_clip_ratio'] < 1


def trl_reward_statistics(per_fn, weights, g, scale, aggregation):
  """TRL 1.16's logged reward spreads (_generate_and_score_completions), loops: reward_std (the
  weighted totals, unscorable rows out), rewards/<k>/std, frac_reward_zero_std (the share of rows
  whose std_rewards, group or batch, torch.isclose(., 0): |std| <= 1e-8; NaN is not close)."""
  n = len(per_fn)
  totals = [np.nan if np.isnan(row).all() else sum(w * x for w, x in zip(weights, row)
                                                  if not np.isnan(x)) for row in per_fn]
  if aggregation == 'normalize_then_sum':
    stds = [trl_nanstd(trl_normalized_sum(per_fn, weights, g))] * n
  elif scale == 'batch':
    stds = [trl_nanstd(totals)] * n
  else:
    stds = [trl_nanstd(totals[(i // g) * g:(i // g) * g + g]) for i in range(n)]
  out = {'reward/std': trl_nanstd(totals),
         'reward/frac_zero_std': sum(1.0 for s in stds if abs(s) <= 1e-8) / n}
  for k, name in enumerate(['a', 'b']):
    out[f'reward/{name}/std'] = trl_nanstd(per_fn[:, k])
  return out


@pytest.mark.parametrize('scale, aggregation', [
    ('group', 'sum_then_normalize'), ('batch', 'sum_then_normalize'),
    ('none', 'sum_then_normalize'), ('group', 'normalize_then_sum')])
def test_logged_reward_spreads_equal_trls(scale, aggregation):
  """reward/std was the population std (ddof 0) where TRL logs the sample std; TRL's
  rewards/<name>/std and frac_reward_zero_std were not logged. A group of equal rewards (std 0),
  one with a single scored completion (std NaN, not 0) and an unscorable completion."""
  rng = np.random.default_rng(5)
  g = 4
  per_fn = np.stack([rng.integers(0, 2, 16).astype(np.float64), rng.normal(0, 2, 16)], 1)
  per_fn[0:4] = [[1.0, 0.5]] * 4  # equal totals: std 0
  per_fn[5, 1] = np.nan  # one function does not apply
  per_fn[7] = np.nan  # unscorable
  per_fn[8:11] = np.nan  # one scored completion in the group
  weights = [1.0, 0.5]
  got = rewards_lib.reward_statistics(per_fn, weights, ['a', 'b'], g, scale, aggregation)
  want = trl_reward_statistics(per_fn, weights, g, scale, aggregation)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-9, err_msg=k)
  if aggregation == 'sum_then_normalize' and scale != 'batch':
    assert got['reward/frac_zero_std'] == 0.25  # the equal group's 4 rows of 16
