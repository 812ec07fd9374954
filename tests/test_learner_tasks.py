"""SFT and DPO exactness, the per-micro-batch normalization bug, non-finite skipping, sequential
mode, the alignment diagnostic. References are one-pass computations written out in the test,
compared as in tests/test_learner.py (helpers in tests/learner_refs.py): clipping off (OPT), so the applied gradient is linear in the
accumulated one; the learner's grad_norm and loss outputs; the state's structure before any step.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import learner as learner_lib
from jaxrl_ga.config import DPOLossConfig, GRPOLossConfig, ScheduleConfig
import helpers
from learner_refs import (CLIPPED, MODEL, OPT, TC, TP, init_params, make_mesh, ref_dpo, ref_sft,
                          rel_err, run_learner, synthetic_dpo_batch, synthetic_rollout,
                          synthetic_sft_batch, token_logps)

_CLASSIC_EMITTERS = '--xla_cpu_use_fusion_emitters=false'  # conftest.py's


@pytest.mark.parametrize('k,mesh', [(1, (1, 1, 1)), (3, (2, 2, 2))])
def test_sft_accumulation_is_exact(k, mesh):
  errs, outs, _, _ = run_learner(learner_lib.sft_task_loss(), ref_sft,
                          lambda rng, s: synthetic_sft_batch(rng, 4), k, mesh_shape=mesh)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['grad_norm'], o['ref_grad_norm'], rtol=1e-5)
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5)


@pytest.mark.parametrize('aggregation,mesh', [('pair', (1, 1, 1)), ('pair', (2, 2, 2)),
                                              ('token', (1, 1, 1)), ('token', (2, 2, 2))])
def test_dpo_accumulation_is_exact(aggregation, mesh):
  cfg = DPOLossConfig(aggregation=aggregation)
  errs, outs, _, _ = run_learner(learner_lib.dpo_task_loss(cfg), ref_dpo(cfg),
                          lambda rng, s: synthetic_dpo_batch(rng, 4), 3, mesh_shape=mesh)
  assert max(errs) <= 1e-5, errs
  for o in outs:
    np.testing.assert_allclose(o['grad_norm'], o['ref_grad_norm'], rtol=1e-5)
    np.testing.assert_allclose(o['loss'], o['ref_loss'], rtol=1e-5)


def _grpo_batch(equal_counts):
  def make(rng, s):
    b = synthetic_rollout(rng, 4)
    if equal_counts:
      b['completion_mask'][:] = 1
    elif s % 2:  # alternate short and long micro-batches
      b['completion_mask'][:, 1:] = 0
    else:
      b['completion_mask'][:] = 1
    b['completion_tokens'] *= b['completion_mask']
    b['old_logps'] = np.zeros((4, TC), np.float32)
    b['has_old'] = np.zeros(4, bool)
    return b
  return make


def _ref_token_pg(graphdef, params, b):
  """On-policy (ratio 1) GRPO with token aggregation is the token-mean policy gradient."""
  tokens = jnp.concatenate([b['prompt_tokens'], b['completion_tokens']], 1)
  mask = jnp.concatenate([b['prompt_mask'], b['completion_mask']], 1)
  lp = token_logps(graphdef, params, tokens, mask)[:, TP - 1:]
  m = b['completion_mask'].astype(jnp.float32)
  return -jnp.sum(m * lp * b['advantages'][:, None]) / jnp.sum(m)


@pytest.mark.parametrize('equal_counts', [False, True])
def test_microbatch_token_shows_seed_003_bug(equal_counts):
  """Normalizing per micro-batch differs from the window's token mean unless the micro-batches
  hold the same number of tokens; `token` matches the on-policy policy gradient either way."""
  make = _grpo_batch(equal_counts)
  errs_bug, *_ = run_learner(learner_lib.grpo_task_loss(
      GRPOLossConfig(aggregation='microbatch_token'), TC), _ref_token_pg, make, 4, n_steps=1)
  errs_ok, *_ = run_learner(learner_lib.grpo_task_loss(GRPOLossConfig(aggregation='token'), TC),
                     _ref_token_pg, make, 4, n_steps=1)
  assert errs_ok[0] <= 1e-5
  if equal_counts:
    assert errs_bug[0] <= 1e-5
  else:
    assert errs_bug[0] > 1e-2


def test_nonfinite_window_is_skipped_and_counted():
  make_ok = _grpo_batch(False)

  def make(rng, s):
    b = make_ok(rng, s)
    if s == 4:  # second micro-batch of the second window
      b['advantages'][0] = np.nan
    return b

  mesh = make_mesh((1, 1, 1))
  graphdef, params, shardings = init_params(MODEL, mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=1, steps_per_generation=1,
                         grad_accum_steps=3)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(GRPOLossConfig(), TC), OPT,
                            mesh, shardings, optimizer_every=sched.optimizer_every)
  rng = np.random.default_rng(0)
  state, snapshots = None, []
  for s in range(9):
    b = make(rng, s)
    if state is None:
      state = lrn.init(params, b)
    state, out = lrn.step(state, b)
    if bool(out['stepped']):
      snapshots.append((jax.device_get(state.params), int(out['nonfinite_skipped'])))
  (p1, n1), (p2, n2), (p3, n3) = snapshots
  assert (n1, n2, n3) == (0, 1, 1)
  jax.tree.map(np.testing.assert_array_equal, p2, p1)  # the NaN window left params unchanged
  assert rel_err(p3, p2) > 0  # and training went on
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(p3))
  # Windows are counted (the schedule's policy versions advance), the skip is counted apart.
  assert int(state.optimizer_step) == 3 and int(state.nonfinite_skipped) == 1


def test_sequential_mode_steps_every_micro_batch_with_scaled_lr():
  k = 4
  errs, outs, lrn, state = run_learner(
      learner_lib.grpo_task_loss(GRPOLossConfig(), TC), _ref_token_pg, _grpo_batch(False), k,
      n_steps=1, update_mode='sequential')
  assert len(outs) == k  # one optimizer step per micro-batch
  assert max(errs) <= 1e-5  # each step is exact for its own micro-batch
  for o in outs:
    np.testing.assert_allclose(o['grad_norm'], o['ref_grad_norm'], rtol=1e-5)
  np.testing.assert_allclose(outs[0]['learning_rate'], OPT.learning_rate / np.sqrt(k), rtol=1e-6)


def test_alignment_diagnostic_matches_direct_computation():
  mesh = make_mesh((1, 1, 1))
  graphdef, params, shardings = init_params(MODEL, mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=1, steps_per_generation=1,
                         grad_accum_steps=2)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(GRPOLossConfig(), TC), OPT,
                            mesh, shardings, optimizer_every=sched.optimizer_every,
                            align_diagnostic=True)
  make = _grpo_batch(False)
  rng = np.random.default_rng(3)
  batches = [make(rng, s) for s in range(2)]
  state = lrn.init(params, batches[0])
  for b in batches:
    state, out = lrn.step(state, b)
  full = {kk: np.concatenate([b[kk] for b in batches]) for kk in batches[0]}
  n_tok = full['completion_mask'].sum()

  grad = jax.jit(jax.grad(lambda p, sub: _ref_token_pg(graphdef, p, sub) *
                          jnp.sum(sub['completion_mask']) / n_tok))  # one compile for both signs

  def part(sign):
    sub = dict(full, completion_mask=full['completion_mask'] * (np.sign(full['advantages']) ==
                                                                sign)[:, None])
    return grad(params, sub)

  gp, gn = part(1), part(-1)
  dot = sum(np.vdot(a, b) for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gn)))
  cos = dot / (np.sqrt(sum(np.vdot(a, a) for a in jax.tree.leaves(gp))) *
               np.sqrt(sum(np.vdot(b, b) for b in jax.tree.leaves(gn))))
  np.testing.assert_allclose(float(out['align/dot']), dot, rtol=1e-4)
  np.testing.assert_allclose(float(out['align/cosine']), cos, rtol=1e-4)
  # A window whose samples all have one sign has no alignment: NaN, not a misleading 0.
  for b in batches:
    state, out = lrn.step(state, dict(b, advantages=np.abs(b['advantages']) + 0.1))
  assert float(out['align/dot']) == 0.0 and np.isnan(float(out['align/cosine']))


@pytest.mark.parametrize('k', [3, 1])
def test_lazy_inner_optimizer_keeps_multisteps_semantics(k):
  """lazy_inner=True (the inner optimizer runs only when a step fires, without MultiSteps'
  selects) ends in the same state, bit for bit, as plain optax.MultiSteps, a skipped non-finite
  window included, the clip in the inner chain; K=1 fires at every micro-step.

  Bit for bit between two programs is a property of the compiler that runs them: it holds for
  XLA:CPU's default (MLIR) fusion emitters, which the product uses; with the classic emitters
  the suite compiles with (conftest.py), K=1's firing step rounds a few gradients by an ulp
  differently. So K=1 runs in a subprocess with the default emitters."""
  if k == 1 and _CLASSIC_EMITTERS in os.environ.get('XLA_FLAGS', ''):
    env = dict(os.environ, XLA_FLAGS=helpers.xla_flags().replace(
        _CLASSIC_EMITTERS, '--xla_cpu_use_fusion_emitters=true'))
    node = f'{__file__}::test_lazy_inner_optimizer_keeps_multisteps_semantics[1]'
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', node],
                         env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0 and '1 passed' in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    return
  mesh = make_mesh((1, 1, 1))
  graphdef, params, shardings = init_params(MODEL, mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=1, steps_per_generation=1,
                         grad_accum_steps=k)
  make = _grpo_batch(False)
  rng = np.random.default_rng(5)
  batches = [make(rng, s) for s in range(9)]
  batches[4]['advantages'][0] = np.nan
  finals = []
  for lazy in (True, False):
    lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(GRPOLossConfig(), TC),
                              CLIPPED, mesh, shardings, optimizer_every=sched.optimizer_every,
                              lazy_inner=lazy)
    state = lrn.init(params, batches[0])
    for b in batches:
      state, _ = lrn.step(state, b)
    finals.append(jax.device_get(state))
  assert int(finals[0].nonfinite_skipped) == 1
  assert int(finals[0].optimizer_step) == 9 // k  # MultiSteps counts the skipped window too
  jax.tree.map(np.testing.assert_array_equal, finals[0], finals[1])
