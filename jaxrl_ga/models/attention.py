"""Every attention of the decoder (``models/transformer.py``) and its KV cache.

Masks: a row's [B, T] attention mask is 0/1 or, for SFT's packed rows, segment ids 1, 2, ...
(0: padding); ``positions_from_mask`` and ``causal_mask`` keep each segment to itself;
``window_masks`` adds the sliding window (Mistral, Gemma 3's local layers) as one more mask term.

The training forward's and the prefill's self-attention (``attend``, by ``ATTENTION_IMPLS``,
model.attention; issues 36, 47): 'einsum' (``einsum_attention``: two einsums and a float32 softmax
over a dense [B, T, S] mask), 'xla' (``jax.nn.dot_product_attention(implementation='xla')`` with
that mask: the same arithmetic as jax stages it, which every backend compiles) or 'splash' (TPU
only: the Pallas splash-attention kernel, ``jax.experimental.pallas.ops.tpu.splash_attention``,
which never materializes the [T, S] scores; its mask is causal (or local: the sliding window) and
the rows' segment ids, 0/1 masks and SFT's packed ids alike, so a padding query attends to the
padding before it instead of ``causal_mask``'s real positions: only padding positions' outputs
differ, and no loss reads them), 'cudnn' (``cudnn_attention``: cuDNN's fused flash attention on
NVIDIA GPUs, bf16/fp16, with that mask as an additive one; REFUSED for now: it failed
tests/test_attention_gpu.py on an H200, ``CUDNN_FAILED``) or 'flash' (``flash_attention``: FlashAttention's blocked online softmax
and recomputing backward in pure JAX, every backend; the dense mask; no [B, N, T, S] tensor kept
for the backward; issue 47). Every implementation keeps GQA, the sliding window, Gemma's
``query_pre_attn_scalar``, packed segments and left padding; what one cannot express runs the
einsum, or with 'splash' 'flash' (no [B, N, T, S] tensor kept on a TPU either): the
suffix-over-shared-prefix attention of ``Transformer.hidden_after_prefix``
(``attention_after_prefix``; 'cudnn' and 'flash' have their own), and with 'splash' a model
whose layers mix sliding and full attention (Gemma 3). model.attention='auto', the default, is
none of these: ``resolve`` turns it into one, once per run before anything compiles
(``programs.resolve_attention``), so every program holds a concrete implementation.

The decode step reads only the filled blocks of its cache (``cache_attention``,
``blocked_attention``: an online softmax over the blocks) on CPU and TPU, the whole cache at once
on GPUs (``WHOLE_CACHE_PLATFORMS``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga.models.config import ModelConfig

ATTENTION_IMPLS = ('einsum', 'xla', 'splash', 'cudnn', 'flash')  # ForwardOptions.attention
AUTO = 'auto'  # model.attention's default: ``resolve`` picks one of ATTENTION_IMPLS per run


def check_attention(attention: str) -> None:
  if attention not in ATTENTION_IMPLS:
    hint = (" ('auto' is resolved once per run: programs.resolve_attention)"
            if attention == AUTO else '')
    raise ValueError(f'attention={attention!r}; choose one of {", ".join(ATTENTION_IMPLS)}{hint}.')


# -- model.attention='auto' (issue 47) --------------------------------------------------------------
# The implementation on CPU: benchmarks/attention.py measured 'einsum' and 'xla' within 4% of each
# other (BENCHMARKS.md, "attention.py"; learner fwd+bwd einsum/xla 1.003x at T=256 and 1.038x at
# T=512, prefill 0.968x and 0.980x), so the einsum, bitwise the default before 'auto' existed.
CPU_ATTENTION = 'einsum'
# cuDNN's fused attention (jax/_src/cudnn/fused_attention_stablehlo.py, check_layout and
# check_is_flash_attention): bf16/fp16 q, k, v only; head dim a multiple of 8, at most 256 on
# Hopper (compute capability 9.0) and later, 128 before.
CUDNN_DTYPES = ('bfloat16', 'float16')
CUDNN_FAILED = ("it failed this project's GPU check (tests/test_attention_gpu.py on an H200, "
                'jax 0.11.2, cuDNN 9.19: relative error 0.82 where the bf16 einsum has 0.034)')


def resolve(attention: str, platform: str, dtype: str, cfg: ModelConfig, device_kind: str = '',
            compute_capability: Optional[str] = None) -> tuple[str, str]:
  """model.attention -> (one of ATTENTION_IMPLS, why): an explicit implementation as is (ValueError
  where the devices cannot run it); 'auto' by the backend ``platform`` ('cpu', 'gpu', 'tpu'),
  the compute ``dtype`` and the model: on GPUs 'flash', the reason for not 'cudnn' named (it
  failed this project's GPU check: ``CUDNN_FAILED``, so 'cudnn' is refused); on TPU 'splash' (a
  model whose layers mix sliding and full attention runs 'flash' there, ``splash_mask``); on
  CPU ``CPU_ATTENTION``, the fastest measured. ``device_kind`` (e.g. 'NVIDIA H200') and
  ``compute_capability`` (e.g. '9.0') are the first device's. A pure function: once per run,
  before anything compiles (programs.resolve_attention)."""
  where = ', '.join(x for x in (device_kind or platform, dtype) if x)
  if attention == 'splash' and platform != 'tpu':
    raise ValueError(f"model.attention='splash' is a TPU kernel but the devices are {platform}; "
                     "set model.attention to 'auto', 'einsum' or 'xla' (python -m jaxrl_ga.plan "
                     "compiles 'splash' for a TPU topology).")
  why_not = _cudnn_unsupported(platform, dtype, cfg, device_kind, compute_capability)
  if attention == 'cudnn':  # refused: it would train on wrong attention (CUDNN_FAILED)
    raise ValueError(f"model.attention='cudnn' cannot run here: {why_not or CUDNN_FAILED}; set "
                     "model.attention to 'auto' (on GPUs: 'flash') or 'einsum'.")
  if attention != AUTO:
    check_attention(attention)
    return attention, where
  if platform == 'tpu':
    sliding = cfg.sliding_layers()
    mixed = any(sliding) and not all(sliding)
    return 'splash', where + ('; layers mixing sliding and full attention run flash'
                              if mixed else '')
  if platform == 'gpu':  # FlashAttention in JAX: no [B, N, T, S] tensor kept for the backward
    # Not 'cudnn', though its learner step is 2x flash's on an H200 at issue 47's shape
    # (BENCHMARKS.md, "Accelerator"): it fails tests/test_attention_gpu.py (CUDNN_FAILED).
    return 'flash', f'{where}; not cudnn: ' + (why_not or CUDNN_FAILED)
  return CPU_ATTENTION, f'{where}; the fastest measured on CPU, BENCHMARKS.md'


def _cudnn_unsupported(platform: str, dtype: str, cfg: ModelConfig, device_kind: str,
                       compute_capability: Optional[str]) -> str:
  """Why cuDNN's fused attention cannot take this run's attention ('' where it can)."""
  if platform != 'gpu' or (device_kind and 'nvidia' not in device_kind.lower()):
    return f'cuDNN runs on NVIDIA GPUs, the devices are {device_kind or platform}'
  if dtype not in CUDNN_DTYPES:
    return f'model.dtype={dtype} (cuDNN takes bfloat16 or float16; set model.dtype=bfloat16)'
  h = cfg.head_size
  major = int((compute_capability or '0').split('.')[0] or 0)
  limit = 256 if major >= 9 else 128
  if h % 8 or h > limit:
    return f'head size {h} (cuDNN: a multiple of 8, at most {limit} on this GPU)'
  return ''


@flax.struct.dataclass
class KVCache:
  """Preallocated decoding cache. Slot i holds token i of the left-padded sequence.

  ``k`` and ``v`` are stacked [L, B, Nkv, S, H], or after ``per_layer()`` tuples of L arrays
  [B, Nkv, S, H] (the layout a decode loop with ``Transformer.unstacked_layers`` uses). Heads
  before slots: the attention products read the cache in place; with [B, S, Nkv, H] XLA:CPU
  copied the whole cache into that layout at every layer and token (15% of the XLA op time of
  a d=512/8 decode step; see BENCHMARKS.md, decode.py).
  """
  k: Any  # [L, B, Nkv, S, H], or a tuple of L [B, Nkv, S, H]
  v: Any
  valid: jax.Array  # [B, S] bool: slot holds a real (non-pad) token
  # [] int32: next slot to write; or [B] int32, each row's own next slot (a decode slot pool
  # whose rows started at different steps, ``sampling``'s slots)
  index: jax.Array
  positions: jax.Array  # [B] int32: rotary position of the next token of each row

  def per_layer(self) -> 'KVCache':
    n = self.k.shape[0]
    return self.replace(k=tuple(self.k[i] for i in range(n)), v=tuple(self.v[i] for i in range(n)))


# A packed row (SFT's sft.packing) holds several examples: its attention_mask is their segment
# ids, 1, 2, ... ascending along the row (0: padding), and both functions below keep each example
# to itself: positions restart at a segment's first token and a token attends only to its own
# segment. A 0/1 mask is one segment per row, for which they are the plain mask's rules.
def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """[B, T] mask (0/1, or segment ids) -> [B, T] int32 positions: the count of real tokens of the
  same segment before each token."""
  ids = attention_mask.astype(jnp.int32)
  count = jnp.cumsum((ids > 0).astype(jnp.int32), axis=-1)  # real tokens up to t
  before = jnp.pad(jax.lax.cummax(ids, axis=1)[:, :-1], ((0, 0), (1, 0)))
  offset = jax.lax.cummax(jnp.where(ids > before, count - 1, 0), axis=1)  # at segment starts
  return jnp.maximum(count - 1 - offset, 0)


def causal_mask(attention_mask: jax.Array) -> jax.Array:
  """[B, T] mask (0/1, or segment ids) -> [B, T, T] bool: position t attends to the real positions
  <= t of its own segment (a padding position t: to every real position <= t)."""
  t = attention_mask.shape[-1]
  ids = attention_mask.astype(jnp.int32)
  same = (ids[:, :, None] == ids[:, None, :]) | (ids[:, :, None] == 0)
  return jnp.tril(jnp.ones((t, t), bool))[None] & (ids > 0)[:, None, :] & same


def window_masks(cfg: ModelConfig, mask: jax.Array, q_positions: jax.Array,
                 k_positions: jax.Array) -> Any:
  """The attention mask(s) a layer chooses from (``layer_mask``): ``mask`` [B, T, S] itself
  without sliding layers; ``mask`` and the keys at positions > q - W when every layer slides
  (Mistral); the pair (full, sliding) when some do (Gemma 3). Positions: q [B, T], k [B, S]."""
  sliding = cfg.sliding_layers()
  if not any(sliding):
    return mask
  local = mask & (q_positions[:, :, None] - k_positions[:, None, :] < cfg.sliding_window)
  return local if all(sliding) else (mask, local)


def layer_mask(p: dict[str, jax.Array], masks: Any) -> jax.Array:
  """The layer's mask: one of the (full, sliding) pair by its 'sliding' flag, else ``masks``."""
  if isinstance(masks, tuple):
    return jnp.where(p['sliding'], masks[1], masks[0])
  return masks


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     heads_first: bool = False, scale_dim: Optional[float] = None) -> jax.Array:
  """Grouped-query attention. q: [B, T, N, H]; k, v: [B, S, K, H], or [B, K, S, H] with
  heads_first (the KV cache's layout); mask: [B, T, S] bool. Scores are divided by
  sqrt(scale_dim) (default H; Gemma's query_pre_attn_scalar)."""
  b, t, n, h = q.shape
  kv = 'BKSH' if heads_first else 'BSKH'
  kv_heads = k.shape[1 if heads_first else 2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)  # q head i uses kv head i // (N/K), as HF
  logits = jnp.einsum(f'BTKGH,{kv}->BKGTS', q, k, preferred_element_type=jnp.float32)
  logits = logits / np.sqrt(scale_dim or h).astype(np.float32)
  logits = jnp.where(mask[:, None, None, :, :], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  if heads_first:
    # Batch dims, then the rows and columns of one [G*T, S] x [S, H] product: XLA:CPU runs this
    # as a library matmul. Asked for BTKGH directly, it ran a [H, S] x [S, G] product in its own
    # dot loop: 42% of a tiny decode step's op time, 10% of SmolLM2's (BENCHMARKS.md, issue 15).
    # The training path keeps BTKGH: there the other form was not faster with its backward.
    out = jnp.einsum('BKGTS,BKSH->BKGTH', probs, v).transpose(0, 3, 1, 2, 4)
  else:
    out = jnp.einsum(f'BKGTS,{kv}->BTKGH', probs, v)
  return out.reshape(b, t, n, h)


# -- fused attention (ForwardOptions.attention; "Fused attention" in the module docstring) ---------
_SPLASH_BLOCK = 128  # the splash kernel's default block (BlockSizes.get_default): T is padded to it


@flax.struct.dataclass
class Segments:
  """The mask of the 'splash' attention in place of the dense [B, T, S] one: the rows' [B, T]
  segment ids (0/1, or SFT's packed ids; 0: padding), causal self-attention, and keys within
  ``window`` positions of the query (0: no window)."""
  ids: jax.Array
  window: int = flax.struct.field(pytree_node=False, default=0)


def splash_mask(cfg: ModelConfig, attention_mask: jax.Array, attention: str
               ) -> Optional[Segments]:
  """``Segments`` of the rows with 'splash' when every layer attends alike (all sliding, or
  none); None: the dense masks (``window_masks``) and, with 'splash', 'flash'."""
  sliding = cfg.sliding_layers()
  if attention != 'splash' or (any(sliding) and not all(sliding)):
    return None
  return Segments(attention_mask.astype(jnp.int32), cfg.sliding_window if all(sliding) else 0)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, attention: str,
           scale_dim: Optional[float] = None, kernel_mesh: Any = None) -> jax.Array:
  """Self-attention of the training forward and the prefill by ``attention`` (ATTENTION_IMPLS).
  q: [B, T, N, H]; k, v: [B, S, K, H]; mask: [B, T, S] bool, or ``Segments`` (splash).
  ``scale_dim``: as ``einsum_attention``'s; ``kernel_mesh``: splash's (``splash_attention``)."""
  if isinstance(mask, Segments):
    return splash_attention(q, k, v, mask, scale_dim, kernel_mesh=kernel_mesh)
  if attention == 'cudnn':
    return cudnn_attention(q, k, v, mask, scale_dim, causal=q.shape[1] == k.shape[1])
  if attention == 'xla':  # the scores times 1/sqrt(d) (the einsum divides: float32 rounding)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                        scale=1.0 / math.sqrt(scale_dim or q.shape[-1]),
                                        implementation='xla')
  if attention in ('flash', 'splash'):  # splash: what its kernel cannot take (Gemma 3's mix)
    return flash_attention(q, k, v, mask, scale_dim)
  return einsum_attention(q, k, v, mask, scale_dim=scale_dim)


# cuDNN's operand lengths are padded to a multiple of this: whole 128-key tiles (cudnn_operands).
CUDNN_LENGTH_MULTIPLE = 128


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    scale_dim: Optional[float] = None, causal: bool = False,
                    length_multiple: int = CUDNN_LENGTH_MULTIPLE) -> jax.Array:
  """cuDNN's fused (flash) attention, ``jax.nn.dot_product_attention(implementation='cudnn')``:
  q [B, T, N, H], k and v [B, S, K, H] in bf16/fp16 (GQA as is), the dense mask [B, T, S] of
  every case (left and right padding, SFT's packed segments, sliding windows) passed as its
  boolean ``mask``, which jax turns into an additive [B, 1, T, S] bias of 0 and a large negative
  number (``combine_bias_and_mask``; a boolean mask gets no bias gradient). The kernel never
  materializes the [B, N, T, S] scores; its backward keeps q, k, v, the output, the log-sum-exp
  [B, N, T] and that bias (one for all the scanned layers when they attend alike; with Gemma 3's
  per-layer choice, one per layer: the CUDA lowering in tests/test_attention_gpu.py). ``causal``
  (T = S, the mask causal): cuDNN skips the blocks above the diagonal (the mask is unchanged by
  it). Scale: 1/sqrt(scale_dim or H), as ``einsum_attention``'s. The operands are
  ``cudnn_operands``': lengths a multiple of ``length_multiple`` (128, whole key tiles: see
  there; issue 47's T = 576 becomes 640), and no query row without a key."""
  t = q.shape[1]
  q, k, v, mask = cudnn_operands(q, k, v, mask, length_multiple)
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                     scale=1.0 / math.sqrt(scale_dim or q.shape[-1]),
                                     is_causal=causal, implementation='cudnn')
  return out[:, :t]


def cudnn_operands(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                   length_multiple: int = CUDNN_LENGTH_MULTIPLE
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """What ``cudnn_attention`` hands the kernel. (1) Lengths a multiple of ``length_multiple``
  (2: cuDNN's backward with a bias takes even lengths only; 128: whole key tiles, the
  workaround of cuDNN's SM90 backward that scores the padded tail of the last 128-key tile 0
  instead of masking it, pytorch/pytorch#196678, NVIDIA/cudnn-frontend#160, which
  benchmarks/cudnn_check.py's `pad128` row tries): T and S grow by queries whose outputs the
  caller drops and keys masked out. (2) Every query row attends to at least one key: a row
  whose keys are all masked (a left-padding position before a prompt's first token, the query
  added in (1)) gets its own position (its diagonal, clipped to the last key), which a causal
  kernel allows. On an H200 (jax 0.11.2, cuDNN 9.19) such rows made cuDNN's backward return NaN
  or large finite garbage in dq (and through it every gradient: a relative error of 3.7 on
  qwen3_tiny), and a NaN output of a padding row would reach the real rows as a NaN key that an
  additive mask cannot remove. Those rows' outputs are never read: the loss masks padding
  positions, and no real query attends to a padding key; so the rows that are read are
  unchanged, and only the einsum's average of the values at padding rows is not reproduced."""
  t, s = q.shape[1], k.shape[1]
  dt, ds = -t % length_multiple, -s % length_multiple
  if dt or ds:
    grow = lambda x, n: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
    q, k, v = grow(q, dt), grow(k, ds), grow(v, ds)
    mask = jnp.pad(mask, ((0, 0), (0, dt), (0, ds)))  # False: the added key is never attended
  rows, keys = mask.shape[1], mask.shape[2]
  own = jnp.arange(keys)[None, :] == jnp.minimum(jnp.arange(rows), keys - 1)[:, None]  # [T, S]
  mask = mask | (~mask.any(-1, keepdims=True) & own[None])
  return q, k, v, mask


@functools.lru_cache(maxsize=64)
def _splash_kernel(size: int, window: int, heads: int, interpret: Any):
  """The splash kernel for rows of ``size`` slots, ``heads`` query heads and a causal (or, with
  ``window``, local) mask: built once per shape, not at every trace (its mask info is host
  numpy work over every block)."""
  # lazy: import cost: the TPU Pallas kernel (0.7 s to import), only when splash runs
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top
  shape = (size, size)
  base = (splash.LocalMask(shape, (window - 1, 0), 0) if window else splash.CausalMask(shape))
  return splash.make_splash_mha(splash.MultiHeadMask([base] * heads), head_shards=1,
                                q_seq_shards=1, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Segments,
                     scale_dim: Optional[float] = None, interpret: Any = False,
                     kernel_mesh: Any = None) -> jax.Array:
  """The Pallas TPU splash-attention kernel (``splash_attention.make_splash_mha``: GQA, a causal
  or local mask, segment ids; MaxText's ``tpu_flash_attention`` calls it the same way), one call
  per row under ``vmap``, per shard of the batch under ``shard_map`` over ``kernel_mesh`` (a
  ``sharding.KernelMesh``: its ``mesh`` and ``spec``; None: one call over the whole batch,
  ``ForwardOptions.kernel_mesh``) (the partitioner cannot split a Pallas call;
  the heads are not split, so a tensor-parallel mesh gathers them for the kernel). The rows
  are padded to a multiple of the kernel's block with segment id 0, which no real token attends
  to; q is scaled before the kernel (it has no scale of its own). TPU only: Mosaic lowers it for
  TPU, and XLA:CPU has no kernel to run (``interpret``: Pallas' TPU interpreter instead,
  ``pallas.tpu.InterpretParams()``, which runs the kernel's code on CPU: tests)."""
  # lazy: import cost: the TPU Pallas kernel (0.7 s to import), only when splash runs
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top
  b, t, n, h = q.shape
  size = -(-t // _SPLASH_BLOCK) * _SPLASH_BLOCK
  kernel = _splash_kernel(size, mask.window, n, interpret)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, size - t)) + ((0, 0),) * (x.ndim - 2))
  heads = lambda x: jnp.swapaxes(pad(x), 1, 2)  # [B, heads, T', H]: the kernel's layout per row
  scale = jnp.asarray(1.0 / math.sqrt(scale_dim or h), q.dtype)
  args = (heads(q * scale), heads(k), heads(v), pad(mask.ids))

  def rows(q, k, v, ids):
    return jax.vmap(lambda *a: kernel(*a[:3], segment_ids=splash.SegmentIds(a[3], a[3])))(
        q, k, v, ids)

  if kernel_mesh is not None:
    specs = tuple(kernel_mesh.spec(x, ('activation_batch',) + (None,) * (x.ndim - 1))
                  for x in args)
    rows = jax.shard_map(rows, mesh=kernel_mesh.mesh, in_specs=specs, out_specs=specs[0],
                         check_vma=False)
  return jnp.swapaxes(rows(*args), 1, 2)[:, :t]


# -- memory-efficient attention in pure JAX (model.attention='flash'; issue 47) ---------------------
# FlashAttention's algorithm (Dao et al. 2022, arXiv:2205.14135; FlashAttention-2, Dao 2023,
# arXiv:2307.08691) written with jnp, so every backend compiles it: the forward walks the keys in
# blocks of FLASH_BLOCK with an online softmax (a running max, sum and weighted values), and a
# ``jax.custom_vjp`` keeps for the backward only q, k, v, the mask, the output and each query's
# softmax max and sum (its logsumexp in two parts: max + log(sum) rounds to the max in float32
# for a query that attends to nothing, whose scores are all float32's lowest), then recomputes each block's probabilities from them. No [B, N, T, S] score or
# probability tensor is kept per layer (the einsum's is 4 B x N x T x S bytes: 1.2 GB per layer of
# issue 47's 0.4B model at B = 64, T = 576) nor built at once (one [B, N, T, FLASH_BLOCK] block
# at a time). The arithmetic is the einsum's: float32 scores divided by sqrt(scale_dim), masked
# with float32's lowest value (a query with no key attends to all S keys evenly, as the einsum's
# softmax does), probabilities cast to v's dtype for the value product; only the order of the
# softmax's sums differs (float32 rounding). It runs every query against every key block (the
# mask is data, so no block is skipped): the einsum's FLOPs, not causal FlashAttention's half.
FLASH_BLOCK = 128  # keys per block of the 'flash' attention


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    scale_dim: Optional[float] = None, block: int = FLASH_BLOCK) -> jax.Array:
  """``einsum_attention``'s values (q [B, T, N, H]; k, v [B, S, K, H]; mask [B, T, S] bool;
  GQA; scale_dim) computed over key blocks of ``block`` with an online softmax, its gradient
  recomputed blockwise (``jax.custom_vjp``); see the comment above."""
  return _flash(q, k, v, mask, float(scale_dim or q.shape[-1]), int(block))


def _flash_blocks(k, v, mask, block):
  """Keys, values and mask cut into blocks along S (padded to a multiple of ``block``): k, v
  [nb, B, blk, K, H], mask [nb, B, T, blk], and a [nb, blk] bool that is False on the padding
  (keys that exist in no row: weight exactly 0, even for a query that attends to nothing)."""
  s = k.shape[1]
  blk = min(block, s)
  nb = -(-s // blk)
  pad = nb * blk - s
  cut = lambda x, axis: jnp.moveaxis(
      jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)]).reshape(
          x.shape[:axis] + (nb, blk) + x.shape[axis + 1:]), axis, 0)
  real = (jnp.arange(nb * blk) < s).reshape(nb, blk)
  return cut(k, 1), cut(v, 1), cut(mask, 2), real


def _flash_scores(q, kb, mb, real, scale):
  """One block's float32 scores [B, K, G, T, blk], masked as the einsum masks (float32's lowest
  value), the padding keys at -inf. q: [B, T, K, G, H]."""
  logits = jnp.einsum('BTKGH,BSKH->BKGTS', q, kb, preferred_element_type=jnp.float32) / scale
  logits = jnp.where(mb[:, None, None], logits, jnp.finfo(jnp.float32).min)
  return jnp.where(real, logits, -jnp.inf)


def _flash_forward(q, k, v, mask, scale_dim, block):
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, t, kv_heads, n // kv_heads, h)  # q head i uses kv head i // (N/K), as HF
  scale = np.sqrt(scale_dim).astype(np.float32)
  kb, vb, mb, real = _flash_blocks(k, v, mask, block)

  def body(carry, xs):
    top, total, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H]
    kj, vj, mj, rj = xs
    logits = _flash_scores(qg, kj, mj, rj, scale)
    new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
    p = jnp.exp(logits - new_top[..., None])
    fix = jnp.exp(top - new_top)
    acc = acc * fix[..., None] + jnp.einsum('BKGTS,BSKH->BKGTH', p.astype(v.dtype), vj,
                                            preferred_element_type=jnp.float32)
    return (new_top, total * fix + jnp.sum(p, axis=-1), acc), None

  low = jnp.full((b, kv_heads, n // kv_heads, t), jnp.finfo(jnp.float32).min, jnp.float32)
  (top, total, acc), _ = jax.lax.scan(
      body, (low, jnp.zeros_like(low), jnp.zeros(low.shape + (h,), jnp.float32)),
      (kb, vb, mb, real))
  out = (acc / total[..., None]).astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
  return out, (top, total)  # the output and each query's softmax max and sum [B, K, G, T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, mask, scale_dim, block):
  return _flash_forward(q, k, v, mask, scale_dim, block)[0]


def _flash_fwd(q, k, v, mask, scale_dim, block):
  out, stats = _flash_forward(q, k, v, mask, scale_dim, block)
  return out, (q, k, v, mask, out, stats)


def _flash_bwd(scale_dim, block, res, d_out):
  """FlashAttention-2's backward (Algorithm 2): per key block, P = exp(S - max) / sum,
  dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ += dS K, dK = dS^T Q (the
  1/sqrt(scale_dim) applied to dQ and dK)."""
  q, k, v, mask, out, (top, total) = res
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  g = n // kv_heads
  qg = q.reshape(b, t, kv_heads, g, h)
  dog = d_out.reshape(b, t, kv_heads, g, h)
  scale = np.sqrt(scale_dim).astype(np.float32)
  kb, vb, mb, real = _flash_blocks(k, v, mask, block)
  # rowsum(dO * O) [B, K, G, T], float32
  delta = jnp.einsum('BTKGH,BTKGH->BKGT', dog.astype(jnp.float32),
                     out.reshape(b, t, kv_heads, g, h).astype(jnp.float32))

  inv = 1.0 / total

  def body(dq, xs):
    kj, vj, mj, rj = xs
    p = jnp.exp(_flash_scores(qg, kj, mj, rj, scale) - top[..., None]) * inv[..., None]
    dv = jnp.einsum('BKGTS,BTKGH->BSKH', p.astype(v.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum('BTKGH,BSKH->BKGTS', dog, vj, preferred_element_type=jnp.float32)
    # masked scores are constants (the einsum's jnp.where): no gradient to q or k through them
    ds = jnp.where(mj[:, None, None], p * (dp - delta[..., None]) / scale, 0.0).astype(q.dtype)
    dq = dq + jnp.einsum('BKGTS,BSKH->BTKGH', ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum('BKGTS,BTKGH->BSKH', ds, qg, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32), (kb, vb, mb, real))
  whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, kv_heads, h)[:, :s]  # blocks -> [B, S]
  return (dq.reshape(b, t, n, h).astype(q.dtype), whole(dk).astype(k.dtype),
          whole(dv).astype(v.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_after_prefix(q: jax.Array, prefix_kv: tuple[jax.Array, jax.Array],
                                 prefix_valid: jax.Array, k: jax.Array, v: jax.Array,
                                 mask: jax.Array, scale_dim: Optional[float] = None) -> jax.Array:
  """``attention_after_prefix`` (same arguments and values) by ``flash_attention``: each row's
  keys are its prefix's (repeated for its R rows: [B, S, K, H], small with few KV heads) then its
  own, in the unshared sequence's order, under one [B, T, S + T] mask; the repeat's backward sums
  the prefix's key and value gradients over the R rows, as ``attention_after_prefix``'s does."""
  b, t = q.shape[:2]
  pk, pv = prefix_kv
  p, s = pk.shape[:2]
  r = b // p
  seen = (jnp.broadcast_to(prefix_valid[:, None, None, :], (p, r, t, s)) if prefix_valid.ndim == 2
          else prefix_valid).reshape(b, t, s)
  keys = jnp.concatenate([jnp.repeat(pk, r, axis=0), k], axis=1)
  values = jnp.concatenate([jnp.repeat(pv, r, axis=0), v], axis=1)
  return flash_attention(q, keys, values, jnp.concatenate([seen, mask], axis=-1), scale_dim)


# -- attention over the filled part of a KV cache (issue 36) ---------------------------------------
# The cache is preallocated for the whole prompt + completion, but at decode step i only the first
# Tp + i slots hold tokens. Attending over all S slots made every step pay for the maximum length
# (at 128 completion tokens the tiny model's cache reads already exceeded its weights). Instead
# the slots are cut into blocks and the step loops over the blocks that hold a token (a
# ``fori_loop`` bound by the filled length) with an online softmax (a running max, sum and
# weighted values; Milakov & Gimelshein 2018, arXiv:1805.02867, as FlashAttention does): each
# block is a dynamic slice read in place. The skipped slots are masked out anyway (their softmax
# weight is exactly 0), so the values are full attention's up to float32 rounding. Two
# alternatives were slower on XLA:CPU: a ``lax.switch`` over static prefixes of the cache, and a
# static slice, both copied the whole cache at every layer (its layout or the conditional's
# operand), so their cost still grew with S.
DECODE_BLOCK = 64  # cache slots per block of the decode attention (0: always the whole cache)
# On a GPU the loop costs more than the slots it skips: XLA:GPU runs a while loop whose trip
# count is computed on the device by copying its condition to the host at every iteration (every
# block of every layer of every decode step), each block's few small ops are kernels of their own,
# and the whole cache streams fast (the 0.4B shape of issue 47, 64 rows and 576 slots in bfloat16:
# 19 MB per layer, 4 us at 4.8 TB/s). There the decode step attends over the whole cache at once
# (masked slots weigh exactly 0, as in the loop); the platforms of ``lax.platform_dependent``.
WHOLE_CACHE_PLATFORMS = ('cuda', 'rocm')


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    attend: Any = None, scale_dim: Optional[float] = None
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """``einsum_attention`` of q [B, T, N, H] over a cache k, v [B, K, S, H] (mask [B, T, S]) reading
  only its first slots: ``attend`` None reads all S; a Python int n the static first n (the
  prefill: its T tokens); a pair (filled, block) with ``filled`` traced (the slots written, the
  decode step's) the blocks of ``block`` slots up to the one that covers it. Slots
  past those read must be masked out (they hold no token of the row). Returns the attention
  [B, T, N, H] and the cache (k, v), to be used in place of the one passed in. ``scale_dim``:
  as ``einsum_attention``'s."""
  def over(n):
    dt = q.dtype
    return einsum_attention(q, k[:, :, :n].astype(dt), v[:, :, :n].astype(dt), mask[..., :n],
                      heads_first=True, scale_dim=scale_dim), (k, v)

  if attend is None or isinstance(attend, int):
    return over(k.shape[2] if attend is None else attend)
  filled, block = attend
  if block <= 0 or block >= k.shape[2]:  # one block: the whole cache, no loop
    return over(k.shape[2])
  # The loop on CPU and TPU; on GPUs one attention over the whole cache (WHOLE_CACHE_PLATFORMS).
  whole = lambda q, k, v, mask, filled: over(k.shape[2])
  blocked = lambda q, k, v, mask, filled: blocked_attention(q, k, v, mask, filled, block,
                                                            scale_dim)
  return jax.lax.platform_dependent(q, k, v, mask, filled, default=blocked,
                                    **{p: whole for p in WHOLE_CACHE_PLATFORMS})


def blocked_attention(q, k, v, mask, filled, block: int, scale_dim: Optional[float] = None
                     ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """Online softmax over the cache's blocks 0 .. ceil(filled / block) - 1 (a fori_loop)."""
  b, t, n, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)
  scale = np.sqrt(scale_dim or h).astype(np.float32)

  def body(i, carry):
    top, total, acc, k, v = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H], the cache
    start = jnp.minimum(i * block, s - block)  # the last block may overlap the one before
    kb = jax.lax.dynamic_slice_in_dim(k, start, block, 2).astype(q.dtype)  # [B, K, blk, H]
    vb = jax.lax.dynamic_slice_in_dim(v, start, block, 2).astype(q.dtype)
    mb = jax.lax.dynamic_slice_in_dim(mask, start, block, 2)  # [B, T, blk]
    mb = mb & (start + jnp.arange(block) >= i * block)  # slots of the earlier block: done
    logits = jnp.einsum('BTKGH,BKSH->BKGTS', q, kb, preferred_element_type=jnp.float32) / scale
    keep = mb[:, None, None]
    new_top = jnp.maximum(top, jnp.max(jnp.where(keep, logits, -jnp.inf), axis=-1))
    p = jnp.where(keep, jnp.exp(logits - new_top[..., None]), 0.0)
    fix = jnp.exp(top - new_top)
    acc = acc * fix[..., None] + jnp.einsum('BKGTS,BKSH->BKGTH', p.astype(vb.dtype), vb,
                                            preferred_element_type=jnp.float32)
    return new_top, total * fix + jnp.sum(p, axis=-1), acc, k, v

  low = jnp.full((b, kv_heads, n // kv_heads, t), jnp.finfo(jnp.float32).min, jnp.float32)
  init = (low, jnp.zeros_like(low), jnp.zeros(low.shape + (h,), jnp.float32), k, v)
  blocks = jnp.minimum((filled + block - 1) // block, -(-s // block))
  # The cache goes through the loop as a carry and is taken from its result: captured as a
  # constant instead, XLA copied the whole cache at every layer to keep it for after the loop.
  _, total, acc, k, v = jax.lax.fori_loop(0, blocks, body, init)
  out = (acc / total[..., None]).astype(q.dtype)  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), (k, v)


def attention_after_prefix(q: jax.Array, prefix_kv: tuple[jax.Array, jax.Array],
                           prefix_valid: jax.Array, k: jax.Array, v: jax.Array,
                           mask: jax.Array, scale_dim: Optional[float] = None,
                           attention: str = 'einsum') -> jax.Array:
  """Grouped-query attention of a suffix over a shared prefix and itself: ``einsum_attention``
  over the keys [prefix; suffix] without repeating the prefix for every row; with ``attention``
  'cudnn', ``cudnn_attention`` over those keys with the prefix's repeated for its R rows (k and
  v only, [B, S, K, H]: no kernel takes keys shared by rows); 'flash'
  ``flash_attention_after_prefix``; the others the einsum.

  q: [B, T, N, H] suffix queries, rows ``i*R .. i*R+R-1`` sharing prefix row i; prefix_kv: k, v
  [P, S, K, H] with B = P*R; prefix_valid: [P, S] bool (every suffix position sees every valid
  prefix slot), or [P, R, T, S] (a sliding window); k, v: [B, T, K, H] the suffix's own; mask:
  [B, T, T] bool (suffix to suffix); scale_dim as ``einsum_attention``'s.
  The logits against the prefix broadcast over the R rows (no copy); in the backward the prefix's
  key and value gradients sum over them. One softmax over both parts, the keys in the order of the
  unshared sequence, so the values are ``einsum_attention``'s on the concatenated rows.
  """
  if attention in ('flash', 'splash'):  # no kernel takes keys shared by rows: flash for splash
    return flash_attention_after_prefix(q, prefix_kv, prefix_valid, k, v, mask, scale_dim)
  b, t, n, h = q.shape
  pk, pv = prefix_kv
  p, s, kv_heads, _ = pk.shape
  r = b // p
  if attention == 'cudnn':
    seen = (jnp.broadcast_to(prefix_valid[:, None, None, :], (p, r, t, s)) if prefix_valid.ndim == 2
            else prefix_valid).reshape(b, t, s)
    rows = lambda prefix, own: jnp.concatenate([jnp.repeat(prefix, r, axis=0), own], axis=1)
    return cudnn_attention(q, rows(pk, k), rows(pv, v), jnp.concatenate([seen, mask], -1),
                           scale_dim)
  q = q.reshape(p, r, t, kv_heads, n // kv_heads, h)  # q head i uses kv head i // (N/K), as HF
  scale = np.sqrt(scale_dim or h).astype(np.float32)
  on_prefix = jnp.einsum('PRTKGH,PSKH->PRKGTS', q, pk, preferred_element_type=jnp.float32) / scale
  seen = (prefix_valid[:, None, None, None, None, :] if prefix_valid.ndim == 2
          else prefix_valid[:, :, None, None, :, :])
  on_prefix = jnp.where(seen, on_prefix, jnp.finfo(jnp.float32).min)
  on_self = jnp.einsum('BTKGH,BSKH->BKGTS', q.reshape(b, t, kv_heads, n // kv_heads, h), k,
                       preferred_element_type=jnp.float32) / scale
  on_self = jnp.where(mask[:, None, None, :, :], on_self, jnp.finfo(jnp.float32).min)
  logits = jnp.concatenate([on_prefix, on_self.reshape(on_prefix.shape[:-1] + (t,))], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [P, R, K, G, T, S + T]
  from_self = jnp.einsum('BKGTS,BSKH->BTKGH', probs[..., s:].reshape(b, *probs.shape[2:-1], t), v)
  out = jnp.einsum('PRKGTS,PSKH->PRTKGH', probs[..., :s], pv).reshape(from_self.shape) + from_self
  return out.reshape(b, t, n, h)
