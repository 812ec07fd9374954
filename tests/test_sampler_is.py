"""Sampler-side importance sampling (loss.sampler_is_*) and the off-policy sequence mask
(loss.off_policy_mask_threshold) mean what TRL 1.16 means (issue 45).

VESPO (TRL's loss_type='vespo', token modes) folds the token ratio into its sequence weight
instead of multiplying the loss by it (the vespo_* cases). Two independent references for each
of TRL's four modes: (a) the weights and the window loss
written out in float64 (tests/loss_refs.py, ref_sampler_weights), differentiated by finite
differences in one pass over the window; (b) TRL's own code, run by
tests/fixtures/make_trl_is_fixtures.py in a separate venv (tests/fixtures/trl_is.npz: its loss,
its gradient with respect to the current log-probs, its IS ratio and metrics; one micro-batch per
generation batch, where TRL is exact). Ours is accumulated over K = 3 micro-batches of uneven
size, the learner's way (sum numerator gradients, divide once).
"""

import ast
import dataclasses
import os

import numpy as np
import pytest

from jaxrl_ga import losses
from jaxrl_ga.config import ConfigError, GRPOConfig, GRPOLossConfig, SamplingConfig

from loss_refs import (L_MAX, accumulated, fd_grad, ref_per_token, ref_sampler_weights,
                       ref_window_loss)

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'trl_is.npz')
SPLIT = (3, 2, 3)  # K = 3 micro-batches of the 8-row window
RTOL = 1e-5


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _fixture():
  with np.load(FIXTURE) as f:
    return dict(f)


FIX = _fixture()
CASES = [str(c) for c in FIX['cases']]


def case(name):
  """(GRPOLossConfig, batch as float32 with nan off the mask, TRL's arrays) of a fixture case."""
  spec = ast.literal_eval(str(FIX[f'{name}/config'][0]))
  eps_low, eps_high = FIX['epsilon']
  cfg = GRPOLossConfig(
      loss_type=spec['loss_type'], epsilon_low=float(eps_low),
      epsilon_high=float(eps_high), beta=spec['beta'],
      sampler_is_correction=bool(spec['mode']), sampler_is_mode=spec['mode'] or 'sequence_mask',
      sampler_is_clip_min=spec['clip_min'], sampler_is_clip_max=spec['clip_max'],
      off_policy_mask_threshold=spec['threshold'])
  x = {k[len('input/'):]: v for k, v in FIX.items() if k.startswith('input/')}
  batch = {k: v.astype(np.float32) for k, v in x.items()}
  for k in ('old', 'sampler', 'ref'):
    batch[k][batch['mask'] == 0] = np.nan  # garbage off the mask must not matter
  trl = {k[len(name) + 1:]: v for k, v in FIX.items() if k.startswith(name + '/')}
  return cfg, batch, trl


def terms_fn(batch, cfg):
  def fn(logps, lo, hi):
    sl = slice(lo, hi)
    return losses.grpo_loss(logps[sl], batch['old'][sl], batch['adv'][sl], batch['mask'][sl],
                            cfg, L_MAX, ref_logps=batch['ref'][sl],
                            sampler_logps=batch['sampler'][sl])
  return fn


def reference(batch, cfg):
  """(float64 one-pass loss, its gradient by finite differences, the metrics): the weights
  are data, computed once at the given log-probs."""
  b64 = {k: np.asarray(v, np.float64) for k, v in batch.items()}
  weights = lambda c: ref_sampler_weights(b64['logps'], b64['old'], b64['sampler'], b64['adv'],
                                          b64['mask'], c)
  w, metrics = weights(cfg)
  vespo_ratio = None
  if cfg.objective == 'vespo':  # TRL: the IS ratio goes into VESPO's w, not onto the loss
    vespo_ratio = weights(dataclasses.replace(cfg, off_policy_mask_threshold=None))[0]
    w = weights(dataclasses.replace(cfg, sampler_is_correction=False))[0]
  loss = lambda lp: ref_window_loss(
      ref_per_token(lp, b64['old'], b64['adv'], b64['mask'], cfg, ref=b64['ref'], weights=w,
                    frozen=b64['logps'], vespo_sampler_ratio=vespo_ratio),
      b64['mask'], cfg.aggregation)
  return loss(b64['logps']), fd_grad(loss, b64['logps']), metrics


@pytest.mark.parametrize('name', CASES)
def test_accumulated_gradient_equals_float64_and_trl(name):
  cfg, batch, trl = case(name)
  loss, metrics, grad = accumulated(terms_fn(batch, cfg), batch['logps'], SPLIT)
  want_loss, want_grad, want_metrics = reference(batch, cfg)
  # (a) the formula written out, one pass over the window
  assert rel(grad, want_grad) <= RTOL, rel(grad, want_grad)
  np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
  # (b) TRL's own _compute_loss on the whole window (its loss is the window loss: K = 1)
  assert rel(grad, trl['grad']) <= RTOL, rel(grad, trl['grad'])
  np.testing.assert_allclose(float(loss), float(trl['loss']), rtol=RTOL)
  # The metrics: TRL's (over its one generation batch) and the float64 ones.
  for key, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[key]), value, rtol=RTOL, atol=1e-7, err_msg=key)
    if 'metric/' + key in trl:
      np.testing.assert_allclose(float(metrics[key]), float(trl['metric/' + key]), rtol=RTOL,
                                 err_msg=key)
  if cfg.sampler_is_correction:
    assert any('metric/' + k in trl for k in want_metrics)


@pytest.mark.parametrize('name', [c for c in CASES if not c.startswith(('opsm_dapo', 'vespo'))])
def test_weights_are_trls_ratio(name):
  """The per-token weight equals TRL's IS ratio (broadcast per row in the sequence modes) at
  every valid token, and the masked share counts TRL's zeros; the cases really clip or mask."""
  cfg, batch, trl = case(name)
  w, means, _, _ = losses.sampler_weights(batch['logps'], batch['old'], batch['sampler'],
                                          batch['adv'], batch['mask'], cfg)
  ratio = np.broadcast_to(trl['is_ratio'], w.shape)
  valid = batch['mask'] > 0
  if cfg.off_policy_mask_threshold is None:
    np.testing.assert_allclose(np.asarray(w)[valid], ratio[valid], rtol=1e-5)
  lo, hi = cfg.sampler_is_clip_min or 0.0, cfg.sampler_is_clip_max
  if cfg.sampler_is_mode.endswith('_mask'):
    over = (ratio if cfg.sampler_is_mode.startswith('sequence') else ratio[valid])
    zeros = float(np.mean(trl['is_ratio'] == 0)) if cfg.sampler_is_mode.startswith(
        'sequence') else float(np.mean(over == 0))
    assert 0 < zeros < 1
    s, n = means['sampling/importance_sampling_masked_fraction']
    np.testing.assert_allclose(float(s / n), zeros, rtol=1e-6)
  else:
    assert np.any(np.isclose(ratio[valid], hi)) or np.any(np.isclose(ratio[valid], lo))


def test_off_policy_mask_drops_negative_advantage_rows_only():
  cfg, batch, _ = case('opsm_dapo')
  w, means, _, _ = losses.sampler_weights(batch['logps'], batch['old'], batch['sampler'],
                                          batch['adv'], batch['mask'], cfg)
  dropped = ~np.asarray(w).any(-1) & (batch['mask'].sum(-1) > 0)
  assert dropped.sum() >= 1 and (batch['adv'][dropped] < 0).all()
  s, n = means['sampling/off_policy_masked_fraction']
  assert float(s / n) == dropped.sum() / len(dropped)


def test_off_by_default_and_needs_sampler_logps():
  cfg, batch, _ = case('token_mask_dapo')
  default = GRPOLossConfig(aggregation='token', epsilon_low=cfg.epsilon_low,
                           epsilon_high=cfg.epsilon_high)
  assert not default.sampler_is_correction and default.off_policy_mask_threshold is None
  plain = losses.grpo_loss(batch['logps'], batch['old'], batch['adv'], batch['mask'], default,
                           L_MAX)
  assert not any(k.startswith('sampling/') for k in plain.mean_metrics)
  with pytest.raises(ValueError, match='sampler_logps'):
    losses.grpo_loss(batch['logps'], batch['old'], batch['adv'], batch['mask'], cfg, L_MAX)


@pytest.mark.parametrize('kwargs,message', [
    (dict(sampler_is_mode='token'), "loss.sampler_is_mode='token' is not a known value"),
    (dict(sampler_is_clip_max=0.0), 'loss.sampler_is_clip_max=0.0 must be None or a number > 0'),
    (dict(sampler_is_clip_min=-1.0), 'loss.sampler_is_clip_min=-1.0 must be None or a number'),
    (dict(sampler_is_clip_min=3.0), 'loss.sampler_is_clip_min=3.0 must be below'),
    (dict(sampler_is_correction=True, sampler_is_mode='token_truncate',
          sampler_is_clip_max=None), "loss.sampler_is_mode='token_truncate' needs"),
    (dict(off_policy_mask_threshold=-0.5), 'loss.off_policy_mask_threshold=-0.5 must be'),
    (dict(loss_type='vespo', sampler_is_correction=True),
     "loss.sampler_is_mode='sequence_mask' with loss.objective='vespo': VESPO folds"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(')) as e:
    GRPOLossConfig(**kwargs)
  assert '\n' not in str(e.value)


def test_trl_error_at_k3_s2():
  """TRL's own accumulation at K = 3, S = 2 (make_trl_is_fixtures.k3_s2_error, TRL's code on a
  window spanning two rollouts, against TRL's code on the window at once), for docs/design.md:
  with dapo's normalizer (the rollout's tokens x K/S) every mode is off; grpo's per-row means
  over equal micro-batches are exact."""
  for mode in ('token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'):
    dapo, grpo = (FIX[f'k3_s2_error/{mode}_{t}'] for t in ('dapo', 'grpo'))
    print(f'TRL K=3 S=2 {mode}: dapo {dapo.mean():.3f} mean, {dapo.max():.3f} max; '
          f'grpo {grpo.max():.1e} max')
    assert len(dapo) == 5 and dapo.min() > 1e-2 and grpo.max() < 1e-9


def test_sampler_old_logprobs_are_refused():
  with pytest.raises(ConfigError, match="old_logprob_source='sampler': the old log-probs"):
    GRPOConfig(loss=GRPOLossConfig(sampler_is_correction=True),
               sampling=SamplingConfig(old_logprob_source='sampler'))


def _ref_learner_window(cfg):
  """TRL's token_mask IS and off-policy mask over the concatenated window, written out on the
  model's own log-probs (on-policy rows: old = the learner's forward, stop-gradient), 'token'
  aggregation (dapo at K = S)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from learner_refs import ref_completion_logps  # pylint: disable=g-import-not-at-top
  sg = jax.lax.stop_gradient

  def ref(graphdef, params, b):
    logp = ref_completion_logps(graphdef, params, b)
    m = b['completion_mask'].astype(jnp.float32)
    adv = b['advantages'][:, None]
    old = jnp.where(b['has_old'][:, None], b['old_logps'], sg(logp))
    w = jnp.exp(jnp.where(m > 0, sg(old) - b['sampler_logps'], 0.0))
    w = jnp.where((w < cfg.sampler_is_clip_min) | (w > cfg.sampler_is_clip_max), 0.0, w)
    kl = jnp.sum(jnp.where(m > 0, b['sampler_logps'] - sg(logp), 0.0), 1) / jnp.maximum(
        jnp.sum(m, 1), 1.0)
    keep = (b['advantages'] >= 0) | (kl <= cfg.off_policy_mask_threshold)
    r = jnp.exp(logp - old)
    policy = -jnp.minimum(r * adv, jnp.clip(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * adv)
    return jnp.sum(m * policy * w * keep[:, None]) / jnp.sum(m)
  return ref


@pytest.mark.slow
def test_learner_with_sampler_weights_is_exact():
  """Through the learner (K = 3): the batch's sampler_logps reach the loss, the on-policy rows
  take the learner's own forward as old, and the applied gradient is the one-pass one."""
  from jaxrl_ga import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from learner_refs import TC, run_learner, synthetic_rollout  # pylint: disable=g-import-not-at-top
  cfg = GRPOLossConfig(aggregation='token', sampler_is_correction=True,
                       sampler_is_mode='token_mask', sampler_is_clip_min=0.8,
                       sampler_is_clip_max=1.25, off_policy_mask_threshold=0.05)
  typical = -np.log(48.0)  # a freshly initialized model's log-prob of a token, about

  def make(rng, s):
    b = synthetic_rollout(rng, 4)
    b['has_old'] = np.arange(4) % 2 == s % 2  # half the rows off-policy
    b['old_logps'] = (typical + rng.normal(0, 0.1, (4, TC))).astype(np.float32)
    b['sampler_logps'] = (typical + rng.normal(0, 0.3, (4, TC))).astype(np.float32)
    return b

  errs, outs, _, _ = run_learner(learner_lib.grpo_task_loss(cfg, TC), _ref_learner_window(cfg),
                                 make, 3)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5, atol=1e-7)
    assert 0 < o['sampling/importance_sampling_masked_fraction'] < 1
