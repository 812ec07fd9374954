"""The learner driven against one-pass references, shared by the learner, LoRA and peer tests.

The reference of each window is computed independently of the accumulation machinery: the
window's micro-batches are concatenated, the window loss written out from docs/design.md's table,
differentiated in one pass and applied with a plain optax AdamW; the learner's applied gradient
is read from AdamW's first moment (b1 = 0).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def make_mesh(shape):
  return sharding.make_mesh(MeshConfig(*shape), jax.devices()[:int(np.prod(shape))])


_INITIAL = {}


def init_params(model, mesh, seed=0):
  """sharding.init_params(model, seed, mesh): (graphdef, params, shardings). Its jitted init
  compiles anew at every call (a new closure); the host values are computed once per (model,
  seed, mesh) in this process and put on the mesh again, as fresh arrays (a learner step may
  donate them)."""
  key = (model, seed, mesh)
  if key not in _INITIAL:
    graphdef, params, shardings = sharding.init_params(model, seed=seed, mesh=mesh)
    _INITIAL[key] = graphdef, jax.device_get(params), shardings
  graphdef, host, shardings = _INITIAL[key]
  return graphdef, jax.device_put(host, shardings), shardings


def global_norm(tree):
  """Global norm, summed in float64."""
  return np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))


def rel_err(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return global_norm(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y), a, b)) / (
      global_norm(b))


def applied_grad(state):
  return optax.tree.get(state.opt_state.inner_opt_state, 'mu')


def reference_optimizer(opt: OptimizerConfig):
  """optax's clip (if on) and AdamW, on the one-pass gradient."""
  clip = [optax.clip_by_global_norm(opt.max_grad_norm)] if opt.max_grad_norm else []
  return optax.chain(*clip, optax.adamw(opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                        weight_decay=opt.weight_decay))


def check_structure(state, params):
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


def applied_grad_err(state, g, opt: OptimizerConfig) -> float:
  """The relative error of the gradient the learner applied at its last optimizer step (AdamW's
  first moment) against the one-pass gradient ``g``, clipped by g's own norm in the clipped case
  (where the clip must act)."""
  if opt.max_grad_norm:
    norm = global_norm(g)
    assert norm > opt.max_grad_norm, 'the clipped case must clip'
    g = jax.tree.map(lambda x: x * (opt.max_grad_norm / norm), g)
  return rel_err(applied_grad(state), g)


def synthetic_rollout(rng, n, group=1):
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


def ref_completion_logps(graphdef, params, batch):
  """Log-probs [B, Tc] of the completion tokens from the full forward's logits over each row's
  whole prompt + completion sequence."""
  tokens = jnp.concatenate([batch['prompt_tokens'], batch['completion_tokens']], 1)
  mask = jnp.concatenate([batch['prompt_mask'], batch['completion_mask']], 1)
  logits = tfm.merge(graphdef, params)(tokens, mask)[:, batch['prompt_tokens'].shape[1] - 1:-1]
  return jnp.take_along_axis(jax.nn.log_softmax(logits), batch['completion_tokens'][..., None],
                             -1)[..., 0]


def ref_grpo_window_loss(graphdef, params, batch, cfg: GRPOLossConfig):
  """The design doc's window loss over the concatenated window, written out directly."""
  logp = ref_completion_logps(graphdef, params, batch)
  old = jnp.where(batch['has_old'][:, None], batch['old_logps'], jax.lax.stop_gradient(logp))
  ratio = jnp.exp(logp - old)
  a = batch['advantages'][:, None]
  per_tok = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * a)
  if cfg.beta > 0:  # the k3 estimator of KL(policy || reference), Schulman's
    d = batch['ref_logps'] - logp
    per_tok = per_tok + cfg.beta * (jnp.exp(d) - d - 1)
  m = batch['completion_mask'].astype(jnp.float32)
  n_seq = m.shape[0]  # every synthetic completion has >= 1 token
  if cfg.aggregation == 'token':
    return jnp.sum(m * per_tok) / jnp.sum(m)
  if cfg.aggregation == 'sequence':
    return jnp.mean(jnp.sum(m * per_tok, 1) / jnp.sum(m, 1))
  assert cfg.aggregation == 'constant'  # the batch's width is max_completion_length
  return jnp.sum(m * per_tok) / (n_seq * m.shape[1])


def run_grpo_learner(sched: ScheduleConfig, loss_cfg: GRPOLossConfig, mesh_shape, n_opt_steps,
              model=MODEL, trainable=None, check_state=None, scan_layers=True,
              share_prompts=False, opt=OPT, rtol=1e-5):
  """Drives the learner through the schedule with table-driven old log-probs; checks every
  optimizer step against the one-pass reference. Returns the max relative errors of the applied
  gradient and of the param update; asserts the loss and grad_norm outputs on the way.

  ``trainable(params, shardings)`` -> ((params, frozen), (shardings, frozen shardings)): train
  part of the params (LoRA: the adapters, tests/test_lora.py); ``check_state(state, frozen)``
  runs on the initial state, after ``check_structure`` and before any step, and on the final state.
  ``opt``: OPT (clipping off) or CLIPPED. ``scan_layers``: the learner's layers scanned or unrolled
  (model.scan_layers); the reference's forward always scans. ``share_prompts``: the rollouts'
  G completions share a prompt and the learner and the old-log-prob pass run each prompt once
  per ``rollout.prompt_share`` rows (model.share_prompt_prefix); the reference's forward
  computes every row's prompt itself. ``rtol``: of the loss and grad_norm outputs (bfloat16
  params need more than float32's 1e-5). Returns the max relative errors."""
  mesh = make_mesh(mesh_shape)
  graphdef, params, shardings = init_params(model, mesh)
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
  ref_loss_fn = lambda p, b: ref_grpo_window_loss(graphdef, tfm.combine(p, frozen), b, loss_cfg)
  ref_value_and_grad = jax.jit(jax.value_and_grad(ref_loss_fn))
  ref_opt = reference_optimizer(opt)
  ref_state = ref_opt.init(params)
  ref_update = jax.jit(ref_opt.update)  # one compile, not one per optax op and leaf shape

  b, s_, e = sched.micro_batch_size, sched.steps_per_generation, sched.micro_steps_per_rollout
  k = sched.grad_accum_steps
  state, window, grad_errs, param_errs = None, [], [], []
  for s in range(n_opt_steps * k):
    r = s // e
    if s % e == 0:  # a new rollout, generated by the current policy
      ro = synthetic_rollout(rng, s_ * b, sched.num_generations if share_prompts else 1)
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
      check_structure(state, params)
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
      ref_loss, g = ref_value_and_grad(theta, full)
      grad_errs.append(applied_grad_err(state, g, opt))
      upd, ref_state = ref_update(g, ref_state, theta)
      want = optax.apply_updates(theta, upd)
      delta = jax.tree.map(lambda a, b: np.asarray(a) - b, state.params, theta)
      want_delta = jax.tree.map(lambda a, b: np.asarray(a) - b, want, theta)
      param_errs.append(rel_err(delta, want_delta))
      # The window's loss and grad_norm metrics are the one-pass loss and gradient norm.
      np.testing.assert_allclose(float(out['loss']), float(ref_loss), rtol=rtol, atol=1e-7)
      np.testing.assert_allclose(float(out['grad_norm']), global_norm(g), rtol=rtol)
  if check_state is not None:
    check_state(state, frozen)
  return max(grad_errs), max(param_errs)



T = 8  # SFT / DPO sequence length


def token_logps(graphdef, params, tokens, mask):
  logits = tfm.merge(graphdef, params)(tokens, mask)[:, :-1]
  return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]


def synthetic_sft_batch(rng, n):
  length = rng.integers(3, T + 1, size=n)
  mask = (np.arange(T)[None] < length[:, None]).astype(np.int32)
  prompt = rng.integers(1, 3, size=n)
  loss_mask = mask * (np.arange(T)[None] >= prompt[:, None])
  return dict(tokens=rng.integers(0, MODEL.vocab_size, (n, T)).astype(np.int32) * mask,
              attention_mask=mask, loss_mask=loss_mask.astype(np.int32))


def ref_sft(graphdef, params, b):
  m = b['loss_mask'][:, 1:].astype(jnp.float32)
  return -jnp.sum(m * token_logps(graphdef, params, b['tokens'], b['attention_mask'])) / jnp.sum(m)


def synthetic_dpo_batch(rng, n):
  out = {}
  for side in ('chosen', 'rejected'):
    b = synthetic_sft_batch(rng, n)
    out.update({f'{side}_{k}': v for k, v in b.items()})
  out['ref_chosen_logps'] = rng.normal(-20, 2, n).astype(np.float32)
  out['ref_rejected_logps'] = rng.normal(-20, 2, n).astype(np.float32)
  return out


def ref_dpo(cfg):
  def ref(graphdef, params, b):
    def seq(side):
      m = b[f'{side}_loss_mask'][:, 1:].astype(jnp.float32)
      lp = token_logps(graphdef, params, b[f'{side}_tokens'], b[f'{side}_attention_mask'])
      return jnp.sum(m * lp, 1), jnp.sum(m, 1)
    (c, nc), (r, nr) = seq('chosen'), seq('rejected')
    h = (c - r) - (b['ref_chosen_logps'] - b['ref_rejected_logps'])
    per_pair = -jax.nn.log_sigmoid(cfg.beta * h)
    if cfg.aggregation == 'pair':
      return jnp.mean(per_pair)
    return jnp.sum((nc + nr) * per_pair) / jnp.sum(nc + nr)
  return ref


def run_learner(task_loss, ref_loss, make_batch, k, mesh_shape=(1, 1, 1), n_steps=2, opt=OPT,
         update_mode='accumulate'):
  """Feeds k*n_steps micro-batches; checks the state's structure first. -> (the applied
  gradient's relative error per window, the window outputs with the one-pass loss and gradient
  norm as 'ref_loss' and 'ref_grad_norm', the learner, the final state)."""
  mesh = make_mesh(mesh_shape)
  graphdef, params, shardings = init_params(MODEL, mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=1, steps_per_generation=1,
                         grad_accum_steps=k, update_mode=update_mode)
  lrn = learner_lib.Learner(graphdef, task_loss, opt, mesh, shardings,
                            optimizer_every=sched.optimizer_every,
                            lr_scale=learner_lib.sequential_lr_scale(opt, sched))
  rng = np.random.default_rng(0)
  ref_grad = jax.jit(jax.value_and_grad(lambda p, b: ref_loss(graphdef, p, b)))
  bsh = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, np.ndim(x)))
  state, errs, outs = None, [], []
  window_every = sched.optimizer_every
  for s in range(k * n_steps):
    mb = make_batch(rng, s)
    dev = {kk: bsh(v) for kk, v in mb.items()}
    if state is None:
      state = lrn.init(params, dev)
      check_structure(state, params)
    if s % window_every == 0:
      theta, window = jax.device_get(state.params), []
    window.append(mb)
    state, out = lrn.step(state, dev)
    if bool(out['stepped']):
      full = {kk: np.concatenate([w[kk] for w in window]) for kk in window[0]}
      loss, g = ref_grad(theta, full)
      errs.append(applied_grad_err(state, g, opt))
      outs.append(jax.device_get(out) | {'ref_loss': float(loss), 'ref_grad_norm': global_norm(g)})
  return errs, outs, lrn, state

