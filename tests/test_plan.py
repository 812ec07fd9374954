"""jaxrl_ga.plan: the GRPO steps compiled ahead of time for a TPU topology by libtpu's compiler
(no TPU needed; libtpu is in the test extra), and activation sharding on the CPU mesh.

The TPU test compiles Qwen2.5-0.5B's per-layer shapes (2 of its 24 layers, shorter sequences)
for v5e:2x4 and checks: the plan's JSON equals the compiled executables' own memory and cost
analyses; the analytic flops equal the compiler's on a compile with the layer loop unrolled;
model.logprob_chunk_size lowers the temporaries; and no all-reduce in the learner's HLO carries
activations (the batch is sharded over data x fsdp, weights are gathered).
tests/test_plan_tpu_knobs.py checks model.remat and LoRA there (a file of its own, so that with
``--dist loadfile`` the TPU compiles run on two workers).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import helpers
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import plan
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, OptimizerConfig, ScheduleConfig
from jaxrl_ga.models import policy
from jaxrl_ga.models import transformer as tfm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP, TC = helpers.TPU_TP, helpers.TPU_TC


@pytest.fixture(scope='module', autouse=True)
def _one_core():
  """libtpu's compiles on one core (helpers.pinned_to_one_core)."""
  yield from helpers.pinned_to_one_core()


def test_learner_has_no_activation_all_reduce_on_cpu_mesh():
  """On the 8-device CPU mesh (data 2 x fsdp 4) the learner step all-reduces no activations.
  Without the model's activation constraints XLA shards the hidden dimension as the fsdp-sharded
  weights are, and all-reduces [b, T, ...] activations in the forward and backward."""
  cfg = tfm.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        attention_bias=True, dtype='float32')
  tp, tc, b = 11, 13, 16
  mesh = sharding.make_mesh(MeshConfig(2, 4, 1), jax.devices()[:8])
  graphdef, shapes, axes = sharding.abstract_model(cfg)
  pshard = sharding.param_shardings(shapes, axes, mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        pshard)
  sched = ScheduleConfig(micro_batch_size=b, num_generations=2, steps_per_generation=1,
                         grad_accum_steps=1)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(GRPOLossConfig(), tc),
                            OptimizerConfig(), mesh, pshard,
                            optimizer_every=sched.optimizer_every)
  row = lambda *shape, dt=jnp.int32: jax.ShapeDtypeStruct(
      (b, *shape), dt, sharding=sharding.batch_sharding(mesh, 1 + len(shape)))
  batch = dict(prompt_tokens=row(tp), prompt_mask=row(tp), completion_tokens=row(tc),
               completion_mask=row(tc), old_logps=row(tc, dt=jnp.float32),
               has_old=row(dt=jnp.bool_), advantages=row(dt=jnp.float32))
  state = lrn.abstract_init(params, batch)
  hlo = lrn.step_fn.lower(state, batch).compile().as_text()
  assert 'all-reduce' in hlo or 'reduce-scatter' in hlo  # the weights' gradients are reduced
  assert helpers.activation_all_reduces(hlo, {tp + tc, tc, tp + tc - 1}) == []


@pytest.mark.slow
def test_tpu_plan_matches_compiler_and_knobs_lower_memory():
  helpers.require_libtpu()
  plan.quiet_libtpu_env()
  devices = plan.topology_devices('v5e:2x4')
  assert len(devices) == 8 and devices[0].device_kind == 'TPU v5 lite'
  # One unrolled layer (the compiler counts a loop body once; a second layer doubled the compile
  # time and proves nothing the first does not).
  cfg = helpers.tpu_plan_config(scan_layers=False, num_hidden_layers=1)
  rep = plan.plan(cfg, 'v5e:2x4', devices=devices)
  js = json.loads(json.dumps(plan.public(rep)))
  assert set(js) >= {'topology', 'chips', 'hbm_bytes_per_chip', 'fits', 'steps'}
  assert js['chips'] == 8 and js['hbm_bytes_per_chip'] == 16 * 2**30 and js['fits']
  for name in ('rollout', 'learner'):
    step, exe = js['steps'][name], rep['_executables'][name]
    assert set(step) >= set(plan.STEP_KEYS)
    mem = exe.memory_analysis()
    assert step['argument_bytes'] == mem.argument_size_in_bytes
    assert step['output_bytes'] == mem.output_size_in_bytes
    assert step['temp_bytes'] == mem.temp_size_in_bytes
    assert step['peak_bytes'] >= mem.argument_size_in_bytes + mem.temp_size_in_bytes
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert step['compiler_flops'] == cost['flops']
    assert step['bytes_accessed'] >= cost['bytes accessed']
  # Analytic learner flops (per chip) vs the compiler's on the unrolled layers: the compiler also
  # counts elementwise work (softmax, norms), so it may exceed the matmul count by a little.
  learner = js['steps']['learner']
  assert learner['flops'] <= learner['compiler_flops'] <= 1.03 * learner['flops'], learner

  # The decode estimate (the batched loop: rollout_micro_batch_size 0, all S*B rows at once; one
  # step at the mean KV fill, Tp + Tc // 2 slots): tokens/s by hand from the decode step's own
  # cost analysis and v5e's published peaks (197 TFLOP/s, 819 GB/s), and below the bound of the
  # bytes each chip must read per step: its 16 rows' bfloat16 KV cache at that fill and the
  # layer's bfloat16 projections, gathered (fsdp 4; Qwen2.5-0.5B's shapes).
  d, exe = js['decode'], rep['_executables']['decode_step']
  rows = 128
  assert (d['mode'], d['rows_per_step'], d['cache_slots']) == ('batched', rows, TP + TC // 2)
  assert js['prompt_share'] == {'generation': 4, 'old_logprobs': 4}  # gcd(G = 8, B / 8 chips)
  cost = exe.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  seconds = max(cost['flops'] / 197e12, cost['bytes accessed'] / 819e9)
  if cost.get('optimal_seconds', -1.0) >= cost['flops'] / 197e12:
    seconds = max(seconds, cost['optimal_seconds'])
  assert d['tokens_per_second'] == pytest.approx(rows / seconds, rel=1e-9)
  kv_bytes = rows // 8 * (TP + TC // 2) * 2 * (1 * 2 * 64) * 2  # layers, k and v, heads x size
  weight_bytes = 1 * (896 * (14 * 64 + 2 * 2 * 64) + 14 * 64 * 896 + 3 * 896 * 4864) * 2
  print(f"decode step: {cost['bytes accessed']:.4g} bytes, {cost['flops']:.4g} flops per chip "
        f"(reads >= {kv_bytes + weight_bytes}); {d['tokens_per_second']:.0f} tokens/s")
  assert d['tokens_per_second'] <= rows * 819e9 / (kv_bytes + weight_bytes)
  assert d['seconds_at_max_length'] == pytest.approx((TC - 1) * rows / d['tokens_per_second'])

  # No activation all-reduce in the learner's TPU program.
  hlo = rep['_executables']['learner'].as_text()
  assert helpers.activation_all_reduces(hlo, {TP + TC, TC, TP + TC - 1}) == []

  # model.logprob_chunk_size lowers the unrolled learner's temporaries (scanned, the layer
  # scan's saved activations set the peak and the chunks' buffers add to it: 1.78 against
  # 1.69 GB on 2026-11-25): the float32 [b, Tc, V] logits of the 2 rows per chip, 117 MB, are
  # kept ~3 times unchunked (the rollout's old-log-prob pass chunks with the same function,
  # jaxrl_ga/logprobs.py).
  lowered = plan.lower_grpo(cfg, policy.planned_model_config(cfg), devices, steps=('learner',),
                            logprob_chunk_size=32).learner
  chunked = plan.compile_step(lowered)['temp_bytes']
  print(f"temp bytes: unrolled learner {learner['temp_bytes']}, chunk=32 {chunked}")
  logits = 2 * TC * 151936 * 4
  assert chunked < learner['temp_bytes'] - logits


@pytest.mark.parametrize('attention', ['splash', 'auto'])
def test_splash_attention_lowers_for_tpu(attention):
  """model.attention='splash' (issue 36), and 'auto' (issue 47: resolved for the topology's
  devices, not this host's CPU): the learner (forward and backward) and the rollout's
  old-log-prob pass, lowered for v5e:2x4, call the Pallas kernel (Mosaic's tpu_custom_call) inside a
  shard_map over the batch shards, 3 calls in the learner (forward, dq, dk/dv). libtpu compiles
  them (docs/scaling.md, "Fused attention on TPU"); tests/test_attention.py checks the values."""
  helpers.require_libtpu()
  plan.quiet_libtpu_env()
  devices = plan.topology_devices('v5e:2x4')
  cfg = helpers.tpu_plan_config(attention=attention, share_prompt_prefix=False)
  steps = plan.lower_grpo(cfg, policy.planned_model_config(cfg), devices)
  assert steps.programs.options.attention == 'splash'
  learner, rollout = steps.learner.as_text(), steps.rollout.as_text()
  assert learner.count('tpu_custom_call') == 3 == learner.count('sdy.manual_computation')
  # the rollout: the old-log-prob pass's forward (the prefill runs 'flash': Transformer.prefill)
  assert rollout.count('tpu_custom_call') == 1 == rollout.count('sdy.manual_computation')



def test_splash_with_roles_of_their_own_runs_each_kernel_on_its_steps_mesh():
  """The learner on chips 0-3 and the rollout on 4-7, model.attention='splash': each step's
  kernel runs per shard of that step's own mesh (ForwardOptions.kernel_mesh), the learner's on
  the actor's chips. With the rollout's mesh in the learner's options this lowering was refused
  ("incompatible devices ... shard_map inside jit"), the learner's params on 0-3 and its kernel
  on 4-7."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  helpers.require_libtpu()
  plan.quiet_libtpu_env()
  devices = plan.topology_devices('v5e:2x4')
  cfg = api.make_config(
      helpers.tpu_plan_config(attention='splash', share_prompt_prefix=False),
      **{'mesh.devices': '0:4', 'mesh.data': 1, 'mesh.fsdp': 4, 'mesh.rollout.devices': '4:8',
         'mesh.rollout.data': 1, 'mesh.rollout.fsdp': 4})
  steps = plan.lower_grpo(cfg, policy.planned_model_config(cfg), devices, steps=('learner',))
  assert steps.learner.as_text().count('tpu_custom_call') == 3  # forward, dq, dk/dv

def test_cli_bad_input_is_one_line_exit_2():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  cases = [['--topology=v5e:2x4'],  # no --config
           ['--config=configs/grpo_gsm8k_tpu.py', '--topology=banana'],
           ['--config=configs/grpo_gsm8k_tpu.py', '--topology=v5e:2x4', '--format=xml'],
           ['--config=configs/grpo_gsm8k_tpu.py:v9', '--topology=v5e:2x4']]
  for args in cases:
    p = subprocess.run([sys.executable, '-m', 'jaxrl_ga.plan', *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    err = [l for l in p.stderr.splitlines() if l.startswith('error:')]
    assert p.returncode == 2 and len(err) == 1 and 'Traceback' not in p.stderr, (args, p.stderr)
  assert 'topology' in err[0] or 'v9' in err[0]


@pytest.mark.parametrize('overrides', [
    {},  # the smoke config's unrolled layers (model.scan_layers=False), R = 2 rows per prompt
    {'model.lora.rank': 4, 'grpo.loss.beta': 0.04,  # LoRA, its reference the adapters-off base
     'grpo.advantage.order_by_advantage_sign': True,  # old log-probs deferred to the reorder
     'grpo.sampling.decode_slots': 8},  # the slot pool's decode loop
])
def test_plan_lowers_the_program_the_trainer_runs(tmp_path, overrides):
  """Every program ``plan`` lowers for a config is the trainer's: for every entry of the GRPO
  programs' table (learner, rollout, reorder, evaluation, decode) the same StableHLO text,
  lowered from the trainer's own jitted steps at the arguments it calls them with (its starting
  state, a micro-batch of its buffer, the evaluator's prompt batch) and from the plan's abstract
  ones (``plan.lower_grpo``, a build of its own; here on the 8 CPU devices instead of a TPU
  topology). The config shares each prompt's forward between R = 2 rows (B = 16 over 8
  devices, G = 4) with the layers unrolled; a plan that rebuilt the steps without those
  settings lowers other programs."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import lora, placement  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import evaluation, grpo, text  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.schedule.micro_batch_size': 16, **overrides})
  assert not cfg.model.scan_layers and cfg.model.share_prompt_prefix
  ctx, params = api.build_context(cfg, str(tmp_path))
  trainer = grpo.GRPOLoop(ctx, cfg.grpo)
  assert trainer.engine.share_prompts == 2
  progs = trainer.programs
  state = progs.init_state(params)  # what run() starts from
  frozen = lora.partition(params, ctx.model_cfg)[1]
  prompts = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding),
                         trainer.engine.abstract_prompts())
  evaluator = evaluation.Evaluator(ctx, progs.table['evaluation'])
  eval_tokens, eval_mask = placement.place_rows(text.left_pad(
      [[1, 2, 3]] * evaluator.batch_size, evaluator.max_prompt_length, ctx.pad_id, 'test'),
      evaluator.batch_size, ctx.mesh)
  trained = {
      'learner': trainer.learner.step_fn.lower(
          state['learner'], trainer.engine.micro_batch(state['buffer'], 0, state['advantages']),
          *([] if frozen is None else [frozen])),
      'rollout': trainer.engine.step_fn.lower(params, state['ref_params'], state['rollout'],
                                              prompts, prompts),
      'evaluation': evaluator._generate.lower(  # pylint: disable=protected-access
          params, eval_tokens, eval_mask, jax.random.PRNGKey(0), np.float32(1.0),
          np.float32(1.0)),
      # one iteration of the rollout's decode loop: no call of the trainer's runs it alone (the
      # rollout step does, inside its loop); the trainer's table entry at its own arguments
      'decode': progs.table['decode'].lower()}
  if cfg.grpo.advantage.order_by_advantage_sign:
    order = jnp.zeros((trainer.table.config.completions_per_rollout,), jnp.int32)
    trained['reorder'] = trainer.engine.reorder_fn.lower(
        params, state['buffer'], state['rollout'], state['advantages'], order)
  assert set(trained) == set(progs.table)  # every entry of the table
  planned = plan.lower_grpo(cfg, ctx.model_cfg, list(ctx.mesh.devices.flat),
                            eos_id=ctx.eos_id, pad_id=ctx.pad_id)
  lowered = {'learner': planned.learner, 'rollout': planned.rollout,
             **({'reorder': planned.reorder} if planned.reorder is not None else {}),
             **planned.others}
  assert set(lowered) == set(trained)
  for name, program in trained.items():
    assert lowered[name].as_text() == program.as_text(), name
  # The pool's KV cache, [P, K, Tp + Tc - 1, H] per layer, is in the rollout iff it has a pool.
  m, sp = ctx.model_cfg, cfg.grpo.sampling
  pool_cache = (f'tensor<8x{m.num_key_value_heads}x'
                f'{sp.max_prompt_length + sp.max_completion_length - 1}x{m.head_size}x')
  assert (pool_cache in trained['rollout'].as_text()) == bool(sp.decode_slots)
  assert (pool_cache in trained['decode'].as_text()) == bool(sp.decode_slots)
  assert (planned.decode_rows, planned.decode is not None) == (
      sp.decode_slots or trainer.table.config.completions_per_rollout, True)


@pytest.mark.parametrize('lora_rank', [0, 4])
def test_sft_and_dpo_tables_are_the_calls_their_trainers_make(tmp_path, lora_rank):
  """Every entry of the SFT and DPO programs' tables (learner, evaluation; DPO's reference pass
  and the generation of its sampled pairs) at its abstract arguments lowers to the StableHLO of
  the call its trainer makes: at the starting state ``init_state`` puts together, SFT's first
  micro-batch (trainers/sft.py's rows of the task), DPO's (``PairStream.batch_at`` over pairs
  laid out as trainers/dpo.py lays them out), the evaluator's and the pairs' prompt batches and
  the reference pass's rows, built here from text. A table whose shapes, dtypes or shardings
  were not the trainer's would lower another program (or a second one at run time)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, lora, placement, programs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import dpo, evaluation, sft, text  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('dpo_arith', **{'model.lora.rank': lora_rank})
  ctx, params = api.build_context(cfg, str(tmp_path))
  frozen = lora.partition(params, ctx.model_cfg)[1]
  extra = [] if frozen is None else [frozen]
  prompts = lambda n, width: placement.shard_batch(text.left_pad(
      [text.encode_prompt(ctx.tokenizer, ctx.task.train_example(i, 0).prompt) for i in range(n)],
      width, ctx.pad_id, 'test'), ctx.mesh)
  key, one = jax.random.PRNGKey(0), np.float32(1.0)

  def evaluator_call(program):
    ev = evaluation.Evaluator(ctx, program)
    generate = ev._generate  # pylint: disable=protected-access
    return generate.lower(params, *prompts(ev.batch_size, ev.max_prompt_length), key, one, one)

  s = ctx.cfg.sft
  progs = programs.build_sft_programs(ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings,
                                      ctx.graphdef, eos_id=ctx.eos_id, pad_id=ctx.pad_id)
  rows = placement.batch_rows(s.micro_batch_size, ctx.mesh)
  batch = placement.place_rows(sft.micro_batch(ctx, s, 0, 0, rows)[0], s.micro_batch_size,
                               ctx.mesh)
  calls = {'learner': progs.learner.step_fn.lower(progs.init_state(params), batch, *extra),
           'evaluation': evaluator_call(progs.table['evaluation'])}
  assert set(calls) == set(progs.table)
  for name, lowered in calls.items():
    assert progs.table[name].lower().as_text() == lowered.as_text(), ('sft', name)

  d = ctx.cfg.dpo
  progs = dpo.DPOStage().programs(ctx, d, fitted=False)
  assert d.pairs != 'dataset' and d.loss.rpo_alpha
  n = 2 * d.micro_batch_size
  ids = [text.encode_prompt(ctx.tokenizer, ctx.task.train_example(i, 0).prompt)
         for i in range(n)]
  pairs = {}
  for side, reply in (('chosen', [5, ctx.eos_id]), ('rejected', [6, 7, ctx.eos_id])):
    rows = text.right_padded_rows(ids, [reply] * n, d.max_length, ctx.pad_id, 'test')
    pairs.update({f'{side}_{k}': v for k, v in rows.items()})
    pairs[f'ref_{side}_logps'] = np.zeros(n, np.float32)  # as add_reference_logps keeps them
  reference_rows = placement.shard_batch(
      [pairs[f'chosen_{k}'][:progs.table['reference'].args[1].shape[0]]
       for k in ('tokens', 'attention_mask', 'loss_mask')], ctx.mesh)
  generation_rows = dpo.GENERATION_PROMPTS * d.samples_per_prompt
  stream = dpo.PairStream(pairs, d, 0, ctx.mesh)
  calls = {'learner': progs.learner.step_fn.lower(progs.init_state(params), stream.batch_at(0),
                                                  *extra),
           'evaluation': evaluator_call(progs.table['evaluation']),
           'reference': progs.table['reference'].fn.lower(params, *reference_rows),
           'generation': progs.table['generation'].fn.lower(
               params, *prompts(generation_rows, d.sampling.max_prompt_length),
               key, np.float32(d.sampling.temperature), np.float32(d.sampling.top_p))}
  assert set(calls) == set(progs.table)
  for name, lowered in calls.items():
    assert progs.table[name].lower().as_text() == lowered.as_text(), ('dpo', name)
