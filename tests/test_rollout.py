"""The rollout step pays old-log-prob forward passes only where the slice rule says, and every
off-policy slice trains against log-probs of the policy that generated it.

Values are checked against an independent reference: numpy float64 log_softmax(logits / T) of a
full forward pass over prompt + completion (``_np_logps``), for the sampler's, the old and the
reference-model log-probs, the k3 KL term through the GRPO loss, the sampler/learner agreement
metrics, and the DAPO mask of truncated completions.
"""

import functools

import jax
import numpy as np

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import logprobs
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import sampling
from jaxrl_ga import schedule, sharding
from jaxrl_ga.config import (GRPOLossConfig, MeshConfig, OptimizerConfig, SamplingConfig,
                             ScheduleConfig)
from jaxrl_ga.models import transformer as tfm

MODEL = tfm.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
TP, TC = 4, 5
EOS, PAD = 1, 0


def _prompts(rng, n):
  lengths = rng.integers(1, TP + 1, n)
  mask = (np.arange(TP)[None] >= TP - lengths[:, None]).astype(np.int32)
  return rng.integers(2, MODEL.vocab_size, (n, TP)).astype(np.int32) * mask, mask


def _run(source, mesh_shape=(1, 1, 1), n_rollouts=6, beta=0.0):
  mesh = sharding.make_mesh(MeshConfig(*mesh_shape), jax.devices()[:int(np.prod(mesh_shape))])
  graphdef, params, shardings = sharding.init_params(MODEL, seed=0, mesh=mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         num_iterations=1, grad_accum_steps=3)
  table = schedule.build_table(sched)
  samp = SamplingConfig(max_prompt_length=TP, max_completion_length=TC, temperature=1.0,
                        old_logprob_source=source)
  loss_cfg = GRPOLossConfig(beta=beta)
  engine = rollout_lib.RolloutEngine(graphdef, table, samp, loss_cfg, mesh, shardings,
                                     eos_id=EOS, pad_id=PAD)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(loss_cfg, TC), OptimizerConfig(
      learning_rate=1e-2), mesh, shardings, optimizer_every=sched.optimizer_every)
  logps_fn = jax.jit(lambda p, b: logprobs.completion_logps(
      tfm.merge(graphdef, p), b['prompt_tokens'], b['prompt_mask'], b['completion_tokens'],
      b['completion_mask'])[0])
  rng = np.random.default_rng(0)
  rstate, lstate = engine.init_state(0), None
  ref_params = params if beta > 0 else None
  s_, e, k = sched.steps_per_generation, sched.micro_steps_per_rollout, sched.grad_accum_steps
  checked_off_policy = 0
  for r in range(n_rollouts):
    cur = params if lstate is None else lstate.params
    gen_params, gen_version = jax.device_get(cur), (r * e) // k
    prompts = _prompts(rng, s_ * sched.micro_batch_size // sched.num_generations)
    buffer, rstate, metrics = engine.rollout(cur, ref_params, rstate, *prompts)
    # Slice-major rows g*G .. g*G+G-1 are the G completions of prompt g.
    np.testing.assert_array_equal(np.asarray(buffer.prompt_tokens).reshape(-1, TP),
                                  np.repeat(prompts[0], sched.num_generations, axis=0))
    adv = jax.device_put(rng.normal(size=(s_, sched.micro_batch_size)).astype(np.float32),
                         engine.advantage_sharding)
    for i in range(e):
      s = r * e + i
      mb = engine.micro_batch(buffer, s % s_, adv)
      if s // k != gen_version:  # off-policy: old log-probs from the generating policy
        assert bool(np.all(np.asarray(mb['has_old'])))
        m = np.asarray(mb['completion_mask']).astype(bool)
        want = np.asarray(logps_fn(gen_params, mb))
        np.testing.assert_allclose(np.asarray(mb['old_logps'])[m], want[m], atol=1e-5)
        checked_off_policy += 1
      if lstate is None:
        lstate = lrn.init(params, mb)
      lstate, _ = lrn.step(lstate, mb)
  return table, rstate, buffer, metrics, checked_off_policy


def test_forward_passes_equal_the_slice_rule(compile_log):
  table, rstate, _, metrics, checked = _run('recompute')
  assert compile_log.count('_rollout') == 1  # one compile over 6 rollouts
  periods = 6 // table.period_rollouts
  assert table.counts == {'trl_static': 6, 'rollout_rule': 2, 'slice_rule': 1}
  assert int(rstate.forward_passes) == table.counts['slice_rule'] * periods == 2
  # TRL's static rule would have paid every rollout: 6 rollouts * S = 12 slice passes.
  assert table.counts['trl_static'] * periods == 12
  assert checked == 2  # the two off-policy micro-steps were checked
  assert int(rstate.counter) == 6


def test_sampler_logps_as_old_logps_cost_no_forward_pass():
  _, rstate, buffer, _, checked = _run('sampler', n_rollouts=3)
  assert int(rstate.forward_passes) == 0
  marked = np.asarray(buffer.has_old)
  np.testing.assert_array_equal(np.asarray(buffer.old_logps)[marked],
                                np.asarray(buffer.sampler_logps)[marked])


def test_rollout_on_8_device_mesh_with_reference(compile_log):
  table, rstate, buffer, metrics, checked = _run('recompute', mesh_shape=(2, 2, 2), n_rollouts=3,
                                                 beta=0.04)
  assert compile_log.count('_rollout') == 1
  assert int(rstate.forward_passes) == 1 and checked == 1
  # The reference is the initial policy: on rollout 0 it equals the sampler's log-probs.
  assert buffer.ref_logps.shape == buffer.sampler_logps.shape
  # Agreement of sampler and learner log-probs where a slice was recomputed (rollout 1 of 3).
  assert buffer.prompt_tokens.sharding.spec == jax.sharding.PartitionSpec(
      None, ('data', 'fsdp'), None)


def test_reorder_by_advantage_keeps_old_logps_with_their_slices():
  """Rows moved into a marked slice get old log-probs of the generating policy (computed after
  the move), so ordering micro-batches by advantage sign never trains a slice off-policy
  without them."""
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  graphdef, params, shardings = sharding.init_params(MODEL, seed=0, mesh=mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         grad_accum_steps=3)
  table = schedule.build_table(sched)
  samp = SamplingConfig(max_prompt_length=TP, max_completion_length=TC)
  engine = rollout_lib.RolloutEngine(graphdef, table, samp, GRPOLossConfig(), mesh,
                                     shardings, eos_id=EOS, pad_id=PAD, defer_old_logps=True)
  logps_fn = jax.jit(lambda p, b: logprobs.completion_logps(
      tfm.merge(graphdef, p), b['prompt_tokens'], b['prompt_mask'], b['completion_tokens'],
      b['completion_mask'])[0])
  rng = np.random.default_rng(0)
  rstate = engine.init_state(0)
  for r in range(2):  # rollout 1 has its slice 1 marked (K=3, S=2)
    buffer, rstate, _ = engine.rollout(params, None, rstate, *_prompts(rng, 4))
    adv = rng.normal(size=(2, 4)).astype(np.float32)
    order = np.argsort(-adv.reshape(-1), kind='stable')
    new_buf, rstate, new_adv = engine.reorder(params, buffer, rstate, adv, order)
    flat = lambda x: np.asarray(x).reshape(8, *np.shape(x)[2:])
    np.testing.assert_array_equal(flat(new_buf.completion_tokens),
                                  flat(buffer.completion_tokens)[order])
    np.testing.assert_array_equal(np.asarray(new_adv).reshape(-1), adv.reshape(-1)[order])
    assert np.all(np.diff(np.asarray(new_adv).reshape(-1)) <= 0)  # positive first
    marks = table.slice_recompute[r]
    np.testing.assert_array_equal(np.asarray(new_buf.has_old), np.repeat(marks[:, None], 4, 1))
    for j in np.flatnonzero(marks):
      mb = engine.micro_batch(new_buf, j, new_adv)
      m = np.asarray(mb['completion_mask']).astype(bool)
      np.testing.assert_allclose(np.asarray(mb['old_logps'])[m],
                                 np.asarray(logps_fn(params, mb))[m], atol=1e-5)
  assert int(rstate.forward_passes) == table.slice_recompute[:2].sum() == 1


# -- values against numpy ------------------------------------------------------------------------
@functools.cache
def _forward(graphdef):
  return jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m))


def _np_logps(graphdef, params, prompt_tokens, prompt_mask, tokens, mask, temperature):
  """[N, Tc] float64: numpy log_softmax(logits / T) of one full forward pass over prompt +
  completion, at the completion tokens. Inputs [..., T] are flattened over the leading axes."""
  pt, pm = np.reshape(prompt_tokens, (-1, TP)), np.reshape(prompt_mask, (-1, TP))
  ct, cm = np.reshape(tokens, (-1, TC)), np.reshape(mask, (-1, TC))
  logits = np.asarray(_forward(graphdef)(params, np.concatenate([pt, ct], 1),
                                         np.concatenate([pm, cm], 1)), np.float64)
  x = logits[:, TP - 1:-1] / temperature
  x = x - x.max(-1, keepdims=True)
  x = x - np.log(np.exp(x).sum(-1, keepdims=True))
  return np.take_along_axis(x, ct[..., None], -1)[..., 0].reshape(np.shape(tokens))


def _sharp_params(seed, mesh, scale):
  """Random params with lm_head scaled: logits of order 1, so that log-probs, their differences
  between two models and the KL are far from their values at a uniform policy."""
  graphdef, params, shardings = sharding.init_params(MODEL, seed=seed, mesh=mesh)
  params = {**params, 'lm_head': params['lm_head'] * scale}
  return graphdef, params, shardings


def _offset(shape):
  """A known perturbation of the sampler's log-probs, [N, Tc]: 0.01 * (t + 1) + 0.001 * n."""
  n, t = shape
  return 0.01 * (np.arange(t)[None] + 1) + 0.001 * np.arange(n)[:, None]


def test_rollout_log_probs_kl_and_agreement_against_numpy(monkeypatch):
  """Two rollouts (the second has slice 1 marked: K=3, S=2) at T=0.8 with top-k and top-p, a
  reference model other than the policy (beta > 0):

  * sampler log-probs = numpy's tempered, untruncated log-softmax (what the learner computes);
  * old log-probs (recomputed) = numpy's on the marked slices, 0 elsewhere;
  * reference log-probs = numpy's of the reference params (not the policy's);
  * the GRPO loss of a micro-batch, with its k3 KL term, = numpy's per-token formula;
  * logp_agreement_{mean,max}_abs = numpy's mean / max |sampler - learner| over the completion
    tokens of the recomputed slices. The sampler's log-probs are shifted by a known offset
    (wrapping ``sampling.generate``) so the metric has something to measure; NaN when no slice
    was recomputed.
  """
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  graphdef, params, shardings = _sharp_params(0, mesh, 40.0)
  _, ref_params, _ = _sharp_params(1, mesh, 40.0)
  temperature, beta = 0.8, 0.5
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         grad_accum_steps=3)
  table = schedule.build_table(sched)
  samp = SamplingConfig(max_prompt_length=TP, max_completion_length=TC, temperature=temperature,
                        top_k=12, top_p=0.9)
  loss_cfg = GRPOLossConfig(beta=beta, epsilon_low=0.2, epsilon_high=0.28)
  engine = rollout_lib.RolloutEngine(graphdef, table, samp, loss_cfg, mesh, shardings,
                                     eos_id=EOS, pad_id=PAD)
  generate = sampling.generate

  def shifted(*args, **kwargs):
    out = generate(*args, **kwargs)
    return out.replace(logps=out.logps + _offset(out.logps.shape) * out.mask)

  monkeypatch.setattr(sampling, 'generate', shifted)
  np_logps = functools.partial(_np_logps, graphdef, temperature=temperature)
  loss_fn = jax.jit(lambda p, mb: learner_lib.grpo_task_loss(loss_cfg, TC, temperature)(
      tfm.merge(graphdef, p), mb))
  _, new_params, _ = _sharp_params(2, mesh, 40.0)  # the policy the learner evaluates
  rng = np.random.default_rng(1)
  rstate = engine.init_state(0)
  assert table.slice_recompute[:2].tolist() == [[False, False], [False, True]]
  for r in range(2):
    prompts = _prompts(rng, 4)
    buffer, rstate, metrics = engine.rollout(params, ref_params, rstate, *prompts)
    pt, pm = np.asarray(buffer.prompt_tokens), np.asarray(buffer.prompt_mask)
    ct, cm = np.asarray(buffer.completion_tokens), np.asarray(buffer.completion_mask)
    m = cm == 1
    policy = np_logps(params, pt, pm, ct, cm)  # [S, B, Tc]
    ref = np_logps(ref_params, pt, pm, ct, cm)
    # Generation order is i*S + j for row (j, i): the offset's row index follows it.
    offset = np.swapaxes(_offset((8, TC)).reshape(4, 2, TC), 0, 1) * cm
    sampler_logps = np.asarray(buffer.sampler_logps)
    np.testing.assert_allclose(sampler_logps[m], (policy + offset)[m], atol=1e-4, rtol=0)

    marks = table.slice_recompute[r]
    np.testing.assert_array_equal(np.asarray(buffer.has_old), np.repeat(marks[:, None], 4, 1))
    old = np.asarray(buffer.old_logps)
    np.testing.assert_allclose(old[marks][m[marks]], policy[marks][m[marks]], atol=1e-4, rtol=0)
    assert (old[~marks] == 0).all()

    assert np.abs(ref - policy)[m].mean() > 0.3  # the reference is really another model
    np.testing.assert_allclose(np.asarray(buffer.ref_logps)[m], ref[m], atol=1e-4, rtol=0)

    recomputed = m & marks[:, None, None]
    mean_abs = metrics['rollout/logp_agreement_mean_abs']
    max_abs = metrics['rollout/logp_agreement_max_abs']
    if recomputed.any():
      diff = np.abs(sampler_logps - policy)[recomputed]
      assert diff.mean() > 0.01
      np.testing.assert_allclose(float(mean_abs), diff.mean(), atol=1e-5, rtol=0)
      np.testing.assert_allclose(float(max_abs), diff.max(), atol=1e-5, rtol=0)
    else:
      assert np.isnan(float(mean_abs)) and np.isnan(float(max_abs))

    # The GRPO loss with its k3 KL term, for a policy other than the generating one.
    adv = rng.normal(size=(2, 4)).astype(np.float32)
    new = np_logps(new_params, pt, pm, ct, cm)
    for j in range(2):
      mb = engine.micro_batch(buffer, j, adv)
      terms = loss_fn(new_params, mb)
      mj = m[j]
      old_j = policy[j] if marks[j] else new[j]  # no old log-probs: on-policy, ratio 1
      ratio = np.exp(new[j] - old_j)
      a = adv[j][:, None].astype(np.float64)
      surrogate = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
      d = ref[j] - new[j]
      k3 = np.exp(d) - d - 1
      assert k3[mj].mean() > 0.1  # a KL term far from 0 and from its quadratic approximation
      np.testing.assert_allclose(float(terms.denominator), mj.sum())
      np.testing.assert_allclose(float(terms.numerator), (surrogate + beta * k3)[mj].sum(),
                                 rtol=1e-4, atol=1e-4)
      kl_sum, kl_weight = terms.mean_metrics['kl']
      np.testing.assert_allclose(float(kl_sum) / float(kl_weight), k3[mj].mean(), rtol=1e-4)


def test_slot_pool_rollout_keeps_the_buffer_layout():
  """``sampling.decode_slots``: the rollout decoded by a pool of 3 slots fills the same [S, B]
  buffer as the batched sampler: at a temperature that makes every draw the argmax, every row's
  completion is the greedy continuation of its own prompt (the full forward's argmax, numpy)
  and equals the batched rollout's row for row, with the same masks, EOS flags and log-probs
  (numpy's)."""
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  graphdef, params, shardings = _sharp_params(0, mesh, 40.0)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         grad_accum_steps=2)
  table = schedule.build_table(sched)
  temperature = 1e-3
  buffers = []
  prompts = _prompts(np.random.default_rng(3), 4)
  for slots in (0, 3):
    samp = SamplingConfig(max_prompt_length=TP, max_completion_length=TC,
                          temperature=temperature, decode_slots=slots)
    engine = rollout_lib.RolloutEngine(graphdef, table, samp, GRPOLossConfig(), mesh, shardings,
                                       eos_id=EOS, pad_id=PAD)
    buffers.append(engine.rollout(params, None, engine.init_state(0), *prompts)[0])
  batched, pooled = buffers
  for name in ('prompt_tokens', 'prompt_mask', 'completion_tokens', 'completion_mask',
               'ended_with_eos', 'has_old'):
    np.testing.assert_array_equal(np.asarray(getattr(pooled, name)),
                                  np.asarray(getattr(batched, name)))
  pt, pm = np.asarray(pooled.prompt_tokens), np.asarray(pooled.prompt_mask)
  ct, cm = np.asarray(pooled.completion_tokens), np.asarray(pooled.completion_mask)
  np.testing.assert_array_equal(pt.reshape(-1, TP), np.repeat(prompts[0], 2, axis=0))
  logits = np.asarray(_forward(graphdef)(params, np.concatenate([pt, ct], -1).reshape(-1, TP + TC),
                                         np.concatenate([pm, cm], -1).reshape(-1, TP + TC)))
  greedy = logits[:, TP - 1:-1].argmax(-1).reshape(ct.shape)
  m = cm == 1
  np.testing.assert_array_equal(ct[m], greedy[m])
  want = _np_logps(graphdef, params, pt, pm, ct, cm, temperature)
  np.testing.assert_allclose(np.asarray(pooled.sampler_logps)[m], want[m], atol=1e-3, rtol=0)


def test_mask_truncated_completions_leave_the_loss():
  """DAPO: with ``mask_truncated_completions``, a completion that hit max_completion_length
  without EOS has no token in the loss mask, and the loss is numpy's over the other rows only;
  without it, every completion counts. A crafted buffer with known EOS flags."""
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  graphdef, params, shardings = _sharp_params(0, mesh, 40.0)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         grad_accum_steps=2)
  table = schedule.build_table(sched)
  samp = SamplingConfig(max_prompt_length=TP, max_completion_length=TC)
  loss_cfg = GRPOLossConfig()
  rng = np.random.default_rng(2)
  pt, pm = _prompts(rng, 8)
  lengths = np.array([TC, 2, TC, 3, 1, TC, TC, 4])  # rows without EOS run to TC
  ended = np.array([False, True, True, True, True, False, True, True])  # row 2 ends on EOS at TC
  cm = (np.arange(TC)[None] < lengths[:, None]).astype(np.int32)
  ct = rng.integers(2, MODEL.vocab_size, (8, TC)).astype(np.int32)
  last = lengths - 1
  ct[np.arange(8)[ended], last[ended]] = EOS
  ct = np.where(cm == 1, ct, PAD).astype(np.int32)
  slab = lambda x: np.asarray(x).reshape(2, 4, *np.shape(x)[1:])
  buffer = rollout_lib.RolloutBuffer(
      prompt_tokens=slab(pt), prompt_mask=slab(pm), completion_tokens=slab(ct),
      completion_mask=slab(cm), ended_with_eos=slab(ended),
      sampler_logps=np.zeros((2, 4, TC), np.float32), old_logps=np.zeros((2, 4, TC), np.float32),
      has_old=np.zeros((2, 4), bool), ref_logps=None)
  adv = rng.normal(size=(2, 4)).astype(np.float32)
  loss_fn = jax.jit(lambda p, mb: learner_lib.grpo_task_loss(loss_cfg, TC)(tfm.merge(graphdef, p),
                                                                           mb))
  for mask_truncated in (True, False):
    engine = rollout_lib.RolloutEngine(graphdef, table, samp, loss_cfg, mesh, shardings,
                                       eos_id=EOS, pad_id=PAD,
                                       mask_truncated_completions=mask_truncated)
    for j in range(2):
      mb = engine.micro_batch(buffer, j, adv)
      keep = slab(ended)[j] if mask_truncated else np.ones(4, bool)
      want_mask = slab(cm)[j] * keep[:, None]
      np.testing.assert_array_equal(np.asarray(mb['completion_mask']), want_mask)
      # On-policy (no old log-probs): ratio 1, every kept token contributes -A.
      terms = loss_fn(params, mb)
      want = -(adv[j][:, None] * want_mask).sum() / want_mask.sum()
      np.testing.assert_allclose(float(terms.numerator) / float(terms.denominator), want,
                                 rtol=1e-5)
    if mask_truncated:
      assert (slab(cm)[~slab(ended)].sum() > 0)  # the batch really has truncated tokens
