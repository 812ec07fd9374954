"""What the training backward keeps of the SwiGLU MLP in bfloat16 (issue 47, models/transformer.py,
``_recomputed_keeping_bits``): the gate and up products kept as their bit patterns. The gradient
is jax's own autodiff of the same layer (nothing recomputed, nothing kept differently), and on
XLA:CPU the compiled backward no longer holds a float32 copy of each stacked bf16 residual
(benchmarks/learner_memory.py at issue 47's 0.4B shape: 65.74 -> 47.02 GiB). And the logits'
head in bfloat16 (``_head_product``): its backward's two products run in bf16, not in float32,
with a gradient as close to the float32 model's as autodiff's."""

import dataclasses
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import logprobs
from jaxrl_ga.models import transformer as tfm

# Wide MLP, few layers: the f32 copy of one stacked [L, rows, MLP] residual is 4 x 2048 x 1024 x 4
# bytes = 32 MiB, far above everything else the backward holds.
MODEL = tfm.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, dtype='bfloat16')
B, T = 8, 256


def _case(cfg):
  graphdef, params = tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, (B, T)).astype(np.int32)
  mask = np.ones((B, T), np.int32)
  mask[1, :40], mask[2, -30:] = 0, 0  # left and right padding

  def loss(p):
    out, _ = logprobs.sequence_logps(tfm.merge(graphdef, p), tokens, mask, mask > 0)
    return jnp.sum(out)
  return jax.grad(loss), params


def _plain(fn, *args):  # the reference: jax differentiates the layer as written
  return fn(*args)


def test_bf16_mlp_gradient_is_jax_autodiff_of_the_layer(monkeypatch):
  cfg = dataclasses.replace(MODEL, intermediate_size=128)
  grad, params = _case(cfg)
  got = jax.tree.leaves(jax.jit(grad)(params))
  monkeypatch.setattr(tfm, '_recomputed_keeping_bits', _plain)
  grad, _ = _case(cfg)  # traced anew (jit caches a function's trace)
  want = jax.tree.leaves(jax.jit(grad)(params))
  scale = max(float(np.abs(np.asarray(w, np.float32)).max()) for w in want)
  diff = max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
             for a, b in zip(got, want))
  print(f'bf16 gradient, kept bits vs autodiff: max abs diff {diff:.2e} of max |grad| {scale:.2e}')
  assert scale > 0 and diff <= 1e-6 * scale


def test_xla_cpu_keeps_no_float32_copy_of_the_bf16_mlp_residuals(monkeypatch):
  temp = lambda: (lambda grad, params: jax.jit(grad).lower(params).compile().memory_analysis()
                  .temp_size_in_bytes)(*_case(MODEL))  # traced anew each time
  ours = temp()
  monkeypatch.setattr(tfm, '_recomputed_keeping_bits', tfm._recomputed)  # pylint: disable=protected-access
  before = temp()
  stack_f32 = MODEL.num_hidden_layers * B * T * MODEL.intermediate_size * 4
  print(f'backward temp bytes: {ours} kept as bits, {before} kept as bf16 (one f32 stack: '
        f'{stack_f32})')
  assert ours <= before - stack_f32


def test_kept_bits_leave_integer_args_alone():
  """A uint16 arg next to a bf16 one: its values reach the backward as they are (a kept bf16 is
  bitcast back from uint16; a uint16 arg must not be), so the gradient is autodiff's."""
  fn = lambda a, idx: a * idx.astype(jnp.bfloat16)
  a = jnp.arange(1, 9, dtype=jnp.bfloat16)
  idx = jnp.arange(3, 11, dtype=jnp.uint16)
  loss = lambda f: lambda a: jnp.sum(f(fn, a, idx).astype(jnp.float32))
  got = jax.grad(loss(tfm._recomputed_keeping_bits))(a)  # pylint: disable=protected-access
  want = jax.grad(loss(_plain))(a)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  np.testing.assert_array_equal(np.asarray(want, np.float32), np.arange(3, 11))


HEAD_VOCAB = 320  # a size no other axis of HEAD_MODEL has, to find the head's products by shape
HEAD_MODEL = dataclasses.replace(MODEL, vocab_size=HEAD_VOCAB, intermediate_size=128,
                                 num_hidden_layers=2)


def _head_dots(grad, params):
  """(lhs, rhs, out) types of the lowered backward's dot_generals with a vocabulary axis."""
  text = jax.jit(grad).lower(params).as_text()
  dots = re.findall(r'stablehlo\.dot_general [^\n]*?:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*'
                    r'->\s*(tensor<[^>]*>)', text)
  return [d for d in dots if any(f'{HEAD_VOCAB}x' in t or f'x{HEAD_VOCAB}x' in t for t in d)]


def test_bf16_head_backward_runs_in_bf16_and_is_as_close_to_float32_as_autodiff(monkeypatch):
  grad, params = _case(HEAD_MODEL)
  dots = _head_dots(grad, params)
  print('head products (lhs, rhs, out):', *dots, sep='\n  ')
  # The forward and the two gradients' products; every operand bf16, every result f32.
  assert len(dots) == 3, dots
  assert all('bf16>' in lhs and 'bf16>' in rhs and 'f32>' in out for lhs, rhs, out in dots), dots
  ours = jax.jit(grad)(params)
  grad32, _ = _case(dataclasses.replace(HEAD_MODEL, dtype='float32'))
  want = jax.jit(grad32)(params)  # the same params, computed in float32: the reference
  monkeypatch.setattr(tfm, '_head_product', lambda h, w: jnp.matmul(
      h, w, preferred_element_type=jnp.float32))  # jax's autodiff of the plain product
  grad_ad, _ = _case(HEAD_MODEL)
  assert any('f32>' in lhs for lhs, _, _ in _head_dots(grad_ad, params))  # autodiff's are f32
  autodiff = jax.jit(grad_ad)(params)
  err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                           / np.linalg.norm(np.asarray(b, np.float64)))
  for (path, w), o, a in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(ours),
                             jax.tree.leaves(autodiff)):
    print(f'{jax.tree_util.keystr(path)}: relative error to float32 {err(o, w):.2e} (autodiff '
          f'{err(a, w):.2e})')
    assert err(o, w) <= 1.5 * err(a, w) + 1e-4, jax.tree_util.keystr(path)
