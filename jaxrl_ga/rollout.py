"""The jitted rollout step: generation, table-driven old log-probs, reference log-probs.

One call generates one rollout: ``S*B/G`` prompts, each repeated G times, sampled by the current
policy. Old log-probs are computed only for the slices that the static schedule table marks
(the slice rule of docs/design, "Schedule semantics"): the table is a compile-time constant of
the step, indexed by the rollout counter that lives in device state, and each slice's forward
pass sits in a ``lax.cond`` inside a ``lax.map`` over slices, so an unmarked slice costs nothing.
The device state also counts those forward passes (in slice units), which tests and metrics read.

With ``old_logprob_source='sampler'`` the sampler's own log-probs (free with generation) serve as
old log-probs for the marked slices and no forward pass runs. With 'recompute', the agreement of
the sampler's log-probs with the learner's on the recomputed slices is reported (mean / max abs
difference over completion tokens).

The buffer's arrays are laid out ``[S, B, ...]`` with B sharded over the data-parallel axes, so
``micro_batch(buffer, j, advantages)`` hands the learner slice j without moving rows between
devices. Rows ``g*G .. g*G+G-1`` of the rollout (slice-major) are the G completions of prompt g.

Roles (docs/design.md, "Roles"): the rollout step runs on the rollout role's mesh
(``rollout_mesh``; default: the actor's), its params synced there (``sharding.sync_weights``);
its buffer is written on that mesh and moved to the actor's (``sharding.reshard``: nothing moves
when they share a mesh), where the reorder step and the learner consume it. The reference
log-probs are computed by the rollout step, or, with a reference mesh of its own
(``reference_mesh``), by a reference step there (``reference_fn``) from the rollout's rows. The
buffer carries the policy version that generated it (``policy_version``: the optimizer steps its
params had).

Multi-turn rollouts (docs/design.md, "Multi-turn rollouts"; an engine built with
``multi_turn=True``): ``rollout_rows(..., interaction=...)`` generates the rows as episodes
(``episodes.EpisodeRunner``), then a scoring step computes the same old and reference log-probs
over the whole completions; the buffer's ``model_mask`` marks the policy's tokens, the only ones
the learner's loss mask keeps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from jaxrl_ga import episodes
from jaxrl_ga import logprobs
from jaxrl_ga import lora
from jaxrl_ga import sampling
from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, SamplingConfig, ScheduleConfig
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.schedule import ScheduleTable


@flax.struct.dataclass
class RolloutState:
  counter: jax.Array  # [] int32: rollouts generated so far (indexes the schedule table)
  forward_passes: jax.Array  # [] int32: old-log-prob forward passes so far, in slice units
  rng: jax.Array  # PRNG key; rollout r samples with fold_in(rng, r)


@flax.struct.dataclass
class RolloutBuffer:
  """One rollout. Arrays [S, B, ...]; B is sharded over the data-parallel axes."""
  prompt_tokens: jax.Array  # [S, B, Tp] left-padded
  prompt_mask: jax.Array  # [S, B, Tp]
  completion_tokens: jax.Array  # [S, B, Tc] right-padded
  completion_mask: jax.Array  # [S, B, Tc]
  ended_with_eos: jax.Array  # [S, B] bool
  sampler_logps: jax.Array  # [S, B, Tc]
  old_logps: jax.Array  # [S, B, Tc]; meaningful where has_old
  has_old: jax.Array  # [S, B] bool: the slice is consumed off-policy at some iteration
  ref_logps: Optional[jax.Array]  # [S, B, Tc] when beta > 0
  # [] int32 on the actor's mesh: the optimizer steps of the params that generated the rollout
  # (``rollout_rows``' policy_version); None in the rollout step's own output.
  policy_version: Optional[jax.Array] = None
  # [S, B, Tc] int32, multi-turn rollouts only (None otherwise): 1 where the policy sampled the
  # token, 0 at tokens the host inserted (TRL's tool_mask). Those are context for every forward
  # (completion_mask 1) but never trained or counted (docs/design.md, "Multi-turn rollouts").
  model_mask: Optional[jax.Array] = None


class RolloutEngine:
  """Owns the jitted rollout step and the slice extraction for the learner."""

  def __init__(self, graphdef, table: ScheduleTable, sampling_cfg: SamplingConfig,
               loss_cfg: GRPOLossConfig, mesh, param_shardings, *,
               eos_id: sampling.EosIds, pad_id: int, mask_truncated_completions: bool = False,
               defer_old_logps: bool = False,
               options: tfm.ForwardOptions = tfm.ForwardOptions(),
               rollout_mesh=None, rollout_shardings=None, reference_mesh=None,
               reference_shardings=None, multi_turn: bool = False):
    """``table``: schedule.build_table(sched); its ``config`` is the schedule (B, G, S, ...).
    ``mesh``, ``param_shardings``: the actor's (the reorder step, the learner's micro-batches);
    ``rollout_mesh``, ``rollout_shardings``: the rollout role's, where the rollout step runs
    (default: the actor's), its params on ``rollout_shardings``; ``reference_mesh``,
    ``reference_shardings``: the reference role's (default: the rollout's, whose step then
    computes the reference log-probs), ``ref_params`` on ``reference_shardings``.
    ``options``: the run's forward (``learner_options`` is the learner's; the forward-only old-
    and reference-log-prob passes run it without remat). Its ``share_prompts`` is R from
    ``prompt_share`` (model.share_prompt_prefix; 1: off): the rollout prefills each prompt once
    and the old- and reference-log-prob passes run each prompt's forward once per R rows
    (``micro_batch_share``). ``multi_turn``: rollouts are episodes (``rollout_rows(...,
    interaction=...)``, ``jaxrl_ga.episodes``); the buffer carries a ``model_mask``."""
    if not sampling_cfg.max_prompt_length:  # 0: api.validate_lengths chooses it from the data
      raise ValueError('sampling.max_prompt_length=0: choose the width first '
                       '(api.build_context, whose ctx.cfg holds it).')
    self.graphdef = graphdef
    self.sched: ScheduleConfig = table.config
    self.sampling_cfg = sampling_cfg
    self.use_ref = loss_cfg.beta > 0
    # The learner's micro-batches carry the sampler's log-probs (losses.sampler_weights).
    self.use_sampler_logps = (loss_cfg.sampler_is_correction
                              or loss_cfg.off_policy_mask_threshold is not None)
    # LoRA (adapters among the params): the reference is the policy with its adapters disabled,
    # the frozen base weights themselves; the step takes no ref_params (pass None).
    self.ref_is_base = self.use_ref and bool(lora.split(param_shardings)[0])
    self.table = table
    self.mesh = mesh
    self.rollout_mesh = mesh if rollout_mesh is None else rollout_mesh
    rollout_shardings = param_shardings if rollout_shardings is None else rollout_shardings
    # The reference log-probs in the rollout step (default), or in a step of their own on the
    # reference's mesh (not with LoRA, whose reference is the rollout's own base weights).
    self.reference_mesh = self.rollout_mesh if reference_mesh is None else reference_mesh
    self.ref_in_step = self.use_ref and self.reference_mesh is self.rollout_mesh
    if self.use_ref and not self.ref_in_step and self.ref_is_base:
      raise ValueError('with LoRA the reference is the base weights of the rollout\'s params: '
                       'no reference_mesh of its own.')
    self.mask_truncated = mask_truncated_completions
    self.multi_turn = multi_turn
    self.defer_old_logps = defer_old_logps
    self.options = options
    share_prompts = options.share_prompts
    b, g = self.sched.micro_batch_size, self.sched.num_generations
    if b % share_prompts or g % share_prompts:
      raise ValueError(f'share_prompts={share_prompts} must divide micro_batch_size={b} and '
                       f'num_generations={g} (rollout.prompt_share computes it).')
    self.share_prompts = share_prompts
    chunk = sampling_cfg.rollout_micro_batch_size  # generation shares R rows inside a chunk
    chunked = chunk and not sampling_cfg.decode_slots  # a slot pool prefills every prompt once
    self.gen_share = math.gcd(share_prompts, chunk) if chunked else share_prompts
    # reorder() permutes the rows before the old log-probs and the learner see them: its slices
    # no longer hold runs of rows with one prompt.
    self.micro_batch_share = 1 if defer_old_logps else share_prompts
    # The learner's forward: the rows of its micro-batches share prompts as the buffer's do.
    # The learner runs on the actor's mesh: its per-shard kernel too (options may be the
    # rollout mesh's, with roles of their own).
    self.learner_options = dataclasses.replace(on_mesh(options, mesh, activations=False),
                                               share_prompts=self.micro_batch_share)
    self._old_options = dataclasses.replace(self.learner_options, remat='none')
    # LoRA: the reference is the base weights alone (adapters off); a no-op without adapters.
    self._ref_options = dataclasses.replace(options, remat='none', adapters=False)
    self.sampler = sampling.Sampler.from_config(  # the prefill's attention is the forward's
        sampling_cfg, eos_id=eos_id, pad_id=pad_id, attention=options.attention,
        fuse_weights=self.rollout_mesh.devices.flat[0].platform != 'cpu',
        activation_mesh=sharding.KernelMesh(self.rollout_mesh))
    rep = sharding.replicated(mesh)
    # The buffer's and the state's shardings on the actor's mesh, and on the rollout's (equal to
    # them when the roles share a mesh).
    self._buffer_shardings = self._buffers_on(mesh, self.use_ref).replace(policy_version=rep)
    self._state_shardings = RolloutState(counter=rep, forward_passes=rep, rng=rep)
    self._rollout_buffer_shardings = self._buffers_on(self.rollout_mesh, self.ref_in_step)
    rollout_rep = sharding.replicated(self.rollout_mesh)
    self._rollout_state_shardings = RolloutState(counter=rollout_rep, forward_passes=rollout_rep,
                                                 rng=rollout_rep)
    self._rollout_param_shardings = rollout_shardings
    self._step = jax.jit(
        self._rollout,
        in_shardings=(rollout_shardings,
                      rollout_shardings if self.ref_in_step and not self.ref_is_base else None,
                      self._rollout_state_shardings, self.prompt_sharding,
                      self._rollout_buffer_shardings.prompt_mask),
        out_shardings=(self._rollout_buffer_shardings, self._rollout_state_shardings,
                       rollout_rep),
        compiler_options=sampling.compiler_options(  # GPUs: command buffers
            self.rollout_mesh.devices.flat))
    self._ref_shardings = reference_shardings  # with the reference step below
    self._ref_step = None
    if self.use_ref and not self.ref_in_step:
      ref_rows = row_sharding(self.reference_mesh, 3)
      self._ref_step = jax.jit(
          self._reference,
          in_shardings=(reference_shardings, *[ref_rows] * 4), out_shardings=ref_rows)
    # The learner's micro-batch: rows over the data axes, as ``abstract_micro_batch`` says.
    rows = sharding.batch_sharding(mesh, 1)
    per_token = sharding.batch_sharding(mesh, 2)
    self._slice = jax.jit(self._micro_batch, static_argnames='width', out_shardings=dict(
        prompt_tokens=per_token, prompt_mask=per_token, completion_tokens=per_token,
        completion_mask=per_token, old_logps=per_token, has_old=rows, advantages=rows,
        **({'ref_logps': per_token} if self.use_ref else {}),
        **({'sampler_logps': per_token} if self.use_sampler_logps else {}),
        **({'loss_mask': per_token} if multi_turn else {})))
    self._slice_lengths = jax.jit(self._longest, out_shardings=rep)
    self._reorder_fn = jax.jit(
        self._reorder,
        in_shardings=(param_shardings, self._buffer_shardings, self._state_shardings,
                      self._buffer_shardings.has_old, rep),
        out_shardings=(self._buffer_shardings, self._state_shardings,
                       self._buffer_shardings.has_old))
    self.episodes = None  # multi-turn: the episode programs and the scoring step
    if multi_turn:
      self.episodes = episodes.EpisodeRunner(graphdef, self.sampler, self.rollout_mesh,
                                             share=share_prompts)
      self._episode_inputs = jax.jit(self._gen_inputs, out_shardings=(
          rollout_rep, *[sharding.batch_sharding(self.rollout_mesh, 2)] * 2))
      self._score_step = jax.jit(
          self._score_episodes,
          in_shardings=(rollout_shardings,
                        rollout_shardings if self.ref_in_step and not self.ref_is_base else None,
                        self._rollout_state_shardings, self.prompt_sharding,
                        self.prompt_sharding, *[None] * 6),  # the episodes' outputs, as are
          out_shardings=(self._rollout_buffer_shardings, self._rollout_state_shardings,
                         rollout_rep))

  def _buffers_on(self, mesh, with_ref: bool) -> RolloutBuffer:
    """A buffer's NamedShardings on ``mesh`` (rows over its data axes), as the rollout step
    writes it (policy_version None); ``with_ref``: it holds reference log-probs."""
    slab = lambda nd: row_sharding(mesh, nd)
    return RolloutBuffer(
        prompt_tokens=slab(3), prompt_mask=slab(3), completion_tokens=slab(3),
        completion_mask=slab(3), ended_with_eos=slab(2), sampler_logps=slab(3),
        old_logps=slab(3), has_old=slab(2), ref_logps=slab(3) if with_ref else None,
        model_mask=slab(3) if self.multi_turn else None)

  def init_state(self, seed: int) -> RolloutState:
    # Built by a jitted function: on several processes each places only its own shards.
    return jax.jit(lambda: _initial_state(seed), out_shardings=self._state_shardings)()

  def rollout(self, params, ref_params, state: RolloutState, prompt_tokens, prompt_mask,
              policy_version: int = 0):
    """prompts: [S*B/G, Tp] left-padded host arrays, the same on every process.
    -> (buffer, state, metrics), as ``rollout_rows``."""
    g = self.sched.num_generations
    slab = lambda x: placement.put(np.repeat(np.asarray(x), g, axis=0).reshape(
        *self.prompt_index.shape, -1), self.prompt_sharding)
    return self.rollout_rows(params, ref_params, state, slab(prompt_tokens), slab(prompt_mask),
                             policy_version)

  def rollout_rows(self, params, ref_params, state: RolloutState, prompt_tokens, prompt_mask,
                   policy_version: int = 0, interaction: Optional[episodes.Interaction] = None):
    """One rollout by the rollout role's ``params`` (and the reference's ``ref_params``, each on
    its role's shardings: ``sharding.sync_weights``), the version of the policy they are (its
    optimizer steps). The prompts are laid out per row: [S, B, Tp] global arrays on
    ``prompt_sharding``, row (j, i) holding prompt ``prompt_index[j, i]``; each process builds
    only its own rows (``placement.local_indices(..., axis=1)``, ``from_local``). ``state``: on
    the actor's mesh. ``interaction``: a multi-turn engine's host side (``episodes.Interaction``;
    required there, refused elsewhere): the rows are episodes, generated by segments
    (``episodes.EpisodeRunner``), then scored by one program (old and reference log-probs over
    the whole completion). -> (buffer and state on the actor's mesh, metrics)."""
    if (interaction is not None) != self.multi_turn:
      raise ValueError('rollout_rows: pass an interaction exactly when the engine is multi_turn '
                       f'(multi_turn={self.multi_turn}).')
    state = sharding.reshard(state, self._rollout_state_shardings)
    ref_in = ref_params if self.ref_in_step else None
    if interaction is None:
      buffer, state, metrics = self._step(params, ref_in, state, prompt_tokens, prompt_mask)
    else:
      rng, tokens, mask = self._episode_inputs(state, prompt_tokens, prompt_mask)
      cfg = self.sampling_cfg
      out = self.episodes.run(params, tokens, mask, rng, interaction,
                              temperature=cfg.temperature, top_p=cfg.top_p)
      c = out.completions
      buffer, state, metrics = self._score_step(
          params, ref_in, state, prompt_tokens, prompt_mask, c.tokens, c.mask, c.ended_with_eos,
          c.logps, out.model_mask, c.num_decode_steps)
      metrics = dict(metrics, **out.stats)
    if self._ref_step is not None:  # on the reference's mesh, from the rollout's rows
      rows = row_sharding(self.reference_mesh, 3)
      ref = self._ref_step(ref_params, *sharding.reshard(
          (buffer.prompt_tokens, buffer.prompt_mask, buffer.completion_tokens,
           buffer.completion_mask), (rows,) * 4))
      buffer = buffer.replace(ref_logps=sharding.reshard(ref, self._buffer_shardings.ref_logps))
    buffer = buffer.replace(policy_version=placement.put(np.asarray(policy_version, np.int32),
                                                         self._buffer_shardings.policy_version))
    return (sharding.reshard(buffer, self._buffer_shardings),
            sharding.reshard(state, self._state_shardings), metrics)

  def _gen_inputs(self, state: RolloutState, prompt_tokens, prompt_mask):
    """A multi-turn rollout's key and its prompts [S*B/R, Tp] in row order (slice-major; rows
    ``i*R .. i*R+R-1`` share prompt i, R = share_prompts)."""
    r = self.share_prompts
    first = lambda x: x[:, ::r].reshape(-1, x.shape[-1])
    return (jax.random.fold_in(state.rng, state.counter), first(prompt_tokens),
            first(prompt_mask))

  def _score_episodes(self, params, ref_params, state: RolloutState, p_tok, p_mask, tokens, mask,
                      ended, logps, model_mask, decode_steps):
    """The multi-turn rollout's scoring step: the generated rows ([S*B, ...], slice-major)
    through ``_finish`` as the rollout step's are."""
    s, b = self.sched.steps_per_generation, self.sched.micro_batch_size
    slab = lambda x: x.reshape(s, b, *x.shape[1:])
    return self._finish(tfm.merge(self.graphdef, params), ref_params, state, p_tok, p_mask,
                        slab(tokens), slab(mask), slab(logps), ended, slab, decode_steps,
                        slab(model_mask))

  @property
  def prompt_index(self) -> np.ndarray:
    """[S, B]: the rollout's prompt (0 .. S*B/G-1) whose completion each row holds."""
    return prompt_index(self.sched)

  def local_rows(self) -> np.ndarray:
    """The row indices i (of B) of a rollout's [S, B] arrays that this process's devices hold."""
    return placement.local_indices(self.prompt_index.shape, self.advantage_sharding, axis=1)

  def reorder(self, params, buffer: RolloutBuffer, state: RolloutState, advantages, order):
    """Permutes the rollout's S*B rows (slice-major) by ``order`` and only then computes the old
    log-probs of the slices the table marks (an engine built with ``defer_old_logps=True``).

    Call it right after ``rollout``, before any learner step: ``params`` must still be the
    generating policy. Used to order micro-batches by advantage sign (docs/design, "Implicit bias").
    """
    if not self.defer_old_logps:
      raise ValueError('reorder() needs an engine built with defer_old_logps=True, so that old '
                       'log-probs follow the rows into their final slices.')
    return self._reorder_fn(params, buffer, state, advantages, order)

  @property
  def buffer_shardings(self) -> RolloutBuffer:
    """The NamedShardings of a buffer's arrays ([S, B, ...], B over the data axes; its policy
    version replicated) on the actor's mesh."""
    return self._buffer_shardings

  @property
  def prompt_sharding(self):
    """The sharding of the [S, B, Tp] prompt rows ``rollout_rows`` takes (the rollout's mesh)."""
    return self._rollout_buffer_shardings.prompt_tokens

  @property
  def advantage_sharding(self):
    """The sharding of a rollout's [S, B] advantages (as the buffer's per-row arrays)."""
    return self._buffer_shardings.has_old

  @property
  def step_fn(self):
    """The jitted rollout step, (params, ref_params, state, prompt_tokens, prompt_mask) ->
    (buffer, state, metrics), all on the rollout's mesh, for AOT lowering (``jaxrl_ga.plan``,
    its arguments: ``abstract_step_args``) and compile counting."""
    return self._step

  @property
  def reference_fn(self):
    """The jitted reference step of a reference mesh of its own, (ref_params, prompt_tokens,
    prompt_mask, completion_tokens, completion_mask) -> reference log-probs [S, B, Tc]; None
    when the rollout step computes them."""
    return self._ref_step

  def abstract_reference_args(self, ref_params) -> tuple:
    """``reference_fn``'s arguments on the reference's mesh, from ``ref_params``
    (ShapeDtypeStructs)."""
    rows = row_sharding(self.reference_mesh, 3)
    prompts = self.abstract_prompts()
    tc = self.sampling_cfg.max_completion_length
    comp = jax.ShapeDtypeStruct((*prompts.shape[:2], tc), jnp.int32, sharding=rows)
    prompts = jax.ShapeDtypeStruct(prompts.shape, prompts.dtype, sharding=rows)
    return _with_shardings(ref_params, self._ref_shardings), prompts, prompts, comp, comp

  @property
  def reorder_fn(self):
    """The jitted reorder step (``reorder``), (params, buffer, state, advantages, order) ->
    (buffer, state, advantages), for AOT lowering (``jaxrl_ga.plan``)."""
    return self._reorder_fn

  # -- abstract shapes (ShapeDtypeStructs with their shardings; nothing is computed) ------------
  def abstract_state(self) -> RolloutState:
    """The rollout state on the actor's mesh (what a checkpoint and ``reorder_fn`` hold)."""
    return _with_shardings(jax.eval_shape(lambda: _initial_state(0)), self._state_shardings)

  def abstract_prompts(self) -> jax.ShapeDtypeStruct:
    """The [S, B, Tp] prompt rows that ``rollout_rows`` and ``step_fn`` take."""
    s, b = self.prompt_index.shape
    return jax.ShapeDtypeStruct((s, b, self.sampling_cfg.max_prompt_length), jnp.int32,
                                sharding=self.prompt_sharding)

  def abstract_step_args(self, params, ref_params=None) -> tuple:
    """``step_fn``'s arguments (params, ref_params, state, prompt_tokens, prompt_mask) on the
    rollout's mesh, from the actor's ``params`` (and ``ref_params``; ShapeDtypeStructs)."""
    on_rollout = lambda tree: None if tree is None else _with_shardings(
        tree, self._rollout_param_shardings)
    prompts = self.abstract_prompts()
    state = _with_shardings(self.abstract_state(), self._rollout_state_shardings)
    return (on_rollout(params), on_rollout(ref_params) if self.ref_in_step else None, state,
            prompts, prompts)

  def abstract_buffer(self, params, ref_params=None) -> RolloutBuffer:
    """The rollout buffer's shapes; ``params`` (and ``ref_params`` when beta > 0) may be
    ShapeDtypeStructs."""
    # The jitted steps' own eval_shape: one trace, cached by jit for these argument types and
    # reused by every later call (the trainer asks for the buffer once per learner width, and
    # the step's first real call traces nothing again).
    buffer, _, _ = self._step.eval_shape(*self.abstract_step_args(params, ref_params))
    if self.multi_turn:
      buffer = buffer.replace(model_mask=buffer.completion_mask)
    if self._ref_step is not None:
      buffer = buffer.replace(ref_logps=self._ref_step.eval_shape(
          *self.abstract_reference_args(ref_params)))
    buffer = buffer.replace(policy_version=jax.ShapeDtypeStruct((), jnp.int32))
    return _with_shardings(buffer, self._buffer_shardings)

  def abstract_advantages(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.prompt_index.shape, jnp.float32,
                                sharding=self.advantage_sharding)

  def abstract_micro_batch(self, params, ref_params=None, width: Optional[int] = None) -> dict:
    """The learner's micro-batch shapes (what ``Learner.init``/``abstract_init`` take), rows
    sharded over the mesh's data axes; ``width``: as ``micro_batch``'s."""
    buffer = self.abstract_buffer(params, ref_params).replace(policy_version=None)
    example = self._slice.eval_shape(buffer, jax.ShapeDtypeStruct((), jnp.int32),
                                     self.abstract_advantages(), width=width)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding.batch_sharding(self.mesh, x.ndim)), example)

  def micro_batch(self, buffer: RolloutBuffer, slice_index, advantages,
                  width: Optional[int] = None) -> dict:
    """The learner's micro-batch for slice j; advantages: [S, B] (device, B-sharded).
    ``width``: its completion arrays cut to their first ``width`` positions (``slice_widths``;
    default: all max_completion_length of them)."""
    width = self.sampling_cfg.max_completion_length if width is None else width
    return self._slice(buffer.replace(policy_version=None), jnp.asarray(slice_index, jnp.int32),
                       advantages, width=width)

  def slice_widths(self, buffer: RolloutBuffer, widths: tuple[int, ...]) -> np.ndarray:
    """[S]: for each slice of ``buffer``, the shortest of ``widths`` (ascending, the last
    max_completion_length; ``length_widths``) that holds every position its rows train on. Every
    position past it has loss mask 0 in every row, so a learner that sees only the first
    ``width`` positions computes the same loss and gradient: attention is causal, and masked
    positions enter no sum (jaxrl_ga.losses). One small reduction, fetched to the host (the same
    on every process)."""
    if len(widths) == 1:  # one width (the default): nothing to compute or fetch
      return np.full(buffer.has_old.shape[0], widths[0])
    longest = np.asarray(self._slice_lengths(buffer.completion_mask, buffer.ended_with_eos,
                                             buffer.model_mask))
    return np.asarray(widths)[np.searchsorted(np.asarray(widths), longest)]

  def _loss_mask(self, completion_mask, ended_with_eos, model_mask=None):
    """The positions the learner trains on: [..., Tc] mask, [...] flags. Under
    mask_truncated_completions (DAPO) completions cut at max length do not train. Multi-turn
    rows (``model_mask``): only the tokens the policy sampled."""
    if model_mask is not None:
      completion_mask = completion_mask * model_mask
    if not self.mask_truncated:
      return completion_mask
    return completion_mask * ended_with_eos[..., None].astype(completion_mask.dtype)

  def _longest(self, mask, ended_with_eos, model_mask=None):
    """[S]: per slice, the last position any row trains on, + 1 (the same on every process)."""
    trained = self._loss_mask(mask, ended_with_eos, model_mask)
    last = jnp.where(trained > 0, jnp.arange(1, mask.shape[-1] + 1), 0)  # [S, B, Tc]
    return jnp.max(last, axis=(1, 2))

  # -- traced -----------------------------------------------------------------------------------
  def _rollout(self, params, ref_params, state: RolloutState, prompt_tokens, prompt_mask):
    s, b = self.sched.steps_per_generation, self.sched.micro_batch_size
    cfg = self.sampling_cfg
    model = tfm.merge(self.graphdef, params)

    # Rows i*R .. i*R+R-1 of a slice share a prompt (R = self.gen_share, 1 without sharing),
    # prefilled once. Rollout row j*B + i*R + k (slice j; prompt (j*B + i*R) // G) is generated
    # at position (i*S + j)*R + k, so that after generation the [S, B] view keeps B sharded
    # without moving rows.
    r = self.gen_share

    def gen_prompts(x):  # [S, B, Tp] prompts per row -> [B/R*S, Tp] in generation order
      x = jnp.swapaxes(x.reshape(s, b // r, r, *x.shape[2:])[:, :, 0], 0, 1)
      x = x.reshape(b // r * s, *x.shape[2:])
      return jax.lax.with_sharding_constraint(x, sharding.batch_sharding(self.rollout_mesh,
                                                                         x.ndim))

    # [B/R*S*R, ...] in generation order -> [S, B, ...]
    slab = lambda x: jnp.swapaxes(x.reshape(b // r, s, r, *x.shape[1:]), 0, 1).reshape(
        s, b, *x.shape[1:])
    comps = sampling.generate(model, gen_prompts(prompt_tokens), gen_prompts(prompt_mask),
                              jax.random.fold_in(state.rng, state.counter), self.sampler,
                              temperature=cfg.temperature, top_p=cfg.top_p, share=r)
    return self._finish(model, ref_params, state, prompt_tokens, prompt_mask, slab(comps.tokens),
                        slab(comps.mask), slab(comps.logps), comps.ended_with_eos, slab,
                        comps.num_decode_steps)

  def _finish(self, model, ref_params, state: RolloutState, p_tok, p_mask, c_tok, c_mask,
              c_logps, ended_rows, slab, decode_steps, model_mask=None):
    """A generated rollout's old log-probs (the table's marked slices), reference log-probs,
    metrics, buffer and next state. Completions [S, B, Tc]; ``ended_rows`` in generation order
    and ``slab``, that order -> [S, B, ...]; ``model_mask``: multi-turn rows'
    (``RolloutBuffer.model_mask``; the forwards see every completion token, the agreement
    metric only the model's)."""
    s, b = self.sched.steps_per_generation, self.sched.micro_batch_size
    cfg = self.sampling_cfg
    marks = jnp.asarray(self.table.slice_recompute)[state.counter % self.table.period_rollouts]

    if self.defer_old_logps:  # reorder() computes them once the rows are in their final slices
      old = jnp.zeros(c_logps.shape, jnp.float32)
      passes = jnp.zeros((), jnp.int32)
    else:
      old, passes = self._old_logps(model, p_tok, p_mask, c_tok, c_mask, c_logps, marks,
                                    self.rollout_mesh)

    ref = None
    if self.ref_in_step:
      ref_model = model if self.ref_is_base else tfm.merge(self.graphdef, ref_params)
      ref = self._ref_logps(ref_model, p_tok, p_mask, c_tok, c_mask, mesh=self.rollout_mesh)

    # Sampler vs learner log-probs on the recomputed slices (completion tokens only).
    sampled = c_mask if model_mask is None else c_mask * model_mask
    weight = (sampled * marks[:, None, None]).astype(jnp.float32)
    diff = jnp.abs(c_logps - old) * weight
    n = jnp.sum(weight)
    has_recompute = ((n > 0) & (cfg.old_logprob_source == 'recompute')
                     & (not self.defer_old_logps))
    metrics = {
        'rollout/logp_agreement_mean_abs': jnp.where(has_recompute, jnp.sum(diff) /
                                                     jnp.maximum(n, 1.0), jnp.nan),
        'rollout/logp_agreement_max_abs': jnp.where(has_recompute, jnp.max(diff), jnp.nan),
        'rollout/recomputed_slices': passes,
        'rollout/completion_length': jnp.mean(jnp.sum(c_mask, -1).astype(jnp.float32)),
        # Real prompt tokens of the rows, against the padded width (max_prompt_length).
        'rollout/prompt_length': jnp.mean(jnp.sum(p_mask, -1).astype(jnp.float32)),
        'rollout/prompt_length_max': jnp.max(jnp.sum(p_mask, -1)).astype(jnp.float32),
        'rollout/eos_fraction': jnp.mean(ended_rows.astype(jnp.float32)),
        'rollout/decode_steps': decode_steps,
    }
    if model_mask is not None:
      metrics.update(episodes.episode_metrics(c_mask, model_mask))
    buffer = RolloutBuffer(
        prompt_tokens=p_tok, prompt_mask=p_mask, completion_tokens=c_tok,
        completion_mask=c_mask, ended_with_eos=slab(ended_rows), sampler_logps=c_logps,
        old_logps=old, has_old=jnp.broadcast_to(marks[:, None], (s, b)), ref_logps=ref,
        model_mask=model_mask)
    new_state = RolloutState(counter=state.counter + 1, forward_passes=state.forward_passes +
                             passes, rng=state.rng)
    return buffer, new_state, metrics

  @staticmethod
  def _on(options: tfm.ForwardOptions, mesh) -> tfm.ForwardOptions:
    """``options`` of a step jitted over ``mesh``: its activations constrained there, and a
    per-shard kernel (splash: ``kernel_mesh``) run over that mesh's shards, not another role's."""
    return on_mesh(options, mesh)

  def _ref_logps(self, ref_model, *rows, mesh):
    """The reference log-probs [S, B, Tc] of the rows (prompt tokens, mask, completion tokens,
    mask: [S, B, ...]), one slice at a time, in a step on ``mesh``."""
    options = self._on(self._ref_options, mesh)
    return jax.lax.map(lambda xs: self._logps_of(ref_model, xs, options), rows)

  def _reference(self, ref_params, *rows):
    return self._ref_logps(tfm.merge(self.graphdef, ref_params), *rows, mesh=self.reference_mesh)

  def _logps_of(self, model, xs, options: tfm.ForwardOptions):
    return logprobs.completion_logps(model, *xs, options,
                                     temperature=self.sampling_cfg.temperature)[0]

  def _old_logps(self, model, p_tok, p_mask, c_tok, c_mask, c_logps, marks, mesh):
    """Old log-probs [S, B, Tc] for the marked slices (zeros elsewhere) and the forward passes
    paid (slice units), in a step on ``mesh``. Each slice's pass is a lax.cond: an unmarked
    slice costs nothing."""
    if self.sampling_cfg.old_logprob_source == 'sampler':
      return jnp.where(marks[:, None, None], c_logps, 0.0), jnp.zeros((), jnp.int32)
    options = self._on(self._old_options, mesh)

    def one_slice(xs):
      mark, *rest = xs
      return jax.lax.cond(mark, lambda: self._logps_of(model, rest, options),
                          lambda: jnp.zeros(rest[2].shape, jnp.float32))

    old = jax.lax.map(one_slice, (marks, p_tok, p_mask, c_tok, c_mask))
    return old, jnp.sum(marks.astype(jnp.int32))

  def _reorder(self, params, buffer: RolloutBuffer, state: RolloutState, advantages, order):
    s, b = advantages.shape
    perm = lambda x: x.reshape(s * b, *x.shape[2:])[order].reshape(x.shape)
    buffer = jax.tree.map(perm, buffer.replace(policy_version=None)).replace(
        policy_version=buffer.policy_version)
    marks = jnp.asarray(self.table.slice_recompute)[
        (state.counter - 1) % self.table.period_rollouts]  # the rollout just generated
    old, passes = self._old_logps(tfm.merge(self.graphdef, params), buffer.prompt_tokens,
                                  buffer.prompt_mask, buffer.completion_tokens,
                                  buffer.completion_mask, buffer.sampler_logps, marks, self.mesh)
    buffer = buffer.replace(old_logps=old, has_old=jnp.broadcast_to(marks[:, None], (s, b)))
    state = state.replace(forward_passes=state.forward_passes + passes)
    return buffer, state, perm(advantages)

  def _micro_batch(self, buffer: RolloutBuffer, j, advantages, width=None) -> dict[str, Any]:
    take = lambda x: jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False)
    cut = lambda x: take(x)[:, :width]  # the completion positions the learner computes
    model_mask = None if buffer.model_mask is None else cut(buffer.model_mask)
    loss_mask = self._loss_mask(cut(buffer.completion_mask), take(buffer.ended_with_eos),
                                model_mask)
    batch = dict(prompt_tokens=take(buffer.prompt_tokens), prompt_mask=take(buffer.prompt_mask),
                 completion_tokens=cut(buffer.completion_tokens),
                 completion_mask=loss_mask, old_logps=cut(buffer.old_logps),
                 has_old=take(buffer.has_old), advantages=take(advantages))
    if model_mask is not None:  # multi-turn: every token is context, the model's are trained
      batch['completion_mask'] = cut(buffer.completion_mask)
      batch['loss_mask'] = loss_mask
    if buffer.ref_logps is not None:
      batch['ref_logps'] = cut(buffer.ref_logps)
    if self.use_sampler_logps:
      batch['sampler_logps'] = cut(buffer.sampler_logps)
    return batch


def on_mesh(options: tfm.ForwardOptions, mesh, activations: bool = True) -> tfm.ForwardOptions:
  """``options`` for a step jitted over ``mesh``: its per-shard kernel's mesh (``kernel_mesh``,
  set only where ``options`` has one: splash) and, with ``activations``, the mesh of its
  activations' sharding constraints, both ``mesh``."""
  kernel = None if options.kernel_mesh is None else sharding.KernelMesh(mesh)
  if not activations:
    return dataclasses.replace(options, kernel_mesh=kernel)
  return dataclasses.replace(options, kernel_mesh=kernel,
                             activation_mesh=sharding.KernelMesh(mesh))


def row_sharding(mesh, ndim: int) -> NamedSharding:
  """A rollout's per-row arrays [S, B, ...]: rows (B) over the mesh's data axes."""
  return NamedSharding(mesh, P(None, sharding.BATCH_AXES, *([None] * (ndim - 2))))


def prompt_index(sched: ScheduleConfig) -> np.ndarray:
  """[S, B]: the rollout's prompt (0 .. S*B/G-1) whose completion each row holds."""
  s, b, g = sched.steps_per_generation, sched.micro_batch_size, sched.num_generations
  return np.arange(s * b).reshape(s, b) // g


def local_prompts(sched: ScheduleConfig, mesh) -> np.ndarray:
  """The rollout's prompts (0 .. S*B/G-1) of which this process's devices hold a row: GRPO's
  data position ``d`` is this process's when ``d % (S*B/G)`` is one of them (a rollout starts
  at a multiple of S*B/G), as ``RolloutEngine.local_rows`` lays the rows out."""
  index = prompt_index(sched)
  rows = placement.local_indices(index.shape, row_sharding(mesh, 2), axis=1)
  return np.unique(index[:, rows])


def prompt_share(sched: ScheduleConfig, data_parallel_size: int, enabled: bool = True) -> int:
  """R, the rows of a micro-batch that share one prompt's forward (model.share_prompt_prefix).

  Rows ``g*G .. g*G+G-1`` of a rollout are the G completions of prompt g, and a micro-batch is B
  consecutive rows, so runs of R = gcd(G, B) rows share a prompt. Under a mesh each of the
  ``data_parallel_size`` shards holds B / shards consecutive rows; R also divides that, so a
  shard's prompts are its own rows (no rows cross devices) and the P = B / R prompt rows are
  sharded evenly. 1 (no sharing) when disabled or when nothing is shared.
  """
  b, g = sched.micro_batch_size, sched.num_generations
  if not enabled or b % data_parallel_size:
    return 1
  return math.gcd(g, b // data_parallel_size)


def length_widths(max_completion_length: int, buckets: int) -> tuple[int, ...]:
  """The learner's completion widths (``grpo.length_buckets``): ``buckets`` evenly spaced widths
  up to max_completion_length, each rounded up to a multiple of 8 and capped there; ascending,
  without repeats, the last max_completion_length. E.g. (128, 4) -> (32, 64, 96, 128)."""
  n, length = buckets, max_completion_length
  return tuple(sorted({min(length, -(-math.ceil(length * i / n) // 8) * 8)
                       for i in range(1, n + 1)}))


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree,
                      shardings)


def _initial_state(seed: int) -> RolloutState:
  return RolloutState(counter=jnp.zeros((), jnp.int32), forward_passes=jnp.zeros((), jnp.int32),
                      rng=jax.random.key(seed))
