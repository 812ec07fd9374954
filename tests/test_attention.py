"""Fused attention (``ForwardOptions.attention``, model.attention; issue 36) on the model-family
fixtures: 'xla' (``jax.nn.dot_product_attention``) against transformers' logits, as the einsum is
checked in tests/test_model_families.py: GQA, Gemma 3's mixed sliding layers and
query_pre_attn_scalar, Mistral's window, right and left padding, a packed (SFT) row, the
prefill, the shared-prompt forward; and the learner's gradient against the einsum's. The 'splash'
kernel is TPU only: tests/test_plan.py compiles it with libtpu. Nothing here imports torch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import api
from jaxrl_ga import logprobs
from jaxrl_ga import programs
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, MeshConfig, ModelSpec, RunConfig, from_mapping
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

import helpers

FAMILIES = ('qwen3_tiny', 'gemma3_tiny', 'mistral_tiny')
RTOL = 1e-5  # as tests/test_model_families.py: float32 against HF's float32 logits
XLA = tfm.ForwardOptions(attention='xla')


@functools.cache
def _loaded(name):
  return hf.load_model(helpers.fixture_dir(name))


def _relative_error(ours, ref, real):
  return float(np.abs(np.asarray(ours)[real] - ref[real]).max() / np.abs(ref[real]).max())


def _packed(ref):
  """Rows 0 and 1 of the right-padded batch packed into one row (segment ids 1 and 2, then
  padding), and the HF logits each segment must reproduce (each row's own forward)."""
  mask = ref['right_mask'].astype(bool)
  n0, n1 = int(mask[0].sum()), int(mask[1].sum())
  width = n0 + n1 + 3
  tokens = np.zeros((1, width), np.int32)
  ids = np.zeros((1, width), np.int32)
  tokens[0, :n0], tokens[0, n0:n0 + n1] = ref['right_tokens'][0, :n0], ref['right_tokens'][1, :n1]
  ids[0, :n0], ids[0, n0:n0 + n1] = 1, 2
  want = np.concatenate([ref['right_logits'][0, :n0], ref['right_logits'][1, :n1]])[None]
  real = np.zeros((1, width), bool)
  real[0, :n0 + n1] = True
  want = np.concatenate([want, np.zeros((1, width - n0 - n1, want.shape[-1]), want.dtype)], 1)
  return tokens, ids, want, real


@pytest.mark.parametrize('name', FAMILIES)
def test_xla_attention_forward_matches_hf(name):
  """The training forward with 'xla' attention on a right-padded, a left-padded and a packed
  batch (two fixture rows in one row, segment ids 1 and 2: each must give its own row's HF
  logits, so no token attends across the boundary and positions restart)."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  forward = jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m, XLA))
  cases = {side: (ref[f'{side}_tokens'], ref[f'{side}_mask'], ref[f'{side}_logits'],
                  ref[f'{side}_mask'].astype(bool)) for side in ('right', 'left')}
  cases['packed'] = _packed(ref)
  for case, (tokens, mask, want, real) in cases.items():
    error = _relative_error(forward(params, tokens, mask), want, real)
    print(f'{name} {case} forward, xla attention: max abs logit error / max |logit| = '
          f'{error:.1e}')
    assert error < RTOL, (case, error)


@pytest.mark.parametrize('name', ['gemma3_tiny', 'mistral_tiny'])
def test_xla_prefill_then_decode_matches_hf(name):
  """The prefill with 'xla' attention (its keys: the prompt's own, written to the cache), then
  the decode steps over that cache: HF's greedy continuation logits at every step."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  prompt, prompt_mask, greedy = ref['left_tokens'], ref['left_mask'], ref['greedy_tokens']
  tp, n = prompt.shape[1], greedy.shape[1]
  logits, cache = jax.jit(lambda p: tfm.merge(graphdef, p).prefill(
      prompt, prompt_mask, tp + n, attention='xla'))(params)
  decode = jax.jit(lambda p, t, c: tfm.merge(graphdef, p).decode(t, c, block=4))
  steps = [logits]
  for t in range(n - 1):
    logits, cache = decode(params, greedy[:, t], cache)
    steps.append(logits)
  steps = np.stack([np.asarray(x) for x in steps], axis=1)
  want = ref['greedy_logits'][:, tp - 1:tp + n - 1]
  error = _relative_error(steps, want, np.ones(want.shape[:2], bool))
  print(f'{name} xla prefill + decode: max abs logit error / max |logit| = {error:.1e}')
  assert error < RTOL, error
  np.testing.assert_array_equal(steps.argmax(-1), greedy)


def test_xla_shared_prompt_logps_match_hf():
  """The shared-prompt forward (``hidden_after_prefix``: the prompt's attention by 'xla', the
  completions' over [prompt; own] by the einsum) on Mistral, its window cutting into the
  prompt: log_softmax of HF's logits at the greedy continuation."""
  _, graphdef, params = _loaded('mistral_tiny')
  ref = helpers.reference_arrays('mistral_tiny')
  rows = lambda x: np.repeat(x, 2, axis=0)
  prompt, prompt_mask, greedy = rows(ref['left_tokens']), rows(ref['left_mask']), rows(
      ref['greedy_tokens'])
  options = dataclasses.replace(XLA, share_prompts=2)
  logps, _ = jax.jit(lambda p: logprobs.completion_logps(
      tfm.merge(graphdef, p), prompt, prompt_mask, greedy, np.ones_like(greedy), options))(params)
  tp = prompt.shape[1]
  ref_logits = rows(ref['greedy_logits'][:, tp - 1:-1]).astype(np.float64)
  ref_logps = ref_logits - np.log(np.exp(ref_logits).sum(-1, keepdims=True))
  want = np.take_along_axis(ref_logps, greedy[..., None], axis=-1)[..., 0]
  error = float(np.abs(np.asarray(logps) - want).max())
  print(f'mistral shared-prompt log-probs, xla attention: max abs error = {error:.1e}')
  assert error < 1e-5, error


def test_xla_attention_gradient_equals_einsum():
  """The learner's backward: the gradient of the summed token log-probs of Gemma 3 (mixed
  sliding layers, query_pre_attn_scalar) on a left-padded batch and a packed row is the
  einsum's (checked against HF's forward in tests/test_model_families.py) to float32 rounding,
  and it is not zero."""
  _, graphdef, params = _loaded('gemma3_tiny')
  ref = helpers.reference_arrays('gemma3_tiny')
  tokens, ids, _, _ = _packed(ref)
  batches = [(ref['left_tokens'], ref['left_mask']), (tokens, ids)]

  def loss(p, t, m, options):
    return jnp.sum(logprobs.sequence_logps(tfm.merge(graphdef, p), t, m, m > 0, options)[0])

  grad = jax.jit(jax.grad(loss), static_argnums=3)
  for t, m in batches:
    want = jax.tree.leaves(grad(params, t, m, tfm.ForwardOptions()))
    got = jax.tree.leaves(grad(params, t, m, XLA))
    scale = max(float(np.abs(np.asarray(w)).max()) for w in want)
    error = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
    print(f'gemma3 gradient, xla vs einsum: max abs diff / max |grad| = {error / scale:.1e}')
    assert scale > 0 and error / scale < 1e-5


def test_model_attention_setting():
  """model.attention reaches the forward options (and so the learners, the log-prob passes and
  the rollout's prefill); an unknown name is a ConfigError naming the setting."""
  assert programs.forward_options(ModelSpec(attention='xla')).attention == 'xla'
  assert programs.forward_options(ModelSpec()).attention == 'einsum'
  with pytest.raises(ConfigError, match=r"model.attention='flash' is not a known value.*'einsum', 'xla', 'splash'"):
    ModelSpec(attention='flash')


def test_splash_needs_a_tpu():
  """model.attention='splash' on CPU devices is a ConfigError before anything compiles (the
  check the CLI runs with the mesh, ``api.validate_against_mesh``); 'xla' passes it."""
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  for attention, ok in (('xla', True), ('splash', False)):
    cfg = from_mapping(RunConfig, {'model': {'attention': attention}})
    if ok:
      api.validate_against_mesh(cfg, mesh)
    else:
      with pytest.raises(ConfigError, match=r"model.attention='splash' is a TPU kernel but the "
                         r"devices are cpu"):
        api.validate_against_mesh(cfg, mesh)
