"""Each stage's jitted programs as one value, built in one place from the run's config: the
trainers, ``jaxrl_ga.plan``, ``jaxrl_ga.fit`` and the benchmarks take their programs from it, so
that what ``plan`` compiles and what a benchmark times is the program that trains (layers scanned
or unrolled, remat, the log-prob chunk, the shared prompt forward, deferred old log-probs, LoRA,
the attention).

  progs = build_grpo_programs(cfg, model_cfg, mesh, param_shardings, eos_id=..., pad_id=...)
  state = progs.init_state(params)            # the starting state (abstract_state(): shapes)
  fn, args = progs.table['learner']           # the jitted step and its abstract arguments
  progs.table['rollout'].lower()              # what plan lowers for every entry

Per stage (``build_grpo_programs``, ``build_sft_programs``, ``build_dpo_programs``) the value
has ``abstract_state()``, ``init_state(params)`` (the one place the starting state is put
together: the learner's state, the rollout's, the reference-params rule) and ``table``, name ->
``Program`` (the jitted step, its abstract arguments: ShapeDtypeStructs with their shardings):

  * 'learner': the learner micro-step (every stage);
  * 'rollout', 'reorder' (with ``advantage.order_by_advantage_sign``), 'decode' (GRPO): the
    rollout step, the reorder by advantage sign, and one iteration of the rollout's own decode
    loop jitted alone (``sampling.make_decode_step``);
  * 'multi_turn' (GRPO with an interaction: ``build_grpo_programs(multi_turn=True)``): the
    segment program of multi-turn episodes (``episodes.EpisodeRunner.segment_fn``: the host's
    answers injected, then up to ``episodes.SEGMENT_STEPS`` decode steps of the slot pool);
  * 'evaluation' (every stage): the held-out evaluation's greedy generation;
  * 'evaluation_episodes' (GRPO with an interaction): the held-out evaluation's greedy
    multi-turn episodes (the segment program of ``GRPOPrograms.eval_episodes``, an
    ``episodes.EpisodeRunner`` with greedy=True, one slot per row);
  * 'reference' and, with sampled pairs, 'generation' (DPO): the reference pass and the sampling
    of the pairs.

The ``fitted_*`` builders choose the memory knobs with ``jaxrl_ga.fit``, compiling the steps
they govern (``FIT_STEPS``) before the first runs.

The forward's settings are one ``ForwardOptions`` (``forward_options``), passed as an argument down
to the model; the learner's may differ from the rollout's only in the rows that share a prompt
(``RolloutEngine.learner_options``: none after a reorder by advantage sign). Every generation
program prefills with the forward's attention (``model.attention``, resolved). With LoRA every
learner trains the adapters and takes the base weights as a frozen argument: the shardings are
split here (``lora.partition``), the params by ``trainers.context.TrainedPart``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxrl_ga import episodes
from jaxrl_ga import fit
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import logprobs
from jaxrl_ga import lora
from jaxrl_ga import placement
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import sampling
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import (DPOConfig, GRPOConfig, ModelSpec, OptimizerConfig, RunConfig,
                             SamplingConfig, SFTConfig)
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models import transformer as tfm


def resolve_attention(cfg: RunConfig, model_cfg: tfm.ModelConfig, device
                      ) -> tuple[RunConfig, Optional[str]]:
  """``cfg`` with model.attention resolved for ``device`` (the mesh's first: its platform, kind
  and compute capability) and the model (``attn_lib.resolve``): one of ATTENTION_IMPLS, so that
  every program of the run is built with one concrete implementation; and the console line
  ('model.attention=auto -> cudnn (NVIDIA H200, bfloat16)'), None when it was set explicitly.
  An implementation the devices cannot run is a ConfigError. Called once per run before
  anything compiles: api.build_context for the run's devices, plan.lower_grpo for the TPU
  topology it lowers for."""
  setting = cfg.model.attention
  try:
    impl, why = attn_lib.resolve(setting, device.platform, model_cfg.dtype, model_cfg,
                                 getattr(device, 'device_kind', ''),
                                 getattr(device, 'compute_capability', None))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  line = f'model.attention={setting} -> {impl} ({why})' if setting == attn_lib.AUTO else None
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=impl)), line


def forward_options(spec: ModelSpec, share_prompts: int = 1,
                    mesh: Any = None) -> tfm.ForwardOptions:
  """The training forward's options from ``model.*`` (scan_layers, remat, logprob_chunk_size,
  attention: resolved, ``resolve_attention``); ``share_prompts``: R, from ``rollout.prompt_share``
  (GRPO only); ``mesh``: the mesh the step is jitted over, where 'splash' runs its kernel per
  shard (``kernel_mesh``: ``sharding.KernelMesh``; None, or another attention: none). The
  trainers pass the memory knobs ``jaxrl_ga.fit`` chose (``fitted_*``); an 'auto' knob left here
  (a caller building programs directly) is fit's choice without a memory limit: remat 'none',
  chunk 0; an 'auto' attention, ``attn_lib.resolve``'s for jax's default device (the run itself
  resolves it once, ``resolve_attention``)."""
  attention = spec.attention
  if attention == attn_lib.AUTO:  # likewise: resolved for jax's default device
    device = jax.devices()[0]
    attention = attn_lib.resolve(attention, device.platform, spec.dtype, spec,
                                 getattr(device, 'device_kind', ''),
                                 getattr(device, 'compute_capability', None))[0]
  return tfm.ForwardOptions(
      scan_layers=spec.scan_layers, remat='none' if spec.remat == 'auto' else spec.remat,
      logprob_chunk_size=max(spec.logprob_chunk_size, 0),
      share_prompts=share_prompts, attention=attention,
      kernel_mesh=sharding.KernelMesh(mesh) if mesh is not None and attention == 'splash'
      else None)


def with_memory_knobs(cfg: RunConfig, remat: str, chunk: int) -> RunConfig:
  """``cfg`` with ``model.remat`` and ``model.logprob_chunk_size`` set (fit's candidates)."""
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat,
                                                            logprob_chunk_size=chunk))


def memory_limit(cfg: RunConfig, mesh):
  """The device memory the steps must fit (``fit.device_limit`` of ``mesh.device_memory_gib``
  and the mesh's devices), or None."""
  return fit.device_limit(cfg.mesh.device_memory_gib, list(mesh.devices.flat))


class Program(NamedTuple):
  """A table entry: a jitted step and the abstract arguments it runs on (ShapeDtypeStructs with
  their shardings, the shapes the trainer calls it with)."""
  fn: Any
  args: tuple

  def lower(self):
    return self.fn.lower(*self.args)


# What each step of a stage is called in fit's line and errors.
STEP_NAMES = {'learner': 'learner micro-step',
              'rollout': 'rollout step (generation, old and reference log-probs)',
              'reorder': 'reorder step (old log-probs)',
              'decode': 'decode step (one iteration of the rollout\'s decode loop)',
              'multi_turn': 'multi-turn segment (injection, then decode steps)',
              'evaluation': 'evaluation (greedy generation)',
              'evaluation_episodes': 'evaluation with tools (greedy multi-turn segment)',
              'generation': 'DPO generation (sampled pairs)',
              'reference': 'reference pass (reference log-probs; GRPO: on a mesh of its own)'}
# The steps the memory knobs (model.remat, model.logprob_chunk_size) change: what fit compiles.
# (and a multi-turn run's segment program: no knob changes it, but a run whose pool does not fit
# stops before the first step, as plan reports it)
FIT_STEPS = ('learner', 'rollout', 'reorder', 'reference', 'multi_turn')
DPO_GENERATION_PROMPTS = 32  # prompts per DPO generation call (fixed shape: one compile)


@dataclasses.dataclass(frozen=True)
class GRPOPrograms:
  """The GRPO stage's programs: the rollout engine (generation, old and reference log-probs, the
  reorder by advantage sign) and the learner, the schedule table they follow, and ``table``
  (name -> Program: 'learner', 'rollout', 'reorder' when old log-probs are deferred,
  'evaluation', 'decode', 'multi_turn' and 'evaluation_episodes' with an interaction);
  ``eval_episodes``: with an interaction, the evaluation's greedy ``episodes.EpisodeRunner``."""
  engine: rollout_lib.RolloutEngine
  learner: learner_lib.Learner
  schedule: schedule.ScheduleTable
  model_cfg: tfm.ModelConfig
  params: Any  # the policy's params as ShapeDtypeStructs (``abstract_params``)
  seed: int  # the rollout state's RNG seed (the run's)
  table: Mapping[str, Program]
  eval_episodes: Any = None  # episodes.EpisodeRunner of the evaluation (multi_turn only)

  @property
  def options(self) -> tfm.ForwardOptions:
    """The rollout's forward options (``engine.learner_options``: the learner's)."""
    return self.engine.options

  def reference_params(self, params):
    """The reference policy's params held in the state: the stage's input ``params`` when
    beta > 0, None without a KL term or under LoRA (the reference is the base, adapters off)."""
    return params if self.engine.use_ref and not self.engine.ref_is_base else None

  def init_state(self, params) -> dict[str, Any]:
    """The stage's starting state from its input ``params``: {'learner': TrainState, 'rollout':
    RolloutState, 'buffer': zeros of a rollout buffer, 'advantages': zeros, 'ref_params'}, what
    a checkpoint holds (under LoRA the learner trains the adapters; the base is not in it)."""
    return _grpo_state(self, params, abstract=False)

  def abstract_state(self) -> dict[str, Any]:
    """``init_state``'s shapes and shardings (ShapeDtypeStructs); nothing is computed."""
    return _grpo_state(self, self.params, abstract=True)


def _grpo_state(progs: GRPOPrograms, params, *, abstract: bool) -> dict[str, Any]:
  engine = progs.engine
  ref = progs.reference_params(params)
  trained, frozen = lora.partition(params, progs.model_cfg)  # LoRA: the base is frozen
  example = engine.abstract_micro_batch(params, ref)
  buffer, advantages = engine.abstract_buffer(params, ref), engine.abstract_advantages()
  if abstract:
    return {'learner': progs.learner.abstract_init(trained, example, frozen),
            'rollout': engine.abstract_state(), 'buffer': buffer, 'advantages': advantages,
            'ref_params': ref}
  # Before the first rollout the buffer slots hold zeros of the right shapes and shardings.
  zeros = lambda a: jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)()
  return {'learner': progs.learner.init(trained, example, frozen),
          'rollout': engine.init_state(progs.seed), 'buffer': jax.tree.map(zeros, buffer),
          'advantages': zeros(advantages), 'ref_params': ref}


@dataclasses.dataclass(frozen=True)
class LearnerPrograms:
  """The SFT or DPO stage's programs: the learner and ``table`` (name -> Program: 'learner',
  'evaluation'; DPO: 'reference', and 'generation' with sampled pairs)."""
  learner: learner_lib.Learner
  model_cfg: tfm.ModelConfig
  params: Any  # the policy's params as ShapeDtypeStructs
  example: dict  # a micro-batch's shapes (``sft_example``, ``dpo_example``)
  table: Mapping[str, Program]

  def init_state(self, params) -> learner_lib.TrainState:
    """The learner's starting state from the stage's input ``params`` (LoRA: the adapters)."""
    trained, frozen = lora.partition(params, self.model_cfg)
    return self.learner.init(trained, self.example, frozen)

  def abstract_state(self) -> learner_lib.TrainState:
    trained, frozen = lora.partition(self.params, self.model_cfg)
    return self.learner.abstract_init(trained, self.example, frozen)


def build_grpo_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings, *,
                        eos_id: sampling.EosIds, pad_id: int, grpo: Optional[GRPOConfig] = None,
                        graphdef: Any = None,
                        table: Optional[schedule.ScheduleTable] = None,
                        rollout_mesh=None, rollout_shardings=None, reference_mesh=None,
                        reference_shardings=None, lazy_inner: bool = True,
                        multi_turn: bool = False) -> GRPOPrograms:
  """The GRPO programs of ``cfg`` (``grpo``: its stage config, default ``cfg.grpo``) for
  ``model_cfg`` on ``mesh``. ``param_shardings``: the whole policy's (with LoRA: base and
  adapters; the learner trains the adapters, the base is a frozen step argument);
  ``rollout_mesh``, ``rollout_shardings``: the rollout role's (default: ``mesh``'s; the run's
  ``ctx.roles['rollout']``), where the rollout step runs; ``reference_mesh``,
  ``reference_shardings``: the reference role's (default: the rollout's);
  ``graphdef``: the model's (default: from ``model_cfg``); ``table``: the schedule table
  (default: ``schedule.build_table(grpo.schedule)``; benchmarks/recompute.py passes another rule's
  marks); ``lazy_inner``: the learner's (``learner.Learner``; False, plain ``MultiSteps.update``,
  is benchmarks/multisteps_overhead.py's eager arm). The schedule must already be valid for the
  mesh (``schedule.validate``).
  ``multi_turn``: rollouts are episodes with a host interaction (docs/design.md, "Multi-turn
  rollouts"): the engine's buffer carries a model mask and the table a 'multi_turn' entry, and
  the held-out evaluation runs greedy episodes ('evaluation_episodes', ``eval_episodes``)."""
  g = cfg.grpo if grpo is None else grpo
  sched = g.schedule
  graphdef = sharding.abstract_model(model_cfg)[0] if graphdef is None else graphdef
  sched_table = schedule.build_table(sched) if table is None else table
  share = math.gcd(*(rollout_lib.prompt_share(sched, sharding.data_parallel_size(m),
                                               cfg.model.share_prompt_prefix)
                      for m in (mesh, rollout_mesh or mesh)))  # rows no mesh moves
  options = forward_options(cfg.model, share, rollout_mesh or mesh)
  engine = rollout_lib.RolloutEngine(
      graphdef, sched_table, g.sampling, g.loss, mesh, param_shardings, eos_id=eos_id,
      pad_id=pad_id, mask_truncated_completions=g.advantage.mask_truncated_completions,
      defer_old_logps=g.advantage.order_by_advantage_sign, options=options,
      rollout_mesh=rollout_mesh, rollout_shardings=rollout_shardings,
      reference_mesh=reference_mesh, reference_shardings=reference_shardings,
      multi_turn=multi_turn)
  learner = _learner(
      graphdef, learner_lib.grpo_task_loss(g.loss, g.sampling.max_completion_length,
                                           g.sampling.temperature, engine.learner_options),
      g.optimizer, mesh, param_shardings, model_cfg, sched.optimizer_every,
      lr_scale=learner_lib.sequential_lr_scale(g.optimizer, sched),
      align_diagnostic=g.align_diagnostic, lazy_inner=lazy_inner)
  params = abstract_params(model_cfg, param_shardings)
  progs = GRPOPrograms(engine=engine, learner=learner, schedule=sched_table,
                       model_cfg=model_cfg, params=params, seed=cfg.seed, table={})
  state = progs.abstract_state()  # (its abstract_init also builds the learner's jitted step)
  ref, frozen = state['ref_params'], lora.partition(params, model_cfg)[1]
  entries = {
      'learner': Program(learner.step_fn, (state['learner'],
                                           engine.abstract_micro_batch(params, ref),
                                           *([] if frozen is None else [frozen]))),
      'rollout': Program(engine.step_fn, engine.abstract_step_args(params, ref))}
  if engine.reference_fn is not None:  # the reference log-probs on a mesh of their own
    entries['reference'] = Program(engine.reference_fn, engine.abstract_reference_args(ref))
  if engine.defer_old_logps:
    order = jax.ShapeDtypeStruct((sched.completions_per_rollout,), jnp.int32,
                                 sharding=sharding.replicated(mesh))
    entries['reorder'] = Program(engine.reorder_fn, (params, state['buffer'], state['rollout'],
                                                     state['advantages'], order))
  entries['decode'] = decode_program(engine, params)
  if multi_turn:
    rows = sched.completions_per_rollout // engine.share_prompts
    prompts = jax.ShapeDtypeStruct((rows, g.sampling.max_prompt_length), jnp.int32,
                                   sharding=sharding.batch_sharding(engine.rollout_mesh, 2))
    entries['multi_turn'] = Program(engine.episodes.segment_fn,
                                    engine.episodes.abstract_segment_args(
                                        engine.abstract_step_args(params)[0], prompts))
  entries['evaluation'] = evaluation_program(
      cfg, graphdef, mesh, param_shardings, params, eos_id=eos_id, pad_id=pad_id,
      max_prompt_length=g.sampling.max_prompt_length, attention=options.attention)
  runner = None
  if multi_turn:
    runner, entries['evaluation_episodes'] = evaluation_episodes_program(
        cfg, graphdef, mesh, params, eos_id=eos_id, pad_id=pad_id,
        max_prompt_length=g.sampling.max_prompt_length, attention=options.attention)
  return dataclasses.replace(progs, table=entries, eval_episodes=runner)


def decode_program(engine: rollout_lib.RolloutEngine, params, *,
                   completion_length: Optional[int] = None,
                   block: Optional[int] = None) -> Program:
  """One iteration of the rollout's decode loop (the loop body ``sampling.generate`` runs in
  the rollout step) jitted alone: its carry is that of one generation call, a batch of
  ``rollout_micro_batch_size`` rows (0: all) or the slot pool's. ``completion_length`` / ``block``
  (``jaxrl_ga.plan``'s estimate): the sampler's max_completion_length / decode_block replaced,
  so that the cache has Tp + completion_length - 1 slots and is read in blocks of ``block``
  (0: whole). ``params``: the actor's, as ShapeDtypeStructs (the step takes them on the
  rollout's mesh)."""
  sampler, sched = engine.sampler, engine.sched
  params = engine.abstract_step_args(params)[0]
  changes = {k: v for k, v in (('max_completion_length', completion_length),
                               ('decode_block', block)) if v is not None}
  sampler = dataclasses.replace(sampler, **changes)
  completions = sched.completions_per_rollout
  rows = completions if sampler.slots else (
      min(sampler.chunk_size, completions) if sampler.chunk_size else completions)
  mesh = engine.rollout_mesh  # where generation runs
  prompts = jax.ShapeDtypeStruct((rows // engine.gen_share, engine.sampling_cfg.max_prompt_length),
                                 jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
  return Program(*sampling.make_decode_step(engine.graphdef, sampler, params, prompts, prompts,
                                            share=engine.gen_share, mesh=mesh))


def _generation_program(graphdef, sampler: sampling.Sampler, mesh, param_shardings, params,
                        rows: int, prompt_length: int, *, greedy: bool) -> Program:
  """``sampling.make_generate_fn`` on ``mesh`` and its arguments: ``rows`` prompts of
  ``prompt_length`` tokens, a PRNGKey, temperature and top_p (float32 scalars)."""
  fn = sampling.make_generate_fn(graphdef, sampler, greedy=greedy, mesh=mesh,
                                 param_shardings=param_shardings)
  rep = sharding.replicated(mesh)
  prompts = jax.ShapeDtypeStruct((rows, prompt_length), jnp.int32,
                                 sharding=sharding.batch_sharding(mesh, 2))
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)  # jax.random.PRNGKey's
  return Program(fn, (params, prompts, prompts, key, scalar, scalar))


def evaluation_program(cfg: RunConfig, graphdef, mesh, param_shardings, params, *,
                       eos_id: sampling.EosIds, pad_id: int, max_prompt_length: int,
                       attention: str) -> Program:
  """The held-out evaluation's greedy generation (``trainers.evaluation.Evaluator``): batches of
  ``eval.batch_size`` prompts (rounded up to the data-parallel size) of ``max_prompt_length``
  tokens, ``eval.max_completion_length`` tokens each, prefilled with ``attention``."""
  sampler = sampling.Sampler(max_completion_length=cfg.eval.max_completion_length,
                             **sampling.eos_fields(eos_id), pad_id=pad_id, attention=attention,
                             fuse_weights=_fuse_weights(mesh))
  return _generation_program(graphdef, sampler, mesh, param_shardings, params,
                             placement.padded_batch_size(cfg.eval.batch_size, mesh),
                             max_prompt_length, greedy=True)


def evaluation_episodes_program(cfg: RunConfig, graphdef, mesh, params, *,
                                eos_id: sampling.EosIds, pad_id: int, max_prompt_length: int,
                                attention: str
                                ) -> tuple[episodes.EpisodeRunner, Program]:
  """The held-out evaluation's greedy multi-turn episodes (``trainers.evaluation.Evaluator``
  with tools): an ``episodes.EpisodeRunner`` with greedy=True, one slot per row, over the
  evaluation program's batch (``eval.batch_size`` rounded up to the data-parallel size, prompts of
  ``max_prompt_length`` tokens, ``eval.max_completion_length`` tokens per episode in all).
  -> (the runner, its segment program at its abstract arguments: the table entry)."""
  sampler = sampling.Sampler(max_completion_length=cfg.eval.max_completion_length,
                             **sampling.eos_fields(eos_id), pad_id=pad_id, attention=attention,
                             fuse_weights=_fuse_weights(mesh))
  runner = episodes.EpisodeRunner(graphdef, sampler, mesh, greedy=True)
  prompts = jax.ShapeDtypeStruct((placement.padded_batch_size(cfg.eval.batch_size, mesh),
                                  max_prompt_length), jnp.int32,
                                 sharding=sharding.batch_sharding(mesh, 2))
  return runner, Program(runner.segment_fn, runner.abstract_segment_args(params, prompts))


def generation_program(sampling_cfg: SamplingConfig, graphdef, mesh, param_shardings, params,
                       rows: int, *, eos_id: sampling.EosIds, pad_id: int, attention: str,
                       greedy: bool = False, block: Optional[int] = None) -> Program:
  """Generation (``sampling.make_generate_fn``) by ``sampling_cfg``'s sampler: ``rows`` prompts
  of ``sampling_cfg.max_prompt_length`` tokens, prefilled with ``attention``, sampled (or
  ``greedy``). DPO's 'generation' entry (``DPO_GENERATION_PROMPTS`` x samples_per_prompt rows);
  benchmarks/decode.py and benchmarks/uneven_rollout.py build it at their own batch. ``block``:
  as ``decode_program``'s, the sampler's decode_block replaced (0: every decode step attends
  over the whole cache, the sampler before issue 36)."""
  sampler = sampling.Sampler.from_config(sampling_cfg, eos_id=eos_id, pad_id=pad_id,
                                         attention=attention, fuse_weights=_fuse_weights(mesh))
  if block is not None:
    sampler = dataclasses.replace(sampler, decode_block=block)
  return _generation_program(graphdef, sampler, mesh, param_shardings, params, rows,
                             sampling_cfg.max_prompt_length, greedy=greedy)


def _fuse_weights(mesh) -> bool:
  """The decode loop's fused projections off the CPU (``Sampler.fuse_weights``), as the
  rollout's."""
  return mesh.devices.flat[0].platform != 'cpu'


def abstract_params(model_cfg: tfm.ModelConfig, param_shardings):
  """The params of ``model_cfg`` as ShapeDtypeStructs with ``param_shardings``."""
  shapes = sharding.abstract_model(model_cfg)[1]
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      shapes, param_shardings)


def lower(progs, steps=None) -> dict[str, Any]:
  """``progs.table``'s entries named in ``steps`` (default: all) lowered at their abstract
  arguments: jax.stages.Lowered, what ``jaxrl_ga.plan`` and ``jaxrl_ga.fit`` compile."""
  return {k: v.lower() for k, v in progs.table.items() if steps is None or k in steps}


def _fit_lowerings(progs):
  """fit's lowerings of ``progs``: the steps the memory knobs change, with their names."""
  return lambda: [(STEP_NAMES[k], v) for k, v in lower(progs, FIT_STEPS).items()]


def fitted_grpo_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings, *,
                         eos_id: sampling.EosIds, pad_id: int, grpo: Optional[GRPOConfig] = None,
                         graphdef: Any = None, table: Optional[schedule.ScheduleTable] = None,
                         say: Callable[[str], None] = fit.say, multi_turn: bool = False,
                         **roles) -> GRPOPrograms:
  """``build_grpo_programs`` with the memory knobs ``jaxrl_ga.fit`` chooses for the device:
  every step they change (``FIT_STEPS``: learner, rollout, reorder, the reference step on a mesh
  of its own; with ``multi_turn`` the segment program too) compiled and checked before the first
  runs (ConfigError when explicit knobs do not
  fit); the trainer's steps then find their executables compiled. ``roles``:
  build_grpo_programs' rollout and reference meshes and shardings."""
  g = cfg.grpo if grpo is None else grpo
  graphdef = sharding.abstract_model(model_cfg)[0] if graphdef is None else graphdef

  def build(remat, chunk):
    progs = build_grpo_programs(with_memory_knobs(cfg, remat, chunk), model_cfg, mesh,
                                param_shardings, eos_id=eos_id, pad_id=pad_id, grpo=g,
                                graphdef=graphdef, table=table, multi_turn=multi_turn,
                                **roles)
    return progs, _fit_lowerings(progs)

  return fit.choose(cfg.model, build, memory_limit(cfg, mesh), stage='grpo',
                    positions=g.sampling.max_completion_length,
                    batch_setting='grpo.schedule.micro_batch_size',
                    accum_setting='grpo.schedule.grad_accum_steps', say=say)[0]


def _row_example(shapes: Mapping[str, tuple[int, Any]], rows: int, mesh) -> dict:
  """A micro-batch's shapes: {key: (its length, 0 for one value per row; dtype)}, ``rows`` rows
  over the mesh's data axes (as ``placement.place_rows`` puts them)."""
  out = {}
  for key, (length, dtype) in shapes.items():
    shape = (rows, length) if length else (rows,)
    out[key] = jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=sharding.batch_sharding(mesh, len(shape)))
  return out


def sft_example(sft: SFTConfig, mesh) -> dict:
  """SFT's micro-batch (``trainers.sft.micro_batch``): tokens, attention_mask, loss_mask
  [micro_batch_size, max_length] int32."""
  return _row_example({k: (sft.max_length, jnp.int32)
                       for k in ('tokens', 'attention_mask', 'loss_mask')},
                      sft.micro_batch_size, mesh)


def dpo_example(dpo: DPOConfig, mesh) -> dict:
  """DPO's micro-batch (``trainers.dpo.PairStream.batch_at``): each side's tokens,
  attention_mask, loss_mask [micro_batch_size, max_length] int32 and reference log-probs
  (float32), ref_is_policy, and with rpo_alpha rpo_scale."""
  shapes = {f'{side}_{k}': (dpo.max_length, jnp.int32) for side in ('chosen', 'rejected')
            for k in ('tokens', 'attention_mask', 'loss_mask')}
  shapes.update({'ref_chosen_logps': (0, jnp.float32), 'ref_rejected_logps': (0, jnp.float32),
                 'ref_is_policy': (0, jnp.bool_)})
  if dpo.loss.rpo_alpha:
    shapes['rpo_scale'] = (0, jnp.float32)
  return _row_example(shapes, dpo.micro_batch_size, mesh)


def _learner_programs(learner: learner_lib.Learner, model_cfg, param_shardings, example: dict,
                      entries: dict[str, Program]) -> LearnerPrograms:
  params = abstract_params(model_cfg, param_shardings)
  progs = LearnerPrograms(learner=learner, model_cfg=model_cfg, params=params, example=example,
                          table={})
  state = progs.abstract_state()  # (also builds the learner's jitted step)
  frozen = lora.partition(params, model_cfg)[1]
  learner_entry = Program(learner.step_fn,
                          (state, example, *([] if frozen is None else [frozen])))
  return dataclasses.replace(progs, table={'learner': learner_entry, **entries})


def build_sft_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings,
                       graphdef, sft: Optional[SFTConfig] = None, *, eos_id: sampling.EosIds,
                       pad_id: int) -> LearnerPrograms:
  """SFT's programs (``sft``: the stage config, default ``cfg.sft``): the learner and the
  evaluation's generation (prompts of sft.max_length tokens)."""
  s = cfg.sft if sft is None else sft
  params = abstract_params(model_cfg, param_shardings)
  evaluation = evaluation_program(cfg, graphdef, mesh, param_shardings, params, eos_id=eos_id,
                                  pad_id=pad_id, max_prompt_length=s.max_length,
                                  attention=forward_options(cfg.model).attention)
  return _learner_programs(build_sft_learner(cfg, model_cfg, mesh, param_shardings, graphdef, s),
                           model_cfg, param_shardings, sft_example(s, mesh),
                           {'evaluation': evaluation})


def build_dpo_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings,
                       graphdef, dpo: Optional[DPOConfig] = None, *, eos_id: sampling.EosIds,
                       pad_id: int,
                       reference: Optional[tuple[Any, tfm.ModelConfig, Any]] = None,
                       reference_spec: Optional[ModelSpec] = None) -> LearnerPrograms:
  """DPO's programs (``dpo``: the stage config, default ``cfg.dpo``): the learner, the
  evaluation's generation, the reference pass (``build_reference_logps``: micro_batch_size
  pairs' sides, rounded up to the data-parallel size) and with sampled pairs their generation
  (``DPO_GENERATION_PROMPTS`` prompts x samples_per_prompt rows). ``reference``: (graphdef,
  model config, param shardings) of ``dpo.ref_model``; default the policy's. ``reference_spec``:
  the model settings of the reference pass (default ``cfg.model``; fit's candidates keep the
  run's own: the pass runs before the knobs are chosen)."""
  d = cfg.dpo if dpo is None else dpo
  params = abstract_params(model_cfg, param_shardings)
  options = forward_options(cfg.model)
  entries = {'evaluation': evaluation_program(
      cfg, graphdef, mesh, param_shardings, params, eos_id=eos_id, pad_id=pad_id,
      max_prompt_length=d.sampling.max_prompt_length, attention=options.attention)}
  ref_graphdef, ref_params = graphdef, params
  if reference is not None:
    ref_graphdef, ref_model_cfg, ref_shardings = reference
    ref_params = abstract_params(ref_model_cfg, ref_shardings)
  rows = jax.ShapeDtypeStruct((placement.padded_batch_size(d.micro_batch_size, mesh),
                               d.max_length), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
  ref_cfg = cfg if reference_spec is None else dataclasses.replace(cfg, model=reference_spec)
  entries['reference'] = Program(build_reference_logps(ref_cfg, ref_graphdef),
                                 (ref_params, rows, rows, rows))
  if d.pairs != 'dataset':
    entries['generation'] = generation_program(
        d.sampling, graphdef, mesh, param_shardings, params,
        DPO_GENERATION_PROMPTS * d.samples_per_prompt, eos_id=eos_id, pad_id=pad_id,
        attention=options.attention)
  return _learner_programs(build_dpo_learner(cfg, model_cfg, mesh, param_shardings, graphdef, d),
                           model_cfg, param_shardings, dpo_example(d, mesh), entries)


def _fitted(cfg: RunConfig, build: Callable[[RunConfig], LearnerPrograms], mesh, *, stage: str,
            positions: int, say: Callable[[str], None]) -> LearnerPrograms:
  """``build(cfg)`` with the memory knobs fit chooses for its learner micro-step."""

  def built(remat, chunk):
    progs = build(with_memory_knobs(cfg, remat, chunk))
    return progs, _fit_lowerings(progs)

  return fit.choose(cfg.model, built, memory_limit(cfg, mesh), stage=stage, positions=positions,
                    batch_setting=f'{stage}.micro_batch_size',
                    accum_setting=f'{stage}.grad_accum_steps', say=say)[0]


def fitted_sft_programs(cfg: RunConfig, model_cfg, mesh, param_shardings, graphdef,
                        sft: SFTConfig, *, eos_id: sampling.EosIds, pad_id: int,
                        say: Callable[[str], None] = fit.say) -> LearnerPrograms:
  """``build_sft_programs`` with the memory knobs fit chooses for its micro-step."""
  return _fitted(cfg, lambda c: build_sft_programs(c, model_cfg, mesh, param_shardings, graphdef,
                                                   sft, eos_id=eos_id, pad_id=pad_id),
                 mesh, stage='sft', positions=sft.max_length, say=say)


def fitted_dpo_programs(cfg: RunConfig, model_cfg, mesh, param_shardings, graphdef,
                        dpo: DPOConfig, *, eos_id: sampling.EosIds, pad_id: int,
                        reference: Optional[tuple[Any, tfm.ModelConfig, Any]] = None,
                        say: Callable[[str], None] = fit.say) -> LearnerPrograms:
  """``build_dpo_programs`` with the memory knobs fit chooses for its micro-step (the reference
  pass keeps ``cfg.model``'s: it runs before, as fit's choice without a limit)."""
  return _fitted(cfg, lambda c: build_dpo_programs(
      c, model_cfg, mesh, param_shardings, graphdef, dpo, eos_id=eos_id, pad_id=pad_id,
      reference=reference, reference_spec=cfg.model),
                 mesh, stage='dpo', positions=dpo.max_length, say=say)


def _learner(graphdef, task_loss, opt: OptimizerConfig, mesh, param_shardings, model_cfg,
             optimizer_every: int, **kwargs) -> learner_lib.Learner:
  """A Learner of ``task_loss``; with LoRA it trains the adapters, the base a frozen argument."""
  trained_shardings, frozen_shardings = lora.partition(param_shardings, model_cfg)
  return learner_lib.Learner(graphdef, task_loss, opt, mesh, trained_shardings,
                             optimizer_every=optimizer_every, frozen_shardings=frozen_shardings,
                             **kwargs)


def build_sft_learner(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings,
                      graphdef, sft: Optional[SFTConfig] = None) -> learner_lib.Learner:
  """SFT's learner (``sft``: the stage config, default ``cfg.sft``)."""
  s = cfg.sft if sft is None else sft
  loss = learner_lib.sft_task_loss(forward_options(cfg.model, mesh=mesh))
  return _learner(graphdef, loss, s.optimizer, mesh, param_shardings, model_cfg,
                  s.grad_accum_steps)


def build_dpo_learner(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings,
                      graphdef, dpo: Optional[DPOConfig] = None) -> learner_lib.Learner:
  """DPO's learner (``dpo``: the stage config, default ``cfg.dpo``)."""
  d = cfg.dpo if dpo is None else dpo
  loss = learner_lib.dpo_task_loss(d.loss, forward_options(cfg.model, mesh=mesh))
  return _learner(graphdef, loss, d.optimizer, mesh, param_shardings, model_cfg,
                  d.grad_accum_steps)


def build_reference_logps(cfg: RunConfig, graphdef) -> Callable:
  """DPO's reference pass, the learner's forward (``forward_options``) without a learner:
  jitted (params, tokens, attention_mask, loss_mask) -> summed log-probs [B]."""
  options = forward_options(cfg.model)
  return jax.jit(lambda p, t, a, l: logprobs.sequence_logps(
      tfm.merge(graphdef, p), t, a, l, options)[0])
