"""Chunked completion log-probs (jaxrl_ga.logprobs): the values and gradients of a float64
computation written out here, and less temporary memory than the unchunked projection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import logprobs
from jaxrl_ga.models import transformer as tfm

MODEL = tfm.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def _setup(b=3, t=10, seed=0):
  model = tfm.Transformer(MODEL, rngs=__import__('flax').nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(b, t, MODEL.hidden_size)).astype(np.float32)
  targets = rng.integers(0, MODEL.vocab_size, (b, t)).astype(np.int32)
  weights = rng.normal(size=(b, t)).astype(np.float32)
  return model, h, targets, weights


def _reference(w, h, targets, weights, temperature):
  """numpy float64: log-probs, entropies, and the gradients d/dw, d/dh of
  sum(weights * (logps + entropy)) written out (d entropy / dz_j = -p_j (z_j - sum_i p_i z_i))."""
  w, h = np.float64(w), np.float64(h)
  z = np.einsum('btd,dv->btv', h, w) / temperature
  logz = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
  p = np.exp(z - logz[..., None])
  lp = np.take_along_axis(z, targets[..., None], -1)[..., 0] - logz
  mean_z = np.sum(p * z, -1, keepdims=True)
  ent = logz - mean_z[..., 0]
  onehot = np.eye(w.shape[1])[targets]
  dz = weights[..., None] * (onehot - p - p * (z - mean_z)) / temperature
  return lp, ent, (np.einsum('btd,btv->dv', h, dz), np.einsum('btv,dv->btd', dz, w))


@pytest.mark.parametrize('chunk', [0, 3, 5, 10, 64])
def test_chunked_logps_match_float64_reference(chunk):
  model, h, targets, weights = _setup()
  temperature = 0.7
  w = np.asarray(model.embed[...]).T  # tied embeddings: the output projection is embed.T
  ref_lp, ref_ent, (ref_gw, ref_gh) = _reference(w, h, targets, weights, temperature)

  graphdef, params = tfm.split(model)

  def f(params, h):
    m = tfm.merge(graphdef, params)
    lp, ent = logprobs.completion_token_stats(m, h, jnp.asarray(targets), temperature=temperature,
                                              chunk_size=chunk, with_entropy=True)
    return jnp.sum(weights * (lp + ent)), (lp, ent)

  (_, (lp, ent)), (gp, gh) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
      params, jnp.asarray(h))
  np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gp['embed']).T, ref_gw, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(gh, ref_gh, rtol=1e-4, atol=1e-5)
  lp_only, ent_none = logprobs.completion_token_stats(model, jnp.asarray(h), jnp.asarray(targets),
                                                      temperature=temperature, chunk_size=chunk)
  assert ent_none is None
  np.testing.assert_allclose(lp_only, ref_lp, rtol=1e-5, atol=1e-5)


def test_chunking_bounds_the_live_logits():
  """The backward of the chunked log-probs keeps one chunk's float32 logits, not [b, Tc, V]."""
  cfg = tfm.ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        tie_word_embeddings=True)
  model = tfm.Transformer(cfg, rngs=__import__('flax').nnx.Rngs(0))
  graphdef, params = tfm.split(model)
  b, t = 2, 128
  h = jax.ShapeDtypeStruct((b, t, cfg.hidden_size), jnp.float32)
  targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def temp_bytes(chunk):
    def f(params, h, targets):
      lp, ent = logprobs.completion_token_stats(tfm.merge(graphdef, params), h, targets,
                                                chunk_size=chunk, with_entropy=True)
      return jnp.sum(lp + ent)
    compiled = jax.jit(jax.grad(f)).lower(params, h, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = b * t * cfg.vocab_size * 4  # 4 MiB
  full, chunked = temp_bytes(0), temp_bytes(8)
  assert full >= logits_bytes, (full, logits_bytes)
  # one [b, 8, V] chunk (256 KiB) and the [D, V] gradient (512 KiB), not [b, Tc, V]
  assert chunked < logits_bytes / 2, (chunked, full)
