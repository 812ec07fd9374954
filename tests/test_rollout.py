"""The rollout step pays old-log-prob forward passes only where the slice rule says, and every
off-policy slice trains against log-probs of the policy that generated it."""

import jax
import numpy as np

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import rollout as rollout_lib
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
  engine = rollout_lib.RolloutEngine(graphdef, sched, samp, loss_cfg, table, mesh, shardings,
                                     eos_id=EOS, pad_id=PAD)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(loss_cfg, TC), OptimizerConfig(
      learning_rate=1e-2), sched, mesh, shardings)
  logps_fn = jax.jit(lambda p, b: learner_lib.completion_logps(
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
  engine = rollout_lib.RolloutEngine(graphdef, sched, samp, GRPOLossConfig(), table, mesh,
                                     shardings, eos_id=EOS, pad_id=PAD, defer_old_logps=True)
  logps_fn = jax.jit(lambda p, b: learner_lib.completion_logps(
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
