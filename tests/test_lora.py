"""LoRA (jaxrl_ga.lora, model.lora.*): the adapters' forward against an independently merged
float64 weight, the base model exactly when the adapters are off or zero, exact accumulation of
the adapter update (the one-pass reference of tests/test_learner.py, on the adapter params only),
and the merged HF export / PEFT files reloading with the LoRA model's logits.
"""

import dataclasses
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

from jaxrl_ga import lora
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, GRPOLossConfig, LoRAConfig, RunConfig, ScheduleConfig
from jaxrl_ga.config import from_mapping, default_config_dict
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.models import transformer as tfm

from learner_refs import MODEL, run_grpo_learner

LORA = LoRAConfig(rank=4, alpha=8.0, targets=('q', 'k', 'v', 'o', 'gate', 'up', 'down'))
FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'qwen2_tiny')


def _random_b(adapters, seed=1, std=0.05):
  """Adapters with B drawn at random (B = 0 at init would leave A's gradient zero)."""
  leaves, tree = jax.tree.flatten_with_path(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [x + std * jax.random.normal(k, x.shape, x.dtype) if path[-1].key.endswith('_lora_b')
         else x for (path, x), k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, out)


def _tokens(n=3, t=9, vocab=MODEL.vocab_size, seed=0):
  rng = np.random.default_rng(seed)
  mask = (np.arange(t)[None] >= rng.integers(0, 3, (n, 1))).astype(np.int32)  # left padding
  return jnp.asarray(rng.integers(0, vocab, (n, t)).astype(np.int32) * mask), jnp.asarray(mask)


def test_config_errors_name_the_setting():
  d = default_config_dict().to_dict()
  for key, value, words in [('rank', -1, 'model.lora.rank'), ('targets', 'q,qkv', 'targets'),
                            ('dropout', 0.1, 'model.lora.dropout=0'),
                            ('alpha', 0.0, 'model.lora.alpha')]:
    bad = json.loads(json.dumps(d))
    bad['model']['lora'][key] = value
    with pytest.raises(ConfigError, match=words):
      from_mapping(RunConfig, bad)
  d['model']['lora'].update(rank=8, targets='q,v')
  assert from_mapping(RunConfig, d).model.architecture_config(10).lora == LoRAConfig(
      rank=8, targets=('q', 'v'))


@pytest.mark.slow
def test_adapters_off_or_zero_is_the_base_model_bitwise():
  base_g, base_p = tfm.split(tfm.Transformer(MODEL, rngs=nnx.Rngs(0)))
  cfg = lora.with_lora(MODEL, LORA)
  g, p = tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  adapters, frozen = lora.split(p)
  # the base weights do not depend on the LoRA settings; adapters are float32 LoRAParams
  jax.tree.map(np.testing.assert_array_equal, frozen, base_p)
  assert len(jax.tree.leaves(adapters)) == 2 * len(LORA.targets)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype('float32')}
  tokens, mask = _tokens()
  base = jax.jit(lambda p: tfm.merge(base_g, p)(tokens, mask))(base_p)

  def logits(p, off=False):
    return tfm.merge(g, p)(tokens, mask, tfm.ForwardOptions(adapters=not off))

  f, f_off = jax.jit(logits), jax.jit(lambda p: logits(p, off=True))
  np.testing.assert_array_equal(f(p), base)  # B = 0 at init
  trained = tfm.combine(frozen, _random_b(adapters))
  assert np.abs(np.asarray(f(trained)) - np.asarray(base)).max() > 1e-3  # adapters act
  np.testing.assert_array_equal(f_off(trained), base)  # disabled: the base model, bitwise


@pytest.mark.slow
def test_adapter_forward_equals_float64_merged_weights():
  """The LoRA model's full forward and its prefill/decode (the sampler's path, with and without
  ``decode_layers``' folded, fused weights) equal the plain model whose weights are
  W + alpha/r * A @ B, merged here in float64 with numpy."""
  cfg = lora.with_lora(MODEL, dataclasses.replace(LORA, targets=('q', 'v', 'o', 'down')))
  g, p = tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  adapters, frozen = lora.split(p)
  adapters = _random_b(adapters, std=0.2)
  merged = jax.tree.map(np.asarray, frozen)
  for t in cfg.lora.targets:
    a = np.asarray(adapters['layers'][f'{t}_proj_lora_a'], np.float64)
    b = np.asarray(adapters['layers'][f'{t}_proj_lora_b'], np.float64)
    w = merged['layers'][f'{t}_proj'].astype(np.float64) + cfg.lora.alpha / cfg.lora.rank * (
        np.einsum('lir,lro->lio', a, b))
    merged['layers'][f'{t}_proj'] = w.astype(np.float32)
  base_g = tfm.split(tfm.Transformer(MODEL, rngs=nnx.Rngs(0)))[0]
  tokens, mask = _tokens()
  want = tfm.merge(base_g, merged)(tokens, mask)
  model = tfm.merge(g, frozen, adapters)
  np.testing.assert_allclose(model(tokens, mask), want, rtol=0, atol=2e-5)
  first, cache = model.prefill(tokens, mask, cache_length=tokens.shape[1] + 1)
  np.testing.assert_allclose(first, want[:, -1], rtol=0, atol=2e-5)
  nxt, _ = model.decode(jnp.argmax(first, -1), cache)
  full = tfm.merge(base_g, merged)(jnp.concatenate([tokens, jnp.argmax(first, -1)[:, None]], 1),
                                   jnp.concatenate([mask, jnp.ones_like(mask[:, :1])], 1))
  np.testing.assert_allclose(nxt, full[:, -1], rtol=0, atol=2e-5)
  # The sampler's loop: the adapters folded into fused weights (Transformer.decode_layers).
  nxt, _ = model.decode(jnp.argmax(first, -1), cache.per_layer(), model.decode_layers())
  np.testing.assert_allclose(nxt, full[:, -1], rtol=0, atol=2e-5)


def _adapters_of(params, shardings):
  """The learner trains the adapters (B drawn at random: B = 0 leaves A's gradient zero)."""
  (adapters, base), (a_sh, base_sh) = lora.split(params), lora.split(shardings)
  return (jax.device_put(_random_b(adapters), a_sh), base), (a_sh, base_sh)


@pytest.mark.slow
@pytest.mark.parametrize('mesh,base_dtype', [((1, 1, 1), 'bfloat16'), ((2, 2, 2), 'float32')])
def test_accumulated_adapter_update_is_exact(mesh, base_dtype, compile_log):
  """On 1 device with the base stored in bfloat16, on 8 (data, fsdp, tensor = 2, 2, 2) in
  float32; the adapters, their accumulator and AdamW moments are float32 either way. The state's
  structure is checked on the initial state, before any numeric check, and on the final one."""
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=2,
                         grad_accum_steps=3)  # a window spans two rollouts
  model = lora.with_lora(dataclasses.replace(MODEL, param_dtype=base_dtype), LORA)
  adapter_keys = {f'{t}_proj_lora_{ab}' for t in LORA.targets for ab in 'ab'}

  def check_state(state, base):
    # The state (params, AdamW moments, MultiSteps accumulator) holds the adapters only: no bias,
    # norm or base weight trains (MODEL has q/k/v biases).
    assert set(state.params) == {'layers'}, sorted(state.params)
    assert set(state.params['layers']) == adapter_keys, sorted(state.params['layers'])
    for tree in (state.opt_state.acc_grads, optax.tree.get(state.opt_state, 'mu'),
                 optax.tree.get(state.opt_state, 'nu')):
      assert jax.tree.structure(tree) == jax.tree.structure(state.params)
    # Bytes: params, accumulator, mu and nu of the adapters, and scalars (counters, window sums).
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    other = sum(x.nbytes for x in jax.tree.leaves(state)) - 4 * adapter_bytes
    assert 0 <= other < 1024, other
    assert not ({x.shape for x in jax.tree.leaves(base)}
                & {x.shape for x in jax.tree.leaves(state)})
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(base_dtype)}
    for tree in (state.params, state.opt_state.acc_grads, optax.tree.get(state.opt_state, 'mu')):
      assert {x.dtype for x in jax.tree.leaves(tree)} == {jnp.dtype('float32')}

  grad_err, upd_err = run_grpo_learner(sched, GRPOLossConfig(aggregation='token'), mesh, n_opt_steps=2,
                                model=model, trainable=_adapters_of, check_state=check_state)
  print(f'mesh {mesh}, base {base_dtype}: max relative error of the applied gradient '
        f'{grad_err:.2e}, of the adapter update {upd_err:.2e}')
  assert compile_log.count('_micro_step') == 1
  assert grad_err <= 1e-5 and upd_err <= 1e-5, (grad_err, upd_err)


@pytest.mark.slow
def test_merged_export_reloads_with_the_lora_logits_and_peft_files(tmp_path):
  """A real HF base (the Qwen2 fixture) with trained-like adapters: the merged HF directory,
  reloaded by the loader, gives the LoRA model's logits (float32 merge: |diff| <= 1e-5 on logits
  of size ~1; the unmerged model rounds x@W + (x@A)@B differently); PEFT's files hold
  delta W = alpha/r * lora_B.weight @ lora_A.weight (PEFT's LoraLayer, torch's [out, in])."""
  base_cfg, base_g, base = hf.load_model(FIXTURE)
  cfg = lora.with_lora(base_cfg, LORA)
  graphdef = sharding.abstract_model(cfg)[0]
  adapters = _random_b(lora.init_adapters(cfg, seed=3), std=0.3)
  tokens, mask = _tokens(vocab=cfg.vocab_size)
  want = np.asarray(tfm.merge(graphdef, base, adapters)(tokens, mask))
  merged, out_cfg = lora.merged(tfm.combine(base, adapters), cfg)
  assert out_cfg == base_cfg
  hf.export(merged, out_cfg, tmp_path / 'hf')
  re_cfg, re_g, re_params = hf.load_model(tmp_path / 'hf')
  got = np.asarray(tfm.merge(re_g, re_params)(tokens, mask))
  assert np.abs(want - np.asarray(tfm.merge(base_g, base)(tokens, mask))).max() > 1e-2
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

  lora.save_peft(adapters, cfg, tmp_path / 'peft', base_model='qwen2_tiny')
  conf = json.load(open(tmp_path / 'peft' / 'adapter_config.json'))
  assert conf['peft_type'] == 'LORA' and conf['r'] == 4 and conf['lora_alpha'] == 8.0
  tensors = safetensors.numpy.load_file(tmp_path / 'peft' / 'adapter_model.safetensors')
  assert len(tensors) == 2 * len(LORA.targets) * cfg.num_hidden_layers
  hf_base = safetensors.numpy.load_file(os.path.join(FIXTURE, 'model.safetensors'))
  hf_merged = safetensors.numpy.load_file(tmp_path / 'hf' / 'model.safetensors')
  scaling = conf['lora_alpha'] / conf['r']
  for name in ('self_attn.q_proj', 'mlp.down_proj'):
    prefix = f'model.layers.1.{name}'
    a = tensors[f'base_model.model.{prefix}.lora_A.weight'].astype(np.float64)
    b = tensors[f'base_model.model.{prefix}.lora_B.weight'].astype(np.float64)
    np.testing.assert_allclose(hf_base[f'{prefix}.weight'] + scaling * b @ a,
                               hf_merged[f'{prefix}.weight'], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sft_grpo_lora_run_checkpoint_resume_and_export(tmp_path, capsys):
  """An SFT then GRPO run with model.lora (GRPO's beta > 0: the reference is the base, adapters
  disabled): each stage's checkpoint stores the adapters (params, accumulator, AdamW moments) and no base weight; a
  resume with another model.lora is refused before anything runs; the exported merged model
  reloads with the logits of the checkpoint's base + adapters, computed here from the stored
  arrays and a fresh base of the run's seed."""
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, checkpoint, export  # pylint: disable=g-import-not-at-top
  overrides = {'stages': ('sft', 'grpo'), 'sft.num_steps': 2, 'model.lora.rank': 4, 'model.lora.targets': 'q,v,down',
               'grpo.loss.beta': 0.04, 'grpo.num_steps': 2}
  cfg = smoke_configs.smoke('grpo_arith', **overrides)
  summary = api.run(cfg, str(tmp_path / 'wd'))
  assert summary['grpo/optimizer_steps'] == 2 and not summary['stopped_early']
  # The reference is the pre-SFT base, not the SFT result a run without LoRA takes: said once.
  assert capsys.readouterr().out.count('[grpo] LoRA: the KL reference is the base weights with '
                                       'the adapters off') == 1

  for stage in ('sft', 'grpo'):
    ckpt_dir = tmp_path / 'wd' / 'checkpoints' / stage
    step = checkpoint.all_steps(str(ckpt_dir))[-1]
    # The checkpoint's own index of stored arrays: under params and the optimizer state only
    # adapters; no base weight (embed, norms, q_proj ...) anywhere.
    stored = json.load(open(ckpt_dir / str(step) / 'state' / '_METADATA'))['tree_metadata']
    weights = [k for k in stored if "'params'" in k or "'mu'" in k or "'nu'" in k
               or "'acc_grads'" in k]
    assert weights and all(k.endswith(("_lora_a')", "_lora_b')")) for k in weights), weights
    assert not [k for k in stored if any(f"'{n}'" in k for n in (
        'embed', 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'down_proj', 'final_norm', 'attn_norm'))]
  state, _, fingerprint = checkpoint.Checkpointer(str(ckpt_dir)).restore_raw(step)
  assert state.get('ref_params') is None  # no reference copy of the weights
  adapters = state['learner']['params']
  assert sorted(adapters['layers']) == sorted(f'{t}_proj_lora_{x}' for t in ('q', 'v', 'down')
                                              for x in 'ab')
  assert np.abs(adapters['layers']['q_proj_lora_b']).max() > 0  # trained

  bad = smoke_configs.smoke('grpo_arith', **{**overrides, 'model.lora.rank': 8})
  with pytest.raises(ConfigError, match='lora'):
    api.run(bad, str(tmp_path / 'wd'))

  export.export_checkpoint(str(tmp_path / 'wd'), str(tmp_path / 'hf'),
                           adapter_out=str(tmp_path / 'peft'))
  re_cfg, re_g, re_params = hf.load_model(tmp_path / 'hf')
  run_cfg = policy.model_config_from_dict(fingerprint['model'])
  base = tfm.split(tfm.Transformer(lora.base_config(run_cfg), rngs=nnx.Rngs(cfg.seed)))[1]
  tokens, mask = _tokens(vocab=run_cfg.vocab_size)
  want = tfm.merge(sharding.abstract_model(run_cfg)[0], base, adapters)(tokens, mask)
  np.testing.assert_allclose(tfm.merge(re_g, re_params)(tokens, mask), want, rtol=0, atol=1e-5)
  assert re_cfg == lora.base_config(run_cfg)
  assert sorted(os.listdir(tmp_path / 'peft')) == ['adapter_config.json',
                                                   'adapter_model.safetensors']


@pytest.mark.slow
def test_export_of_a_bfloat16_base_keeps_the_adapters_update(tmp_path, capsys):
  """LoRA on a bfloat16 base at a small learning rate: the trained update (alpha/r) A B is far
  under half a bfloat16 ulp of most weights. The merged export's default (float32) holds
  W + (alpha/r) A B, against that sum in float64 from the checkpoint's adapters and a fresh base
  of the run's seed; the console line says how much bfloat16 would lose. Before, the merge was
  rounded into W's bfloat16 before any --weights_dtype, and ~90% of the update was lost (so
  the export was nearly the untrained base), also with --weights_dtype=float32. With
  --weights_dtype=bfloat16 the rounded weights are written, and the line says what is lost."""
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, checkpoint, export  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('sft_arith', **{
      'model.lora.rank': 4, 'model.lora.targets': 'q,down', 'model.param_dtype': 'bfloat16',
      'sft.num_steps': 2, 'sft.optimizer.learning_rate': 1e-5})
  api.run(cfg, str(tmp_path / 'wd'))
  ckpt_dir = tmp_path / 'wd' / 'checkpoints' / 'sft'
  state, _, fingerprint = checkpoint.Checkpointer(str(ckpt_dir)).restore_raw(
      checkpoint.all_steps(str(ckpt_dir))[-1])
  adapters = state['params']['layers']  # an SFT state: params, opt_state
  run_cfg = policy.model_config_from_dict(fingerprint['model'])
  base = tfm.split(tfm.Transformer(lora.base_config(run_cfg), rngs=nnx.Rngs(cfg.seed)))[1]
  scale = run_cfg.lora.alpha / run_cfg.lora.rank
  capsys.readouterr()
  for dtype in (None, 'bfloat16'):
    out = tmp_path / f'hf_{dtype}'
    export.export_checkpoint(str(tmp_path / 'wd'), str(out), weights_dtype=dtype)
    line = capsys.readouterr().out
    written = safetensors.numpy.load_file(out / 'model.safetensors')
    lost2 = total2 = 0.0
    for name, hf_name in (('q_proj', 'self_attn.q_proj'), ('down_proj', 'mlp.down_proj')):
      for i in range(run_cfg.num_hidden_layers):
        w = np.asarray(base['layers'][name][i], np.float64)
        delta = scale * (np.asarray(adapters[f'{name}_lora_a'][i], np.float64)
                         @ np.asarray(adapters[f'{name}_lora_b'][i], np.float64))
        got = written[f'model.layers.{i}.{hf_name}.weight'].astype(np.float64).T - w
        lost2, total2 = lost2 + np.sum((got - delta) ** 2), total2 + np.sum(delta ** 2)
    lost = np.sqrt(lost2 / total2)
    share = float(line.split('% of the adapters')[0].split()[-1]) / 100
    print(f'weights_dtype={dtype}: written {written["model.norm.weight"].dtype}, update lost '
          f'{lost:.3%}, the line: {share:.1%}')
    if dtype is None:
      assert written['model.norm.weight'].dtype == np.float32
      assert lost < 1e-4 and share > 0.5, (lost, line)
    else:
      assert written['model.norm.weight'].dtype.name == 'bfloat16'
      assert abs(lost - share) < 1e-3 and share > 0.5, (lost, line)


def test_bfloat16_compute_keeps_the_adapters_scale_and_the_samplers_adapters():
  """With model.dtype=bfloat16 the adapters' path computes in float32, as PEFT's LoraLayer does
  (its adapters float32, the input cast to them): alpha / r = 16/12 is not rounded to bfloat16's
  1.3359 (a +0.18% bias on every adapter output, measured as the least-squares slope of the
  projection's output against float64's). And the sampler's per-layer weights
  (``decode_layers``) keep the adapters apart rather than folding them into bfloat16 weights,
  which lost every update under half a bfloat16 ulp of W: the rollout sampled from a policy
  nearer the base than the one the learner trained. Its decode step then computes what the
  unfolded layers compute."""
  rng = np.random.default_rng(0)
  r, alpha = 12, 16.0
  x = jnp.asarray(rng.normal(size=(512, 256)), jnp.bfloat16)
  a, b = rng.normal(size=(256, r)) / 16, rng.normal(size=(r, 192)) * 0.05
  cfg = lora.with_lora(MODEL, LoRAConfig(rank=r, alpha=alpha, targets=('q',)))
  p = {'q_proj': jnp.zeros((256, 192), jnp.bfloat16), 'q_proj_lora_a': jnp.asarray(a, jnp.float32),
       'q_proj_lora_b': jnp.asarray(b, jnp.float32)}
  got = np.asarray(tfm._proj(cfg, p, x, 'q_proj'), np.float64)  # pylint: disable=protected-access
  want = alpha / r * (np.asarray(x, np.float64) @ a.astype(np.float32)) @ b.astype(np.float32)
  slope = float((got * want).sum() / (want * want).sum())
  print(f'bfloat16 compute: adapter output slope vs float64 {slope:.6f}')
  assert abs(slope - 1) < 2e-4, slope

  model_cfg = dataclasses.replace(MODEL, dtype='bfloat16', param_dtype='bfloat16')
  cfg = lora.with_lora(model_cfg, LoRAConfig(rank=r, alpha=alpha, targets=('q', 'gate')))
  g, params = tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  adapters, frozen = lora.split(params)
  model = tfm.merge(g, frozen, _random_b(adapters, std=0.002))
  tokens, mask = _tokens()
  first, cache = model.prefill(tokens, mask, cache_length=tokens.shape[1] + 1)
  tok = jnp.argmax(first, -1)
  unfolded, _ = model.decode(tok, cache.per_layer(), model.unstacked_layers())
  sampler, _ = model.decode(tok, cache.per_layer(), model.decode_layers())
  np.testing.assert_array_equal(np.asarray(sampler, np.float32), np.asarray(unfolded, np.float32))


@pytest.mark.slow
def test_a_changed_base_is_refused_at_resume_and_export(tmp_path):
  """A LoRA checkpoint holds the adapters only; a resume and an export read the base again from
  model.hf_path. With those weights changed since (one tensor scaled by 1.05, as a new revision
  or a file replaced in place would), the export merged the adapters into other weights with no
  word (logits off by 0.2 in helper 41's repro). The checkpoint keeps a digest of the base
  (policy.weights_digest): both refuse, and the same bytes again export."""
  import shutil  # pylint: disable=g-import-not-at-top
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, checkpoint, export  # pylint: disable=g-import-not-at-top
  model = tmp_path / 'model'
  shutil.copytree(FIXTURE, model)
  cfg = smoke_configs.smoke('sft_arith', **{
      'model.hf_path': str(model), 'model.lora.rank': 4, 'sft.num_steps': 2,
      'checkpoint.every_steps': 1})
  api.run(cfg, str(tmp_path / 'wd'))
  ckpts = tmp_path / 'wd' / 'checkpoints' / 'sft'
  steps = checkpoint.all_steps(str(ckpts))
  shutil.rmtree(ckpts / str(steps[-1]))  # as if stopped after the first step
  weights = model / 'model.safetensors'
  original = weights.read_bytes()
  tensors = safetensors.numpy.load_file(weights)
  name = 'model.layers.1.mlp.down_proj.weight'
  tensors[name] = tensors[name] * np.float32(1.05)
  safetensors.numpy.save_file(tensors, weights, metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=r'the base weights at .* differ from those the LoRA '
                                       r'adapters of .* were trained on'):
    export.export_checkpoint(str(tmp_path / 'wd'), str(tmp_path / 'hf'))
  with pytest.raises(ConfigError, match=r'^the base weights at model.hf_path=.* differ'):
    api.run(cfg, str(tmp_path / 'wd'))
  weights.write_bytes(original)
  export.export_checkpoint(str(tmp_path / 'wd'), str(tmp_path / 'hf'))
  assert (tmp_path / 'hf' / 'model.safetensors').exists()
