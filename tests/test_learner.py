"""The learner step applies, at every optimizer step, the update of the one-pass window loss.

The reference in each test is computed independently of the accumulation machinery: the window's
micro-batches are concatenated and the window loss is written out from the design doc's table
(per-token objective, then token / sequence / constant normalization over the whole window),
differentiated in one pass, clipped (or not, as the optimizer config says), and applied with a
plain optax AdamW.

What is compared at every optimizer step (``_applied_grad_err``): the gradient the learner applied,
read from AdamW's first moment (b1 = 0), against the one-pass gradient. Clipping is off in all but
one case (``CLIPPED``), so the first moment is the window-normalized accumulated gradient itself,
linear in it: a wrong scale (a wrong denominator, a factor K) shows, which a clip to a fixed norm
would hide. The learner's ``grad_norm`` output (before clipping) against the one-pass gradient's
norm; the ``loss`` output against the one-pass loss; the param update against optax's AdamW. The
state's structure (what trains, what the optimizer state holds) is checked before any step.
tests/mutants.py lists the bugs these tests are known to catch and checks that they do.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import schedule, sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, OptimizerConfig, ScheduleConfig
from jaxrl_ga.models import transformer as tfm

MODEL = tfm.ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
TP, TC = 5, 6  # prompt and completion lengths
# b1=0 makes Adam's first moment the applied (normalized, clipped) gradient itself; with clipping
# off it is linear in the accumulated gradient.
OPT = OptimizerConfig(learning_rate=3e-3, b1=0.0, b2=0.99, max_grad_norm=0.0)
# The clipped case: 0.05 is under every window gradient's norm here, so the clip acts, and it must
# scale by the one-pass gradient's norm (normalize, then clip).
CLIPPED = dataclasses.replace(OPT, max_grad_norm=0.05)


def _mesh(shape):
  return sharding.make_mesh(MeshConfig(*shape), jax.devices()[:int(np.prod(shape))])


def _norm(tree):
  """Global norm, summed in float64."""
  return np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))


def _rel_err(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return _norm(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y), a, b)) / (
      _norm(b))


def _applied_grad(state):
  return optax.tree.get(state.opt_state.inner_opt_state, 'mu')


def _reference_optimizer(opt: OptimizerConfig):
  """optax's clip (if on) and AdamW, on the one-pass gradient."""
  clip = [optax.clip_by_global_norm(opt.max_grad_norm)] if opt.max_grad_norm else []
  return optax.chain(*clip, optax.adamw(opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                        weight_decay=opt.weight_decay))


def _check_state(state, params):
  """Structure first: the state trains exactly ``params`` (tree and dtypes), and the MultiSteps
  accumulator and AdamW's moments have the same tree, in float32."""
  tree = jax.tree.structure(params)
  assert jax.tree.structure(state.params) == tree
  for x, p in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    assert x.shape == p.shape and x.dtype == p.dtype
  for moment in (state.opt_state.acc_grads, optax.tree.get(state.opt_state, 'mu'),
                 optax.tree.get(state.opt_state, 'nu')):
    assert jax.tree.structure(moment) == tree
    assert {x.dtype for x in jax.tree.leaves(moment)} == {jnp.dtype('float32')}


def _applied_grad_err(state, g, opt: OptimizerConfig) -> float:
  """The relative error of the gradient the learner applied at its last optimizer step (AdamW's
  first moment) against the one-pass gradient ``g``, clipped by g's own norm in the clipped case
  (where the clip must act)."""
  if opt.max_grad_norm:
    norm = _norm(g)
    assert norm > opt.max_grad_norm, 'the clipped case must clip'
    g = jax.tree.map(lambda x: x * (opt.max_grad_norm / norm), g)
  return _rel_err(_applied_grad(state), g)


def _rollout(rng, n, group=1):
  """n synthetic completions with variable prompt padding and completion lengths; rows
  ``g*group .. g*group+group-1`` share one prompt (a GRPO group)."""
  prompt_len = np.repeat(rng.integers(1, TP + 1, size=n // group), group)
  comp_len = rng.integers(1, TC + 1, size=n)
  prompt_mask = (np.arange(TP)[None] >= TP - prompt_len[:, None]).astype(np.int32)
  comp_mask = (np.arange(TC)[None] < comp_len[:, None]).astype(np.int32)
  adv = rng.normal(size=n).astype(np.float32)
  adv[rng.random(n) < 0.2] = 0.0
  prompts = np.repeat(rng.integers(0, MODEL.vocab_size, (n // group, TP)), group, axis=0)
  return dict(
      prompt_tokens=prompts.astype(np.int32) * prompt_mask,
      prompt_mask=prompt_mask,
      completion_tokens=rng.integers(0, MODEL.vocab_size, (n, TC)).astype(np.int32) * comp_mask,
      completion_mask=comp_mask, advantages=adv)


def _ref_completion_logps(graphdef, params, batch):
  """Log-probs [B, TC] of the completion tokens from the full forward's logits over each row's
  whole prompt + completion sequence."""
  tokens = jnp.concatenate([batch['prompt_tokens'], batch['completion_tokens']], 1)
  mask = jnp.concatenate([batch['prompt_mask'], batch['completion_mask']], 1)
  logits = tfm.merge(graphdef, params)(tokens, mask)[:, TP - 1:-1]
  return jnp.take_along_axis(jax.nn.log_softmax(logits), batch['completion_tokens'][..., None],
                             -1)[..., 0]


def _ref_grpo_window_loss(graphdef, params, batch, cfg: GRPOLossConfig):
  """The design doc's window loss over the concatenated window, written out directly."""
  logp = _ref_completion_logps(graphdef, params, batch)
  old = jnp.where(batch['has_old'][:, None], batch['old_logps'], jax.lax.stop_gradient(logp))
  ratio = jnp.exp(logp - old)
  a = batch['advantages'][:, None]
  per_tok = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * a)
  m = batch['completion_mask'].astype(jnp.float32)
  n_seq = m.shape[0]  # every synthetic completion has >= 1 token
  if cfg.aggregation == 'token':
    return jnp.sum(m * per_tok) / jnp.sum(m)
  if cfg.aggregation == 'sequence':
    return jnp.mean(jnp.sum(m * per_tok, 1) / jnp.sum(m, 1))
  assert cfg.aggregation == 'constant'
  return jnp.sum(m * per_tok) / (n_seq * TC)


def _run_grpo(sched: ScheduleConfig, loss_cfg: GRPOLossConfig, mesh_shape, n_opt_steps,
              model=MODEL, trainable=None, check_state=None, scan_layers=True,
              share_prompts=False, opt=OPT):
  """Drives the learner through the schedule with table-driven old log-probs; checks every
  optimizer step against the one-pass reference. Returns the max relative errors of the applied
  gradient and of the param update; asserts the loss and grad_norm outputs on the way.

  ``trainable(params, shardings)`` -> ((params, frozen), (shardings, frozen shardings)): train
  part of the params (LoRA: the adapters, tests/test_lora.py); ``check_state(state, frozen)``
  runs on the initial state, after ``_check_state`` and before any step, and on the final state.
  ``opt``: OPT (clipping off) or CLIPPED. ``scan_layers``: the learner's layers scanned or unrolled
  (model.scan_layers); the reference's forward always scans. ``share_prompts``: the rollouts'
  G completions share a prompt and the learner and the old-log-prob pass run each prompt once
  per ``rollout.prompt_share`` rows (model.share_prompt_prefix); the reference's forward
  computes every row's prompt itself. Returns the max relative errors."""
  mesh = _mesh(mesh_shape)
  graphdef, params, shardings = sharding.init_params(model, seed=0, mesh=mesh)
  frozen = frozen_sh = None
  if trainable is not None:
    (params, frozen), (shardings, frozen_sh) = trainable(params, shardings)
  share = rollout_lib.prompt_share(sched, sharding.data_parallel_size(mesh), share_prompts)
  assert share_prompts == (share > 1)
  task = learner_lib.grpo_task_loss(loss_cfg, TC, scan_layers=scan_layers, share_prompts=share)
  lrn = learner_lib.Learner(graphdef, task, opt, mesh, shardings,
                            optimizer_every=sched.optimizer_every, frozen_shardings=frozen_sh)
  table = schedule.build_table(sched)
  rng = np.random.default_rng(1)
  bsh = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, np.ndim(x)))
  old_fn = jax.jit(lambda p, b: learner_lib.completion_logps(
      tfm.merge(graphdef, p, frozen), b['prompt_tokens'], b['prompt_mask'],
      b['completion_tokens'], b['completion_mask'], share_prompts=share)[0])
  ref_loss_fn = lambda p, b: _ref_grpo_window_loss(graphdef, tfm.combine(p, frozen), b, loss_cfg)
  ref_grad_fn = jax.jit(jax.grad(ref_loss_fn))
  ref_opt = _reference_optimizer(opt)
  ref_state = ref_opt.init(params)

  b, s_, e = sched.micro_batch_size, sched.steps_per_generation, sched.micro_steps_per_rollout
  k = sched.grad_accum_steps
  state, window, grad_errs, param_errs = None, [], [], []
  for s in range(n_opt_steps * k):
    r = s // e
    if s % e == 0:  # a new rollout, generated by the current policy
      ro = _rollout(rng, s_ * b, sched.num_generations if share_prompts else 1)
      marks = table.slice_recompute[r % table.period_rollouts]
      cur = state.params if state is not None else params
      old = np.asarray(old_fn(cur, {kk: bsh(v) for kk, v in ro.items()}))
      ro['old_logps'] = np.where(np.repeat(marks, b)[:, None], old, 0.0).astype(np.float32)
      ro['has_old'] = np.repeat(marks, b)
      gen_version = s // k
    j = s % s_
    mb = {kk: v[j * b:(j + 1) * b] for kk, v in ro.items()}
    # The invariant: a slice trained off-policy has old log-probs of its generating policy.
    assert (s // k != gen_version) <= bool(mb['has_old'][0])
    mb = {kk: bsh(v) for kk, v in mb.items()}
    if state is None:
      state = lrn.init(params, mb, frozen)
      _check_state(state, params)
      if check_state is not None:
        check_state(state, frozen)
    if s % k == 0:
      theta = jax.device_get(state.params)
      window = []
    window.append(mb)
    state, out = lrn.step(state, mb, frozen)
    assert bool(out['stepped']) == ((s + 1) % k == 0)
    if (s + 1) % k == 0:
      full = {kk: np.concatenate([np.asarray(w[kk]) for w in window]) for kk in window[0]}
      g = ref_grad_fn(theta, full)
      grad_errs.append(_applied_grad_err(state, g, opt))
      upd, ref_state = ref_opt.update(g, ref_state, theta)
      want = optax.apply_updates(theta, upd)
      delta = jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, theta)
      want_delta = jax.tree.map(lambda a, b: np.asarray(a) - b, want, theta)
      param_errs.append(_rel_err(delta, want_delta))
      # The window's loss and grad_norm metrics are the one-pass loss and gradient norm.
      ref_loss = ref_loss_fn(theta, full)
      np.testing.assert_allclose(float(out['loss']), float(ref_loss), rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(float(out['grad_norm']), _norm(g), rtol=1e-5)
  if check_state is not None:
    check_state(state, frozen)
  return max(grad_errs), max(param_errs)


@pytest.mark.parametrize('aggregation,ksm,mesh,opt', [
    ('token', (3, 2, 1), (1, 1, 1), OPT),      # a window spans two rollouts
    ('token', (3, 2, 1), (2, 2, 2), CLIPPED),  # ... sharded over 8 devices, clipped
    ('sequence', (3, 2, 1), (2, 2, 2), OPT),
    ('constant', (4, 3, 1), (2, 2, 2), OPT),   # TRL PR #3493's example
    ('sequence', (2, 2, 2), (1, 1, 1), OPT),   # aligned, two iterations: every slice on-policy
    ('constant', (3, 1, 2), (1, 1, 1), OPT),   # two iterations, off-policy second passes
], ids=['token-1dev', 'token-8dev-clipped', 'sequence-8dev', 'constant-8dev', 'sequence-aligned',
        'constant-iterations'])
def test_grpo_accumulation_is_exact(aggregation, ksm, mesh, opt, compile_log):
  k, s, mu = ksm
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=s,
                         num_iterations=mu, grad_accum_steps=k)
  grad_err, param_err = _run_grpo(sched, GRPOLossConfig(aggregation=aggregation), mesh,
                                  n_opt_steps=2, opt=opt)
  assert compile_log.count('_micro_step') == 1  # one compile over the whole run
  assert grad_err <= 1e-5
  assert param_err <= 1e-5


@pytest.mark.parametrize('bgs,mesh,scan', [
    ((8, 4, 2), (1, 1, 1), True),   # R = 4: two prompts per micro-batch, scanned layers
    ((4, 8, 2), (1, 1, 1), False),  # R = 4: half a group per micro-batch, unrolled
    ((16, 4, 1), (2, 2, 1), True),  # R = gcd(4, 16 / 4 shards) = 4 on a 4-device mesh
])
def test_shared_prompt_forward_accumulates_exactly(bgs, mesh, scan, compile_log):
  """model.share_prompt_prefix: the learner and the old-log-prob pass run each group's prompt
  once (Transformer.hidden_after_prefix); the one-pass reference runs every row's whole
  sequence. A window spans two rollouts (K=3, S=2), with off-policy slices."""
  b, g, s = bgs
  sched = ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s,
                         num_iterations=1, grad_accum_steps=3)
  grad_err, param_err = _run_grpo(sched, GRPOLossConfig(aggregation='token'), mesh,
                                  n_opt_steps=2, scan_layers=scan, share_prompts=True)
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-5
  # AdamW divides by sqrt(v): on these rows (G copies of each prompt) some gradient entries are
  # near zero and the update's relative rounding grows; the unshared learner on the same data is
  # at 4e-6 to 3.8e-5 here, the shared one at 1e-5 to 1.8e-5.
  assert param_err <= 1e-4


@pytest.mark.parametrize('remat', ['full', 'save_dots'])
def test_shared_prompt_forward_with_remat_matches_full_forward(remat):
  """The memory knob model.remat around the shared forward's layers: log-probs and their
  gradients equal those of the full forward's logits over every row's whole sequence."""
  graphdef, params, _ = sharding.init_params(MODEL, seed=0, mesh=_mesh((1, 1, 1)))
  rows = _rollout(np.random.default_rng(3), 8, 4)
  weights = np.random.default_rng(4).normal(size=(8, TC)).astype(np.float32)
  weights *= rows['completion_mask']

  def shared(p):
    return jnp.sum(weights * learner_lib.completion_logps(
        tfm.merge(graphdef, p), rows['prompt_tokens'], rows['prompt_mask'],
        rows['completion_tokens'], rows['completion_mask'], remat=remat, share_prompts=4)[0])

  def full(p):
    return jnp.sum(weights * _ref_completion_logps(graphdef, p, rows))

  np.testing.assert_allclose(float(shared(params)), float(full(params)), rtol=1e-6)
  assert _rel_err(jax.grad(shared)(params), jax.grad(full)(params)) <= 1e-5


def test_shared_prompt_forward_does_less_work():
  """The shared forward's compiled FLOPs are those of P = B/R prompts plus B completions, not of
  B whole rows: XLA's own count, against the unshared program's, on a model whose matmuls
  dominate (the count must fall by the prompt positions' share, times (R-1)/R)."""
  model = tfm.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  graphdef, params, _ = sharding.init_params(model, seed=0, mesh=_mesh((1, 1, 1)))
  b, r, tp, tc = 8, 4, 24, 8
  rows = _rollout(np.random.default_rng(0), b, r)
  pt, pm = rows['prompt_tokens'][:, :1].repeat(tp, 1), np.ones((b, tp), np.int32)
  ct, cm = rows['completion_tokens'][:, :1].repeat(tc, 1), np.ones((b, tc), np.int32)

  def flops(share):
    loss = lambda p: jnp.sum(learner_lib.completion_logps(
        tfm.merge(graphdef, p), pt, pm, ct, cm, share_prompts=share)[0])
    return jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()['flops']

  unshared, shared = flops(1), flops(r)
  # Matmul work is linear in the positions run through the layers: B*(tp+tc) against
  # B/R*tp + B*tc (the lm head, at the B*tc completion positions, is the same on both sides).
  expected = (b // r * tp + b * tc) / (b * (tp + tc))
  assert shared / unshared < 0.5  # what sharing gains at this shape ...
  assert abs(shared / unshared - expected) < 0.12  # ... and about what the positions predict


def test_unrolled_layers_accumulate_exactly(compile_log):
  """model.scan_layers=False (the CPU configs' unrolled layer loop) against the same one-pass
  reference, on a window that spans two rollouts and 8 devices."""
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         num_iterations=1, grad_accum_steps=3)
  grad_err, param_err = _run_grpo(sched, GRPOLossConfig(aggregation='token'), (2, 2, 2),
                                  n_opt_steps=2, scan_layers=False)
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-5
  assert param_err <= 1e-5
  # And the knob does unroll: the scanned forward lowers to a while loop, the unrolled one not.
  graphdef, params, _ = sharding.init_params(MODEL, seed=0, mesh=_mesh((1, 1, 1)))
  rows = _rollout(np.random.default_rng(0), 2)
  hlo = lambda scan: jax.jit(lambda p, t, m: learner_lib.completion_logps(
      tfm.merge(graphdef, p), t, m, t, m, scan_layers=scan)).lower(
          params, rows['prompt_tokens'], rows['prompt_mask']).as_text()
  assert 'stablehlo.while' in hlo(True) and 'stablehlo.while' not in hlo(False)
