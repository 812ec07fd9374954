"""The memory-efficient attention in pure JAX (model.attention='flash', ``attention.flash_attention``;
issue 47): blocked over keys with an online softmax, its backward recomputed from q, k, v, the
output and each query's softmax statistics (a ``jax.custom_vjp``). Its values against a float64
brute-force attention (one query at a time, tests/test_attention.py's ``_reference_attention``),
its gradients against the autodiff of the einsum attention (``einsum_attention``), on left and
right padding, packed segments, GQA, a sliding window and Gemma's query_pre_attn_scalar, in
float32 and bfloat16; and in the model: the family fixtures' HF logits and the learner's gradient.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import logprobs
from jaxrl_ga.config import ModelSpec
from jaxrl_ga import programs
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

import helpers
from test_attention import _packed, _reference_attention, _relative_error

FLASH = tfm.ForwardOptions(attention='flash')


def _rows(t):
  """Segment ids of 3 rows of t tokens: left padding (8), right padding (5), and a packed row
  (segments 1 and 2, then padding)."""
  ids = np.ones((3, t), np.int32)
  ids[0, :8] = 0
  ids[1, t - 5:] = 0
  ids[2, :t // 2], ids[2, t // 2:t - 3], ids[2, t - 3:] = 1, 2, 0
  return ids


def _dense_mask(ids, window):
  positions = attn_lib.positions_from_mask(jnp.asarray(ids))
  mask = attn_lib.causal_mask(jnp.asarray(ids))
  return mask & (positions[:, :, None] - positions[:, None, :] < window) if window else mask


@pytest.mark.parametrize('heads,window,scale_dim', [((4, 2), 0, None), ((6, 2), 7, 24.0),
                                                    ((2, 2), 0, None)])
def test_flash_attention_values_and_gradients(heads, window, scale_dim):
  """float32: the output within 1e-5 of the float64 reference on every real query; the
  gradients of a weighted sum of the output (padding queries included) within 1e-5 (relative
  to the largest) of the einsum's autodiff; T = 45 over blocks of 16 (the last block padded).
  bfloat16: output and gradients within bfloat16 rounding of the einsum's."""
  rng = np.random.default_rng(1)
  n, kv = heads
  b, t, h = 3, 45, 16
  ids = _rows(t)
  mask = _dense_mask(ids, window)
  real = ids > 0
  normal = lambda *shape: rng.normal(size=shape)
  q64, k64, v64, w64 = normal(b, t, n, h), normal(b, t, kv, h), normal(b, t, kv, h), \
      normal(b, t, n, h)
  for dtype, out_tol, grad_tol in ((jnp.float32, 1e-5, 1e-5), (jnp.bfloat16, 3e-2, 3e-2)):
    q, k, v = (jnp.asarray(x, dtype) for x in (q64, k64, v64))
    weight = jnp.asarray(w64, jnp.float32)
    flash = lambda q, k, v: attn_lib.flash_attention(q, k, v, mask, scale_dim, block=16)
    einsum = lambda q, k, v: attn_lib.einsum_attention(q, k, v, mask, scale_dim=scale_dim)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weight)
    out = flash(q, k, v)
    assert out.dtype == dtype
    ref = (_reference_attention(q64, k64, v64, ids, window, scale_dim) if dtype == jnp.float32
           else np.asarray(einsum(q, k, v), np.float64))
    error = float(np.abs(np.asarray(out, np.float64) - ref)[real].max())
    got = jax.grad(loss(flash), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(einsum), argnums=(0, 1, 2))(q, k, v)
    rel = [float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()
                 / jnp.abs(w.astype(jnp.float32)).max()) for g, w in zip(got, want)]
    print(f'{jnp.dtype(dtype).name} heads {heads} window {window}: output error {error:.1e}, '
          f'gradient errors (dq, dk, dv) relative {rel}')
    assert error < out_tol, error
    assert max(rel) < grad_tol, rel
    # a query with no key (the left padding's first position): the einsum's uniform average
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float32),
                               np.asarray(einsum(q, k, v)[0, 0], np.float32),
                               atol=out_tol)


def test_flash_attention_keeps_no_scores_for_the_backward():
  """What the backward keeps (the residuals ``jax.vjp``'s backward function holds): q, k, v, the mask, the output and two
  [B, K, G, T] statistics; nothing of size T x S per head (the einsum keeps its [B, K, G, T, S]
  probabilities)."""
  b, t, n, kv, h = 2, 64, 4, 2, 8
  q = jnp.ones((b, t, n, h))
  k = v = jnp.ones((b, t, kv, h))
  mask = _dense_mask(_rows(t)[:b], 0)

  def saved(fn):  # the arrays the backward function holds (a jax.tree_util.Partial's leaves)
    _, backward = jax.vjp(lambda q, k, v: jnp.sum(fn(q, k, v)), q, k, v)
    return sorted(int(np.size(a)) for a in jax.tree.leaves(backward))

  per_head_scores = b * n * t * t
  assert max(saved(lambda q, k, v: attn_lib.einsum_attention(q, k, v, mask))) >= per_head_scores
  flash = saved(lambda q, k, v: attn_lib.flash_attention(q, k, v, mask, block=16))
  assert max(flash) < per_head_scores, flash
  assert sum(flash) <= 2 * b * t * n * h + 2 * b * t * kv * h + b * t * t + 2 * b * n * t


@functools.cache
def _loaded(name):
  return hf.load_model(helpers.fixture_dir(name))


@pytest.fixture
def flash_calls(monkeypatch):
  """Counts the traces of ``flash_attention``: proof that 'flash' ran (the einsum alone matches
  the same references)."""
  calls, original = [], attn_lib.flash_attention

  def spy(*args, **kwargs):
    calls.append(args[0].shape)
    return original(*args, **kwargs)
  monkeypatch.setattr(attn_lib, 'flash_attention', spy)
  return calls


@pytest.mark.parametrize('name', ['qwen3_tiny', 'gemma3_tiny', 'mistral_tiny'])
def test_flash_forward_matches_hf(name, flash_calls):
  """The training forward with model.attention='flash' on the right-padded, left-padded and
  packed batches: HF's float32 logits (GQA, Gemma 3's mixed sliding layers and
  query_pre_attn_scalar, Mistral's window), as tests/test_attention.py checks 'xla'."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  forward = jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m, FLASH))
  cases = {side: (ref[f'{side}_tokens'], ref[f'{side}_mask'], ref[f'{side}_logits'],
                  ref[f'{side}_mask'].astype(bool)) for side in ('right', 'left')}
  cases['packed'] = _packed(ref)
  for case, (tokens, mask, want, real) in cases.items():
    error = _relative_error(forward(params, tokens, mask), want, real)
    print(f'{name} {case} forward, flash attention: max abs logit error / max |logit| = '
          f'{error:.1e}')
    assert error < 1e-5, (case, error)
  assert flash_calls


def test_flash_learner_gradient_equals_einsum(flash_calls):
  """The gradient of the summed token log-probs of Gemma 3 on a left-padded batch and a packed
  row with 'flash' is the einsum's to float32 rounding, and not zero; model.attention='flash'
  reaches the forward options."""
  assert programs.forward_options(ModelSpec(attention='flash')).attention == 'flash'
  _, graphdef, params = _loaded('gemma3_tiny')
  ref = helpers.reference_arrays('gemma3_tiny')
  tokens, ids, _, _ = _packed(ref)
  left = lambda x: np.pad(x, ((0, 0), (tokens.shape[1] - x.shape[1], 0)))
  t = np.concatenate([left(ref['left_tokens']), tokens])
  m = np.concatenate([left(ref['left_mask']), ids])

  def loss(p, options):
    return jnp.sum(logprobs.sequence_logps(tfm.merge(graphdef, p), t, m, m > 0, options)[0])

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  want = jax.tree.leaves(grad(params, tfm.ForwardOptions()))
  assert not flash_calls
  got = jax.tree.leaves(grad(params, FLASH))
  assert flash_calls
  scale = max(float(np.abs(np.asarray(w)).max()) for w in want)
  error = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
  print(f'gemma3 gradient, flash vs einsum: max abs diff / max |grad| = {error / scale:.1e}')
  assert scale > 0 and error / scale < 1e-5


@pytest.mark.parametrize('name', ['mistral_tiny', 'gemma3_tiny'])
def test_flash_shared_prompt_logps_match_hf(name, flash_calls):
  """The shared-prompt forward (``hidden_after_prefix``: the prompt's attention and the
  completions' over [prompt; own], ``flash_attention_after_prefix``, both 'flash') on Mistral
  (its window cutting into the prompt) and Gemma 3 (mixed sliding layers): log_softmax of HF's
  logits at the greedy continuation; and its gradient against the einsum's."""
  _, graphdef, params = _loaded(name)
  prompt, prompt_mask, greedy, want = helpers.shared_prompt_case(name)
  options = dataclasses.replace(FLASH, share_prompts=2)

  def logps(p, options):
    return logprobs.completion_logps(tfm.merge(graphdef, p), prompt, prompt_mask, greedy,
                                     np.ones_like(greedy), options)[0]

  got = jax.jit(logps, static_argnums=1)(params, options)
  error = float(np.abs(np.asarray(got) - want).max())
  print(f'{name} shared-prompt log-probs, flash attention: max abs error = {error:.1e}')
  assert error < 1e-5, error
  assert len(flash_calls) >= 2  # the prompt's and the completions' attention
  grad = jax.jit(jax.grad(lambda p, o: jnp.sum(logps(p, o))), static_argnums=1)
  want_g = jax.tree.leaves(grad(params, dataclasses.replace(options, attention='einsum')))
  got_g = jax.tree.leaves(grad(params, options))
  scale = max(float(np.abs(np.asarray(w)).max()) for w in want_g)
  diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got_g, want_g))
  print(f'{name} shared-prompt gradient, flash vs einsum: {diff / scale:.1e} of max |grad|')
  assert scale > 0 and diff / scale < 1e-5
