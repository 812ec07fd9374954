"""A Flax NNX decoder-only transformer covering the Hugging Face Qwen2, Llama, Qwen3, Gemma 3
(text) and Mistral families.

RMSNorm, rotary embeddings (rope_theta; 'linear' and Llama-3 scaling), grouped-query attention,
SwiGLU MLP, optional q/k/v bias (Qwen2), tied or untied embeddings, float32/bfloat16 params and
compute. What a family changes (``cfg.family``, its spec in ``models/families.py``): q/k RMSNorm
per head (Qwen3, Gemma 3); (1 + w) norms, norms after attention and MLP too, scaled embeddings
and GELU-tanh (Gemma 3); and the family's settings (``ModelConfig``): ``query_pre_attn_scalar``,
final logit soft-capping, sliding-window attention (Mistral, Gemma 3's local layers) as one more
mask term, and Gemma 3's local RoPE base. What
differs between layers (sliding or not, the RoPE frequencies) is arrays stacked with the layer
params (``layer_constants``), so the layers still run as one scan. The layers' params are stacked on a leading ``layers`` axis and run with ``lax.scan``, so
compile time does not grow with depth.

Two paths share one layer function:
  * ``model(tokens, attention_mask)``: the full forward for training over left- or right-padded
    batches; positions are derived from the mask (``cumsum(mask) - 1``), as HF does in generate.
  * ``model.prefill(...)`` then ``model.decode(...)``: a preallocated KV cache in which slot ``i``
    holds token ``i`` of the (left-padded) sequence; decoding writes one slot per step.
  * ``model.hidden_after_prefix(...)``: the training forward of rows that share a prefix (GRPO's
    completions of one prompt), each prefix computed once; the same layer pieces (``_qkv``,
    ``_after_attention``) around an attention over [prefix; own] keys.

Every param carries ``logical_axes`` metadata (``vocab``, ``embed``, ``q_heads``, ``kv_heads``,
``mlp``, ``layers``, ``norm``) that ``jaxrl_ga.sharding`` maps to mesh axes. Activations are named
too (``activation_batch``, ``activation_length``, ``activation_embed``, ``activation_heads``,
``activation_mlp``, ``activation_vocab``, as MaxText names them): on the mesh its options name
(``ForwardOptions.activation_mesh``, a ``sharding.KernelMesh``; ``activation_mesh=`` of
``prefill`` and ``decode``) the model constrains them, so that the batch is sharded over the
data-parallel axes (fsdp included) and fsdp gathers weights instead of sharding the activations'
hidden dimension; without one (one device, tests) the constraints are no-ops.

LoRA (``cfg.lora.rank`` > 0; Hu et al. 2021, arXiv:2106.09685): each targeted projection W [L, in,
out] gets float32 adapters ``<name>_lora_a`` [L, in, r] (PEFT's init: uniform +-1/sqrt(in)) and
``<name>_lora_b`` [L, r, out] (zeros), ``nnx.LoRAParam`` variables with logical axes (``layers``,
W's input axis or None, W's output axis), and the layer computes ``x @ W + (x @ A) @ B * alpha /
r``, PEFT's LoRA forward. ``nnx.LoRA`` computes the same for one unstacked [in, out] weight; the
layer scan here runs on stacked arrays, so the adapters are stacked arrays beside W. With
``ForwardOptions(adapters=False)`` the layers skip the adapters: the base model exactly.

How the training forward runs is one explicit argument, ``ForwardOptions`` (frozen, hashable):
the layers scanned or unrolled, the per-layer remat policy, the log-prob chunk, the rows that
share a prompt's forward, the adapters on or off and the attention's implementation
(``attention.ATTENTION_IMPLS``), the meshes of the splash kernel and of the activations'
sharding constraints. There are no trace-time flags and no module state.

Memory knobs of the training forward (``ForwardOptions.remat``): ``REMAT_POLICIES``, a
``jax.checkpoint`` per decoder layer: 'none' keeps every layer's activations for the backward,
'full' keeps only each layer's input and recomputes the layer, 'save_dots' keeps the outputs of
the weight matmuls (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) and recomputes
the rest (attention, norms, activations). With 'none' the RMSNorms and the MLP's activation
and down projection are still recomputed from their inputs (no matmul; ``_rms_norm``'s comment).

Attention (``ForwardOptions.attention``, model.attention), its masks and the KV cache live in
``models/attention.py``; the sharding constraint in ``models/activations.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga.models.config import ModelConfig, RopeScaling  # pylint: disable=unused-import
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models.activations import constrain

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# The MLP's gate activation by name (families.ACTIVATIONS, a family's ``activation``).
ACTIVATIONS = {'silu': jax.nn.silu, 'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True)}

# vocabulary blocks of the tied head's product at decode time (Transformer._next_token_logits)
_HEAD_BLOCKS = 32


def check_remat(remat: str) -> None:
  if remat not in REMAT_POLICIES:
    raise ValueError(f'remat={remat!r}; choose one of {", ".join(REMAT_POLICIES)}.')


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
  """How the training forward (and the log-probs computed from it) runs: a static argument, each
  value its own program. Built once per run from ``model.*`` (``jaxrl_ga.programs``).

  Attributes:
    scan_layers: one ``lax.scan`` over the stacked layer params (compile time flat in depth), or
      the loop fully unrolled (model.scan_layers; no per-layer slices of the stacked params and
      their gradients; the compiler's cost analysis counts every layer).
    remat: the per-layer rematerialization policy (REMAT_POLICIES; model.remat).
    logprob_chunk_size: completion positions projected to logits at a time (0: all at once;
      model.logprob_chunk_size, ``jaxrl_ga.logprobs``).
    share_prompts: R, rows ``i*R .. i*R+R-1`` of a batch hold one prompt whose forward runs once
      for them (``Transformer.hidden_after_prefix``; model.share_prompt_prefix, computed by
      ``rollout.prompt_share``); 1: every row computes its prompt.
    adapters: the LoRA adapters on (the policy) or off (the frozen base: a LoRA run's reference
      policy); a no-op without adapters.
    attention: the attention of the training forward and the prefill, one of
      ``attention.ATTENTION_IMPLS`` (model.attention once resolved: never 'auto').
    kernel_mesh: where 'splash' runs its Pallas kernel per shard of the batch under
      ``shard_map`` (a ``sharding.KernelMesh``: the step's mesh and rules); None: one call over
      the whole batch (one device, or a step not jitted over a mesh). Set by
      ``programs.forward_options`` for 'splash' steps on a mesh.
    activation_mesh: the mesh (a ``sharding.KernelMesh``: the step's mesh and rules) on which
      the model's named activations get sharding constraints (``activations.constrain``); None:
      none (one device, or a step not jitted over a mesh). They place values and never change
      them. Set by the owner of a step jitted over a mesh (the Learner, ``learner.ForwardLoss.on``;
      the rollout engine's steps; ``Sampler.activation_mesh`` for generation).
  """
  scan_layers: bool = True
  remat: str = 'none'
  logprob_chunk_size: int = 0
  share_prompts: int = 1
  adapters: bool = True
  attention: str = 'einsum'
  kernel_mesh: Any = None
  activation_mesh: Any = None

  def __post_init__(self):
    check_remat(self.remat)
    attn_lib.check_attention(self.attention)
    if self.share_prompts < 1 or self.logprob_chunk_size < 0:
      raise ValueError(f'{self}: share_prompts must be >= 1 and logprob_chunk_size >= 0.')


def _scan_layers(body, carry, xs, options: ForwardOptions):
  """``lax.scan(body, carry, xs)`` over the stacked layers, each under ``jax.checkpoint`` with the
  ``options.remat`` policy (REMAT_POLICIES) unless it is 'none'; fully unrolled unless
  ``options.scan_layers``."""
  body = body if options.remat == 'none' else jax.checkpoint(
      body, policy=REMAT_POLICIES[options.remat], prevent_cse=False)
  return jax.lax.scan(body, carry, xs, unroll=not options.scan_layers)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse rotary frequencies [H/2], with the config's scaling applied (numpy, static)."""
  h = cfg.head_size
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  sc = cfg.rope_scaling
  if sc is None or sc.rope_type == 'default':
    return inv_freq.astype(np.float32)
  if sc.rope_type == 'linear':
    return (inv_freq / sc.factor).astype(np.float32)
  # llama3: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
  old_len = sc.original_max_position_embeddings
  low_wavelen = old_len / sc.low_freq_factor
  high_wavelen = old_len / sc.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
  smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
  smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, HF's rotate-half layout. x: [B, T, N, H]; positions: [B, T]."""
  freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x.dtype)


# What the training backward keeps of a layer (issue 47): by default jax keeps every intermediate
# its VJP reads. Two elementwise parts of the layer are recomputed in the backward instead
# (``jax.checkpoint`` of just that part, whatever ``model.remat`` says), since they cost no
# matmul to redo and kept whole they were most of a layer's activations: the RMSNorm (a float32
# copy of x and the normed values besides its output) keeps only its input, and the SwiGLU MLP's
# down projection (six bf16 [rows, MLP] tensors kept: gate, up, the sigmoid, silu, silu * up)
# keeps only gate and up (issue 47's 0.4B model, B = 64: ~46 MB of residuals per row and layer
# before, ~19 MB after, with model.attention='flash'; in bf16 gate and up are kept as their bit
# patterns, ``_recomputed_keeping_bits``). The recompute is the same ops on the same inputs, so
# values and gradients are unchanged; benchmarks/learner_memory.py measures it.
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
  """RMSNorm over the last axis. HF Llama's: ``scale * normed`` in x's dtype; with ``plus_one``
  Gemma's: ``normed * (1 + scale)`` in float32, then cast to x's dtype. Recomputed in the
  backward from x (the comment above)."""
  return _recomputed(_rms_norm_values, x, scale, eps=eps, plus_one=plus_one)


def _recomputed(fn, *args, **static):
  """``fn(*args, **static)``, its intermediates recomputed in the backward (jax.checkpoint:
  only ``args`` are kept for it)."""
  return jax.checkpoint(lambda *a: fn(*a, **static), prevent_cse=False)(*args)


def _recomputed_keeping_bits(fn, *args):
  """``_recomputed(fn, *args)`` for the MLP's down projection, its bfloat16 args kept for the
  backward as their bit patterns (uint16, a free and exact bitcast; ``jax.custom_vjp``, the
  backward recomputes ``fn`` from them as jax.checkpoint does). XLA:CPU has no native bf16
  arithmetic: given the stacked bf16 gate and up that the backward's layer loop reads, it made a
  float32 copy of each whole stack before the loop (f32[L, rows, MLP]: 2 x 15 GiB of issue 47's
  learner at B = 64, benchmarks/learner_memory.py); an integer stack it leaves alone. Other
  dtypes (float32, the CPU default): ``_recomputed`` as is; so are args with a uint16 leaf, which
  the backward could not tell from a kept bf16 one."""
  dtypes = [x.dtype for x in jax.tree.leaves(args)]
  if not any(d == jnp.bfloat16 for d in dtypes) or any(d == jnp.uint16 for d in dtypes):
    return _recomputed(fn, *args)
  return _bits_vjp(fn, *args)


_to_bits = lambda x: (jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16
                      else x)
_from_bits = lambda x: (jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16
                        else x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bits_vjp(fn, *args):
  return fn(*args)


def _bits_vjp_fwd(fn, *args):
  return fn(*args), jax.tree.map(_to_bits, args)


def _bits_vjp_bwd(fn, kept, ct):
  return jax.vjp(fn, *jax.tree.map(_from_bits, kept))[1](ct)


_bits_vjp.defvjp(_bits_vjp_fwd, _bits_vjp_bwd)


def _head_product(h: jax.Array, w: jax.Array) -> jax.Array:
  """[..., D] @ [D, V] -> [..., V] float32 logits, the product computed in h's dtype. In float32
  (the CPU default) the plain product. In a 16-bit compute dtype the same forward, and a backward
  whose two products (the gradients of h and of the head, each [rows, V] by [V, D] or [D, rows]:
  the largest of the learner after the layers) also run in that dtype: autodiff would run them in
  float32, the incoming float32 gradient of the logits against float32 copies of h and the head
  (issue 47: two float32/TF32 GEMM kernels, 20 ms of a 237 ms H200 learner step). The gradient
  of the logits is rounded to the compute dtype once, as torch's bf16 autocast head does (TRL's
  at bf16); both products accumulate in float32, and the gradients they give are rounded to h's
  and w's dtype as before. tests/test_activation_memory.py checks both."""
  if h.dtype == jnp.float32:
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)
  return _head_product_16(h, w)


@jax.custom_vjp
def _head_product_16(h: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def _head_product_16_fwd(h, w):
  return _head_product_16(h, w), (h, w)


def _head_product_16_bwd(kept, g):
  h, w = kept
  g = g.astype(h.dtype)
  dh = jnp.matmul(g, w.T, preferred_element_type=jnp.float32).astype(h.dtype)
  lead = 'ABCEFGHIJ'[:h.ndim - 1]  # batch axes, summed over for the head's gradient
  dw = jnp.einsum(f'{lead}d,{lead}v->dv', h, g, preferred_element_type=jnp.float32)
  return dh, dw.astype(w.dtype)


_head_product_16.defvjp(_head_product_16_fwd, _head_product_16_bwd)


def _rms_norm_values(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return scale.astype(x.dtype) * x32.astype(x.dtype)


def layer_constants(cfg: ModelConfig) -> dict[str, np.ndarray]:
  """What differs between layers besides their params, stacked on the layers axis to be scanned
  with them (numpy, static): 'sliding' [L] bool where some layers, not all, use the sliding
  window; 'rope_inv_freq' [L, H/2] where the sliding layers have their own RoPE base (Gemma 3).
  Empty for a model whose layers are all alike."""
  out = {}
  sliding = np.asarray(cfg.sliding_layers(), bool)
  if sliding.any() and not sliding.all():
    out['sliding'] = sliding
  if cfg.rope_local_theta and sliding.any():
    local = rope_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta,
                                              rope_scaling=None))
    out['rope_inv_freq'] = np.where(sliding[:, None], local, rope_inv_freq(cfg)[None])
  return out


def _softcap(logits: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(logits / cap) (Gemma's soft-capping); logits unchanged when cap is 0."""
  return logits if not cap else jnp.tanh(logits / cap) * cap


class DecoderStack(nnx.Module):
  """The params of all decoder layers, stacked on a leading ``layers`` axis."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = _DTYPES[cfg.param_dtype]
    n_layers, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_size
    kv_dim = cfg.num_key_value_heads * cfg.head_size
    normal = nnx.initializers.normal(0.02)

    def weight(shape, axes):
      return nnx.Param(normal(rngs.params(), (n_layers, *shape), pdt),
                       logical_axes=('layers', *axes))

    def const(value, shape, axes):
      return nnx.Param(jnp.full((n_layers, *shape), value, pdt), logical_axes=('layers', *axes))

    family = cfg.family
    norm_init = 0.0 if family.norm_plus_one else 1.0  # (1 + w) norms start at w = 0
    self.attn_norm = const(norm_init, (d,), ('norm',))
    if family.qk_norm:  # per head, over the head dim
      self.q_norm = const(norm_init, (cfg.head_size,), ('norm',))
      self.k_norm = const(norm_init, (cfg.head_size,), ('norm',))
    if family.post_norms:  # the norms after attention and after the MLP
      self.post_attn_norm = const(norm_init, (d,), ('norm',))
      self.post_mlp_norm = const(norm_init, (d,), ('norm',))
    self.q_proj = weight((d, q_dim), ('embed', 'q_heads'))
    self.k_proj = weight((d, kv_dim), ('embed', 'kv_heads'))
    self.v_proj = weight((d, kv_dim), ('embed', 'kv_heads'))
    if cfg.attention_bias:
      self.q_bias = const(0.0, (q_dim,), ('q_heads',))
      self.k_bias = const(0.0, (kv_dim,), ('kv_heads',))
      self.v_bias = const(0.0, (kv_dim,), ('kv_heads',))
    self.o_proj = weight((q_dim, d), ('q_heads', 'embed'))
    self.mlp_norm = const(norm_init, (d,), ('norm',))
    self.gate_proj = weight((d, f), ('embed', 'mlp'))
    self.up_proj = weight((d, f), ('embed', 'mlp'))
    self.down_proj = weight((f, d), ('mlp', 'embed'))

  def add_adapters(self, lora, rngs: nnx.Rngs):
    """LoRA adapters (float32 nnx.LoRAParams) on the targeted projections. Called after every
    base weight is drawn, so that the base weights do not depend on the LoRA settings."""
    n_layers = self.q_proj.shape[0]
    if lora.rank:
      # PEFT's lora_A init, kaiming_uniform(a=sqrt(5)): uniform(+-1/sqrt(in)); per layer (axis 0).
      init_a = jax.nn.initializers.variance_scaling(1 / 3, 'fan_in', 'uniform', batch_axis=(0,))
      for target in lora.targets:
        w = getattr(self, f'{target}_proj')
        _, w_in, w_out = tuple(w.get_metadata()['logical_axes'])
        _, n_in, n_out = w.shape
        setattr(self, f'{target}_proj_lora_a', nnx.LoRAParam(
            init_a(rngs.params(), (n_layers, n_in, lora.rank), jnp.float32),
            logical_axes=('layers', w_in, None)))
        setattr(self, f'{target}_proj_lora_b', nnx.LoRAParam(
            jnp.zeros((n_layers, lora.rank, n_out), jnp.float32),
            logical_axes=('layers', None, w_out)))

  def arrays(self, adapters: bool = True) -> dict[str, jax.Array]:
    """The stacked arrays by name; without the LoRA adapters when ``adapters`` is False (the
    layers then compute the base model: ``_proj`` applies the adapters it finds)."""
    return {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)
            and (adapters or not isinstance(v, nnx.LoRAParam))}

  def axes(self) -> dict[str, tuple]:
    """One layer's logical axes by array name (the stacked arrays' without ``layers``)."""
    return {name: tuple(v.get_metadata()['logical_axes'])[1:] for name, v in vars(self).items()
            if isinstance(v, nnx.Param)}


def _proj(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, name: str) -> jax.Array:
  """x @ W (+ bias) (+ the LoRA adapters' (x @ A) @ B * alpha / r); x [rows, in]. The adapters'
  path computes in float32 and is added to x @ W in float32, as PEFT's LoraLayer does (its
  adapters float32, the input cast to them): with bfloat16 compute, alpha / r is not rounded
  (16/12 would be 1.3359) and a small update is not rounded away."""
  dt = x.dtype
  y = x @ p[name].astype(dt)
  bias = p.get(name.replace('proj', 'bias'))
  y = y if bias is None else y + bias.astype(dt)
  a = p.get(f'{name}_lora_a')
  if a is None:  # no adapters, or ForwardOptions(adapters=False)
    return y
  f32 = jnp.float32
  update = (x.astype(f32) @ a.astype(f32)) @ p[f'{name}_lora_b'].astype(f32)
  return (y.astype(f32) + update * (cfg.lora.alpha / cfg.lora.rank)).astype(dt)


_HEADS = ('activation_batch', 'activation_length', 'activation_heads', None)
_EMBED = ('activation_batch', 'activation_length', 'activation_embed')
_MLP = ('activation_batch', 'activation_length', 'activation_mlp')


# The projections and the elementwise work between them run on [B*T, features] rows: with
# [B, T, F] operands XLA:CPU wrote the SwiGLU gradient transposed for the weight gradient's
# product (issue 15, BENCHMARKS.md); the reshapes are free (row-major bitcasts). The residual
# stream and the sharding constraints keep [B, T, ...].
def _qkv(cfg: ModelConfig, p: dict[str, jax.Array], h: jax.Array, positions: jax.Array,
         inv_freq: jax.Array, on: Any = None):
  """The attention inputs of one layer. h: [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H],
  rotary embeddings applied to q and k. ``on``: ``ForwardOptions.activation_mesh``."""
  b, t, _ = h.shape
  hs, plus_one = cfg.head_size, cfg.family.norm_plus_one
  x = _rms_norm(h, p['attn_norm'], cfg.rms_norm_eps, plus_one).reshape(b * t, -1)
  if 'qkv_proj' in p:  # the decode loop's fused weights (Transformer.decode_layers): one product
    n_q = cfg.num_attention_heads * hs
    q, k, v = jnp.split(_proj(cfg, p, x, 'qkv_proj'), [n_q, n_q + cfg.num_key_value_heads * hs],
                        axis=-1)
  else:
    q, k, v = (_proj(cfg, p, x, f'{name}_proj') for name in 'qkv')
  q = constrain(on, q.reshape(b, t, cfg.num_attention_heads, hs), *_HEADS)
  k = constrain(on, k.reshape(b, t, cfg.num_key_value_heads, hs), *_HEADS)
  v = constrain(on, v.reshape(b, t, cfg.num_key_value_heads, hs), *_HEADS)
  if cfg.family.qk_norm:
    q = _rms_norm(q, p['q_norm'], cfg.rms_norm_eps, plus_one)
    k = _rms_norm(k, p['k_norm'], cfg.rms_norm_eps, plus_one)
  inv_freq = p.get('rope_inv_freq', inv_freq)  # the layer's own (layer_constants), if any
  return _rope(q, positions, inv_freq), _rope(k, positions, inv_freq), v


def _after_attention(cfg: ModelConfig, p: dict[str, jax.Array], h: jax.Array,
                     attn: jax.Array, on: Any = None) -> jax.Array:
  """The rest of the layer: the output projection's residual, then the SwiGLU MLP's.
  h: [B, T, D] (the layer's input); attn: [B, T, N, H]; ``on``: as ``_qkv``'s."""
  b, t, _ = h.shape
  rows = lambda y: y.reshape(b * t, -1)  # [B, T, ...] -> [B*T, features]
  per_token = lambda y: y.reshape(b, t, -1)  # and back, for the residual and the constraints
  eps, family = cfg.rms_norm_eps, cfg.family
  post = lambda y, name: (_rms_norm(y, p[name], eps, family.norm_plus_one) if family.post_norms
                          else y)  # the norms after attention and after the MLP (Gemma 3)
  h = constrain(on, h + post(per_token(_proj(cfg, p, rows(attn), 'o_proj')), 'post_attn_norm'),
                *_EMBED)
  x = rows(_rms_norm(h, p['mlp_norm'], eps, family.norm_plus_one))
  if 'gate_up_proj' in p:  # fused (Transformer.decode_layers): one product
    gate, up = jnp.split(_proj(cfg, p, x, 'gate_up_proj'), 2, axis=-1)
  else:
    gate, up = _proj(cfg, p, x, 'gate_proj'), _proj(cfg, p, x, 'up_proj')
  gate = rows(constrain(on, per_token(gate), *_MLP))
  up = rows(constrain(on, per_token(up), *_MLP))

  def down(gate, up, p):  # recomputed in the backward from gate and up (the comment at _rms_norm)
    return _proj(cfg, p, ACTIVATIONS[family.activation](gate) * up, 'down_proj')

  mlp_out = _recomputed_keeping_bits(down, gate, up,
                                     {k: v for k, v in p.items() if k.startswith('down_')})
  return constrain(on, h + post(per_token(mlp_out), 'post_mlp_norm'), *_EMBED)


def _layer(cfg: ModelConfig, p: dict[str, jax.Array], h: jax.Array, positions: jax.Array,
           mask: Any, inv_freq: jax.Array, kv: Optional[tuple[jax.Array, jax.Array]],
           write_index: Optional[jax.Array], attend: Any = None, attention: str = 'einsum',
           kernel_mesh: Any = None, activation_mesh: Any = None):
  """One pre-norm decoder layer. h: [B, T, D]. Returns (h, updated (k, v) cache or None).
  With a cache, ``attend`` bounds the slots read (``cache_attention``). ``attention``: the
  implementation of the self-attention without a cache and of the prefill's (``attend``);
  ``kernel_mesh``, ``activation_mesh``: ``ForwardOptions``'."""
  q, k, v = _qkv(cfg, p, h, positions, inv_freq, activation_mesh)
  mask, scale_dim = attn_lib.layer_mask(p, mask), cfg.query_pre_attn_scalar or None
  new_kv = None
  if kv is not None:
    def write(cache, x):  # x [B, T, K, H] into the slots write_index.. of cache [B, K, S, H]
      x = jnp.swapaxes(x, 1, 2).astype(cache.dtype)
      if jnp.ndim(write_index) == 1:  # each row its own slot (T = 1): a scatter of B vectors
        return cache.at[jnp.arange(x.shape[0]), :, write_index].set(x[:, :, 0])
      return jax.lax.dynamic_update_slice_in_dim(cache, x, write_index, 2)
    if attention != 'einsum' and isinstance(attend, int):
      # The prefill (attend = its T tokens, written at slot 0): the slots it reads are k and v.
      dense = not isinstance(mask, attn_lib.Segments)
      attn = attn_lib.attend(q, k, v, mask[..., :attend] if dense else mask, attention, scale_dim,
                             kernel_mesh)
      new_kv = (write(kv[0], k), write(kv[1], v))
    else:
      attn, new_kv = attn_lib.cache_attention(q, write(kv[0], k), write(kv[1], v), mask, attend,
                                      scale_dim)
  else:
    attn = attn_lib.attend(q, k, v, mask, attention, scale_dim, kernel_mesh)
  return _after_attention(cfg, p, h, attn, activation_mesh), new_kv


# -- one layer's weights gathered at a time, in the prefill and the decode loop (issue 36) ---------
# Under fsdp a weight's ``embed`` axis is sharded at rest and the batch is sharded over the
# data-parallel axes, so every layer's weights are all-gathered before use. In the decode loop the
# layers' weights are loop invariants, and XLA hoisted their all-gathers out of the while loop:
# every layer gathered at once for the whole loop (Llama-3.1-8B with fsdp=8: 17.16 GiB per v5e
# chip). ``_gather_layer`` keeps a layer's weights at rest (sharded) up to an
# ``optimization_barrier`` that ties them to a value the loop computes, then constrains them to the
# gathered sharding: the all-gather depends on a loop variant and cannot be hoisted, so a decode
# step gathers each layer's weights when it gets there (layer i's tied to layer i-1's input, so
# its gather may overlap layer i-1's work: at most two layers gathered at a time). The weights
# with an embed axis (the projections and their adapters, which ``_proj`` casts to the compute
# dtype) are cast before the gather: float32 master weights move and land in bfloat16, half the
# bytes. The values are unchanged: the constraints and the barrier are identities, and the cast
# is the one ``_proj`` makes.
# The price: each decode step all-gathers the layer weights again (a weight's (n-1)/n over the
# interconnect per step) where the hoisted gather paid that once per rollout.
_GATHERED = {'embed': 'activation_embed'}  # a gathered weight's embed axis: as the activations'

# The decode loop's fused projections (Transformer.decode_layers): name -> the weights
# concatenated along their output axis, in that order.
FUSED = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'qkv_bias': ('q_bias', 'k_bias', 'v_bias'),
         'gate_up_proj': ('gate_proj', 'up_proj')}


def fused_axes(axes: dict[str, tuple]) -> dict[str, tuple]:
  """``axes`` (``DecoderStack.axes()``) with the fused weights' (``FUSED``): the first part's,
  whose output axis the concatenation extends (q_heads for qkv, mlp for gate/up). Under a
  tensor-parallel mesh the fused output axis is split as one, so q, k and v (gate and up) are
  resharded after the product."""
  return {**axes, **{f: axes[parts[0]] for f, parts in FUSED.items() if parts[0] in axes}}


def fold_adapter(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """A LoRA adapter folded into its weight: W + scale A @ B in float32 (leading axes: batch,
  e.g. the stacked layers)."""
  f32 = jnp.float32
  return w.astype(f32) + scale * jnp.matmul(a.astype(f32), b.astype(f32),
                                            precision=jax.lax.Precision.HIGHEST)


def _gather_layer(p: dict[str, jax.Array], axes: dict[str, tuple], dtype,
                  anchor: Optional[jax.Array] = None, on: Any = None) -> dict[str, jax.Array]:
  """One layer's params ``p`` (``axes``: ``DecoderStack.axes()``; other entries, the layer
  constants, pass unchanged) constrained at rest on ``on`` (``ForwardOptions.activation_mesh``),
  then, after a barrier with ``anchor`` (None: none), those with an embed axis cast to ``dtype``
  (the compute dtype) and every one gathered as the activations need them. A no-op without a
  mesh (``on`` None)."""
  if on is None:
    return p
  named = {k: v for k, v in p.items() if k in axes}
  named = {k: constrain(on, v, *axes[k]) for k, v in named.items()}
  if anchor is not None:
    named, _ = jax.lax.optimization_barrier((named, anchor))
  named = {k: constrain(on, v.astype(dtype) if 'embed' in axes[k] else v,
                        *(_GATHERED.get(a, a) for a in axes[k])) for k, v in named.items()}
  return {**p, **named}


def _layer_after_prefix(cfg: ModelConfig, p: dict[str, jax.Array], hp: jax.Array, hs: jax.Array,
                        positions: tuple[jax.Array, jax.Array], masks: tuple[jax.Array, ...],
                        inv_freq: jax.Array, attention: str = 'einsum', kernel_mesh: Any = None,
                        activation_mesh: Any = None) -> tuple[jax.Array, jax.Array]:
  """One decoder layer over P shared prefixes hp [P, Tp, D] and the B = P*R suffixes hs
  [B, Ts, D] that follow them (``Transformer.hidden_after_prefix``). The prefix rows attend to
  themselves as ``_layer`` does (by ``attention``); the suffix rows to their prefix and
  themselves (``attention_after_prefix``: 'cudnn' over the prefix's keys repeated per row,
  'flash' its own, the others the einsum: no fused kernel takes the prefix's keys shared by R
  rows))."""
  prefix_mask, prefix_valid, suffix_mask = (attn_lib.layer_mask(p, m) for m in masks)
  scale_dim = cfg.query_pre_attn_scalar or None
  on = activation_mesh
  qp, kp, vp = _qkv(cfg, p, hp, positions[0], inv_freq, on)
  qs, ks, vs = _qkv(cfg, p, hs, positions[1], inv_freq, on)
  attn_p = attn_lib.attend(qp, kp, vp, prefix_mask, attention, scale_dim, kernel_mesh)
  attn_s = attn_lib.attention_after_prefix(qs, (kp, vp), prefix_valid, ks, vs, suffix_mask,
                                           scale_dim, attention)
  return _after_attention(cfg, p, hp, attn_p, on), _after_attention(cfg, p, hs, attn_s, on)


class Transformer(nnx.Module):
  """Decoder-only LM. Params: embed [V, D], layers (stacked), final_norm [D], lm_head [D, V]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = _DTYPES[cfg.param_dtype]
    self.embed = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt),
        logical_axes=('vocab', 'embed'))
    self.layers = DecoderStack(cfg, rngs=rngs)
    # (1 + w) norms start at w = 0 as the layers' (and HF's Gemma init); before, 1: a scale of 2.
    self.final_norm = nnx.Param(jnp.full((cfg.hidden_size,), 0.0 if cfg.family.norm_plus_one
                                         else 1.0, pdt), logical_axes=('norm',))
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Param(
          nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), pdt),
          logical_axes=('embed', 'vocab'))
    self.layers.add_adapters(cfg.lora, rngs)

  # -- shared trunk ------------------------------------------------------------------------------
  def _trunk(self, tokens, positions, mask, cache_kv=None, write_index=None, layers=None,
             options: ForwardOptions = ForwardOptions(), attend=None):
    """tokens, positions: [B, T]; mask: [B, T, S], or ``window_masks``' pair. Returns final
    hidden [B, T, D] and cache. ``attend``: the cache slots the attention reads
    (``cache_attention``; None: all).

    With ``layers`` (``unstacked_layers()``) and a per-layer cache the layers run unrolled on
    those arrays; otherwise ``_scan_layers`` runs over the stacked params as ``options`` say.
    """
    cfg, on = self.cfg, options.activation_mesh
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    h = self._embed(tokens, on)  # [B, T, D]
    axes = fused_axes(self.layers.axes())
    if layers is not None:  # the decode loop's: each layer gathered in the step (_gather_layer)
      new_k, new_v, anchor = [], [], h
      for p, k, v in zip(layers, *cache_kv):
        p, anchor = _gather_layer(p, axes, _DTYPES[cfg.dtype], anchor, on), h
        h, (k, v) = _layer(cfg, p, h, positions, mask, inv_freq, (k, v), write_index, attend,
                           activation_mesh=on)
        new_k.append(k)
        new_v.append(v)
      return self._final_norm(h), (tuple(new_k), tuple(new_v))

    def body(h, xs):
      p, kv = xs
      if kv is not None:  # the prefill: one layer's weights gathered per scan iteration
        p = _gather_layer(p, axes, _DTYPES[cfg.dtype], on=on)
      return _layer(cfg, p, h, positions, mask, inv_freq, kv, write_index, attend,
                    options.attention, options.kernel_mesh, on)

    h, new_kv = _scan_layers(body, h, (self._layer_arrays(options.adapters), cache_kv), options)
    return self._final_norm(h), new_kv

  def _layer_arrays(self, adapters: bool = True) -> dict[str, jax.Array]:
    """The stacked layer params and ``layer_constants``, what the layer scan runs over."""
    return {**self.layers.arrays(adapters),
            **{k: jnp.asarray(v) for k, v in layer_constants(self.cfg).items()}}

  def _embed(self, tokens: jax.Array, on: Any = None) -> jax.Array:
    """[B, T] token ids -> [B, T, D] embeddings in the compute dtype (``on``: as ``_qkv``'s)."""
    h = jnp.take(self.embed[...], tokens, axis=0)
    if self.cfg.family.scale_embeddings:  # times sqrt(D) rounded to the table's dtype, as HF's
      h = h * jnp.asarray(math.sqrt(self.cfg.hidden_size), h.dtype)
    h = h.astype(_DTYPES[self.cfg.dtype])
    return constrain(on, h, 'activation_batch', 'activation_length', 'activation_embed')

  def _final_norm(self, h: jax.Array) -> jax.Array:
    return _rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps,
                     self.cfg.family.norm_plus_one)

  def _logits(self, h: jax.Array, on: Any = None) -> jax.Array:
    """[..., D] -> [..., V] float32 (``on``: as ``_qkv``'s)."""
    w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
    logits = _head_product(h, w.astype(h.dtype))
    logits = _softcap(logits, self.cfg.final_logit_softcapping)
    lead = ('activation_batch', 'activation_length')[:logits.ndim - 1]
    return constrain(on, logits, *lead, *([None] * (logits.ndim - 1 - len(lead))),
                     'activation_vocab')

  def _next_token_logits(self, h: jax.Array, on: Any = None) -> jax.Array:
    """[B, D] -> [B, V] float32: ``_logits`` for the prefill's last slot and each decode step.

    With tied embeddings the head is ``h @ embed.T``, a product with the [V, D] table transposed.
    At 2-64 rows XLA:CPU streams that product at about half the rate of a plain read of the table
    (SmolLM2, 8 rows: 8.3-9.3 ms for the 113 MB table). Split into 32 vocabulary blocks, as one
    batched product over ``embed`` reshaped to [32, V/32, D] (a free view), the same rows take
    5.7-6.1 ms; at 128 rows and more the plain product is faster, and a vocabulary under 16k rows
    is too small to matter (BENCHMARKS.md, "the tied head at decode time"). The split is staged
    for CPU only (``lax.platform_dependent``): other backends, and AOT lowering for TPU from a CPU
    host, get the plain product. Each logit is still one dot over D, so the values agree with the
    full forward's to float32 rounding.
    """
    rows, v = h.shape[0], self.cfg.vocab_size
    if not (self.cfg.tie_word_embeddings and 2 <= rows <= 64 and v % _HEAD_BLOCKS == 0
            and v >= 16384):
      return self._logits(h, on)

    def plain(h, e):
      return jnp.matmul(h, e.T, preferred_element_type=jnp.float32)

    def blocked(h, e):
      out = jnp.einsum('bd,cvd->cbv', h, e.reshape(_HEAD_BLOCKS, v // _HEAD_BLOCKS, -1),
                       preferred_element_type=jnp.float32)
      return out.transpose(1, 0, 2).reshape(rows, v)

    e = self.embed[...].astype(h.dtype)
    logits = jax.lax.platform_dependent(h, e, cpu=blocked, default=plain)
    logits = _softcap(logits, self.cfg.final_logit_softcapping)
    return constrain(on, logits, 'activation_batch', 'activation_vocab')

  # -- training path -----------------------------------------------------------------------------
  def hidden(self, tokens: jax.Array, attention_mask: jax.Array,
             options: ForwardOptions = ForwardOptions()) -> jax.Array:
    """Final (normed) hidden states [B, T, D] of the full forward; project with ``logits``.
    ``options``: layers scanned or unrolled, remat, adapters on or off, the attention."""
    positions = attn_lib.positions_from_mask(attention_mask)
    mask = attn_lib.splash_mask(self.cfg, attention_mask, options.attention)
    if mask is None:
      mask = attn_lib.window_masks(self.cfg, attn_lib.causal_mask(attention_mask), positions,
                                   positions)
    h, _ = self._trunk(tokens, positions, mask, options=options)
    return h

  def hidden_after_prefix(self, prefix_tokens: jax.Array, prefix_mask: jax.Array,
                          tokens: jax.Array, attention_mask: jax.Array,
                          options: ForwardOptions = ForwardOptions()
                          ) -> tuple[jax.Array, jax.Array]:
    """The full forward of rows that share their prefixes, each prefix computed once.

    Row ``i*R + j`` (j < R) is the sequence ``[prefix_tokens[i], tokens[i*R + j]]``; with R = 1
    this is ``hidden`` of the concatenated rows. GRPO's G completions of one prompt are such rows:
    the prompt's forward (and in the backward its gradient, summed over the R rows) is paid once
    per prompt instead of once per completion. The values are ``hidden``'s on the concatenated
    rows (the same positions, masks and keys, in the same order; only float32 rounding of the
    products can differ).

    Args:
      prefix_tokens, prefix_mask: [P, Tp], left-padded (each prefix needs one real token).
      tokens, attention_mask: [P*R, T], the suffixes (right-padded completions).
      options: layers scanned or unrolled, remat, adapters on or off (its share_prompts is the
        caller's business: R here is the rows' ratio).

    Returns:
      Final (normed) hidden states: the prefixes' [P, Tp, D] and the suffixes' [P*R, T, D].
    """
    cfg = self.cfg
    p, b = prefix_tokens.shape[0], tokens.shape[0]
    if b % p:
      raise ValueError(f'hidden_after_prefix: {b} suffix rows are not a multiple of {p} prefixes.')
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    # Positions and masks as ``hidden`` derives them from the concatenated rows' mask: a suffix
    # position counts its prefix's real tokens (>= 1, so the clip at 0 never applies) and its own.
    prefix_len = jnp.sum(prefix_mask.astype(jnp.int32), axis=-1)  # [P]
    suffix_positions = (jnp.repeat(prefix_len, b // p)[:, None] - 1
                        + jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1))
    positions = (attn_lib.positions_from_mask(prefix_mask), suffix_positions)
    prefix_valid = prefix_mask.astype(bool)  # [P, Tp]
    if any(cfg.sliding_layers()):  # the window cuts each suffix position's prefix keys
      r, t, tp = b // p, tokens.shape[1], prefix_tokens.shape[1]
      rows = jnp.broadcast_to(prefix_valid[:, None, None, :], (p, r, t, tp)).reshape(b, t, tp)
      cut = attn_lib.window_masks(cfg, rows, suffix_positions, jnp.repeat(positions[0], r, axis=0))
      prefix_valid = jax.tree.map(lambda m: m.reshape(p, r, t, tp), cut)  # [P, R, T, Tp]
    own = attn_lib.splash_mask(cfg, prefix_mask, options.attention)
    causal = attn_lib.causal_mask
    masks = (attn_lib.window_masks(cfg, causal(prefix_mask), positions[0], positions[0])
             if own is None else own,
             prefix_valid,
             attn_lib.window_masks(cfg, causal(attention_mask), suffix_positions,
                                   suffix_positions))

    def body(carry, p):
      return _layer_after_prefix(cfg, p, *carry, positions, masks, inv_freq,
                                 options.attention, options.kernel_mesh,
                                 options.activation_mesh), None

    on = options.activation_mesh
    (hp, hs), _ = _scan_layers(body, (self._embed(prefix_tokens, on), self._embed(tokens, on)),
                               self._layer_arrays(options.adapters), options)
    return self._final_norm(hp), self._final_norm(hs)

  def logits(self, h: jax.Array, options: ForwardOptions = ForwardOptions()) -> jax.Array:
    """[..., D] hidden states -> [..., V] float32 logits (``options``: its activation_mesh)."""
    return self._logits(h, options.activation_mesh)

  def __call__(self, tokens: jax.Array, attention_mask: jax.Array,
               options: ForwardOptions = ForwardOptions()) -> jax.Array:
    """Full forward. tokens, attention_mask: [B, T] (left or right padding). -> logits [B, T, V]."""
    return self._logits(self.hidden(tokens, attention_mask, options), options.activation_mesh)

  # -- decoding path -----------------------------------------------------------------------------
  def init_cache(self, batch_size: int, cache_length: int) -> attn_lib.KVCache:
    cfg = self.cfg
    shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cache_length,
             cfg.head_size)
    dt = _DTYPES[cfg.dtype]
    return attn_lib.KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   valid=jnp.zeros((batch_size, cache_length), bool),
                   index=jnp.zeros((), jnp.int32), positions=jnp.zeros((batch_size,), jnp.int32))

  def prefill(self, tokens: jax.Array, attention_mask: jax.Array, cache_length: int,
              attention: str = 'einsum', activation_mesh: Any = None
              ) -> tuple[jax.Array, attn_lib.KVCache]:
    """Runs left-padded prompts [B, Tp] into a fresh cache of ``cache_length`` slots.
    ``attention``: the implementation of its attention (attn_lib.ATTENTION_IMPLS);
    ``activation_mesh``: ``ForwardOptions.activation_mesh``.

    Returns the logits of the last slot [B, V] (the next-token distribution) and the cache.
    'splash' prefills with 'flash': with the kernel the rollout of issue 47's 0.4B shape needed
    9.19 GiB on v5e:1x1 (plan), with 'flash' or the einsum 3.55 GiB.
    """
    attention = 'flash' if attention == 'splash' else attention
    b, t = tokens.shape
    cache = self.init_cache(b, cache_length)
    valid = cache.valid.at[:, :t].set(attention_mask.astype(bool))
    q_positions = attn_lib.positions_from_mask(attention_mask)
    mask = attn_lib.splash_mask(self.cfg, attention_mask, attention)
    if mask is None:
      slots = jnp.arange(cache_length)
      mask = valid[:, None, :] & (slots[None, None, :] <= jnp.arange(t)[None, :, None])
      mask = attn_lib.window_masks(self.cfg, mask, q_positions, attn_lib.positions_from_mask(valid))
    h, (k, v) = self._trunk(tokens, q_positions, mask, (cache.k, cache.v),
                            jnp.zeros((), jnp.int32), attend=t,
                            options=ForwardOptions(attention=attention,
                                                   activation_mesh=activation_mesh))
    positions = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)
    cache = attn_lib.KVCache(k=k, v=v, valid=valid, index=jnp.asarray(t, jnp.int32),
                             positions=positions)
    return self._next_token_logits(h[:, -1], activation_mesh), cache

  def unstacked_layers(self) -> list[dict[str, jax.Array]]:
    """Each layer's params as its own arrays. A decode loop that takes them (sliced once, before
    the loop) reads the weights in place; with the stacked params, XLA copies every layer's
    weights out of the stack at every token. Under fsdp they stay sharded: each decode step
    gathers one layer's at a time (``_gather_layer``)."""
    arrays = self._layer_arrays()
    return [{k: v[i] for k, v in arrays.items()} for i in range(self.cfg.num_hidden_layers)]

  def decode_layers(self, fuse: bool = True) -> list[dict[str, jax.Array]]:
    """The decode loop's per-layer weights (``unstacked_layers``) prepared once per rollout in
    the layout and dtype the decode step uses, so that a step launches fewer, larger products and
    streams the weights in the compute dtype (issue 47):

      * with float32 compute, the LoRA adapters folded into their weights, W + (alpha / r) A @ B
        (``fold_adapter``, as ``lora.merged`` folds them: the same function up to rounding).
        With bfloat16 compute they stay apart and the step adds their float32 path as the
        learner's forward does (``_proj``): folded and rounded to bfloat16, every update under
        half a bfloat16 ulp of W was lost, and the rollout sampled from a policy nearer the
        base than the one trained (their projections are then not fused);
      * with ``fuse``, q/k/v concatenated into one [D, (N + 2K) H] ``qkv_proj`` (and
        ``qkv_bias``), gate/up into one [D, 2F] ``gate_up_proj`` (``FUSED``): one product each
        instead of three and two; each output column is the same dot product as before. (On
        XLA:CPU the fused products measured slower: ``Sampler.fuse_weights`` leaves them
        unfused there);
      * the projections and biases cast to the compute dtype (model.dtype), the cast ``_proj``
        makes at every use: a bfloat16 decode reads bfloat16 weights (XLA:CPU, which computes
        bfloat16 products in float32, may keep the float32 weights instead).

    Norm scales and ``layer_constants`` pass unchanged. The values are the unfused layer's up to
    float32 summation order (and the adapters' rounding). The learner's forward and the
    log-probs of the loss never use these arrays. Under fsdp they stay sharded as the weights
    they come from (``fused_axes``) and the step gathers them one layer at a time
    (``_gather_layer``). A copy of the layer weights in the compute dtype lives for the rollout:
    half the float32 params' bytes with bfloat16 compute.
    """
    cfg, dt = self.cfg, _DTYPES[self.cfg.dtype]
    scale = cfg.lora.alpha / cfg.lora.rank if cfg.lora.rank else 0.0
    fold = jnp.dtype(dt) == jnp.float32
    out = []
    for p in self.unstacked_layers():
      p = dict(p)
      adapted = {k[:-len('_lora_a')] for k in p if k.endswith('_lora_a')}
      for w in adapted if fold else ():
        p[w] = fold_adapter(p[w], p.pop(f'{w}_lora_a'), p.pop(f'{w}_lora_b'), scale)
      for fused, parts in FUSED.items() if fuse else ():
        group = FUSED[fused.replace('bias', 'proj')]  # a bias fuses with its projections
        if all(k in p for k in parts) and not (adapted & set(group) and not fold):
          p[fused] = jnp.concatenate([p.pop(k).astype(dt) for k in parts], axis=-1)
      out.append({k: v.astype(dt) if k.endswith(('_proj', '_bias')) else v
                  for k, v in p.items()})
    return out

  def decode(self, tokens: jax.Array, cache: attn_lib.KVCache, layers: Optional[list] = None,
             block: int = attn_lib.DECODE_BLOCK, activation_mesh: Any = None
             ) -> tuple[jax.Array, attn_lib.KVCache]:
    """One decoding step. tokens: [B] -> logits [B, V] and the cache with the token written.
    ``layers``: ``unstacked_layers()``, with a ``cache.per_layer()`` cache (faster in a loop).
    ``decode_layers()`` (the sampler's) are such arrays with fused projections.
    The attention reads the cache's filled blocks of ``block`` slots only (up to the largest
    row's written slots; ``block`` 0: every slot). ``cache.index`` [B]: each row writes
    its own slot. ``activation_mesh``: ``ForwardOptions.activation_mesh``."""
    b = tokens.shape[0]
    if cache.index.ndim == 1:
      valid = cache.valid.at[jnp.arange(b), cache.index].set(True)
      filled = jnp.max(cache.index) + 1
    else:
      valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, jnp.ones((b, 1), bool),
                                                  cache.index, 1)
      filled = cache.index + 1
    mask = attn_lib.window_masks(self.cfg, valid[:, None, :], cache.positions[:, None],
                        attn_lib.positions_from_mask(valid))  # the new token's position: its count
    h, (k, v) = self._trunk(tokens[:, None], cache.positions[:, None], mask,
                            (cache.k, cache.v), cache.index, layers, attend=(filled, block),
                            options=ForwardOptions(activation_mesh=activation_mesh))
    cache = attn_lib.KVCache(k=k, v=v, valid=valid, index=cache.index + 1,
                             positions=cache.positions + 1)
    return self._next_token_logits(h[:, 0], activation_mesh), cache


def logical_axes(model_or_state) -> dict:
  """Nested dict (same structure as the params' pure dict) of each param's logical axes."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = tuple(var.get_metadata()['logical_axes'])
  return out


def split(model: Transformer) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, params as a plain nested dict of arrays)."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def combine(*trees: Optional[dict]) -> dict:
  """The union of nested params dicts with disjoint leaves (e.g. a LoRA model's frozen base
  params and its adapters, ``jaxrl_ga.lora.split``); None entries are skipped. No array is
  copied."""
  out: dict = {}
  for tree in trees:
    for key, value in (tree or {}).items():
      if isinstance(value, dict) and isinstance(out.get(key), dict):
        out[key] = combine(out[key], value)
      elif key in out:
        raise ValueError(f'combine: {key!r} is in two of the params trees.')
      else:
        out[key] = value
  return out


def merge(graphdef: nnx.GraphDef, params: dict, *more: Optional[dict]) -> Transformer:
  """Rebuilds the module from a graphdef and a params dict, or several disjoint ones (a LoRA
  model's base params and adapters; see ``combine``). Works on tracers inside jit."""
  more = [m for m in more if m is not None]
  return nnx.merge(graphdef, combine(params, *more) if more else params)
