"""model.attention='cudnn' (issue 47): cuDNN's fused attention,
``jax.nn.dot_product_attention(implementation='cudnn')``, on this project's masks and families.

On an NVIDIA GPU (skipped elsewhere; under a minute): the learner's loss and gradient in bfloat16
with 'cudnn' against the float32 einsum, no further from it than the bfloat16 einsum is, on the
model-family fixtures (Qwen3: GQA; Gemma 3: mixed sliding and full layers and
query_pre_attn_scalar; Mistral: every layer sliding) over rows that hold a left-padded prompt
followed by a right-padded completion, packed SFT segments, and GRPO's shared-prompt forward
(``hidden_after_prefix``: the completions over [prompt; own] keys).

On CPU: the same programs lowered for CUDA (``lower(lowering_platforms=('cuda',))``; jax's
cuDNN-version probe, which needs the library, patched): the cuDNN forward and backward custom
calls are there and no [B, heads, T, S] score tensor is (the einsum's lowering has them).
"""

import dataclasses
import functools
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import logprobs
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

import helpers

FAMILIES = ('qwen3_tiny', 'gemma3_tiny', 'mistral_tiny')
# row width, prompt, completion: odd T and TC (cuDNN's backward takes even lengths: padded)
T, TP, TC, SHARE = 23, 12, 11, 2


def _rows(vocab: int):
  """Tokens and masks: 4 rows of a left-padded prompt then a right-padded completion, a row of
  3 packed segments then padding; 4 shared-prompt rows (2 prompts x SHARE completions)."""
  rng = np.random.default_rng(0)
  mask = np.zeros((5, T), np.int32)
  for row, (left, right) in enumerate([(0, 0), (3, 2), (7, 5), (1, 9)]):
    mask[row, left:T - right] = 1
  mask[4, :6], mask[4, 6:15], mask[4, 15:20] = 1, 2, 3  # then padding
  prompt_mask = np.zeros((4, TP), np.int32)
  prompt_mask[0:2, 2:], prompt_mask[2:4, 5:] = 1, 1
  completion_mask = np.zeros((4, TC), np.int32)
  for row, n in enumerate([11, 7, 3, 10]):
    completion_mask[row, :n] = 1
  prompt = np.repeat(rng.integers(1, vocab, (2, TP)), SHARE, axis=0).astype(np.int32)
  return {'tokens': rng.integers(1, vocab, (5, T)).astype(np.int32), 'mask': mask,
          'prompt': prompt, 'prompt_mask': prompt_mask,
          'completion': rng.integers(1, vocab, (4, TC)).astype(np.int32),
          'completion_mask': completion_mask,
          'weight': rng.normal(size=(4, TC)).astype(np.float32)}


@functools.cache
def _family(name: str):
  """(params, {dtype: graphdef}): the fixture's float32 weights, computed in float32 or bf16."""
  cfg, _, params = hf.load_model(helpers.fixture_dir(name))
  graphdefs = {dt: tfm.split(tfm.Transformer(dataclasses.replace(cfg, dtype=dt),
                                             rngs=nnx.Rngs(0)))[0]
               for dt in ('float32', 'bfloat16')}
  return cfg, params, graphdefs


def _loss(graphdef, attention: str, params, rows):
  """The summed log-probs of the full rows plus the weighted completion log-probs of the
  shared-prompt rows: -> (loss, (sequence log-probs [5], completion log-probs [4, TC]))."""
  model = tfm.merge(graphdef, params)
  options = tfm.ForwardOptions(attention=attention)
  seq, _ = logprobs.sequence_logps(model, rows['tokens'], rows['mask'], rows['mask'] > 0, options)
  shared, _ = logprobs.completion_logps(
      model, rows['prompt'], rows['prompt_mask'], rows['completion'], rows['completion_mask'],
      dataclasses.replace(options, share_prompts=SHARE))
  shared = shared * rows['completion_mask']
  return jnp.sum(seq) + jnp.sum(shared * rows['weight']), (seq, shared)


def _value_and_grad(graphdef, attention):
  return jax.value_and_grad(functools.partial(_loss, graphdef, attention), has_aux=True)


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='cuDNN attention needs an NVIDIA GPU')
@pytest.mark.parametrize('name', FAMILIES)
def test_cudnn_matches_einsum_on_gpu(name, monkeypatch):
  calls, original = [], jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    calls.append(kwargs.get('implementation'))
    return original(*args, **kwargs)
  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  cfg, params, graphdefs = _family(name)
  rows = _rows(cfg.vocab_size)
  run = lambda dt, attention: jax.jit(_value_and_grad(graphdefs[dt], attention))(params, rows)
  ref = jax.tree.leaves(run('float32', 'einsum'))
  einsum = jax.tree.leaves(run('bfloat16', 'einsum'))
  assert not calls
  cudnn = jax.tree.leaves(run('bfloat16', 'cudnn'))
  assert calls and set(calls) == {'cudnn'}

  def error(got):  # the largest difference relative to the reference's largest magnitude
    return max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
                     / max(float(np.abs(np.asarray(b, np.float32)).max()), 1e-30))
               for a, b in zip(got, ref))
  e_einsum, e_cudnn = error(einsum), error(cudnn)
  print(f'{name}: relative error against the float32 einsum (loss, log-probs, gradients): '
        f'bf16 einsum {e_einsum:.2e}, bf16 cudnn {e_cudnn:.2e}')
  assert max(float(np.abs(np.asarray(x)).max()) for x in ref[3:]) > 0  # the gradients
  assert e_cudnn <= 2 * e_einsum + 2e-3, (e_cudnn, e_einsum)


# the rows' lengths, as is or made even, or padded to whole 128-key tiles (cudnn_operands)
_LENGTHS = {T, T + 1, TP, TC, TC + 1, TP + TC, TP + TC + 1, 128}


def _score_tensors(text: str) -> set[str]:
  """Float tensors [..., heads, T, S] of the rows' lengths: the einsum's [B, K, G, T, S] logits
  and probabilities (cuDNN's additive mask, [B, 1, T, S], is not one)."""
  found = set()
  for m in re.finditer(r'tensor<((?:\d+x){4,})(?:f32|bf16|f16)>', text):
    dims = [int(d) for d in m.group(1).split('x') if d]
    if dims[-2] in _LENGTHS and dims[-1] in _LENGTHS and dims[-3] > 1:
      found.add(m.group(0))
  return found


@pytest.mark.parametrize('name', ['gemma3_tiny'])
def test_cudnn_lowers_for_cuda_without_scores(name, monkeypatch):
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  # Its version probe needs cuDNN on this machine; the lowering itself does not.
  monkeypatch.setattr(fused_attention_stablehlo, 'check_cudnn_version', lambda: 91000)
  cfg, params, graphdefs = _family(name)
  rows = _rows(cfg.vocab_size)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  lower = lambda attention: jax.jit(_value_and_grad(graphdefs['bfloat16'], attention)).trace(
      abstract, rows).lower(lowering_platforms=('cuda',)).as_text()
  cudnn, einsum = lower('cudnn'), lower('einsum')
  forward = cudnn.count('custom_call @__cudnn$fmhaScaleBiasSoftmax(')
  backward = cudnn.count('custom_call @__cudnn$fmhaScaleBiasSoftmaxBackward(')
  print(f'{name}: {forward} cuDNN attention forward and {backward} backward calls; score '
        f'tensors: cudnn {sorted(_score_tensors(cudnn))}, einsum {len(_score_tensors(einsum))}')
  # the layers are scanned: one forward for the full rows, one for the prompts and one for the
  # completions over [prompt; own] keys; each with its backward
  assert forward == 3 and backward == 3
  assert _score_tensors(einsum) and not _score_tensors(cudnn)
