"""Model families as specs (jaxrl_ga/models/families.py): every spec is complete, and each field
of a spec is what the model computes by.

The references are transformers' float32 logits of the tiny checkpoints
(tests/fixtures/make_family_fixtures.py, make_hf_fixtures.py): a spec field flipped must move the
forward far from them, the registry's spec must match them (test_model_families.py,
test_model_hf.py hold the full comparisons).
"""

import dataclasses

import jax
import numpy as np
import pytest
import transformers

from jaxrl_ga import sharding
from jaxrl_ga.config import MeshConfig, RunConfig
from jaxrl_ga.models import families
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.models.config import ModelConfig
from jaxrl_ga.trainers import context

import helpers


def _config(family: families.Family) -> ModelConfig:
  """A tiny config of ``family`` with every setting it has set (a sliding and a full layer)."""
  values = {'sliding_window': 4, 'layer_types': ('sliding_attention', 'full_attention'),
            'rope_local_theta': 1e4, 'query_pre_attn_scalar': 24.0,
            'final_logit_softcapping': 30.0}
  return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2,
                     attention_bias=family.attention_bias, architecture=family.name,
                     **{n: values[n] for n in family.settings})


@pytest.mark.parametrize('name', list(families.FAMILIES))
def test_every_spec_is_complete(name):
  family = families.FAMILIES[name]
  assert set(family.settings) <= {f.name for f in dataclasses.fields(ModelConfig)}
  assert set(family.settings) <= set(hf.HF_SETTINGS)
  assert family.activation in tfm.ACTIVATIONS
  assert isinstance(getattr(transformers, family.hf_config_class)(), transformers.PretrainedConfig)
  # Every param of the family's layer has an HF name, no two the same.
  cfg = _config(family)
  params = sharding.abstract_model(cfg)[1]
  layer_names = [family.hf_layer_tensors[p][0] for p in params['layers']]
  assert len(set(layer_names)) == len(layer_names)
  # Export writes a config that transformers reads back as this family, by its class and by its
  # model_type alone.
  exported = hf.hf_config(cfg)
  assert exported.architectures == [family.hf_class]
  assert hf.model_config_from_hf(exported) == cfg
  for model_type in family.model_types:
    plain = transformers.PretrainedConfig.from_dict({**exported.to_dict(), 'architectures': None})
    plain.model_type = model_type
    assert hf.model_config_from_hf(plain).architecture == name


def test_a_setting_outside_the_family_is_refused():
  with pytest.raises(ValueError, match=r"sliding_window: architecture='qwen3' has no such "
                                       r'setting \(the architectures that have it: '
                                       r'sliding_window: gemma3, mistral\)'):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, architecture='qwen3',
                sliding_window=4)


def _relative_error(name: str) -> float:
  """max |ours - transformers| / max |transformers| of the right-padded batch's logits."""
  _, graphdef, params = hf.load_model(helpers.fixture_dir(name))
  ref = helpers.reference_arrays(name)
  tokens, mask = ref['right_tokens'], ref['right_mask']
  logits = np.asarray(jax.jit(lambda p: tfm.merge(graphdef, p)(tokens, mask))(params))
  real = mask.astype(bool)
  return float(np.abs(logits[real] - ref['right_logits'][real]).max()
               / np.abs(ref['right_logits'][real]).max())


@pytest.mark.parametrize('name, field, flipped', [
    ('gemma3_tiny', 'norm_plus_one', False),
    ('gemma3_tiny', 'post_norms', False),
    ('gemma3_tiny', 'scale_embeddings', False),
    ('gemma3_tiny', 'activation', 'silu'),
    ('qwen3_tiny', 'qk_norm', False),
])
def test_each_spec_field_is_what_the_model_computes_by(name, field, flipped, monkeypatch):
  """The registry's spec matches transformers; the same checkpoint read with one field of its
  family's spec flipped does not (the field is read, not a flag beside the code)."""
  architecture = name.split('_')[0]
  assert _relative_error(name) < 1e-5
  spec = families.FAMILIES[architecture]
  monkeypatch.setitem(families.FAMILIES, architecture,
                      dataclasses.replace(spec, **{field: flipped}))
  error = _relative_error(name)
  print(f'{name} with {field}={flipped!r}: relative logit error {error:.2f}')
  assert error > 0.05


def test_the_fingerprint_of_a_model_without_family_settings_is_as_before_they_existed():
  """A checkpoint's fingerprint['model'] lists these fields, as checkpoints written before any
  family had settings of its own (Gemma 3, Mistral) did, so those resume; a family's settings
  join it once set."""
  before = {'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
            'num_attention_heads', 'num_key_value_heads', 'head_dim', 'rope_theta',
            'rope_scaling', 'rms_norm_eps', 'attention_bias', 'tie_word_embeddings',
            'max_position_embeddings', 'architecture', 'param_dtype', 'dtype', 'lora'}

  def fingerprint_model(cfg):
    ctx = context.RunContext(cfg=RunConfig(), workdir='', mesh=None, task=None, tokenizer=None,
                             model_cfg=cfg, graphdef=None, param_shardings=None, writer=None)
    return ctx.fingerprint('grpo')['model']

  assert set(fingerprint_model(_config(families.FAMILIES['llama']))) == before
  gemma = fingerprint_model(_config(families.FAMILIES['gemma3']))
  assert set(gemma) == before | set(families.FAMILIES['gemma3'].settings)
  assert gemma['layer_types'] == ['sliding_attention', 'full_attention']


@pytest.mark.parametrize('name', list(families.FAMILIES))
def test_a_fresh_models_norms_start_at_scale_one(name):
  """A model built from the model.* fields: every RMSNorm starts as the plain normalization,
  scale 1, as transformers initializes each family (Llama's weight ones, Gemma's (1 + w) weight
  zeros: Gemma3RMSNorm). Before, Gemma's final norm started at w = 1, a scale of 2."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  cfg = _config(families.FAMILIES[name])
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  _, params, _ = sharding.init_params(cfg, seed=0, mesh=mesh)
  want = 0.0 if families.FAMILIES[name].norm_plus_one else 1.0
  norms = {'/'.join(map(str, k)): np.asarray(v) for k, v in
           traverse_util.flatten_dict(jax.device_get(params)).items() if 'norm' in str(k[-1])}
  assert 'final_norm' in norms and len(norms) > 1, sorted(norms)
  for path, value in norms.items():
    assert np.all(value == want), (path, value.ravel()[:4])
