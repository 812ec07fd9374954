"""HF interop: our forward and KV-cache decoding reproduce HF's logits; load/export round trips.

The checkpoints and HF's reference logits come from tests/fixtures/make_hf_fixtures.py (run with
torch, once); nothing here imports torch.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer

import helpers

NAMES = ('qwen2_tiny', 'llama_tiny')
ATOL = 1e-4
# Config fields an exported config.json must carry with the fixture's values.
KEY_FIELDS = ('architectures', 'model_type', 'vocab_size', 'hidden_size', 'intermediate_size',
              'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'head_dim',
              'rms_norm_eps', 'tie_word_embeddings', 'max_position_embeddings', 'rope_parameters',
              'attention_bias', 'mlp_bias', 'pad_token_id', 'bos_token_id', 'eos_token_id',
              'hidden_act', 'dtype')



@functools.cache
def _loaded(name, dtype='float32'):
  """(cfg, graphdef, params), loaded once per fixture and dtype."""
  return hf.load_model(helpers.fixture_dir(name), dtype=dtype, param_dtype=dtype)


@functools.cache
def _forward(graphdef):
  """Jitted full forward of one model (compiled once per fixture and input shape)."""
  return jax.jit(lambda params, tokens, mask: transformer.merge(graphdef, params)(tokens, mask))


def _tensor_shapes(path):
  with safetensors.safe_open(path, framework='numpy') as f:
    return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('side', ['right', 'left'])
@pytest.mark.parametrize('name', NAMES)
def test_logits_match_hf(name, side):
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  tokens, mask = ref[f'{side}_tokens'], ref[f'{side}_mask']
  logits = np.asarray(_forward(graphdef)(params, tokens, mask))  # [B, T, V]
  real = mask.astype(bool)
  np.testing.assert_allclose(logits[real], ref[f'{side}_logits'][real], rtol=0, atol=ATOL)


def test_configs_from_hf():
  qwen, llama = _loaded('qwen2_tiny')[0], _loaded('llama_tiny')[0]
  assert (qwen.architecture, qwen.attention_bias, qwen.tie_word_embeddings) == ('qwen2', True, True)
  assert qwen.rope_scaling is None and qwen.rope_theta == 10000.0
  assert (llama.architecture, llama.attention_bias, llama.tie_word_embeddings) == (
      'llama', False, False)
  assert llama.rope_scaling == transformer.RopeScaling('llama3', 4.0, 1.0, 4.0, 32)
  # The fixture's scaling moves some frequencies and keeps others: it is really exercised.
  unscaled = transformer.rope_inv_freq(dataclasses.replace(llama, rope_scaling=None))
  changed = transformer.rope_inv_freq(llama) != unscaled
  assert changed.any() and not changed.all()


def test_sharded_checkpoint_loads_same_params():
  cfg, _, params = _loaded('llama_tiny')
  assert os.path.exists(os.path.join(helpers.fixture_dir('llama_tiny_sharded'), 'model.safetensors.index.json'))
  assert hf.model_config_from_hf(helpers.fixture_dir('llama_tiny_sharded')) == cfg
  _assert_trees_equal(hf.load_params(helpers.fixture_dir('llama_tiny_sharded'), cfg), params)


def test_a_sharded_load_reads_each_part_once_and_never_a_whole_tensor():
  """The trainer's load (params on a mesh): each process reads, through safetensors' lazy slices,
  only the parts its devices hold. One process holds all 8 devices here, so every element of
  every tensor is read exactly once (a part replicated over the data axis: once, not per
  device), no read of a sharded param covers its whole tensor, and no tensor is read whole; the
  params equal the whole-tensor load bitwise, on the requested shardings. (On several processes
  jax.make_array_from_callback asks each for its own devices' parts only.)"""
  from jaxrl_ga import sharding  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import MeshConfig  # pylint: disable=g-import-not-at-top
  cfg, _, params = _loaded('llama_tiny')
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
  _, shapes, axes = sharding.abstract_model(cfg)
  shardings = sharding.param_shardings(shapes, axes, mesh)
  loaded = hf.load_params(helpers.fixture_dir('llama_tiny_sharded'), cfg, shardings=shardings)
  _assert_trees_equal(loaded, params)
  for array, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings)):
    assert array.sharding == want

  tensors = safetensors.numpy.load_file(
      os.path.join(helpers.fixture_dir(NAMES[1]), 'model.safetensors'))
  reads = {name: [] for name in tensors}

  class View:  # safetensors' get_slice, counting the elements each read returns
    def __init__(self, name):
      self.name, self.shape = name, tensors[name].shape

    def __getitem__(self, index):
      part = tensors[self.name][index]
      reads[self.name].append(part.size)
      return part

  def whole(name):
    raise AssertionError(f'{name} read whole')

  hf.params_from_tensors(whole, tensors.keys(), cfg, source='test', shardings=shardings,
                         get_slice=View)
  used = {n for n in tensors if reads[n]}
  assert used and all(sum(reads[n]) == tensors[n].size for n in used), {
      n: (sum(r), tensors[n].size) for n, r in reads.items() if r}
  flat = {'/'.join(str(getattr(k, 'key', k)) for k in path): s for path, s in
          jax.tree_util.tree_flatten_with_path(shardings)[0]}
  sharded = [p for p, s in flat.items() if not s.is_fully_replicated]
  assert sharded  # the mesh really splits params
  assert sum(max(r) < tensors[n].size for n, r in reads.items() if r) >= len(sharded)


@pytest.mark.parametrize('name', NAMES)
def test_kv_cache_decoding_matches_full_forward(name):
  """Prefill a left-padded prefix, then decode one token at a time: the logits at every
  position from the prefix's last on (all real tokens) equal the full forward's, and so HF's."""
  cfg, graphdef, params = _loaded(name)
  batch, length, prefix = 4, 20, 10
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 81, size=(batch, length)).astype(np.int32)
  pads = np.array([0, 3, 9, 6])  # left padding, all inside the prefix
  mask = (np.arange(length)[None] >= pads[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, tokens, 0)
  full = np.asarray(_forward(graphdef)(params, tokens, mask))  # [B, T, V]

  model = lambda p: transformer.merge(graphdef, p)
  prefill = jax.jit(lambda p, t, m: model(p).prefill(t, m, cache_length=length))
  decode = jax.jit(lambda p, t, c: model(p).decode(t, c))
  logits, cache = prefill(params, tokens[:, :prefix], mask[:, :prefix])
  stepwise = [logits]  # position prefix - 1
  for t in range(prefix, length):
    logits, cache = decode(params, tokens[:, t], cache)
    stepwise.append(logits)  # position t
  stepwise = np.stack([np.asarray(x) for x in stepwise], axis=1)  # [B, T - prefix + 1, V]
  np.testing.assert_allclose(stepwise, full[:, prefix - 1:], rtol=0, atol=ATOL)
  assert int(cache.index) == length
  np.testing.assert_array_equal(cache.positions, mask.sum(-1))


@pytest.mark.parametrize('name', NAMES)
def test_export_round_trip(name, tmp_path):
  cfg, _, params = _loaded(name)
  tokenizer = hf.load_tokenizer(helpers.fixture_dir(name))
  hf.export(params, cfg, tmp_path, tokenizer=tokenizer)

  assert hf.model_config_from_hf(tmp_path) == cfg
  _assert_trees_equal(hf.load_params(tmp_path, cfg), params)
  assert _tensor_shapes(tmp_path / 'model.safetensors') == _tensor_shapes(
      os.path.join(helpers.fixture_dir(name), 'model.safetensors'))
  with open(tmp_path / 'config.json') as f:
    exported = json.load(f)
  with open(os.path.join(helpers.fixture_dir(name), 'config.json')) as f:
    original = json.load(f)
  for field in KEY_FIELDS:
    assert exported.get(field) == original.get(field), field
  text = 'Hi there, 12+34=46\n'
  assert hf.load_tokenizer(tmp_path)(text)['input_ids'] == tokenizer(text)['input_ids']


BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2^-7: bfloat16's spacing at 1 (8 bits)


def _rms(x):
  return float(np.sqrt(np.mean(np.square(x))))


@pytest.mark.parametrize('name', NAMES)
def test_bfloat16_params_load_and_run(name, tmp_path):
  cfg, graphdef, params = _loaded(name, 'bfloat16')
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  ref = helpers.reference_arrays(name)
  tokens, mask = ref['left_tokens'], ref['left_mask']
  real = mask.astype(bool)
  logits = np.asarray(_forward(graphdef)(params, tokens, mask), np.float64)[real]  # [N, V]
  want = ref['left_logits'][real].astype(np.float64)
  # bfloat16 params and compute against HF's float32 logits: every weight and activation is
  # rounded to 8 significant bits, a relative error of up to eps/2 each; a dozen roundings per
  # layer add up independently, so the logits' RMS relative error grows like sqrt(depth).
  # Observed: 2.4 and 2.0 eps (qwen2, llama; depth 2); bound: 3 eps * sqrt(depth).
  depth = cfg.num_hidden_layers
  error = _rms(logits - want) / _rms(want)
  assert error < 3 * BF16_EPS * np.sqrt(depth), (error / BF16_EPS, depth)
  # The compute really runs in bfloat16: against our float32 forward on the same (bf16-rounded)
  # weights the error is of bfloat16's size (observed 1.8 and 1.5 eps), not float32's (~1e-7).
  _, graphdef32, _ = _loaded(name)
  upcast = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  logits32 = np.asarray(_forward(graphdef32)(upcast, tokens, mask), np.float64)[real]
  compute_error = _rms(logits - logits32) / _rms(logits32)
  assert BF16_EPS / 8 < compute_error < 3 * BF16_EPS * np.sqrt(depth), compute_error / BF16_EPS
  # Where HF's top token leads by more than twice the largest error the bound allows on one logit
  # (taken as 4x the RMS bound), it stays on top.
  top2 = np.sort(want, axis=-1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 2 * 4 * 3 * BF16_EPS * np.sqrt(depth) * _rms(want)
  assert clear.sum() >= 10, clear.sum()
  np.testing.assert_array_equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])

  # bfloat16 safetensors (numpy has no bfloat16 of its own) write and read back bit for bit.
  hf.export(params, cfg, tmp_path)
  with safetensors.safe_open(tmp_path / 'model.safetensors', framework='numpy') as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {'BF16'}
  assert json.loads((tmp_path / 'config.json').read_text())['dtype'] == 'bfloat16'
  _assert_trees_equal(hf.load_params(tmp_path, cfg), params)


def test_load_onto_shardings():
  mesh = jax.make_mesh((2, 4), ('data', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = {'vocab': 'tensor', 'q_heads': 'tensor', 'kv_heads': 'tensor', 'mlp': 'tensor',
           'embed': 'data'}

  def shardings_fn(shapes, axes):
    assert jax.tree.structure(shapes) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.map(
        lambda names: jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*(rules.get(n) for n in names))),
        axes, is_leaf=lambda x: isinstance(x, tuple))

  name = 'llama_tiny'
  _, graphdef, params = hf.load_model(helpers.fixture_dir(name), shardings_fn=shardings_fn)
  assert params['layers']['q_proj'].sharding.spec == jax.sharding.PartitionSpec(
      None, 'data', 'tensor')
  assert params['lm_head'].sharding.spec == jax.sharding.PartitionSpec('data', 'tensor')
  _assert_trees_equal(params, _loaded(name)[2])
  ref = helpers.reference_arrays(name)
  logits = np.asarray(_forward(graphdef)(params, ref['left_tokens'], ref['left_mask']))
  real = ref['left_mask'].astype(bool)
  np.testing.assert_allclose(logits[real], ref['left_logits'][real], rtol=0, atol=ATOL)


def _copy_config(name, dst, **changes):
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(helpers.fixture_dir(name), 'config.json')) as f:
    config = json.load(f)
  config.update(changes)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(config, f)


def test_unknown_architecture_names_it(tmp_path):
  _copy_config('llama_tiny', tmp_path, architectures=['OlmoForCausalLM'], model_type='olmo')
  with pytest.raises(ValueError, match=r'OlmoForCausalLM.*Qwen2ForCausalLM, LlamaForCausalLM'):
    hf.model_config_from_hf(tmp_path)


def test_unsupported_rope_type_names_it(tmp_path):
  _copy_config('llama_tiny', tmp_path, rope_parameters={
      'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
      'original_max_position_embeddings': 32})
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    hf.model_config_from_hf(tmp_path)


def test_a_multimodal_gemma3_config_without_architectures_is_refused_by_name(tmp_path):
  """model_type 'gemma3' is the multimodal Gemma3Config (its text model under text_config): read
  as the text model it failed with an AttributeError traceback."""
  import transformers  # pylint: disable=import-outside-toplevel
  config = transformers.Gemma3Config().to_dict()
  config.pop('architectures', None)
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=r"Unsupported architecture None \(model_type 'gemma3'\)"):
    hf.model_config_from_hf(tmp_path)


def test_missing_tensor_error_and_extra_tensor_warning(tmp_path, caplog):
  name = 'qwen2_tiny'
  cfg = _loaded(name)[0]
  with safetensors.safe_open(os.path.join(helpers.fixture_dir(name), 'model.safetensors'), 'numpy') as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  extra = 'model.layers.0.self_attn.rotary_emb.inv_freq'
  tensors[extra] = np.ones(8, np.float32)
  safetensors.numpy.save_file(tensors, str(tmp_path / 'model.safetensors'))
  with caplog.at_level('WARNING'):
    hf.load_params(tmp_path, cfg)
  assert extra in caplog.text

  gone = ('model.layers.1.mlp.up_proj.weight', 'model.layers.0.self_attn.k_proj.bias')
  for k in gone:
    del tensors[k]
  safetensors.numpy.save_file(tensors, str(tmp_path / 'model.safetensors'))
  with pytest.raises(ValueError, match=r'2 tensors missing.*k_proj.bias.*up_proj.weight'):
    hf.load_params(tmp_path, cfg)


def test_shape_mismatch_names_tensor():
  cfg = dataclasses.replace(_loaded('llama_tiny')[0], intermediate_size=64)
  with pytest.raises(ValueError, match=r'down_proj.*shape \(2, 96, 64\).*wants \(2, 64, 64\)'):
    hf.load_params(helpers.fixture_dir('llama_tiny'), cfg)


def test_works_without_torch(tmp_path):
  """Config, weights, tokenizer and export, in a process where ``import torch`` fails."""
  script = textwrap.dedent(f"""
      import sys
      sys.modules['torch'] = None  # find_spec('torch') -> None, import torch -> ImportError
      import numpy as np
      from jaxrl_ga.models import hf, transformer
      cfg, graphdef, params = hf.load_model({helpers.fixture_dir('qwen2_tiny')!r})
      ref = np.load({os.path.join(helpers.fixture_dir('qwen2_tiny'), 'reference_logits.npz')!r})
      logits = transformer.merge(graphdef, params)(ref['left_tokens'], ref['left_mask'])
      real = ref['left_mask'].astype(bool)
      assert np.abs(np.asarray(logits)[real] - ref['left_logits'][real]).max() < 1e-3
      hf.export(params, cfg, {str(tmp_path)!r}, tokenizer=hf.load_tokenizer({helpers.fixture_dir('qwen2_tiny')!r}))
      assert hf.model_config_from_hf({str(tmp_path)!r}) == cfg
      print('ok')
  """)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': helpers.xla_flags(1),
         'PYTHONPATH': os.pathsep.join([root, os.environ.get('PYTHONPATH', '')])}
  result = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0 and 'ok' in result.stdout, result.stderr[-3000:]


def test_completions_stop_at_every_eos_id_of_the_generation_config(tmp_path):
  """TRL 1.16 (``GRPOTrainer.eos_token_ids``) and transformers' ``generate`` end a completion at
  any eos id of the model's generation config (Llama 3's <|eom_id|>, Qwen's <|endoftext|>,
  Gemma 3's <end_of_turn>), not only the tokenizer's: its generation_config.json, else the one
  derived from config.json. End to end: a GRPO run on a checkpoint whose generation config
  lists every id ends every completion at its first token."""
  import shutil  # pylint: disable=import-outside-toplevel  # lazy: this test only
  from jaxrl_ga import api  # pylint: disable=import-outside-toplevel
  from jaxrl_ga.models import policy  # pylint: disable=import-outside-toplevel
  import smoke_configs  # pylint: disable=import-outside-toplevel
  model = tmp_path / 'model'
  shutil.copytree(helpers.fixture_dir('qwen2_tiny'), model)
  tok = hf.load_tokenizer(model)
  with open(model / 'config.json') as f:
    vocab = json.load(f)['vocab_size']

  def trl_eos_ids(listed):  # grpo_trainer.py, as TRL 1.16 builds eos_token_ids
    listed = [] if listed is None else [listed] if isinstance(listed, int) else listed
    return listed if tok.eos_token_id in listed else [tok.eos_token_id, *listed]

  stop_ids = lambda: policy.stop_ids(tok, policy.run_generation_config(str(model), tok))
  assert stop_ids() == (tok.eos_token_id,)  # the fixture lists only it
  with open(model / 'generation_config.json') as f:
    gen = json.load(f)
  for listed in ([7, tok.eos_token_id, 81], [81]):
    gen['eos_token_id'] = listed
    with open(model / 'generation_config.json', 'w') as f:
      json.dump(gen, f)
    got = stop_ids()
    assert got[0] == tok.eos_token_id and sorted(got) == sorted(trl_eos_ids(listed))
  os.remove(model / 'generation_config.json')  # derived from config.json
  with open(model / 'config.json') as f:
    config = json.load(f)
  with open(model / 'config.json', 'w') as f:
    json.dump({**config, 'eos_token_id': [tok.eos_token_id, 5]}, f)
  assert sorted(stop_ids()) == sorted({tok.eos_token_id, 5})
  with open(model / 'generation_config.json', 'w') as f:
    json.dump({**gen, 'eos_token_id': list(range(vocab))}, f)
  cfg = smoke_configs.smoke(**{'model.hf_path': str(model), 'stages': ('grpo',),
                               'grpo.num_steps': 1, 'eval.num_examples': 4, 'eval.batch_size': 4})
  api.run(cfg, str(tmp_path / 'run'))
  with open(tmp_path / 'run' / 'metrics.jsonl', encoding='utf-8') as f:
    rollouts = [m for m in map(json.loads, f) if 'rollout/completion_length' in m]
  assert rollouts and all(m['rollout/completion_length'] == 1.0 and m['rollout/eos_fraction'] == 1.0
                          for m in rollouts), rollouts
  # The run keeps them beside its tokenizer; sampling its checkpoint and its export stop there too.
  everything = [tok.eos_token_id, *[i for i in range(vocab) if i != tok.eos_token_id]]
  from jaxrl_ga import completions, export  # pylint: disable=import-outside-toplevel
  run_tok = hf.load_tokenizer(tmp_path / 'run' / 'tokenizer')
  assert list(completions.stop_ids(str(tmp_path / 'run'), run_tok)) == everything
  export.export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'hf'))
  assert hf.eos_ids(hf.generation_config(tmp_path / 'hf')) == tuple(everything)
  with open(tmp_path / 'hf' / 'config.json') as f:  # as the source's config.json lists them
    assert json.load(f)['eos_token_id'] == everything


def test_a_tied_config_with_a_different_stored_head_is_refused(tmp_path):
  """transformers 5 unties a config's tie_word_embeddings when the checkpoint stores an
  lm_head.weight of other values, and uses that head ("...so we will NOT tie them"); this model
  would use the embedding, silently other logits. A stored head equal to the embedding is the
  tie saved twice and loads. Through the run: one ConfigError line naming model.hf_path."""
  import shutil  # pylint: disable=import-outside-toplevel  # lazy: this test only
  from jaxrl_ga import api  # pylint: disable=import-outside-toplevel
  from jaxrl_ga.config import ConfigError  # pylint: disable=import-outside-toplevel
  import smoke_configs  # pylint: disable=import-outside-toplevel
  model = tmp_path / 'model'
  shutil.copytree(helpers.fixture_dir('qwen2_tiny'), model)  # tie_word_embeddings: true
  tensors = safetensors.numpy.load_file(model / 'model.safetensors')
  assert 'lm_head.weight' not in tensors
  embed = tensors['model.embed_tokens.weight']
  for head, refused in ((embed.copy(), False), (embed[::-1].copy(), True)):
    safetensors.numpy.save_file({**tensors, 'lm_head.weight': head}, model / 'model.safetensors',
                                metadata={'format': 'pt'})
    if not refused:
      cfg, _, params = hf.load_model(model)
      assert cfg.tie_word_embeddings
      np.testing.assert_array_equal(np.asarray(params['embed']), embed)
      continue
    with pytest.raises(ValueError, match='tie_word_embeddings=true.*lm_head.weight with other'):
      hf.load_model(model)
    cfg = smoke_configs.smoke(**{'model.hf_path': str(model), 'stages': ('grpo',)})
    with pytest.raises(ConfigError, match=f'^model.hf_path={model}: .*"tie_word_embeddings": '
                                          'false'):
      api.run(cfg, str(tmp_path / 'run'))
