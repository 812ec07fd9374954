"""The learner step applies, at every optimizer step, the update of the one-pass window loss.

The reference in each test is computed independently of the accumulation machinery: the window's
micro-batches are concatenated and the window loss is written out from the design doc's table
(per-token objective, then token / sequence / constant normalization over the whole window),
differentiated in one pass, clipped (or not, as the optimizer config says), and applied with a
plain optax AdamW.

What is compared at every optimizer step (``applied_grad_err``): the gradient the learner applied,
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
import pytest

from jaxrl_ga import learner as learner_lib
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, ScheduleConfig
from jaxrl_ga.models import transformer as tfm

from learner_refs import (CLIPPED, MODEL, OPT, TC, init_params, make_mesh, ref_completion_logps,
                          rel_err, run_grpo_learner, synthetic_rollout)


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
  grad_err, param_err = run_grpo_learner(sched, GRPOLossConfig(aggregation=aggregation), mesh,
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
  grad_err, param_err = run_grpo_learner(sched, GRPOLossConfig(aggregation='token'), mesh,
                                  n_opt_steps=2, scan_layers=scan, share_prompts=True)
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-5
  # AdamW divides by sqrt(v): on these rows (G copies of each prompt) some gradient entries are
  # near zero and the update's relative rounding grows; the unshared learner on the same data is
  # at 4e-6 to 3.8e-5 here, the shared one at 1e-5 to 1.8e-5.
  assert param_err <= 1e-4


def test_bfloat16_params_train_with_float32_optimizer_state(compile_log):
  """model.param_dtype=bfloat16 without LoRA (issue 47: it stopped at the first optimizer step
  with 'cond branches must have equal output types', AdamW's moments bfloat16 in one branch,
  float32 in the other). The accumulator and AdamW's moments are float32 (check_structure, before
  any step), the step compiles once, and the applied gradient and the update agree with the
  one-pass reference to bfloat16's precision: each micro-batch's gradient is bfloat16, as the
  params are (the reference's one-pass gradient too), and the update is rounded into them.
  Measured here: 2.5e-3 and 2.3e-2; a K-fold or a wrong-denominator step is off by 50% or more."""
  model = dataclasses.replace(MODEL, param_dtype='bfloat16')
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         num_iterations=1, grad_accum_steps=3)
  grad_err, param_err = run_grpo_learner(sched, GRPOLossConfig(aggregation='token'), (1, 1, 1),
                                         n_opt_steps=2, model=model, rtol=1e-2)
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-2
  assert param_err <= 5e-2


@pytest.mark.parametrize('remat', ['full', 'save_dots'])
def test_shared_prompt_forward_with_remat_matches_full_forward(remat):
  """The memory knob model.remat around the shared forward's layers: log-probs and their
  gradients equal those of the full forward's logits over every row's whole sequence."""
  graphdef, params, _ = init_params(MODEL, make_mesh((1, 1, 1)))
  rows = synthetic_rollout(np.random.default_rng(3), 8, 4)
  weights = np.random.default_rng(4).normal(size=(8, TC)).astype(np.float32)
  weights *= rows['completion_mask']

  def shared(p):
    return jnp.sum(weights * learner_lib.completion_logps(
        tfm.merge(graphdef, p), rows['prompt_tokens'], rows['prompt_mask'],
        rows['completion_tokens'], rows['completion_mask'], remat=remat, share_prompts=4)[0])

  def full(p):
    return jnp.sum(weights * ref_completion_logps(graphdef, p, rows))

  np.testing.assert_allclose(float(shared(params)), float(full(params)), rtol=1e-6)
  assert rel_err(jax.grad(shared)(params), jax.grad(full)(params)) <= 1e-5


def test_shared_prompt_forward_does_less_work():
  """The shared forward's compiled FLOPs are those of P = B/R prompts plus B completions, not of
  B whole rows: XLA's own count, against the unshared program's, on a model whose matmuls
  dominate (the count must fall by the prompt positions' share, times (R-1)/R)."""
  model = tfm.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  graphdef, params, _ = sharding.init_params(model, seed=0, mesh=make_mesh((1, 1, 1)))
  b, r, tp, tc = 8, 4, 24, 8
  rows = synthetic_rollout(np.random.default_rng(0), b, r)
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
  grad_err, param_err = run_grpo_learner(sched, GRPOLossConfig(aggregation='token'), (2, 2, 2),
                                  n_opt_steps=2, scan_layers=False)
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-5
  assert param_err <= 1e-5
  # And the knob does unroll: the scanned forward lowers to a while loop, the unrolled one not.
  graphdef, params, _ = init_params(MODEL, make_mesh((1, 1, 1)))
  rows = synthetic_rollout(np.random.default_rng(0), 2)
  hlo = lambda scan: jax.jit(lambda p, t, m: learner_lib.completion_logps(
      tfm.merge(graphdef, p), t, m, t, m, scan_layers=scan)).lower(
          params, rows['prompt_tokens'], rows['prompt_mask']).as_text()
  assert 'stablehlo.while' in hlo(True) and 'stablehlo.while' not in hlo(False)


# transformers' Trainer.get_decay_parameter_names (transformers 5.24, trainer.py): the parameters
# whose name matches one of these patterns, or that belong to an nn.LayerNorm, get no weight decay.
# TRL's trainers use it.
HF_NO_DECAY_PATTERNS = (r'bias', r'layernorm', r'rmsnorm', r'(?:^|\.)norm(?:$|\.)',
                        r'_norm(?:$|\.)')


@pytest.mark.parametrize('fixture', ['qwen2_tiny', 'gemma3_tiny'])
def test_weight_decay_spares_the_norms_and_biases_as_transformers_trainer(fixture, tmp_path):
  """With a zero gradient AdamW's step is its weight decay alone: w <- w (1 - lr wd). One such
  optimizer step on an HF checkpoint (Qwen2: q/k/v biases; Gemma 3: four norms per layer and q/k
  norms), written back in HF's names by the export, against transformers' rule: a tensor whose
  name matches HF_NO_DECAY_PATTERNS is unchanged, every other one scaled by (1 - lr wd). Decaying
  every leaf (jaxrl_ga before) moved the norms' scales and the biases."""
  import re
  from safetensors.numpy import load_file
  from jaxrl_ga.config import OptimizerConfig
  from jaxrl_ga.models import hf
  source = f'tests/fixtures/{fixture}'
  cfg = hf.model_config_from_hf(source)
  params = hf.load_params(source, cfg)
  lr, wd = 0.1, 0.5
  opt = learner_lib.make_optimizer(
      OptimizerConfig(learning_rate=lr, weight_decay=wd, max_grad_norm=0.0), optimizer_every=1)
  state = opt.init(learner_lib.float32_like(params))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = opt.update(zeros, state, params, denominator=jnp.float32(1.0))
  hf.export(jax.tree.map(jnp.add, params, updates), cfg, tmp_path)
  before, after = load_file(f'{source}/model.safetensors'), load_file(tmp_path / 'model.safetensors')
  assert set(after) == set(before)
  spared = {n for n in before if any(re.search(p, n) for p in HF_NO_DECAY_PATTERNS)}
  assert spared and len(spared) < len(before)  # both kinds are there
  for name, w in before.items():
    want = w if name in spared else w * np.float32(1 - lr * wd)
    np.testing.assert_allclose(after[name], want, rtol=1e-6, atol=0, err_msg=name)
