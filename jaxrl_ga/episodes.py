"""Multi-turn rollouts: a rollout row is an episode (docs/design.md, "Multi-turn rollouts").

The model writes a turn until it samples EOS; the host (an ``Interaction``) reads the turn,
runs a tool or an environment, and answers with the tokens to append (the tool turn as the chat
template renders it and the next assistant header), or None: the episode ends. Decoding then
continues from the same KV cache: the appended tokens are fed through the decode step at the
row's own cache slots, one per step, as if the model had sampled them (teacher forcing); the
history is never prefilled again.

Device side (``EpisodeRunner``): the slot pool of ``jaxrl_ga.sampling`` ("Slot pool") with
P = ``Sampler.slots`` slots (0: one slot per row). ``start`` prefills every prompt once and fills
the first slots; ``segment`` is one jitted program that (1) applies the host's answers
(``inject_tokens`` / ``inject_len``), (2) refills free slots from the queue, (3) runs up to
``segment_steps`` decode iterations while some slot is active. A slot whose row ended its turn
at EOS keeps its cache and waits (it is neither decoded nor refilled) until the host answers;
the others keep decoding. A slot that holds appended tokens still to feed is *forced*: its
step writes the row's next host token (log-prob 0, model mask 0) instead of a draw.

Host side (``EpisodeRunner.run``): after each segment it submits the rows whose turn just ended
(``Interaction.submit``), then dispatches the next segment with the answers whose futures are
done; the tools run on the host while the device decodes. When no slot can decode it waits for
the first future. A row's episode ends when the host answers None (``ended_with_eos`` True: its
last model token is EOS), when it reaches the buffer's L positions (truncated), or when an
answer would not leave room for one more model token (truncated: the answer is not written).
A turn cut at L never reaches ``submit``; it goes to the interaction's optional ``close``, so
the host sees every model turn of every row from the engine.

Per-row state and RNG: row i's completion position s draws with ``sampling.row_keys`` (a key of
its row and position only), so an episode's tokens do not depend on its slot, on P, on the
segment length or on when the host answered: the pool (P < N) and one slot per row give the same
tokens, sampled or greedy, whenever the host's answers are a function of the turn.

Outputs: ``sampling.Completions`` over the whole completion (model and host tokens: mask 1,
sampler log-probs 0 at host tokens) and ``model_mask`` [N, L] int32, 1 where the policy sampled
the token (TRL's ``tool_mask``): the loss and its normalizers count only those
(``rollout.RolloutEngine``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import sampling
from jaxrl_ga import sharding as shd
from jaxrl_ga.models import transformer as tfm

SEGMENT_STEPS = 16  # decode iterations per segment program call (the host answers between)


class Interaction(Protocol):
  """Host side of one rollout's multi-turn episodes (docs/design.md, "Multi-turn rollouts")."""

  def submit(self, row: int, turn_tokens: np.ndarray) -> concurrent.futures.Future:
    """row: index 0..S*B-1 of the rollout's rows in [S, B] slice-major order (row j*B+i);
    turn_tokens: the int32 tokens the model sampled in the turn that just ended (ends with EOS
    when the turn ended at EOS). The future's result: an int32 array of tokens to append to the
    row's context (the tool turn as the chat template renders it plus the next assistant header)
    and continue decoding, or None: the episode ends. Never raises (tool errors are the
    host's)."""

  # Optional: ``close(row, turn_tokens) -> None``, the row's last turn when it ended the episode
  # without reaching ``submit``: cut at the length limit (or ended at EOS with no position left),
  # so no answer can follow; called once, from the runner's thread, before ``run`` returns. With
  # it the host has seen every model turn of every row (``tools.Episodes.close``).
  # Optional: ``withdraw(row) -> None``, the row's last answer did not fit in the completion
  # (more tokens than the positions left): it is taken back and the episode ends as its last turn
  # did, at EOS (TRL 1.16 drops such tool results; ``tools.Episodes.withdraw``).


@flax.struct.dataclass
class EpisodeState:
  """The segment program's carry: the slot pool's and the episodes' per-row state. N rows,
  P slots, L = max_completion_length."""
  pool: sampling.PoolState  # slots, the [N, L] tokens / mask / logps, ended, the KV cache
  model_mask: jax.Array  # [N, L] int32: 1 where the policy sampled the token
  forced_end: jax.Array  # [P] int32: the slot's positions below it are the host's tokens
  waiting: jax.Array  # [N] bool: the row's turn ended at EOS; the host's answer is pending
  over: jax.Array  # [N] bool: the row's episode has ended
  length: jax.Array  # [N] int32: completion positions written


def _classify(state: EpisodeState) -> EpisodeState:
  """Rows whose slot just stopped: waiting for the host (ended at EOS with room left) or over."""
  pool = state.pool
  n, length = pool.tokens.shape
  holds = pool.row < n
  rs = jnp.minimum(pool.row, n - 1)
  new = holds & ~pool.active & ~state.waiting[rs] & ~state.over[rs]
  wait = new & pool.ended[rs] & (pool.position < length)
  to = lambda m: jnp.where(m, pool.row, n)  # rows out of range: the scatters drop them
  return state.replace(waiting=state.waiting.at[to(wait)].set(True, mode='drop'),
                       over=state.over.at[to(new & ~wait)].set(True, mode='drop'))


def _settle(state: EpisodeState, queue: sampling.PoolQueue) -> EpisodeState:
  """Classifies the stopped rows, frees the slots of ended episodes and refills them."""
  state = _classify(state)
  pool = state.pool
  n = pool.tokens.shape[0]
  tp = queue.prompt_cache.valid.shape[1]
  held = (pool.row < n) & state.waiting[jnp.minimum(pool.row, n - 1)]
  keep = pool.active | held
  # A free slot's index back at Tp (as the pool's): it must not widen the attention's reach.
  pool = pool.replace(cache=pool.cache.replace(index=jnp.where(keep, pool.cache.index, tp)))
  refilled = sampling._pool_refill(pool, queue, free=~keep)  # pylint: disable=protected-access
  started = refilled.row != pool.row  # a new row has no host tokens to feed
  return _classify(state.replace(pool=refilled,
                                 forced_end=jnp.where(started, 0, state.forced_end)))


def _inject(state: EpisodeState, inject_tokens, inject_len) -> EpisodeState:
  """The host's answers to waiting rows: inject_len [N] > 0: inject_tokens [N, L] at positions
  length .. length + inject_len - 1 (forced into the row's slot), -1: the episode ends, 0:
  nothing. An answer that leaves no room for a model token ends the episode truncated (one
  longer than that never comes here: the runner withdraws it and ends the episode, -1)."""
  pool = state.pool
  n, length = pool.tokens.shape
  act = state.waiting & (inject_len != 0)
  ins = act & (inject_len > 0)
  end = state.length + jnp.maximum(inject_len, 0)
  overflow = ins & (end >= length)
  ins = ins & ~overflow
  cols = jnp.arange(length)[None, :]
  write = ins[:, None] & (cols >= state.length[:, None]) & (cols < end[:, None])
  rs = jnp.minimum(pool.row, n - 1)
  slot_ins = (pool.row < n) & ins[rs]
  pool = pool.replace(
      tokens=jnp.where(write, inject_tokens.astype(jnp.int32), pool.tokens),
      mask=jnp.where(write, 1, pool.mask), logps=jnp.where(write, 0.0, pool.logps),
      ended=pool.ended & ~overflow & ~ins, active=pool.active | slot_ins)
  return state.replace(pool=pool, forced_end=jnp.where(slot_ins, end[rs], state.forced_end),
                       waiting=state.waiting & ~act,
                       over=state.over | (act & (inject_len < 0)) | overflow)


def _step(model: tfm.Transformer, layers, state: EpisodeState, queue, rng,
          sampler: sampling.Sampler, temperature, top_p, greedy: bool) -> EpisodeState:
  """One decode iteration: every active slot decodes its last token (forced slots then write
  the host's next token), the stopped rows are classified, free slots refilled."""
  pool = state.pool
  old = pool.cache
  logits, cache = model.decode(pool.last_token, old, layers, sampler.decode_block)
  live = pool.active
  # Idle slots (waiting or free) keep their place: their (discarded) step is written at their
  # index again when they resume.
  cache = cache.replace(index=jnp.where(live, cache.index, old.index),
                        positions=jnp.where(live, cache.positions, old.positions))
  forced = live & (pool.position < state.forced_end)
  n = pool.tokens.shape[0]
  emitted = sampling._pool_emit(  # pylint: disable=protected-access
      pool.replace(cache=cache, steps=pool.steps + 1), logits, rng, sampler, temperature, top_p,
      greedy, forced=forced)
  # A waiting slot feeds its EOS when it resumes (the pool's emit writes pad to idle slots).
  emitted = emitted.replace(last_token=jnp.where(live, emitted.last_token, pool.last_token))
  at = (jnp.where(live, pool.row, n), pool.position)
  state = state.replace(pool=emitted,
                        model_mask=state.model_mask.at[at].set((~forced).astype(jnp.int32),
                                                               mode='drop'),
                        length=state.length.at[at[0]].set(emitted.position, mode='drop'))
  return _settle(state, queue)


def start(model: tfm.Transformer, prompt_tokens, prompt_mask, rng, sampler: sampling.Sampler,
          temperature, top_p, greedy: bool, share: int):
  """Every prompt prefilled once, every row's token 0 drawn, the first slots filled (the slot
  pool's start, ``sampling._pool_carry``, with P = ``sampler.slots`` or N). -> (the decode
  weights, the queue, an EpisodeState)."""
  n = prompt_tokens.shape[0] * share
  slots = min(sampler.slots or n, n)
  sampler = dataclasses.replace(sampler, slots=slots)
  layers, queue, pool = sampling._pool_carry(  # pylint: disable=protected-access
      model, prompt_tokens, prompt_mask, rng, sampler, temperature, top_p, greedy, share)
  length = sampler.max_completion_length
  state = EpisodeState(pool=pool,
                       model_mask=jnp.zeros((n, length), jnp.int32).at[:, 0].set(1),
                       forced_end=jnp.zeros((slots,), jnp.int32),
                       waiting=jnp.zeros((n,), bool), over=jnp.zeros((n,), bool),
                       length=jnp.ones((n,), jnp.int32))
  return layers, queue, _classify(state)


def segment(model: tfm.Transformer, layers, state: EpisodeState, queue, rng,
            sampler: sampling.Sampler, temperature, top_p, greedy: bool, inject_tokens,
            inject_len, steps: int) -> EpisodeState:
  """The host's answers applied, free slots refilled, then up to ``steps`` decode iterations
  while some slot is active."""
  state = _settle(_inject(state, inject_tokens, inject_len), queue)

  def cond(carry):
    i, st = carry
    return (i < steps) & jnp.any(st.pool.active)

  def body(carry):
    i, st = carry
    return i + 1, _step(model, layers, st, queue, rng, sampler, temperature, top_p, greedy)

  return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]


@dataclasses.dataclass
class EpisodeResult:
  """``EpisodeRunner.run``'s output, rows in the order of the prompts' rows (row i*share + k of
  prompt i)."""
  completions: sampling.Completions  # [N, L]: model and host tokens (mask 1), logps 0 at host's
  model_mask: jax.Array  # [N, L] int32: 1 where the policy sampled the token
  stats: dict[str, float]  # host-side: segments run, host answers, time waiting for them


class EpisodeRunner:
  """The jitted multi-turn programs (``start``, ``segment``) on a mesh and their host loop.

  ``sampler``: the rollout's (its ``slots``: the pool's P, 0: one slot per row; its
  ``chunk_size`` is not used); ``share``: completion rows per prompt (prefilled once);
  ``segment_steps``: decode iterations per segment call."""

  def __init__(self, graphdef, sampler: sampling.Sampler, mesh, *, share: int = 1,
               greedy: bool = False, segment_steps: int = SEGMENT_STEPS):
    # The programs' activations get their sharding constraints on ``mesh``.
    sampler = dataclasses.replace(sampler, activation_mesh=shd.KernelMesh(mesh))
    self.graphdef, self.sampler, self.mesh = graphdef, sampler, mesh
    self.share, self.greedy, self.segment_steps = share, greedy, segment_steps
    options = sampling.compiler_options(mesh.devices.flat)

    def start_fn(params, prompt_tokens, prompt_mask, rng, temperature, top_p):
      return start(tfm.merge(graphdef, params), prompt_tokens, prompt_mask, rng, sampler,
                   temperature, top_p, greedy, share)

    def segment_fn(params, layers, state, queue, rng, temperature, top_p, inject_tokens,
                   inject_len):
      return segment(tfm.merge(graphdef, params), layers, state, queue, rng, sampler,
                     temperature, top_p, greedy, inject_tokens, inject_len, segment_steps)

    self._start_traced = start_fn
    self._options = options
    self._starts: dict[Any, Any] = {}  # start_fn jitted per (params, prompts) layout
    # The host's answers [N, L] and their lengths [N]: rows over the mesh's data axes.
    self.inject_shardings = (shd.batch_sharding(mesh, 2), shd.batch_sharding(mesh, 1))
    self.segment_fn = jax.jit(segment_fn, donate_argnums=(2,), compiler_options=options)

  def _carry(self, params, prompt_tokens, rng) -> tuple:
    """The start program's output, (layers, queue, state), as ShapeDtypeStructs with the
    shardings the segment program takes them on (``sampling.place_carry``)."""
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=shd.replicated(self.mesh))
    layers, queue, state = jax.eval_shape(self._start_traced, params, prompt_tokens,
                                          prompt_tokens, rng, scalar, scalar)
    return sampling.place_carry(params, layers, queue, state, self.mesh)

  def start_fn(self, params, prompt_tokens, prompt_mask, rng, temperature, top_p):
    """The jitted start program (``start``), its carry laid out as ``abstract_segment_args``
    says (``params`` on the mesh, NamedShardings), so that ``run``'s segment calls are the
    program of the table's entry (one jit per layout of ``params`` and the prompts)."""
    leaves, tree = jax.tree.flatten((params, prompt_tokens, rng))
    key = tree, tuple((x.shape, x.dtype, getattr(x, 'sharding', None)) for x in leaves)
    fn = self._starts.get(key)
    if fn is None:
      placed = all(isinstance(getattr(x, 'sharding', None), jax.sharding.NamedSharding)
                   for x in jax.tree.leaves(params))  # else (host arrays): the compiler's layout
      out = (jax.tree.map(lambda x: x.sharding, self._carry(params, prompt_tokens, rng))
             if placed else None)
      fn = self._starts[key] = jax.jit(self._start_traced, compiler_options=self._options,
                                       out_shardings=out)
    return fn(params, prompt_tokens, prompt_mask, rng, temperature, top_p)

  def abstract_segment_args(self, params, prompt_tokens) -> tuple:
    """``segment_fn``'s arguments as ShapeDtypeStructs with their shardings (the program
    table's 'multi_turn' entry): ``params`` and ``prompt_tokens`` [N / share, Tp] likewise."""
    rep = shd.replicated(self.mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    layers, queue, state = self._carry(params, prompt_tokens, rng)
    n = prompt_tokens.shape[0] * self.share
    length = self.sampler.max_completion_length
    inject = jax.ShapeDtypeStruct((n, length), jnp.int32, sharding=self.inject_shardings[0])
    inject_len = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.inject_shardings[1])
    return (params, layers, state, queue, rng, scalar, scalar, inject, inject_len)

  def run(self, params, prompt_tokens, prompt_mask, rng, interaction: Interaction, *,
          temperature: Any = 1.0, top_p: Any = 1.0) -> EpisodeResult:
    """The episodes of N = len(prompt_tokens) * share rows; row r is ``interaction``'s row r."""
    # Scalars and key replicated on the mesh, as abstract_segment_args places them.
    temperature, top_p, rng = jax.device_put((jnp.float32(temperature), jnp.float32(top_p), rng),
                                             shd.replicated(self.mesh))
    layers, queue, state = self.start_fn(params, prompt_tokens, prompt_mask, rng, temperature,
                                         top_p)
    n, length = state.pool.tokens.shape
    turn_start = np.zeros(n, np.int64)  # the first position of each row's current model turn
    # Rows whose last turn the host has seen: answered None, answered past the limit, or closed.
    seen_last = np.zeros(n, bool)
    close = getattr(interaction, 'close', None)
    pending: dict[int, concurrent.futures.Future] = {}
    inject_tokens = np.zeros((n, length), np.int32)
    inject_len = np.zeros(n, np.int32)
    segments = answers = 0
    wait_s = 0.0
    while True:
      waiting, over, lengths, active, rows, next_row = (np.asarray(x) for x in jax.device_get(
          (state.waiting, state.over, state.length, state.pool.active, state.pool.row,
           state.pool.next_row)))
      new = [int(r) for r in np.flatnonzero(waiting) if int(r) not in pending]
      cut = np.flatnonzero(over & ~seen_last)  # truncated at L: their last turn never submitted
      seen_last[cut] = True
      cut = cut if close is not None else cut[:0]
      if new or cut.size:
        tokens = np.asarray(jax.device_get(state.pool.tokens))
        for r in new:
          pending[r] = interaction.submit(r, tokens[r, turn_start[r]:lengths[r]].copy())
        for r in cut:
          close(int(r), tokens[r, turn_start[r]:lengths[r]].copy())
      if over.all():
        break
      inject_len[:] = 0

      def collect():
        nonlocal answers
        for r in [r for r, f in pending.items() if f.done()]:
          answer = pending.pop(r).result()
          answers += 1
          if answer is None:
            inject_len[r] = -1
            seen_last[r] = True
            continue
          answer = np.asarray(answer, np.int32).reshape(-1)
          if not answer.size:
            raise ValueError(f'the interaction answered row {r} with no tokens; answer None to '
                             'end the episode.')
          start_at = int(lengths[r])
          if start_at + answer.size > length:  # it does not fit: TRL 1.16 drops the tool result
            withdraw = getattr(interaction, 'withdraw', None)  # and the episode ends at the
            if withdraw is not None:  # model's EOS: a finished completion, not a truncated one
              withdraw(r)
            inject_len[r] = -1
            seen_last[r] = True
            continue
          inject_len[r] = answer.size
          seen_last[r] = start_at + answer.size >= length  # no room after: _inject, truncated
          fits = answer[:max(length - start_at, 0)]
          inject_tokens[r, start_at:start_at + fits.size] = fits
          turn_start[r] = start_at + answer.size

      collect()
      held = (rows < n) & waiting[np.minimum(rows, n - 1)]
      runnable = active.any() or inject_len.any() or ((~active & ~held).any() and next_row < n)
      if not runnable:
        if not pending:
          raise RuntimeError('multi-turn rollout: no row can decode and no answer is pending.')
        started = time.perf_counter()
        concurrent.futures.wait(list(pending.values()),
                                return_when=concurrent.futures.FIRST_COMPLETED)
        wait_s += time.perf_counter() - started
        collect()
      # On the mesh as the table's abstract arguments place them (abstract_segment_args): the
      # program plan and fit compile is the one this call runs.
      state = self.segment_fn(params, layers, state, queue, rng, temperature, top_p,
                              *jax.device_put((inject_tokens.copy(), inject_len.copy()),
                                              self.inject_shardings))  # (reused buffers)
      segments += 1
    pool = state.pool
    completions = sampling.Completions(tokens=pool.tokens, mask=pool.mask,
                                       ended_with_eos=pool.ended, logps=pool.logps,
                                       num_decode_steps=pool.steps + 1)
    return EpisodeResult(completions=completions, model_mask=state.model_mask,
                         stats={'rollout/segments': float(segments),
                                'tools/answers': float(answers), 'tools/wait_s': wait_s})


def model_turns(tokens: np.ndarray, model_mask: np.ndarray) -> list[np.ndarray]:
  """A multi-turn row's assistant turns: its runs of policy-sampled tokens (model mask 1), in
  order (what the held-out evaluation hands ``finish``)."""
  cuts = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(model_mask) > 0, [0]]).astype(
      np.int8)))
  return [np.asarray(tokens)[a:b] for a, b in zip(cuts[::2], cuts[1::2])]


def episode_metrics(completion_mask, model_mask) -> dict[str, jax.Array]:
  """Device metrics of multi-turn rows ([..., L] masks): model turns per episode (runs of
  model tokens) and the share of completion tokens the policy sampled."""
  model = (completion_mask * model_mask).astype(jnp.int32)
  before = jnp.pad(model[..., :-1], [(0, 0)] * (model.ndim - 1) + [(1, 0)])
  turns = jnp.sum((model > 0) & (before == 0), axis=-1).astype(jnp.float32)
  return {'tools/turns_per_episode': jnp.mean(turns),
          'rollout/model_token_fraction': jnp.sum(model).astype(jnp.float32) /
                                          jnp.maximum(jnp.sum(completion_mask), 1).astype(
                                              jnp.float32)}
