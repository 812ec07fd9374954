"""The sampler against independent references: the full forward pass and numpy.

* Greedy tokens are the argmax of the full forward's logits at every position (random tiny model
  unsharded and on a (2, 2, 2) mesh, the HF fixtures), and equal the tokens of a greedy loop of
  full forwards; EOS / pad / mask / early-exit semantics hold; chunking changes nothing.
* Sampled one-token completions follow softmax(logits / T) truncated by top-k / top-p (numpy),
  by a chi-square test; truncated tokens never appear.
* The sampler's log-probs are those of the tempered, untruncated softmax (what the learner
  computes), with and without top-k / top-p: equal to the learner's and to numpy's float64
  log_softmax(logits / T) of a full forward pass.
* New temperature / top_p values do not recompile.

Each jitted function is compiled once (module-scoped fixtures, ``functools.cache``).
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import logprobs
from jaxrl_ga import sampling
from jaxrl_ga import sharding
from jaxrl_ga.config import MeshConfig, SamplingConfig
from jaxrl_ga.models import transformer as tfm

try:
  from jaxrl_ga.models import hf
except ImportError:  # the HF loader (or transformers) is not available
  hf = None

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
CFG = tfm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
SHARPEN = 30.0  # lm_head scale: well-separated logits, so argmax never hinges on rounding
N, TP, L = 8, 6, 10  # prompts, prompt slots, max completion length
PAD = 0
TIE_ATOL = 1e-5  # a token within this of the max logit counts as an argmax (HF fixtures)


# -- helpers -------------------------------------------------------------------------------------
def _prompts(seed, vocab, low=1):
  """Left-padded [N, TP] prompts of different lengths (1 to TP real tokens)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(low, vocab, size=(N, TP)).astype(np.int32)
  lengths = np.array([TP, 1, 3, TP - 1, 2, TP, 4, 3])
  mask = (np.arange(TP)[None] >= (TP - lengths)[:, None]).astype(np.int32)
  return np.where(mask == 1, tokens, PAD).astype(np.int32), mask


def _random_params(cfg, seed, lm_head_scale=1.0, mesh=None):
  """(graphdef, numpy params, their shardings on ``mesh`` or None) of a random model.

  Drawn with numpy (much faster to set up than jitting the random init): weights and biases
  N(0, 0.02), norm scales 1 + N(0, 0.1); ``lm_head`` scaled by ``lm_head_scale``.
  """
  graphdef, shapes, axes = sharding.abstract_model(cfg)
  rng = np.random.default_rng(seed)

  def draw(shape, logical):
    if logical[-1] == 'norm':
      return (1.0 + 0.1 * rng.standard_normal(shape.shape)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape.shape)).astype(np.float32)

  params = jax.tree.map(draw, shapes, axes)
  params['lm_head'] = params['lm_head'] * np.float32(lm_head_scale)
  shardings = None if mesh is None else sharding.param_shardings(shapes, axes, mesh)
  return graphdef, params, shardings


@functools.cache
def _forward(graphdef):
  return jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m))


def _completion_logits(fwd, params, prompt_tokens, prompt_mask, tokens, mask):
  """Full-forward logits [N, Tc, V] at the positions that predict each completion token."""
  logits = fwd(params, np.concatenate([prompt_tokens, tokens], 1),
               np.concatenate([prompt_mask, mask], 1))
  return np.asarray(logits, np.float64)[:, prompt_tokens.shape[1] - 1:-1]


def _greedy_reference(fwd, params, prompt_tokens, prompt_mask):
  """[N, L] tokens of a greedy loop of full forwards (no cache, no EOS)."""
  tokens = np.full((N, L), PAD, np.int32)
  mask = np.zeros((N, L), np.int32)
  for s in range(L):
    logits = _completion_logits(fwd, params, prompt_tokens, prompt_mask, tokens, mask)
    tokens[:, s], mask[:, s] = logits[:, s].argmax(-1), 1
  return tokens


def _first_index(tokens, token):
  """[N] first position of ``token`` in each row of [N, L] tokens (L if absent)."""
  hit = tokens == token
  return np.where(hit.any(1), hit.argmax(1), tokens.shape[1])


def _pick_eos(reference):
  """A token that greedy emits before the last position in some rows (at several distinct
  positions) but never in others, so a batch has both early stops and truncations."""
  best, best_key = None, None
  for t in np.unique(reference):
    first = _first_index(reference, t)
    stops = first < L - 1
    if 2 <= stops.sum() <= N - 2:
      key = (len(set(first[stops])), stops.sum())
      if best_key is None or key > best_key:
        best, best_key = int(t), key
  assert best is not None, 'no token splits the batch into stopped and truncated rows'
  return best


def _check_semantics(out, eos):
  """Mask is a prefix; EOS ends it (kept, masked in); pad and logp 0 after; early exit."""
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  ended, logps = np.asarray(out.ended_with_eos), np.asarray(out.logps)
  lengths = mask.sum(1)
  np.testing.assert_array_equal(mask, np.arange(L)[None] < lengths[:, None])
  assert (tokens[mask == 0] == PAD).all() and (logps[mask == 0] == 0).all()
  assert (logps[mask == 1] <= 0).all()
  for row, length in enumerate(lengths):
    real = tokens[row, :length]
    assert length >= 1 and eos not in real[:-1]
    assert ended[row] == (real[-1] == eos)
    assert ended[row] or length == L
  assert int(out.num_decode_steps) == lengths.max()


def _assert_greedy_argmax(fwd, params, prompt_tokens, prompt_mask, out, atol=0.0):
  """Every completion token is the argmax of the full forward's logits before it."""
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  logits = _completion_logits(fwd, params, prompt_tokens, prompt_mask, tokens, mask)
  chosen = np.take_along_axis(logits, tokens[..., None], -1)[..., 0]  # [N, L]
  is_max = (logits.argmax(-1) == tokens) | (chosen >= logits.max(-1) - atol)
  assert is_max[mask == 1].all(), np.argwhere(~is_max & (mask == 1))
  return logits


def _categorical_draws(logits, key, temperature):
  """The sampler's RNG contract: completion position s draws
  ``jax.random.categorical(fold_in(key, s), logits[:, s] / T)``. logits [N, L, V] -> [N, L]."""
  return np.stack([np.asarray(jax.random.categorical(
      jax.random.fold_in(key, s), jnp.asarray(logits[:, s] / temperature, jnp.float32)))
      for s in range(logits.shape[1])], 1)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _expected_probs(logits, temperature, top_k=0, top_p=1.0):
  """Numpy: softmax(logits / T); keep the top_k; keep the smallest most-likely set of mass >= top_p;
  renormalize. logits [..., V] -> probs [..., V]."""
  probs = np.exp(_log_softmax(np.asarray(logits, np.float64) / temperature))
  order = np.argsort(-probs, axis=-1, kind='stable')
  ranked = np.take_along_axis(probs, order, -1)
  if top_k:
    ranked[..., top_k:] = 0
    ranked /= ranked.sum(-1, keepdims=True)
  if top_p < 1:
    count = (np.cumsum(ranked, -1) < top_p).sum(-1, keepdims=True) + 1  # tokens to keep
    ranked = np.where(np.arange(ranked.shape[-1]) < count, ranked, 0)
    ranked /= ranked.sum(-1, keepdims=True)
  out = np.zeros_like(probs)
  np.put_along_axis(out, order, ranked, -1)
  return out


def _chi_square_pvalue(counts, probs):
  """Goodness of fit over the support of ``probs``; bins expecting < 5 draws are lumped."""
  support = probs > 0
  expected = counts.sum() * probs
  big, small = support & (expected >= 5), support & (expected < 5)
  obs, exp = list(counts[big]), list(expected[big])
  if small.any():
    obs.append(counts[small].sum())
    exp.append(expected[small].sum())
  obs, exp = np.asarray(obs, np.float64), np.asarray(exp, np.float64)
  stat = ((obs - exp) ** 2 / exp).sum()
  df = len(obs) - 1
  return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


# -- a random tiny model: greedy, unsharded, on a mesh, chunked ----------------------------------
@pytest.fixture(scope='module')
def tiny():
  mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
  graphdef, params, shardings = _random_params(CFG, seed=0, lm_head_scale=SHARPEN, mesh=mesh)
  mesh_params = jax.device_put(params, shardings)  # the same values, sharded by the rules
  fwd = _forward(graphdef)
  prompt_tokens, prompt_mask = _prompts(1, CFG.vocab_size)
  reference = _greedy_reference(fwd, params, prompt_tokens, prompt_mask)
  eos = _pick_eos(reference)
  # A second batch whose rows all stop early: the stopping rows, repeated.
  stops = np.flatnonzero(_first_index(reference, eos) < L - 1)
  rows = np.resize(stops, N)
  return dict(mesh=mesh, graphdef=graphdef, params=params, mesh_params=mesh_params,
              shardings=shardings, fwd=fwd, prompts=(prompt_tokens, prompt_mask),
              stop_prompts=(prompt_tokens[rows], prompt_mask[rows]),
              reference=reference, stop_reference=reference[rows], eos=eos,
              sampler=sampling.Sampler(L, eos_id=eos, pad_id=PAD))


@pytest.fixture(scope='module')
def greedy(tiny):
  fn = sampling.make_generate_fn(tiny['graphdef'], tiny['sampler'], greedy=True)
  key = jax.random.key(0)
  out = dict(fn=fn, mixed=fn(tiny['params'], *tiny['prompts'], key, 1.0, 1.0),
             stop=fn(tiny['params'], *tiny['stop_prompts'], key, 1.0, 1.0),
             cold=fn(tiny['params'], *tiny['prompts'], key, 0.7, 0.9))
  return out


def _assert_matches_reference(out, reference, eos):
  lengths = np.minimum(_first_index(reference, eos) + 1, L)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), lengths)
  expected = np.where(np.arange(L)[None] < lengths[:, None], reference, PAD)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)


def test_greedy_equals_full_forward_argmax(tiny, greedy):
  out = greedy['mixed']
  _check_semantics(out, tiny['eos'])
  ended = np.asarray(out.ended_with_eos)
  assert ended.any() and not ended.all()  # some rows stop early, some are truncated
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], *tiny['prompts'], out)
  _assert_matches_reference(out, tiny['reference'], tiny['eos'])
  assert int(out.num_decode_steps) == L


def test_greedy_early_exit_when_all_rows_stop(tiny, greedy):
  out = greedy['stop']
  _check_semantics(out, tiny['eos'])
  assert np.asarray(out.ended_with_eos).all()
  lengths = np.asarray(out.mask).sum(1)
  assert len(set(lengths)) > 1  # rows stop at different steps
  assert int(out.num_decode_steps) == lengths.max() < L  # the loop exited early
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], *tiny['stop_prompts'], out)
  _assert_matches_reference(out, tiny['stop_reference'], tiny['eos'])


def test_greedy_logps_and_temperature_is_traced(tiny, greedy):
  """Greedy log-probs are those of the tempered softmax; new T / top_p do not recompile."""
  out, cold = greedy['mixed'], greedy['cold']
  np.testing.assert_array_equal(np.asarray(cold.tokens), np.asarray(out.tokens))
  mask = np.asarray(out.mask) == 1
  logits = _completion_logits(tiny['fwd'], tiny['params'], *tiny['prompts'],
                              np.asarray(out.tokens), np.asarray(out.mask))
  tokens = np.asarray(out.tokens)[..., None]
  for o, probs in ((out, _expected_probs(logits, 1.0)),
                   (cold, _expected_probs(logits, 0.7))):  # top-p does not change log-probs
    want = np.log(np.take_along_axis(probs, tokens, -1)[..., 0][mask])
    np.testing.assert_allclose(np.asarray(o.logps)[mask], want, atol=1e-5, rtol=0)
  assert greedy['fn']._cache_size() == 1


def test_greedy_on_mesh_equals_unsharded(tiny, greedy):
  mesh = tiny['mesh']
  fn = sampling.make_generate_fn(tiny['graphdef'], tiny['sampler'], greedy=True, mesh=mesh,
                                 param_shardings=tiny['shardings'])
  rows = sharding.batch_sharding(mesh)
  prompts = [jax.device_put(x, rows) for x in tiny['prompts']]
  out = fn(tiny['mesh_params'], *prompts, jax.random.key(0), 1.0, 1.0)
  assert out.tokens.sharding.spec == rows.spec
  ref = greedy['mixed']
  for name in ('tokens', 'mask', 'ended_with_eos', 'num_decode_steps'):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5, rtol=0)
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], *tiny['prompts'], out)


def test_chunked_greedy_equals_unchunked(tiny, greedy):
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, chunk_size=2)
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler, greedy=True)
  out = fn(tiny['params'], *tiny['prompts'], jax.random.key(0), 1.0, 1.0)
  ref = greedy['mixed']
  for name in ('tokens', 'mask', 'ended_with_eos', 'num_decode_steps'):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-6, rtol=0)


# -- sampled log-probs against the learner and numpy ---------------------------------------------
def test_sampled_logps_equal_learner_logps(tiny):
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, chunk_size=4)
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler)
  params, (prompt_tokens, prompt_mask) = tiny['params'], tiny['prompts']

  @jax.jit
  def learner_logps(params, tokens, mask, temperature):
    return logprobs.completion_logps(tfm.merge(tiny['graphdef'], params), prompt_tokens,
                                     prompt_mask, tokens, mask, temperature=temperature)[0]

  out = fn(params, prompt_tokens, prompt_mask, jax.random.key(1), 1.0, 1.0)
  _check_semantics(out, tiny['eos'])
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  logits = _completion_logits(tiny['fwd'], params, prompt_tokens, prompt_mask, tokens, mask)
  assert (logits.argmax(-1) != tokens)[mask == 1].any()  # really sampled, not all argmax
  want = np.asarray(learner_logps(params, tokens, mask, 1.0))
  m = mask == 1
  np.testing.assert_allclose(np.asarray(out.logps)[m], want[m], atol=1e-4, rtol=0)

  for temperature, top_p in ((0.7, 1.0), (1.3, 0.8)):
    out = fn(params, prompt_tokens, prompt_mask, jax.random.key(2), temperature, top_p)
    _check_semantics(out, tiny['eos'])
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    logits = _completion_logits(tiny['fwd'], params, prompt_tokens, prompt_mask, tokens, mask)
    probs = np.take_along_axis(_expected_probs(logits, temperature, top_p=top_p),
                               tokens[..., None], -1)[..., 0]
    m = mask == 1
    assert (probs[m] > 0).all()  # never a token outside the nucleus
    full = np.take_along_axis(_log_softmax(logits / temperature), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logps)[m], full[m], atol=1e-4, rtol=0)
    # The learner's tempered log-probs are the sampler's, with or without top-p.
    want = np.asarray(learner_logps(params, tokens, mask, temperature))
    np.testing.assert_allclose(np.asarray(out.logps)[m], want[m], atol=1e-4, rtol=0)
  assert fn._cache_size() == 1


def test_sampled_tokens_are_jax_categorical_draws(tiny):
  """The RNG contract of the module docstring, against jax's own sampler: completion position s
  is ``jax.random.categorical(fold_in(rng, s), logits / T)`` of the full forward's logits given
  the tokens before it (EOS never stops these rows: its id is outside the vocabulary)."""
  sampler = sampling.Sampler(L, eos_id=CFG.vocab_size, pad_id=PAD)
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler)
  params, (prompt_tokens, prompt_mask) = tiny['params'], tiny['prompts']
  temperature, key = 20.0, jax.random.key(7)  # hot enough to undo SHARPEN: real draws
  out = fn(params, prompt_tokens, prompt_mask, key, temperature, 1.0)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  assert (mask == 1).all()
  logits = _completion_logits(tiny['fwd'], params, prompt_tokens, prompt_mask, tokens, mask)
  assert (logits.argmax(-1) != tokens).any()  # really sampled, not all argmax
  np.testing.assert_array_equal(tokens, _categorical_draws(logits, key, temperature))
  # Raw key data (jax.random.PRNGKey, as the DPO pair sampler passes) is one key too: the same
  # draws as jax.random.categorical's with it.
  raw = jax.random.PRNGKey(7)
  out = fn(params, prompt_tokens, prompt_mask, raw, temperature, 1.0)
  np.testing.assert_array_equal(np.asarray(out.tokens), _categorical_draws(logits, raw,
                                                                           temperature))


@pytest.mark.parametrize('chunk_size,on_mesh', [(0, False), (4, False), (0, True)])
def test_shared_prompts_are_prefilled_once_and_sample_as_copies(tiny, chunk_size, on_mesh):
  """``generate(share=R)``: N/R prompts, R rows each, one prefill per prompt. Every row's tokens
  are ``jax.random.categorical`` draws of the full forward's logits of its prompt and the tokens
  before it (the RNG contract, as for R copies of the prompt), its log-probs numpy's float64
  log_softmax of those logits; greedy rows are the full forward's argmax. Chunked (chunks of 4
  rows: 2 prompts) and on a (2, 2, 2) mesh as well; and the prefill runs on N/R rows."""
  r = 2
  sampler = sampling.Sampler(L, eos_id=CFG.vocab_size, pad_id=PAD, chunk_size=chunk_size)
  prompt_tokens, prompt_mask = (x[:N // r] for x in tiny['prompts'])
  rows_tokens, rows_mask = (np.repeat(x, r, axis=0) for x in (prompt_tokens, prompt_mask))
  mesh = tiny['mesh'] if on_mesh else None
  params = tiny['mesh_params'] if on_mesh else tiny['params']

  def make(greedy):
    fn = lambda p, t, m, key, temp: sampling.generate(
        tfm.merge(tiny['graphdef'], p), t, m, key, sampler, temperature=temp, greedy=greedy,
        share=r)
    if not on_mesh:
      return jax.jit(fn)
    rows = sharding.batch_sharding(mesh)
    return jax.jit(fn, in_shardings=(tiny['shardings'], rows, rows, None, None))

  temperature, key = 20.0, jax.random.key(7)  # hot enough to undo SHARPEN: real draws
  out = make(False)(params, prompt_tokens, prompt_mask, key, temperature)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  assert tokens.shape == (N, L) and (mask == 1).all()
  logits = _completion_logits(tiny['fwd'], tiny['params'], rows_tokens, rows_mask, tokens, mask)
  assert (logits.argmax(-1) != tokens).any()  # really sampled, not all argmax
  assert (tokens[0::r] != tokens[1::r]).any()  # a prompt's rows draw their own tokens
  if chunk_size == 0:  # chunks derive their own keys (the module docstring)
    np.testing.assert_array_equal(tokens, _categorical_draws(logits, key, temperature))
  full = np.take_along_axis(_log_softmax(logits / temperature), tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logps), full, atol=1e-4, rtol=0)
  greedy_out = make(True)(params, prompt_tokens, prompt_mask, key, 1.0)
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], rows_tokens, rows_mask, greedy_out)
  np.testing.assert_array_equal(np.asarray(greedy_out.tokens)[0::r],
                                np.asarray(greedy_out.tokens)[1::r])
  if not on_mesh:  # the prefill's projections run on the N/R prompts' rows, not on N rows
    hlo = make(True).lower(params, prompt_tokens, prompt_mask, key, 1.0).as_text()
    rows = chunk_size or N  # completions generated at once
    assert f'tensor<{rows // r * TP}x{CFG.hidden_size}xf32>' in hlo
    assert f'tensor<{rows * TP}x{CFG.hidden_size}xf32>' not in hlo


@pytest.mark.parametrize('top_k,temperature,top_p', [(5, 1.0, 1.0), (0, 1.3, 0.7),
                                                     (6, 0.8, 0.9)])
def test_sampler_logps_are_untruncated_with_top_k_and_top_p(top_k, temperature, top_p):
  """Top-k / top-p choose the token; the reported log-prob is log_softmax(logits / T)[token] of
  the whole vocabulary (what the learner computes and ``old_logprob_source='sampler'`` feeds to
  the ratio), checked against numpy float64 over a full forward pass of prompt + completion."""
  graphdef, params, _ = _random_params(CFG, seed=3, lm_head_scale=8.0)  # spread-out logits
  prompt_tokens, prompt_mask = _prompts(4, CFG.vocab_size)
  sampler = sampling.Sampler(L, eos_id=CFG.vocab_size, pad_id=PAD, top_k=top_k)  # no EOS
  out = sampling.make_generate_fn(graphdef, sampler)(params, prompt_tokens, prompt_mask,
                                                     jax.random.key(5), temperature, top_p)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask) == 1
  assert mask.all()
  logits = _completion_logits(_forward(graphdef), params, prompt_tokens, prompt_mask, tokens,
                              mask.astype(np.int32))
  full = np.take_along_axis(_log_softmax(logits / temperature), tokens[..., None], -1)[..., 0]
  truncated = np.log(np.take_along_axis(_expected_probs(logits, temperature, top_k, top_p),
                                        tokens[..., None], -1)[..., 0])
  assert np.isfinite(truncated).all()  # every token came from the truncated distribution ...
  assert (truncated - full).mean() > 0.05  # ... which differs from the full softmax here
  np.testing.assert_allclose(np.asarray(out.logps), full, atol=1e-4, rtol=0)


# -- sampling follows the distribution (V = 8, one-token completions) ----------------------------
DIST_CFG = tfm.ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
DRAWS = 4000


@pytest.fixture(scope='module')
def dist_model():
  # lm_head scaled so that the probabilities range over two orders of magnitude.
  graphdef, params, _ = _random_params(DIST_CFG, seed=0, lm_head_scale=12.0)
  prompt_tokens = np.tile(np.array([[0, 3, 5, 1, 6]], np.int32), (DRAWS, 1))
  prompt_mask = np.tile(np.array([[0, 1, 1, 1, 1]], np.int32), (DRAWS, 1))
  logits = np.asarray(_forward(graphdef)(params, prompt_tokens[:1], prompt_mask[:1]),
                      np.float64)[0, -1]  # [V]
  return graphdef, params, prompt_tokens, prompt_mask, logits


@pytest.mark.parametrize('top_k,cases', [
    (0, ((0.7, 1.0), (1.5, 1.0), (1.0, 0.8))),
    (3, ((1.0, 1.0), (1.3, 0.7))),
])
def test_sampling_follows_distribution(dist_model, top_k, cases):
  graphdef, params, prompt_tokens, prompt_mask, logits = dist_model
  sampler = sampling.Sampler(1, eos_id=7, pad_id=PAD, top_k=top_k)
  fn = sampling.make_generate_fn(graphdef, sampler)
  for i, (temperature, top_p) in enumerate(cases):
    out = fn(params, prompt_tokens, prompt_mask, jax.random.key(10 + i), temperature, top_p)
    tokens = np.asarray(out.tokens)[:, 0]
    assert (np.asarray(out.mask) == 1).all()
    probs = _expected_probs(logits, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=DIST_CFG.vocab_size)
    if top_k or top_p < 1:
      assert (probs == 0).any()  # the case truncates something ...
      assert (counts[probs == 0] == 0).all()  # ... and truncated tokens never appear
    p_value = _chi_square_pvalue(counts, probs)
    assert p_value > 1e-3, (temperature, top_p, counts, DRAWS * probs)
    # Power: the same draws reject a distribution at another temperature.
    wrong = np.where(probs > 0, _expected_probs(logits, 2.0 * temperature, top_k, top_p), 0)
    assert _chi_square_pvalue(counts, wrong / wrong.sum()) < 1e-3
    full = _log_softmax(logits / temperature)  # log-probs are untruncated, as the learner's
    np.testing.assert_allclose(np.asarray(out.logps)[:, 0], full[tokens], atol=1e-5, rtol=0)
  assert fn._cache_size() == 1  # new temperature / top_p values reuse the compile


def _nucleus_reference(x, top_p):
  """Numpy (float64, sorted): the tokens top-p keeps — the most likely ones while the mass before
  them is < top_p, and every token tied with the last kept one. x [B, V] -> bool [B, V]."""
  x = np.asarray(x, np.float64)
  probs = np.exp(_log_softmax(x))
  keep = np.zeros(x.shape, bool)
  for r in range(x.shape[0]):
    order = np.argsort(-x[r], kind='stable')
    before = np.cumsum(probs[r, order]) - probs[r, order]
    threshold = x[r, order][(before < top_p).sum() - 1]
    keep[r] = x[r] >= threshold
  return keep


@pytest.mark.parametrize('vocab', [5, 64, 32000])
def test_top_p_without_sort_equals_sorted_reference(vocab):
  """warp_logits' full-vocabulary top-p (a bisection, no sort) keeps the sorted reference's
  tokens: continuous logits, and tie-heavy ones with signed zeros."""
  rng = np.random.default_rng(vocab)
  warp = jax.jit(sampling.warp_logits)
  rows = [rng.normal(size=(4, vocab)) * 3,
          np.round(rng.normal(size=(4, vocab)) * 2),  # many ties, -0.0 and 0.0 among them
          np.round(rng.normal(size=(4, vocab)), 1) * 0.5]
  for x in rows:
    x = x.astype(np.float32)
    for top_p in (0.05, 0.37, 0.9, 0.999):
      kept = np.isfinite(np.asarray(warp(x, 1.0, top_p)))
      # float32 sums over up to 32000 tokens may round either way where the mass before a token
      # is within 1e-5 of top_p: such tokens may go either way, no other token may.
      must, may = _nucleus_reference(x, top_p - 1e-5), _nucleus_reference(x, top_p + 1e-5)
      assert (kept >= must).all() and (kept <= may).all(), f'top_p={top_p}'
      assert (may.sum(-1) - must.sum(-1) <= 0.01 * may.sum(-1) + 2).all()  # a narrow band
      assert kept.sum(-1).min() >= 1


@pytest.mark.parametrize('top_k', [1, 2, 5, 40])
def test_top_p_after_top_k_is_the_nucleus_of_every_token_top_k_keeps(top_k):
  """top-k keeps the tokens tied with the k-th (as transformers' TopKLogitsWarper); top-p then
  works on the renormalized result, those ties included in its mass (bfloat16 logits tie
  often). The reference: the sorted nucleus of the top-k-masked logits, in float64."""
  rng = np.random.default_rng(top_k)
  warp = jax.jit(sampling.warp_logits, static_argnums=3)
  rows = [np.array([[2.0, 1.0, 1.0, -10.0, -10.0] + [-20.0] * 59]),  # TRL-audit's case
          np.round(rng.normal(size=(8, 64)) * 2),  # many ties
          rng.normal(size=(8, 64)) * 3]
  for x in rows:
    x = x.astype(np.float32)
    kth = np.sort(x, -1)[:, ::-1][:, top_k - 1:top_k]
    after_k = np.where(x >= kth, x, -np.inf)
    for top_p in (0.3, 0.6, 0.9):
      kept = np.isfinite(np.asarray(warp(x, 1.0, top_p, top_k)))
      must, may = (_nucleus_reference(after_k, top_p - 1e-6),
                   _nucleus_reference(after_k, top_p + 1e-6))
      assert (kept >= must).all() and (kept <= may).all(), (top_k, top_p, x[0, :5])


# -- HF fixture models ---------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['qwen2_tiny', 'llama_tiny'])
def test_greedy_equals_full_forward_argmax_hf(name):
  path = os.path.join(FIXTURES, name)
  if hf is None or not os.path.exists(os.path.join(path, 'model.safetensors')):
    pytest.skip('HF loader or fixture not available')
  cfg, graphdef, params = hf.load_model(path)
  fwd = _forward(graphdef)
  prompt_tokens, prompt_mask = _prompts(2, cfg.vocab_size, low=4)
  eos = _pick_eos(_greedy_reference(fwd, params, prompt_tokens, prompt_mask))
  fn = sampling.make_generate_fn(graphdef, sampling.Sampler(L, eos_id=eos, pad_id=PAD),
                                 greedy=True)
  out = fn(params, prompt_tokens, prompt_mask, jax.random.key(0), 1.0, 1.0)
  _check_semantics(out, eos)
  assert np.asarray(out.ended_with_eos).any()
  logits = _assert_greedy_argmax(fwd, params, prompt_tokens, prompt_mask, out, atol=TIE_ATOL)
  mask = np.asarray(out.mask) == 1
  want = np.take_along_axis(_log_softmax(logits), np.asarray(out.tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logps)[mask], want[mask], atol=1e-4, rtol=0)
  # The same weights loaded straight onto an 8-device mesh give the same greedy tokens.
  mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
  _, _, mesh_params = hf.load_model(
      path, shardings_fn=functools.partial(sharding.param_shardings, mesh=mesh))
  mesh_fn = sampling.make_generate_fn(
      graphdef, sampling.Sampler(L, eos_id=eos, pad_id=PAD), greedy=True, mesh=mesh,
      param_shardings=jax.tree.map(lambda x: x.sharding, mesh_params))
  rows = sharding.batch_sharding(mesh)
  mesh_out = mesh_fn(mesh_params, jax.device_put(prompt_tokens, rows),
                     jax.device_put(prompt_mask, rows), jax.random.key(0), 1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(mesh_out.tokens), np.asarray(out.tokens))
  np.testing.assert_array_equal(np.asarray(mesh_out.mask), np.asarray(out.mask))


# -- the tied head at decode time: split into vocabulary blocks on CPU ---------------------------
TIED_CFG = tfm.ModelConfig(vocab_size=16384, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)


def test_tied_head_at_decode_is_split_on_cpu_only_and_matches_full_forward():
  """With tied embeddings, 2-64 rows and a vocabulary of 16k or more, the prefill's and each
  decode step's head run as 32 vocabulary blocks when compiled for CPU
  (``Transformer._next_token_logits``); the same function lowered for TPU keeps the plain
  product. The greedy tokens are the full forward's argmax (the plain product over every
  position) and the log-probs its log-softmax, unsharded and on a (2, 2, 2) mesh."""
  mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
  graphdef, shapes, axes = sharding.abstract_model(TIED_CFG)
  rng = np.random.default_rng(0)
  params = jax.tree.map(  # N(0, 1) embeddings: logits spread over tens of units
      lambda s, a: ((1.0 + 0.1 * rng.standard_normal(s.shape)) if a[-1] == 'norm' else
                    (1.0 if a[0] == 'vocab' else 0.2) * rng.standard_normal(s.shape)
                    ).astype(np.float32), shapes, axes)
  prompts = _prompts(3, TIED_CFG.vocab_size)
  sampler = sampling.Sampler(L, eos_id=TIED_CFG.vocab_size - 1, pad_id=PAD)
  fn = sampling.make_generate_fn(graphdef, sampler, greedy=True)
  args = (params, *prompts, jax.random.key(0), 1.0, 1.0)
  split = 'bd,cvd->cbv'  # the blocked product's einsum, in the ops' names
  assert split in fn.lower(*args).compile().as_text()
  assert split not in fn.trace(*args).lower(lowering_platforms=('tpu',)).as_text(
      debug_info=True)

  out = fn(*args)
  mask = np.asarray(out.mask) == 1
  logits = _assert_greedy_argmax(_forward(graphdef), params, *prompts, out, atol=1e-4)
  want = np.take_along_axis(_log_softmax(logits), np.asarray(out.tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logps)[mask], want[mask], atol=1e-4, rtol=0)

  shardings = sharding.param_shardings(shapes, axes, mesh)
  mesh_fn = sampling.make_generate_fn(graphdef, sampler, greedy=True, mesh=mesh,
                                      param_shardings=shardings)
  rows = sharding.batch_sharding(mesh)
  mesh_out = mesh_fn(jax.device_put(params, shardings),
                     *[jax.device_put(x, rows) for x in prompts], jax.random.key(0), 1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(mesh_out.tokens), np.asarray(out.tokens))
  np.testing.assert_allclose(np.asarray(mesh_out.logps), np.asarray(out.logps), atol=1e-4,
                             rtol=0)


# -- issue 36: attention over the filled cache, the slot pool ------------------------------------
BLOCK = 4  # cache slots per block of the decode attention: 4 blocks in TP + L - 1 = 15, the
# last overlapping the third


def _tail_from(cache, source, keep):
  """``cache`` with its slots from ``keep`` on (k and v) taken from ``source`` (a cache, or a
  number for every such slot)."""
  tail = lambda x, y: x.at[..., keep:, :].set(y if np.isscalar(y) else y[..., keep:, :])
  if np.isscalar(source):
    return cache.replace(k=tail(cache.k, source), v=tail(cache.v, source))
  return cache.replace(k=tail(cache.k, source.k), v=tail(cache.v, source.v))


def test_decode_attends_over_the_filled_blocks_only(tiny):
  """Each decode step reads the cache's blocks up to the slot it writes and no further: with every
  later slot NaN, its logits are still the full forward's (float64 reference) at every step,
  while the same step over the whole cache (``block=0``) reads the NaNs."""
  graphdef, params = tiny['graphdef'], tiny['params']
  prompt_tokens, prompt_mask = tiny['prompts']
  tokens = tiny['reference']  # the greedy continuation, fed back
  want = _completion_logits(tiny['fwd'], params, prompt_tokens, prompt_mask, tokens,
                            np.ones_like(tokens))

  @functools.partial(jax.jit, static_argnums=(3,))
  def step(params, cache, token, block):
    return tfm.merge(graphdef, params).decode(token, cache, block=block)

  prefill = jax.jit(lambda p, t, m: tfm.merge(graphdef, p).prefill(t, m, TP + L - 1))
  first, cache = prefill(params, prompt_tokens, prompt_mask)
  np.testing.assert_allclose(np.asarray(first), want[:, 0], atol=1e-4, rtol=0)
  for s in range(1, L):
    written = TP + s  # slots 0 .. TP + s - 1 after this step's write
    keep = min(-(-written // BLOCK) * BLOCK, TP + L - 1)
    poisoned = _tail_from(cache, np.nan, keep)
    logits, new = step(params, poisoned, tokens[:, s - 1], BLOCK)
    np.testing.assert_allclose(np.asarray(logits), want[:, s], atol=1e-4, rtol=0)
    if keep < TP + L - 1:  # the whole cache's attention would read the poisoned slots
      assert np.isnan(np.asarray(step(params, poisoned, tokens[:, s - 1], 0)[0])).all()
    cache = _tail_from(new, cache, keep)  # the step wrote below keep; the tail stays clean


@pytest.fixture(scope='module')
def pool_greedy(tiny):
  """Greedy pools of 3 slots (blocked attention) on the mixed and the all-stopping batches."""
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, slots=3, decode_block=BLOCK)
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler, greedy=True)
  key = jax.random.key(0)
  return {name: fn(tiny['params'], *tiny[f'{name}prompts'], key, 1.0, 1.0)
          for name in ('', 'stop_')}


@pytest.mark.parametrize('batch', ['', 'stop_'])
def test_slot_pool_greedy_equals_the_batched_sampler(tiny, greedy, pool_greedy, batch):
  """Rows with early EOS and truncated ones: the pool's greedy tokens, masks and EOS flags are
  the batched sampler's (and the full forward's argmax), its log-probs equal; and it refills
  slots as rows finish: fewer decode steps than batches of 3 rows would take."""
  out, ref = pool_greedy[batch], greedy['mixed' if batch == '' else 'stop']
  for name in ('tokens', 'mask', 'ended_with_eos'):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5, rtol=0)
  _check_semantics(out.replace(num_decode_steps=np.asarray(out.mask).sum(1).max()),
                  tiny['eos'])
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], *tiny[f'{batch}prompts'], out)
  lengths = np.asarray(out.mask).sum(1)
  batched = sum(lengths[i:i + 3].max() for i in range(0, N, 3))
  # Each row's token 0 comes from the prefill; then one step per later token, 3 at a time.
  assert (lengths - 1).sum() / 3 <= int(out.num_decode_steps) < batched


@pytest.mark.parametrize('slots', [0, 3])
def test_any_of_several_eos_ids_ends_a_row_as_trl_stops(tiny, slots):
  """TRL 1.16 ends a completion at the first of its eos ids (the tokenizer's and the model's
  generation config's): the reference is the no-cache greedy loop cut at the first of two ids,
  picked so that some rows stop at the second, some at the first, some run to the limit."""
  reference = tiny['reference']
  first_eos = tiny['eos']
  at_first = _first_index(reference, first_eos)
  candidates = [int(t) for t in np.unique(reference) if t not in (first_eos, PAD)
                and ((_first_index(reference, t) < np.minimum(at_first, L - 1))).any()
                and (np.minimum(_first_index(reference, t), at_first) >= L).any()]
  assert candidates, 'no second id stops a row earlier while another row runs to the limit'
  second = candidates[0]
  stop = np.minimum(at_first, _first_index(reference, second))
  assert (stop < at_first).any() and (stop == at_first).any() and (stop >= L).any()
  sampler = sampling.Sampler.from_config(
      SamplingConfig(max_completion_length=L, decode_slots=slots), eos_id=(first_eos, second),
      pad_id=PAD)
  assert (sampler.eos_id, sampler.more_eos_ids) == (first_eos, (second,))
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler, greedy=True)
  out = fn(tiny['params'], *tiny['prompts'], jax.random.key(0), 1.0, 1.0)
  lengths = np.minimum(stop + 1, L)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), lengths)
  np.testing.assert_array_equal(np.asarray(out.tokens),
                                np.where(np.arange(L)[None] < lengths[:, None], reference, PAD))
  np.testing.assert_array_equal(np.asarray(out.ended_with_eos), stop < L)


def test_slot_pool_on_mesh_equals_the_batched_sampler(tiny, greedy):
  """The pool under a (2, 2, 2) mesh (prompts and outputs sharded over the data axes, params by
  the rules): the batched sampler's greedy tokens."""
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, slots=4, decode_block=BLOCK)
  fn = sampling.make_generate_fn(tiny['graphdef'], sampler, greedy=True, mesh=tiny['mesh'],
                                 param_shardings=tiny['shardings'])
  rows = sharding.batch_sharding(tiny['mesh'])
  out = fn(tiny['mesh_params'], *[jax.device_put(x, rows) for x in tiny['prompts']],
           jax.random.key(0), 1.0, 1.0)
  ref = greedy['mixed']
  for name in ('tokens', 'mask', 'ended_with_eos'):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5, rtol=0)


@pytest.mark.parametrize('slots', [0, 4])
def test_decode_step_program_is_the_loops_own_body(tiny, greedy, slots):
  """``sampling.make_decode_step`` (the GRPO programs' 'decode' entry, the program ``plan``
  costs the decode loop by), called step by step on the (2, 2, 2) mesh from the loop's carry
  after the prefill until the loop's condition ends it, gives the sampler's greedy completions,
  every token the full forward's argmax: it is one iteration of the loop, batched or the slot
  pool's, at the abstract arguments it was built for."""
  mesh, graphdef = tiny['mesh'], tiny['graphdef']
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, slots=slots, decode_block=BLOCK)
  rows = sharding.batch_sharding(mesh)
  tokens, mask = [jax.device_put(x, rows) for x in tiny['prompts']]
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  fn, args = sampling.make_decode_step(
      graphdef, sampler, jax.tree.map(abstract, tiny['mesh_params']), abstract(tokens),
      abstract(mask), greedy=True, mesh=mesh)
  rng = jax.random.key(0)
  # pylint: disable-next=protected-access
  start = sampling._pool_carry if slots else sampling._rows_carry
  carry = jax.jit(lambda p, t, m: start(tfm.merge(graphdef, p), t, m, rng, sampler, 1.0, 1.0,
                                        True, 1))(tiny['mesh_params'], tokens, mask)
  layers, queue, state = carry if slots else (carry[0], None, carry[1])
  put = lambda x, a: jax.device_put(x, a.sharding)
  layers, state = jax.tree.map(put, layers, args[1]), jax.tree.map(put, state, args[2])
  queue = jax.tree.map(put, queue, args[3])
  assert jax.tree.map(abstract, (layers, state, queue)) == (args[1], args[2], args[3])
  running = (lambda s: bool(np.asarray(s.active).any() or int(s.next_row) < N)) if slots else (
      lambda s: int(s.step) < L and not np.asarray(s.done).all())
  steps = 0
  while running(state) and steps < N * L:
    state = fn(tiny['mesh_params'], layers, state, queue, rng, np.float32(1.0), np.float32(1.0))
    steps += 1
  out, ref = greedy['mixed'], dict(tokens=state.tokens, mask=state.mask,
                                   ended_with_eos=state.ended if slots else state.done)
  for name, value in ref.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(out, name)))
  _assert_greedy_argmax(tiny['fwd'], tiny['params'], *tiny['prompts'], out)
  assert steps == (int(state.steps) if slots else L - 1)


def _fsdp_generate(graphdef, sampler, mesh, shardings):
  """The sampler as the rollout step runs it: its activations constrained on the mesh
  (``Sampler.activation_mesh``), params sharded by the rules, rows over the data axes."""
  rows = sharding.batch_sharding(mesh)
  sampler = dataclasses.replace(sampler, activation_mesh=sharding.KernelMesh(mesh))
  fn = lambda p, t, m: sampling.generate(tfm.merge(graphdef, p), t, m, jax.random.key(0),
                                         sampler, greedy=True)
  return jax.jit(fn,
                 in_shardings=(shardings, rows, rows))


@pytest.mark.parametrize('slots', [0, 3])
def test_decode_under_fsdp8_equals_unsharded(tiny, greedy, slots):
  """On an fsdp=8 mesh (every weight's embed axis over 8 devices, gathered one layer at a time
  in the decode step; ``transformer._gather_layer``) the batched sampler and the slot pool give
  the unsharded sampler's greedy tokens; with the fused weights of accelerators
  (``Sampler.fuse_weights``) against the unfused ones the CPU runs by default."""
  mesh = sharding.make_mesh(MeshConfig(1, 8, 1))
  _, shapes, axes = sharding.abstract_model(CFG)
  shardings = sharding.param_shardings(shapes, axes, mesh)
  sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, slots=slots, decode_block=BLOCK,
                             fuse_weights=True)
  rows = sharding.batch_sharding(mesh)
  out = _fsdp_generate(tiny['graphdef'], sampler, mesh, shardings)(
      jax.device_put(tiny['params'], shardings),
      *[jax.device_put(x, rows) for x in tiny['prompts']])
  ref = greedy['mixed']
  for name in ('tokens', 'mask', 'ended_with_eos'):
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)))
  np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5, rtol=0)


def _all_gathers(hlo: str) -> dict[str, list[str]]:
  """The result shapes (e.g. 'f32[64,512]') of the all-gathers of a compiled HLO module, by
  computation: 'ENTRY' or a nested one (a loop body, ...)."""
  out, comp = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(' '):
      comp = 'ENTRY' if line.startswith('ENTRY') else line.split(' ')[0]
    m = re.search(r'= (\w+\[[\d,]*\])\S* all-gather(?:-start)?\(', line)
    if m:
      out.setdefault(comp, []).append(m.group(1))
  return out


def test_decode_under_fsdp8_gathers_layers_inside_the_loop():
  """In the compiled fsdp=8 sampler (8 layers) no layer weight is all-gathered before the decode
  loop, where one gather of every layer would stay live for the whole loop: each is gathered
  inside a loop body (``transformer._gather_layer``). Before it, XLA gathered 59 of them in the
  entry computation, ahead of the loop. The decode step gathers the fused weights of
  ``Transformer.decode_layers`` (qkv [64, 64 + 2 x 32], gate/up [64, 2 x 512]): 4 per layer,
  7 before they were fused."""
  cfg = tfm.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=512,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
  mesh = sharding.make_mesh(MeshConfig(1, 8, 1))
  graphdef, shapes, axes = sharding.abstract_model(cfg)
  shardings = sharding.param_shardings(shapes, axes, mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        shardings)
  prompt = jax.ShapeDtypeStruct((N, TP), jnp.int32, sharding=sharding.batch_sharding(mesh))
  weights = {'f32[%s]' % ','.join(map(str, x.shape[1:])) for name, x in shapes['layers'].items()
             if 'embed' in axes['layers'][name]}  # the gathered shapes of one layer's weights
  assert weights == {'f32[64,64]', 'f32[64,32]', 'f32[64,512]', 'f32[512,64]'}
  fused = {'f32[64,128]', 'f32[64,64]', 'f32[64,1024]', 'f32[512,64]'}  # decode_layers'
  for slots in (0, 3):
    sampler = sampling.Sampler(L, eos_id=1, pad_id=PAD, slots=slots, decode_block=BLOCK,
                               fuse_weights=True)
    hlo = _fsdp_generate(graphdef, sampler, mesh, shardings).lower(
        params, prompt, prompt).compile().as_text()
    gathers = _all_gathers(hlo)
    assert not [s for s in gathers.get('ENTRY', []) if s in weights | fused], (
        slots, gathers['ENTRY'])
    in_loops = sum(s in fused for comp, found in gathers.items() if comp != 'ENTRY'
                   for s in found)
    assert in_loops >= 4 * cfg.num_hidden_layers, gathers  # the decode step's, at least


# -- the compiled decode step ---------------------------------------------------------------------
_FREE_OPS = ('parameter', 'get-tuple-element', 'tuple', 'constant', 'bitcast')


def _decode_body_ops(hlo: str) -> dict[str, int]:
  """Instructions by opcode in the body of the compiled program's largest while loop (the decode
  loop: every layer unrolled) and in the loops, conditionals and calls it runs (each counted once:
  per iteration), without the free ones (``_FREE_OPS``); 'dot-fusion' counts the fusions that hold
  a dot (a product), also counted in 'fusion'."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(' ') and line.rstrip().endswith('{') and '(' in line:
      name = (line.split(' ')[1] if line.startswith('ENTRY') else line.split(' ')[0]).lstrip('%')
      comps[name] = []
    elif name and ' = ' in line:
      m = re.search(r' ([a-z][\w-]*)\(', line.split(' = ', 1)[1])
      comps[name].append((m.group(1) if m else '?', line))
  subs = lambda line, keys: re.findall(r'(?:%s)=\{?%%?([\w.-]+)' % '|'.join(keys), line)
  bodies = [b for ins in comps.values() for op, line in ins if op == 'while'
            for b in subs(line, ['body'])]
  body = max(bodies, key=lambda b: len(comps[b]))
  count, seen, todo = {}, {body}, [body]
  while todo:
    for op, line in comps[todo.pop()]:
      if op in _FREE_OPS:
        continue
      count[op] = count.get(op, 0) + 1
      if op == 'fusion' and any(o == 'dot' for o, _ in comps[subs(line, ['calls'])[0]]):
        count['dot-fusion'] = count.get('dot-fusion', 0) + 1
      keys = ['body', 'condition', 'true_computation', 'false_computation',
              'branch_computations'] + (['to_apply'] if op == 'call' else [])
      for sub in subs(line, keys):
        if sub in comps and sub not in seen:
          seen.add(sub)
          todo.append(sub)
  return count


def test_gpu_compiler_options_are_xla_s_and_only_for_gpus():
  """``compiler_options``: None (XLA's defaults) on CPU, ``GPU_COMPILER_OPTIONS`` for GPU devices;
  XLA accepts those options by name and value (a wrong value is refused: the check is real), so
  a GPU run cannot fail on them. Compiled here on CPU, where they have no effect."""
  class Gpu:
    platform = 'gpu'
  assert sampling.compiler_options() is None
  assert sampling.compiler_options([Gpu()]) == sampling.GPU_COMPILER_OPTIONS
  f = lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]
  assert float(jax.jit(f, compiler_options=sampling.GPU_COMPILER_OPTIONS)(1.0)) == 8.0
  with pytest.raises(Exception, match='xla_gpu_enable_command_buffer'):
    jax.jit(f, compiler_options={'xla_gpu_enable_command_buffer': 'WHILE,NOT_A_KIND'})(1.0)


@pytest.mark.parametrize('fuse,products,fusions', [(True, 13, 80), (None, 19, 86)])
def test_decode_step_kernel_count(fuse, products, fusions):
  """The decode loop body of the sampler as the rollout compiles it (sampled, temperature and
  top-p traced), on XLA:CPU for the 2-layer ``CFG``. With the fused weights of accelerators
  (``Sampler.fuse_weights``, ``Transformer.decode_layers``) the products are one per weight
  (qkv, o, gate/up, down), two of the attention per layer and the head: 2 x (4 + 2) + 1 = 13,
  where the unfused layer has 2 x (7 + 2) + 1 = 19 (the CPU's default, and every backend's before
  issue 47); at most 80 fusions in all (86 unfused). At the 0.4B shape of issue 47 (24 layers,
  bf16 compute, 64 rows, 576 cache slots; compiled on CPU, not run) fusing took the count from
  988 fusions (217 products) to 940 (145), and from 1198 non-free instructions to 1150. A
  regression in the step's kernel count shows here without a GPU."""
  graphdef, shapes, _ = sharding.abstract_model(CFG)
  prompt = jax.ShapeDtypeStruct((N, TP), jnp.int32)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  sampler = sampling.Sampler(L, eos_id=1, pad_id=PAD, fuse_weights=fuse)
  fn = sampling.make_generate_fn(graphdef, sampler)
  count = _decode_body_ops(fn.lower(shapes, prompt, prompt, jax.random.key(0), scalar,
                                    scalar).compile().as_text())
  assert count.get('dot-fusion', 0) + count.get('dot', 0) == products, count
  assert count['fusion'] <= fusions, count


@pytest.mark.parametrize('share,slot_counts', [(1, (1, 3)), (2, (3,))])
def test_slot_pool_rows_draw_their_own_keys_whatever_the_slots(tiny, share, slot_counts):
  """A sampled row's tokens do not depend on the slot it ran in or when: for 1 and 3 slots
  (rows in different slots, started at different steps) row i's position s is
  ``jax.random.categorical(fold_in(fold_in(rng, i), s), logits / T)`` of the full forward's
  logits (``sampling.row_keys``), its log-probs numpy's log_softmax.
  With ``share`` = 2, rows 2i and 2i+1 continue prompt i."""
  temperature, key = 20.0, jax.random.key(5)  # hot enough to undo SHARPEN: real draws
  prompt_tokens, prompt_mask = (x[:N // share] for x in tiny['prompts'])
  rows_tokens, rows_mask = (np.repeat(x, share, axis=0) for x in (prompt_tokens, prompt_mask))
  outs = []
  for slots in slot_counts:
    sampler = sampling.Sampler(L, eos_id=tiny['eos'], pad_id=PAD, slots=slots,
                               decode_block=BLOCK)
    fn = jax.jit(lambda p, t, m, k, sampler=sampler: sampling.generate(
        tfm.merge(tiny['graphdef'], p), t, m, k, sampler, temperature=temperature,
        share=share))
    outs.append(fn(tiny['params'], prompt_tokens, prompt_mask, key))
  tokens, mask = np.asarray(outs[0].tokens), np.asarray(outs[0].mask)
  logits = _completion_logits(tiny['fwd'], tiny['params'], rows_tokens, rows_mask, tokens, mask)
  assert (logits.argmax(-1) != tokens)[mask == 1].any()  # really sampled, not all argmax
  draw = lambda i, s, x: jax.random.categorical(
      jax.random.fold_in(jax.random.fold_in(key, i), s), x)
  draws = np.asarray(jax.jit(jax.vmap(jax.vmap(draw, (None, 0, 0)), (0, None, 0)))(
      jnp.arange(N), jnp.arange(L), jnp.asarray(logits / temperature, jnp.float32)))
  full = np.take_along_axis(_log_softmax(logits / temperature), tokens[..., None], -1)[..., 0]
  for out in outs:
    o_tok, o_mask = np.asarray(out.tokens), np.asarray(out.mask)
    np.testing.assert_array_equal(o_mask, mask)
    np.testing.assert_array_equal(o_tok[mask == 1], draws[mask == 1])
    np.testing.assert_allclose(np.asarray(out.logps)[mask == 1], full[mask == 1], atol=1e-4,
                               rtol=0)
    _check_semantics(out.replace(num_decode_steps=mask.sum(1).max()), tiny['eos'])


# -- validation ----------------------------------------------------------------------------------
def test_sampler_validation():
  cfg = SamplingConfig(max_completion_length=12, top_k=5, rollout_micro_batch_size=4)
  assert sampling.Sampler.from_config(cfg, eos_id=2, pad_id=0) == sampling.Sampler(
      12, eos_id=2, pad_id=0, top_k=5, chunk_size=4)
  for bad in (dict(max_completion_length=0), dict(top_k=-1), dict(chunk_size=-2),
              dict(eos_id=1.5)):
    with pytest.raises(ValueError):
      sampling.Sampler(**{**dict(max_completion_length=4, eos_id=2, pad_id=0), **bad})
  graphdef, params, _ = _random_params(DIST_CFG, seed=0)
  prompts = np.ones((6, 3), np.int32)
  with pytest.raises(ValueError, match='chunk_size=4 must divide'):
    sampling.generate(tfm.merge(graphdef, params), prompts, prompts, jax.random.key(0),
                      sampling.Sampler(4, eos_id=2, pad_id=0, chunk_size=4))
