"""Autoregressive sampling: one prefill of the prompts, then a ``lax.while_loop`` of decode steps.

``generate`` is a pure, traceable function (the rollout step calls it inside its own jit);
``make_generate_fn`` jits it on its own, optionally with mesh shardings.

Per row of a left-padded prompt batch [N, Tp]:

  * the prompts run through ``model.prefill`` once; completion token 0 is sampled from its logits;
  * each loop iteration feeds the previous token to ``model.decode`` and samples the next one; the
    loop runs while ``step < max_completion_length`` and some row has not finished;
  * a row finishes when it samples ``eos_id`` (or one of ``more_eos_ids``): the EOS is kept
    (mask 1), every later position is ``pad_id`` with mask 0. Rows that finished keep being
    decoded (fed pad) until the whole batch is done, but their outputs are discarded; when every
    row has finished the loop exits early and the remaining positions stay pad / mask 0.

Sampling distribution (the order HF's logits warpers use): ``logits / temperature``, then top-k
(keep tokens whose scaled logit is >= the k-th largest; ties at the threshold are kept), then
top-p on the renormalized result (sort descending, keep a token iff the probability mass strictly
before it is < top_p, so the most likely token is always kept; top_p >= 1 keeps everything).
Dropped tokens get logit -inf; what is left is sampled as ``jax.random.categorical`` does
(the Gumbel-max trick, the same draws for the same key).

Log-probs: ``Completions.logps`` is ``log_softmax(logits / temperature)[token]``, the log-prob of
the token under the tempered but untruncated softmax, 0 at masked positions, whatever top-k / top-p
truncation chose the token. That is what ``logprobs.completion_logps`` computes (with the same
temperature), so with ``old_logprob_source='sampler'`` every importance ratio compares like with
like; the truncated distribution's log-prob would differ from it by log(kept mass) per token and
bias every ratio.

Greedy (``greedy=True``, static): the token is the argmax of the raw logits (temperature, top-k and
top-p cannot change the argmax); ``logps`` are still the log-probs of those tokens under the
tempered softmax (not the degenerate 0 of a point mass), so greedy and sampled rollouts report
comparable numbers.

RNG: completion position ``s`` uses ``fold_in(rng, s)``; with chunking, chunk ``j`` first derives
``fold_in(rng, j)``. Chunked and unchunked sampling therefore draw different (equally valid) random
tokens; greedy tokens are identical.

Chunking (``Sampler.chunk_size``, the rollout micro-batch): rows are generated ``chunk_size`` at a
time under ``lax.map`` to bound the KV cache. Chunk ``j`` holds rows ``j, j + C, j + 2C, ...``
(C = N / chunk_size chunks), so a batch sharded over the data-parallel mesh axes gives every
device an equal share of every chunk; outputs are returned in the original row order.

Shared prompts (``generate(share=R)``, GRPO's G completions of one prompt): N / R prompts are
prefilled once each and every prompt's logits and KV cache are repeated for its R rows, which
then decode as any other rows; chunks then hold prompts ``j, j + C, ...`` with their R rows.

Filled cache (``Sampler.decode_block``): the KV cache has slots for the prompt and every
completion token, but each decode step attends only over the blocks written so far
(``Transformer.decode``): a step's attention costs what the tokens generated so far cost,
not what the maximum length costs. The values are those of the whole cache's attention (its other
slots are masked out) up to float32 summation order. On GPUs the step reads the whole cache at
once instead (``attention.WHOLE_CACHE_PLATFORMS``).

The decode step's weights (``Transformer.decode_layers``) are prepared once per call, before the
loop: LoRA adapters folded in, cast to model.dtype, and off the CPU q/k/v and gate/up fused into
one product each (``Sampler.fuse_weights``). On GPUs the programs that decode compile with XLA's
command buffers (``GPU_COMPILER_OPTIONS``, ``compiler_options``), so the loop body launches as one
graph.

Slot pool (``Sampler.slots`` = P > 0; ``sampling.decode_slots``): the batched loop above holds
every row of a batch until its longest row ends, so one long reply costs a whole batch of decode
steps. The pool decodes the N rows in P slots instead. Every prompt is prefilled once (its KV
and the logits of token 0 kept); a free slot takes the next row of the queue (rows 0, 1, ..., N-1
in order), copies its prompt's KV into its cache, draws token 0 from the prompt's logits, and
then decodes one token per loop iteration until the row ends (EOS or L tokens); the slot is then
free again. Each slot writes its own cache slot (``KVCache.index`` per row). The rollout takes
about (its tokens / P) iterations instead of (longest reply x batches). Outputs are in row order,
the same arrays as the batched loop's; ``num_decode_steps`` is the pool's iterations plus one.
RNG: row i's completion position s draws with ``fold_in(fold_in(rng, i), s)`` (``row_keys``), a
[V] draw of its own, so a completion depends on its row index only, never on the slot or step it
ran in (nor on P); this is another (equally valid) stream than the batched loop's. Greedy tokens
are the batched loop's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_ga import sharding as shd
from jaxrl_ga.config import SamplingConfig
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models import transformer as tfm


# The id that ends a generated row, or several (``Sampler.from_config``'s ``eos_id``).
EosIds = Union[int, Sequence[int]]


def eos_fields(eos_id: EosIds) -> dict[str, Any]:
  """``Sampler``'s ``eos_id`` and ``more_eos_ids`` of one id or several (the first is
  ``eos_id``)."""
  first, *more = ([int(i) for i in eos_id] if isinstance(eos_id, (list, tuple))
                  else [int(eos_id)])
  return {'eos_id': first, 'more_eos_ids': tuple(more)}


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Static sampling settings (hashable: part of the compiled program).

  Attributes:
    max_completion_length: L, generated positions per row.
    eos_id: a row stops after sampling this token (an id outside the vocabulary never stops).
    more_eos_ids: further ids that stop a row as ``eos_id`` does (the model's generation config's
      eos ids besides the tokenizer's, as TRL 1.16 and transformers' ``generate`` stop).
    pad_id: written at every position after a row's EOS (and after an early exit).
    top_k: keep the k most likely tokens; 0 disables.
    chunk_size: generate this many rows at a time (must divide the batch); 0 = all at once.
      Unused with ``slots``.
    slots: 0 decodes the rows in batches (``chunk_size``), each until its last row finishes; > 0
      decodes them in a pool of this many slots, each refilled with the next row as soon as its
      row finishes (see "Slot pool" in the module docstring).
    decode_block: cache slots per block of the decode attention, which reads the blocks written
      so far (``Transformer.decode``); 0 reads the whole cache at every step, as GPUs always do
      (``attention.WHOLE_CACHE_PLATFORMS``).
    attention: the prefill's attention (``Transformer.prefill``; one of
      ``attention.ATTENTION_IMPLS``: model.attention as resolved, set by the rollout engine from
      its forward options); the decode steps keep their own.
    fuse_weights: the decode loop's q/k/v and gate/up weights concatenated into one product each
      (``Transformer.decode_layers(fuse=True)``); None: fused unless jax's default backend is
      the CPU, where the fused products measured slower (BENCHMARKS.md, issue 47). The rollout
      engine sets it from its mesh's devices.
    activation_mesh: the mesh (a ``sharding.KernelMesh``) on which the prefill's and the decode
      steps' activations get sharding constraints (``ForwardOptions.activation_mesh``); None:
      none. The rollout engine sets its mesh's; ``make_decode_step`` its own.
  """
  max_completion_length: int
  eos_id: int
  pad_id: int
  more_eos_ids: tuple[int, ...] = ()
  top_k: int = 0
  chunk_size: int = 0
  slots: int = 0
  decode_block: int = attn_lib.DECODE_BLOCK
  attention: str = 'einsum'
  fuse_weights: Optional[bool] = None
  activation_mesh: Any = None

  def __post_init__(self):
    attn_lib.check_attention(self.attention)
    for name in dataclasses.fields(self):
      if name.name in ('attention', 'fuse_weights', 'activation_mesh'):
        continue
      if name.name == 'more_eos_ids':
        if not isinstance(self.more_eos_ids, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.more_eos_ids):
          raise ValueError(f'Sampler.more_eos_ids must be a tuple of ints, got '
                           f'{self.more_eos_ids!r}.')
        continue
      value = getattr(self, name.name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'Sampler.{name.name} must be an int, got {value!r}.')
    if self.max_completion_length < 1:
      raise ValueError(f'Sampler.max_completion_length must be >= 1, got '
                       f'{self.max_completion_length}.')
    if self.top_k < 0:
      raise ValueError(f'Sampler.top_k must be >= 0 (0 disables), got {self.top_k}.')
    if self.chunk_size < 0:
      raise ValueError(f'Sampler.chunk_size must be >= 0 (0: all rows at once), got '
                       f'{self.chunk_size}.')
    if self.fuse_weights not in (None, True, False):
      raise ValueError(f'Sampler.fuse_weights must be None, True or False, got '
                       f'{self.fuse_weights!r}.')
    if self.slots < 0 or self.decode_block < 0:
      raise ValueError(f'Sampler.slots and decode_block must be >= 0 (0: off), got '
                       f'{self.slots} and {self.decode_block}.')

  @classmethod
  def from_config(cls, cfg: SamplingConfig, *, eos_id: EosIds, pad_id: int,
                  attention: str = 'einsum', fuse_weights: Optional[bool] = None,
                  activation_mesh: Any = None) -> 'Sampler':
    """The static part of a ``SamplingConfig``; pass its temperature / top_p at call time.
    ``eos_id``: the id that stops a row, or a sequence of them (the first is ``eos_id``, the
    others ``more_eos_ids``: ``RunContext.stop_ids``). ``attention``: the prefill's (the forward
    options'); ``fuse_weights``, ``activation_mesh``: as the fields."""
    return cls(max_completion_length=int(cfg.max_completion_length), **eos_fields(eos_id),
               pad_id=int(pad_id), top_k=int(cfg.top_k),
               chunk_size=int(cfg.rollout_micro_batch_size), slots=int(cfg.decode_slots),
               attention=attention, fuse_weights=fuse_weights, activation_mesh=activation_mesh)

  def is_eos(self, token: jax.Array) -> jax.Array:
    """Whether ``token`` (any shape) stops a row: ``eos_id`` or one of ``more_eos_ids``."""
    hit = token == self.eos_id
    for other in self.more_eos_ids:
      hit = hit | (token == other)
    return hit

  def decode_layers(self, model: tfm.Transformer) -> list[dict[str, jax.Array]]:
    """The decode loop's weights (``Transformer.decode_layers``), fused as ``fuse_weights``
    says."""
    fuse = self.fuse_weights
    return model.decode_layers(fuse=jax.default_backend() != 'cpu' if fuse is None else fuse)


@flax.struct.dataclass
class Completions:
  """Generated completions, right-padded. N rows, Tc = max_completion_length."""
  tokens: jax.Array  # [N, Tc] int32: pad_id after EOS (EOS itself kept)
  mask: jax.Array  # [N, Tc] int32: 1 for generated tokens up to and including EOS
  ended_with_eos: jax.Array  # [N] bool: False if truncated at max_completion_length
  logps: jax.Array  # [N, Tc] float32: log-prob under softmax(logits / T), untruncated; 0 at mask 0
  # [] int32: completion positions the loop generated (the prefill's one plus one per decode
  # iteration); max_completion_length unless every row stopped early. Max over chunks.
  num_decode_steps: jax.Array


@flax.struct.dataclass
class SamplingState:
  """The decode loop's carry."""
  step: jax.Array  # [] int32: next completion position to fill
  last_token: jax.Array  # [B] int32: token written at step - 1 (pad for finished rows)
  done: jax.Array  # [B] bool: row has emitted EOS
  tokens: jax.Array  # [B, L] int32
  mask: jax.Array  # [B, L] int32
  logps: jax.Array  # [B, L] float32
  cache: attn_lib.KVCache


# -- the sampling distribution -------------------------------------------------------------------
def warp_logits(logits: jax.Array, temperature, top_p, top_k: int = 0) -> jax.Array:
  """The (unnormalized) log-weights actually sampled from. logits [B, V] -> [B, V] float32.

  ``logits / temperature`` with tokens outside the top-k (those tied with the k-th are in it)
  and outside the top-p nucleus (of the renormalized top-k distribution, ties included) set to
  -inf. ``temperature`` and ``top_p`` may be traced.
  """
  x = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)  # [B, V]
  top_p = jnp.asarray(top_p, jnp.float32)
  vocab = x.shape[-1]
  if 0 < top_k < vocab:
    sorted_desc = jax.lax.top_k(x, top_k)[0]  # [B, k]
    x = jnp.where(x >= sorted_desc[:, -1:], x, -jnp.inf)

    def nucleus(x):
      # Tokens tied with the k-th are kept too (as transformers' TopKLogitsWarper): beyond the
      # k values, they weigh in the renormalized mass.
      ties = jnp.sum(jnp.isfinite(x), axis=-1, keepdims=True) - top_k  # [B, 1]
      return _top_p(x, sorted_desc, top_p, ties)
  else:

    def nucleus(x):  # only paid for when top-p is on
      return _top_p_full_vocab(x, top_p)
  return jax.lax.cond(top_p < 1.0, nucleus, lambda x: x, x)


def _top_p(x: jax.Array, sorted_desc: jax.Array, top_p: jax.Array,
           ties: Optional[jax.Array] = None) -> jax.Array:
  """x [B, V]; sorted_desc [B, K]: the candidates' logits, descending (K <= V); ``ties``
  [B, 1]: candidates beyond the K, each with the K-th's logit."""
  weights = jnp.exp(sorted_desc - sorted_desc[:, :1])  # [B, K]
  total = jnp.sum(weights, axis=-1, keepdims=True)
  if ties is not None:
    total = total + ties.astype(weights.dtype) * weights[:, -1:]
  probs = weights / total
  mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, K]
  keep = mass_before < top_p
  keep = keep.at[:, 0].set(True)
  threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
  return jnp.where(x >= threshold, x, -jnp.inf)


def _ordered_key(x: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (-0.0 and 0.0 mapped to one key)."""
  x = jnp.where(x == 0, jnp.zeros_like(x), x)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _top_p_full_vocab(x: jax.Array, top_p: jax.Array) -> jax.Array:
  """_top_p over the whole vocabulary without sorting it. x [B, V].

  The nucleus threshold (the smallest logit _top_p keeps) is the largest logit value v with
  mass(x >= v) >= top_p. A bisection over the 2^32 float32 values, in their order-preserving
  uint32 encoding, finds it in 32 masked sums over [B, V]: 20x faster than XLA:CPU's sort of a
  32000-token vocabulary (3 vs 58 ms for 8 rows). Ties with the threshold are kept, as _top_p
  does; only float32 rounding of the mass near top_p can differ from a sorted cumulative sum
  (tests/test_sampling.py checks against a float64 sorted reference).
  """
  probs = jax.nn.softmax(x, axis=-1)
  key = _ordered_key(x)

  def halve(_, bounds):  # invariant: mass(key >= lo) >= top_p; the answer is in [lo, hi]
    lo, hi = bounds
    mid = hi - (hi - lo) // 2  # the upper middle, without overflow
    ok = jnp.sum(jnp.where(key >= mid[:, None], probs, 0.0), axis=-1) >= top_p
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.min(key, axis=-1), jnp.max(key, axis=-1)))
  return jnp.where(key >= lo[:, None], x, -jnp.inf)


def _argmax(x: jax.Array) -> jax.Array:
  """``jnp.argmax(x, axis=-1)`` for x [B, V] (the first index of the maximum; the first NaN if
  there is one) as two plain reductions, a max and a min over indices. XLA:CPU runs argmax's
  single (value, index) reduction element by element: 7 ms per decode step over SmolLM2's
  49,152-token vocabulary at 8 rows, 8% of the step (BENCHMARKS.md, issue 15)."""
  top = jnp.max(x, axis=-1, keepdims=True)
  hit = (x == top) | jnp.isnan(x)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _choose(logits, key, temperature, top_p, top_k: int, greedy: bool):
  """logits [B, V] -> (token [B] int32, its log-prob under the tempered, untruncated softmax
  [B]): the token is drawn from the warped distribution, its log-prob is the learner's.
  ``key``: one key for the [B, V] draw, or keys [B], one per row's [V] draw; typed keys
  (``jax.random.key``) or raw uint32 key data (``jax.random.PRNGKey``: the same draws)."""
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)  # raw [2] data is one key, not two rows' keys
  if greedy:
    token = _argmax(logits)
  else:  # jax.random.categorical's Gumbel-max, with the faster argmax
    warped = warp_logits(logits, temperature, top_p, top_k)
    if key.ndim:
      noise = jax.vmap(lambda k: jax.random.gumbel(k, warped.shape[1:], warped.dtype))(key)
    else:
      noise = jax.random.gumbel(key, warped.shape, warped.dtype)
    token = _argmax(warped + noise)
  token = token.astype(jnp.int32)
  scaled = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)  # [B, V]
  chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
  return token, chosen - jax.nn.logsumexp(scaled, axis=-1)


# -- generation ----------------------------------------------------------------------------------
def _write(state: SamplingState, sampled, logp, sampler: Sampler) -> SamplingState:
  """Writes position ``state.step`` (pad / mask 0 for rows already done) and advances it."""
  active = ~state.done  # [B]
  token = jnp.where(active, sampled, sampler.pad_id).astype(jnp.int32)

  def put(buf, col):  # buf [B, L], col [B]
    return jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), state.step, 1)

  return state.replace(
      step=state.step + 1,
      last_token=token,
      done=state.done | (active & sampler.is_eos(sampled)),
      tokens=put(state.tokens, token),
      mask=put(state.mask, active.astype(jnp.int32)),
      logps=put(state.logps, jnp.where(active, logp, 0.0)))


def _rows_carry(model: tfm.Transformer, prompt_tokens, prompt_mask, rng, sampler: Sampler,
                temperature, top_p, greedy: bool, share: int):
  """The batched decode loop's start: prefill (each prompt once) and token 0. -> (the loop's
  weights, ``decode_layers``; its carry, a SamplingState)."""
  n, tp = prompt_tokens.shape
  b = n * share
  length = sampler.max_completion_length
  # Slots for the prompt and every fed-back token (the last sampled token is never decoded).
  logits, cache = model.prefill(prompt_tokens, prompt_mask, cache_length=tp + length - 1,
                                attention=sampler.attention,
                                activation_mesh=sampler.activation_mesh)
  if share > 1:  # prompt i's logits and cache for rows i*share .. i*share+share-1
    rows = lambda x, axis: jnp.repeat(x, share, axis=axis)
    logits = rows(logits, 0)
    cache = cache.replace(k=rows(cache.k, 1), v=rows(cache.v, 1), valid=rows(cache.valid, 0),
                          positions=rows(cache.positions, 0))
  # Sliced, fused and cast once here, not at every token inside the loop
  # (Transformer.unstacked_layers, decode_layers).
  layers, cache = sampler.decode_layers(model), cache.per_layer()
  state = SamplingState(
      step=jnp.zeros((), jnp.int32),
      last_token=jnp.full((b,), sampler.pad_id, jnp.int32),
      done=jnp.zeros((b,), bool),
      tokens=jnp.full((b, length), sampler.pad_id, jnp.int32),
      mask=jnp.zeros((b, length), jnp.int32),
      logps=jnp.zeros((b, length), jnp.float32),
      cache=cache)
  token, logp = _choose(logits, jax.random.fold_in(rng, 0), temperature, top_p, sampler.top_k,
                        greedy)
  return layers, _write(state, token, logp, sampler)


def _rows_step(model: tfm.Transformer, layers, state: SamplingState, rng, sampler: Sampler,
               temperature, top_p, greedy: bool) -> SamplingState:
  """One iteration of the batched decode loop: decode the last tokens, draw and write the next."""
  logits, cache = model.decode(state.last_token, state.cache, layers, sampler.decode_block,
                               sampler.activation_mesh)  # [B, V]
  token, logp = _choose(logits, jax.random.fold_in(rng, state.step), temperature, top_p,
                        sampler.top_k, greedy)
  return _write(state.replace(cache=cache), token, logp, sampler)


def _generate_rows(model: tfm.Transformer, prompt_tokens, prompt_mask, rng, sampler: Sampler,
                   temperature, top_p, greedy: bool, share: int) -> Completions:
  """All rows at once: prefill (each prompt once), first token, then the while-loop decode."""
  length = sampler.max_completion_length
  layers, state = _rows_carry(model, prompt_tokens, prompt_mask, rng, sampler, temperature,
                              top_p, greedy, share)

  def cond(state: SamplingState):
    return (state.step < length) & ~jnp.all(state.done)

  def body(state: SamplingState):
    return _rows_step(model, layers, state, rng, sampler, temperature, top_p, greedy)

  state = jax.lax.while_loop(cond, body, state)
  return Completions(tokens=state.tokens, mask=state.mask, ended_with_eos=state.done,
                     logps=state.logps, num_decode_steps=state.step)


# -- the slot pool -------------------------------------------------------------------------------
@flax.struct.dataclass
class PoolState:
  """The slot pool's carry. P slots, N rows, L = max_completion_length."""
  steps: jax.Array  # [] int32: decode iterations so far
  next_row: jax.Array  # [] int32: the queue's head, the next row to start
  row: jax.Array  # [P] int32: the row in each slot (N: none)
  position: jax.Array  # [P] int32: the row's completion positions written
  active: jax.Array  # [P] bool: the slot holds a row that has not finished
  last_token: jax.Array  # [P] int32
  tokens: jax.Array  # [N, L] int32
  mask: jax.Array  # [N, L] int32
  logps: jax.Array  # [N, L] float32
  ended: jax.Array  # [N] bool
  cache: attn_lib.KVCache  # P rows, each with its own write slot (index [P])


def row_keys(rng: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
  """The slot pool's draws: row ``i``'s completion position ``s`` uses
  ``fold_in(fold_in(rng, i), s)``, whatever slot and step it runs in. rows, positions [P]."""
  return jax.vmap(lambda i, s: jax.random.fold_in(jax.random.fold_in(rng, i), s))(rows, positions)


@flax.struct.dataclass
class PoolQueue:
  """What the slot pool's refills read, fixed for a call: every prompt's KV (stacked, Tp slots)
  and each row's token 0 and whether it needs decode steps. N rows, N / share prompts."""
  prompt_cache: attn_lib.KVCache
  token0: jax.Array  # [N] int32
  decodes: jax.Array  # [N] bool


def _pool_carry(model: tfm.Transformer, prompt_tokens, prompt_mask, rng, sampler: Sampler,
                temperature, top_p, greedy: bool, share: int):
  """The slot pool's start: every prompt prefilled once, every row's token 0 drawn, the first
  slots filled. -> (the loop's weights, ``decode_layers``; the queue; the carry, a PoolState)."""
  n_prompts, tp = prompt_tokens.shape
  n, length = n_prompts * share, sampler.max_completion_length
  slots = min(sampler.slots, n)
  # Every prompt once: its KV (Tp slots) and the logits of completion token 0, copied into a
  # slot when one of its rows starts.
  first_logits, prompt_cache = model.prefill(prompt_tokens, prompt_mask, cache_length=tp,
                                              attention=sampler.attention,
                                              activation_mesh=sampler.activation_mesh)
  cache = model.init_cache(slots, tp + length - 1)
  cache = cache.replace(index=jnp.full((slots,), tp, jnp.int32)).per_layer()
  layers = sampler.decode_layers(model)
  # Token 0 of every row, drawn once here from its prompt's logits with the row's own key; a slot
  # that takes a row starts from it (decode feeds it back), and a row ended by it never decodes.
  rows = jnp.arange(n)
  token0, logp0 = _choose(first_logits[rows // share], row_keys(rng, rows, jnp.zeros_like(rows)),
                          temperature, top_p, sampler.top_k, greedy)
  ended0 = sampler.is_eos(token0)
  queue = PoolQueue(prompt_cache=prompt_cache, token0=token0,
                    decodes=~ended0 & (length > 1))  # [N]: the row needs decode steps
  state = PoolState(
      steps=jnp.zeros((), jnp.int32), next_row=jnp.zeros((), jnp.int32),
      row=jnp.full((slots,), n, jnp.int32), position=jnp.zeros((slots,), jnp.int32),
      active=jnp.zeros((slots,), bool), last_token=jnp.full((slots,), sampler.pad_id, jnp.int32),
      tokens=jnp.full((n, length), sampler.pad_id, jnp.int32).at[:, 0].set(token0),
      mask=jnp.zeros((n, length), jnp.int32).at[:, 0].set(1),
      logps=jnp.zeros((n, length), jnp.float32).at[:, 0].set(logp0),
      ended=ended0, cache=cache)
  return layers, queue, _pool_refill(state, queue)


def _pool_emit(state: PoolState, logits, rng, sampler: Sampler, temperature, top_p,
               greedy: bool, forced=None) -> PoolState:
  """Draws each active slot's next token from ``logits`` [P, V] and writes it to its row.
  ``forced`` [P] bool (``jaxrl_ga.episodes``): those slots write the token their row already
  holds at the position (the host's), log-prob 0, and an EOS there ends nothing."""
  n, length = state.tokens.shape
  live = state.active
  row = jnp.where(live, state.row, n)  # rows out of range: the scatters drop them
  token, logp = _choose(logits, row_keys(rng, state.row, state.position), temperature, top_p,
                        sampler.top_k, greedy)
  at = (row, state.position)
  eos = lambda: sampler.is_eos(token)  # the pool's program as before issue 44 without forced
  if forced is not None:
    sampled_eos = eos()
    given = state.tokens[jnp.minimum(state.row, n - 1), jnp.minimum(state.position, length - 1)]
    token, logp = jnp.where(forced, given, token), jnp.where(forced, 0.0, logp)
    eos = lambda: ~forced & sampled_eos
  position = state.position + live
  stop = live & (eos() | (position >= length))
  return state.replace(
      position=position, active=live & ~stop,
      last_token=jnp.where(live, token, sampler.pad_id),
      tokens=state.tokens.at[at].set(token, mode='drop'),
      mask=state.mask.at[at].set(1, mode='drop'),
      logps=state.logps.at[at].set(logp, mode='drop'),
      ended=state.ended.at[row].set(eos(), mode='drop'))


def _pool_refill(state: PoolState, queue: PoolQueue, free=None) -> PoolState:
  """Free slots take the next rows of the queue (in slot order), from their token 0. ``free``
  [P] bool: the slots that may take a row (default: those not active; the multi-turn episodes
  of ``jaxrl_ga.episodes`` keep a slot whose row waits on the host)."""
  n = state.tokens.shape[0]
  slots = state.row.shape[0]
  prompt_cache = queue.prompt_cache
  share = n // prompt_cache.valid.shape[0]
  tp = prompt_cache.valid.shape[1]
  slot_ids = jnp.arange(slots)
  free = ~state.active if free is None else free
  row = state.next_row + jnp.cumsum(free.astype(jnp.int32)) - 1
  start = free & (row < n)

  def begin(state: PoolState) -> PoolState:
    new_row = jnp.where(start, row, 0)
    prompt = new_row // share
    target = jnp.where(start, slot_ids, slots)  # slots not starting: dropped

    def put(buf, new):  # the starting slots' first Tp cache slots <- their prompt's
      return buf.at[target, :, :tp].set(new[prompt].astype(buf.dtype), mode='drop')

    c = state.cache
    valid = jnp.zeros((slots, c.valid.shape[1]), bool).at[:, :tp].set(prompt_cache.valid[prompt])
    c = c.replace(
        k=tuple(put(k, prompt_cache.k[i]) for i, k in enumerate(c.k)),
        v=tuple(put(v, prompt_cache.v[i]) for i, v in enumerate(c.v)),
        valid=jnp.where(start[:, None], valid, c.valid),
        index=jnp.where(start, tp, c.index),
        positions=jnp.where(start, prompt_cache.positions[prompt], c.positions))
    keep = lambda new, old: jnp.where(start, new, old)  # the running slots are untouched
    return state.replace(cache=c, row=keep(row, state.row), position=keep(1, state.position),
                         active=keep(queue.decodes[new_row], state.active),
                         last_token=keep(queue.token0[new_row], state.last_token),
                         next_row=state.next_row + jnp.sum(start.astype(jnp.int32)))

  return jax.lax.cond(jnp.any(start), begin, lambda s: s, state)


def _pool_step(model: tfm.Transformer, layers, state: PoolState, queue: PoolQueue, rng,
               sampler: Sampler, temperature, top_p, greedy: bool) -> PoolState:
  """One iteration of the slot pool: decode every slot's last token, write the draws, refill."""
  tp = queue.prompt_cache.valid.shape[1]
  logits, cache = model.decode(state.last_token, state.cache, layers, sampler.decode_block,
                               sampler.activation_mesh)
  state = _pool_emit(state.replace(cache=cache, steps=state.steps + 1), logits, rng, sampler,
                     temperature, top_p, greedy)
  # A free slot writes its (discarded) steps at slot Tp, which a refill masks out again: its
  # index must not hold the attention's reach at the longest row it ever held.
  return _pool_refill(state.replace(cache=state.cache.replace(
      index=jnp.where(state.active, state.cache.index, tp))), queue)


def _generate_pool(model: tfm.Transformer, prompt_tokens, prompt_mask, rng, sampler: Sampler,
                   temperature, top_p, greedy: bool, share: int) -> Completions:
  """Rows 0 .. N-1 decoded by a pool of ``sampler.slots`` slots, refilled from the queue."""
  n = prompt_tokens.shape[0] * share
  layers, queue, state = _pool_carry(model, prompt_tokens, prompt_mask, rng, sampler,
                                     temperature, top_p, greedy, share)

  def cond(state: PoolState):
    return jnp.any(state.active) | (state.next_row < n)

  def body(state: PoolState):
    return _pool_step(model, layers, state, queue, rng, sampler, temperature, top_p, greedy)

  state = jax.lax.while_loop(cond, body, state)
  return Completions(tokens=state.tokens, mask=state.mask, ended_with_eos=state.ended,
                     logps=state.logps, num_decode_steps=state.steps + 1)


def generate(model: tfm.Transformer, prompt_tokens: jax.Array, prompt_mask: jax.Array,
             rng: jax.Array, sampler: Sampler, *, temperature: Any = 1.0, top_p: Any = 1.0,
             greedy: bool = False, share: int = 1) -> Completions:
  """Samples ``share`` completions for every left-padded prompt. Traceable (call it inside jit).

  Args:
    model: the policy (e.g. ``transformer.merge(graphdef, params)`` inside the caller's jit).
    prompt_tokens: [N / share, Tp] int, left-padded (every row needs at least one real token).
    prompt_mask: [N / share, Tp] 0/1.
    rng: a PRNG key.
    sampler: the static settings.
    temperature: f32 scalar (> 0), may be traced: new values do not recompile.
    top_p: f32 scalar in (0, 1], may be traced; >= 1 disables.
    greedy: static; argmax decoding (see the module docstring for its log-probs).
    share: static; completion rows per prompt. Each prompt is prefilled once and its cache serves
      rows ``i*share .. i*share+share-1``: the same logits and draws as ``share`` copies of the
      prompt (GRPO's G completions of a prompt), a ``share``-th of the prefill's work. With
      chunking, ``share`` must divide ``Sampler.chunk_size``.

  Returns:
    Completions with N rows of max_completion_length positions.
  """
  temperature = jnp.asarray(temperature, jnp.float32)
  top_p = jnp.asarray(top_p, jnp.float32)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
  n = prompt_tokens.shape[0] * share
  if sampler.slots:
    return _generate_pool(model, prompt_tokens, prompt_mask, rng, sampler, temperature, top_p,
                          greedy, share)
  size = sampler.chunk_size
  if size == 0 or size >= n:
    return _generate_rows(model, prompt_tokens, prompt_mask, rng, sampler, temperature, top_p,
                          greedy, share)
  if n % size or size % share:
    raise ValueError(f'Sampler.chunk_size={size} must divide the number of completions {n} and '
                     f'be a multiple of share={share}; choose a divisor of {n} (or 0 for all '
                     'rows at once).')
  num_chunks = n // size

  def to_chunks(x):  # [N/share, ...] -> [C, size/share, ...]; chunk j: prompts j, j + C, ...
    return jnp.swapaxes(x.reshape(size // share, num_chunks, *x.shape[1:]), 0, 1)

  def from_chunks(x):  # [C, size, ...], rows (prompt, copy) -> [N, ...], row prompt*share + copy
    x = x.reshape(num_chunks, size // share, share, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(n, *x.shape[3:])

  def one_chunk(xs):
    tokens, mask, index = xs
    return _generate_rows(model, tokens, mask, jax.random.fold_in(rng, index), sampler,
                          temperature, top_p, greedy, share)

  out = jax.lax.map(one_chunk, (to_chunks(prompt_tokens), to_chunks(prompt_mask),
                                jnp.arange(num_chunks)))
  return Completions(tokens=from_chunks(out.tokens), mask=from_chunks(out.mask),
                     ended_with_eos=from_chunks(out.ended_with_eos),
                     logps=from_chunks(out.logps),
                     num_decode_steps=jnp.max(out.num_decode_steps))


# -- one iteration of the decode loop, as a program of its own ------------------------------------
def make_decode_step(graphdef, sampler: Sampler, params, prompt_tokens, prompt_mask, *,
                     greedy: bool = False, share: int = 1, mesh: Mesh):
  """One iteration of ``generate``'s decode loop (``_rows_step``, or the pool's ``_pool_step``:
  the function the loop runs) jitted alone, for its cost (``jaxrl_ga.plan``) and for lowering
  (``programs``' table): -> (jitted ``(params, layers, state, queue, rng, temperature, top_p)
  -> state``, its abstract arguments). ``params``, ``prompt_tokens`` / ``prompt_mask`` ([N /
  share, Tp]: one generation call's, a chunk's under ``chunk_size``): ShapeDtypeStructs with
  their shardings; the loop's carry after the prefill (``_rows_carry``, ``_pool_carry``) is
  their abstract image, its rows over the mesh's batch axes, the loop's per-layer weights
  (``decode_layers``) sharded as the stacked params they come from. ``queue``: the pool's
  (``PoolQueue``), None for the batched loop."""
  pool = bool(sampler.slots)

  def carry(params, tokens, mask, rng):
    model = tfm.merge(graphdef, params)
    start = _pool_carry if pool else _rows_carry
    out = start(model, tokens, mask, rng, sampler, 1.0, 1.0, greedy, share)
    return out if pool else (out[0], None, out[1])

  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=shd.replicated(mesh))
  key = jax.eval_shape(lambda: jax.random.key(0))  # the rollout's typed key
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=shd.replicated(mesh))
  layers, queue, state = jax.eval_shape(carry, params, prompt_tokens, prompt_mask, rng)
  layers, queue, state = place_carry(params, layers, queue, state, mesh)

  # The step's activations get their sharding constraints on its mesh (as the rollout step's).
  on_mesh = dataclasses.replace(sampler, activation_mesh=shd.KernelMesh(mesh))

  def step(params, layers, state, queue, rng, temperature, top_p):
    model = tfm.merge(graphdef, params)
    if pool:
      return _pool_step(model, layers, state, queue, rng, on_mesh, temperature, top_p, greedy)
    return _rows_step(model, layers, state, rng, on_mesh, temperature, top_p, greedy)

  fn = jax.jit(step, compiler_options=compiler_options(mesh.devices.flat))
  return fn, (params, layers, state, queue, rng, scalar(jnp.float32), scalar(jnp.float32))


def place_carry(params, layers, queue, state, mesh: Mesh):
  """A decode loop's abstract carry (from ``jax.eval_shape``) with the shardings the loop runs
  it on: its rows over the mesh's batch axes, scalars replicated, the per-layer weights
  (``decode_layers``) sharded as the stacked ``params`` (ShapeDtypeStructs) they come from, the
  pool's queue (or None) by rows. -> (layers, queue, state)."""
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=shd.replicated(mesh))
  stacked = params['layers']
  source = lambda k: tfm.FUSED[k][0] if k in tfm.FUSED else k  # a fused weight: its first part's
  layers = [{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, P(*stacked[source(k)].sharding.spec[1:])) if source(k) in stacked
      else shd.replicated(mesh)) for k, v in layer.items()} for layer in layers]

  def rows(x, leading=0):  # [..., rows, (heads,) ...]: rows over the batch axes
    axes = [None] * leading + ['activation_batch'] + (
        ['activation_heads'] if x.ndim - leading == 4 else []) + [None] * x.ndim
    spec = shd.logical_to_spec(axes[:x.ndim], x.shape, mesh)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  place = lambda x: scalar(x.dtype) if not x.ndim else rows(x)
  state = jax.tree.map(place, state)
  if queue is not None:  # the prompts' stacked KV: [L, N / share, K, Tp, H]
    queue = queue.replace(prompt_cache=queue.prompt_cache.replace(
        k=rows(queue.prompt_cache.k, 1), v=rows(queue.prompt_cache.v, 1),
        valid=rows(queue.prompt_cache.valid), index=place(queue.prompt_cache.index),
        positions=rows(queue.prompt_cache.positions)), token0=rows(queue.token0),
        decodes=rows(queue.decodes))
  return layers, queue, state


# XLA:GPU command buffers (CUDA graphs) for every kind of op the decode loop runs, loops and
# conditionals included, however small the graph: the loop body is launched as one graph instead
# of one kernel launch per op (several hundred per decode step at the 0.4B shape of issue 47; the
# step went from 5.9 to 4.9 ms on an H200 with these options set process-wide). XLA's debug
# options of the same names (XLA_FLAGS); set per program with ``jax.jit(compiler_options=...)``.
GPU_COMPILER_OPTIONS = {
    'xla_gpu_enable_command_buffer': 'FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL',
    'xla_gpu_graph_min_graph_size': 1,
}


def compiler_options(devices=None) -> Optional[dict]:
  """The compiler options of a program that decodes (``jax.jit(compiler_options=...)``) on
  ``devices`` (default: the default backend's): ``GPU_COMPILER_OPTIONS`` on GPUs, None (XLA's
  defaults) on CPU and TPU."""
  devices = list(devices) if devices is not None else jax.devices()
  return dict(GPU_COMPILER_OPTIONS) if devices[0].platform == 'gpu' else None


def make_generate_fn(graphdef, sampler: Sampler, *, greedy: bool = False,
                     mesh: Optional[Mesh] = None, param_shardings: Any = None):
  """Jitted ``(params, prompt_tokens, prompt_mask, rng, temperature, top_p) -> Completions``.

  With a ``mesh``, prompts and per-row outputs are sharded over the data-parallel axes
  ``('data', 'fsdp')`` and params take ``param_shardings`` (e.g. from ``sharding.init_params``);
  without one, jit follows the shardings of its inputs. Temperature and top_p are traced.
  On GPUs it compiles with ``GPU_COMPILER_OPTIONS`` (``compiler_options``).
  """
  def fn(params, prompt_tokens, prompt_mask, rng, temperature, top_p):
    return generate(tfm.merge(graphdef, params), prompt_tokens, prompt_mask, rng, sampler,
                    temperature=temperature, top_p=top_p, greedy=greedy)

  if mesh is None:
    if param_shardings is not None:
      raise ValueError('param_shardings needs a mesh: pass mesh= as well.')
    return jax.jit(fn, compiler_options=compiler_options())
  if param_shardings is None:
    raise ValueError('with a mesh, pass param_shardings (e.g. from sharding.init_params).')
  rows2, rows1 = shd.batch_sharding(mesh, 2), shd.batch_sharding(mesh, 1)
  rep = NamedSharding(mesh, P())
  out = Completions(tokens=rows2, mask=rows2, ended_with_eos=rows1, logps=rows2,
                    num_decode_steps=rep)
  return jax.jit(fn, in_shardings=(param_shardings, rows2, rows2, rep, rep, rep),
                 out_shardings=out, compiler_options=compiler_options(mesh.devices.flat))
