"""Each stage's jitted programs, built in one place from the run's config. GRPO's trainer,
``jaxrl_ga.plan`` and benchmarks/recompute.py build their engine and learner here
(``build_grpo_programs``), so that what ``plan`` compiles and what a benchmark times is the program
that trains (layers scanned or unrolled, remat, the log-prob chunk, the shared prompt forward,
deferred old log-probs, LoRA); SFT's learner (``build_sft_learner``) and DPO's learner
(``build_dpo_learner``) and reference pass (``build_reference_logps``) likewise.

  programs = build_grpo_programs(cfg, model_cfg, mesh, param_shardings, eos_id=..., pad_id=...)
  programs.engine.rollout_rows(...); programs.learner.step(...)

The forward's settings are one ``ForwardOptions`` (``forward_options``), passed as an argument down
to the model; the learner's may differ from the rollout's only in the rows that share a prompt
(``RolloutEngine.learner_options``: none after a reorder by advantage sign). With LoRA every
learner trains the adapters and takes the base weights as a frozen argument: the shardings are
split here (``lora.partition``), the params by ``trainers.context.TrainedPart``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax

from jaxrl_ga import fit
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import logprobs
from jaxrl_ga import lora
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import DPOConfig, GRPOConfig, ModelSpec, OptimizerConfig, RunConfig, SFTConfig
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


@dataclasses.dataclass(frozen=True)
class GRPOPrograms:
  """The GRPO stage's programs: the rollout engine (generation, old and reference log-probs, the
  reorder by advantage sign) and the learner, with the schedule table they follow."""
  engine: rollout_lib.RolloutEngine
  learner: learner_lib.Learner
  table: schedule.ScheduleTable

  @property
  def options(self) -> tfm.ForwardOptions:
    """The rollout's forward options (``engine.learner_options``: the learner's)."""
    return self.engine.options


def build_grpo_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings, *,
                        eos_id: int, pad_id: int, grpo: Optional[GRPOConfig] = None,
                        graphdef: Any = None,
                        table: Optional[schedule.ScheduleTable] = None,
                        rollout_mesh=None, rollout_shardings=None, reference_mesh=None,
                        reference_shardings=None) -> GRPOPrograms:
  """The GRPO engine and learner of ``cfg`` (``grpo``: its stage config, default ``cfg.grpo``) for
  ``model_cfg`` on ``mesh``. ``param_shardings``: the whole policy's (with LoRA: base and
  adapters; the learner trains the adapters, the base is a frozen step argument);
  ``rollout_mesh``, ``rollout_shardings``: the rollout role's (default: ``mesh``'s; the run's
  ``ctx.roles['rollout']``), where the rollout step runs; ``reference_mesh``,
  ``reference_shardings``: the reference role's (default: the rollout's);
  ``graphdef``: the model's (default: from ``model_cfg``); ``table``: the schedule table
  (default: ``schedule.build_table(grpo.schedule)``; benchmarks/recompute.py passes another rule's
  marks). The schedule must already be valid for the mesh (``schedule.validate``)."""
  g = cfg.grpo if grpo is None else grpo
  sched = g.schedule
  graphdef = sharding.abstract_model(model_cfg)[0] if graphdef is None else graphdef
  table = schedule.build_table(sched) if table is None else table
  share = math.gcd(*(rollout_lib.prompt_share(sched, sharding.data_parallel_size(m),
                                               cfg.model.share_prompt_prefix)
                      for m in (mesh, rollout_mesh or mesh)))  # rows no mesh moves
  engine = rollout_lib.RolloutEngine(
      graphdef, table, g.sampling, g.loss, mesh, param_shardings, eos_id=eos_id, pad_id=pad_id,
      mask_truncated_completions=g.advantage.mask_truncated_completions,
      defer_old_logps=g.advantage.order_by_advantage_sign,
      options=forward_options(cfg.model, share, rollout_mesh or mesh), rollout_mesh=rollout_mesh,
      rollout_shardings=rollout_shardings, reference_mesh=reference_mesh,
      reference_shardings=reference_shardings)
  learner = _learner(
      graphdef, learner_lib.grpo_task_loss(g.loss, g.sampling.max_completion_length,
                                           g.sampling.temperature, engine.learner_options),
      g.optimizer, mesh, param_shardings, model_cfg, sched.optimizer_every,
      lr_scale=learner_lib.sequential_lr_scale(g.optimizer, sched),
      align_diagnostic=g.align_diagnostic)
  return GRPOPrograms(engine=engine, learner=learner, table=table)


# What each step of a stage is called in fit's line and errors.
STEP_NAMES = {'learner': 'learner micro-step',
              'rollout': 'rollout step (generation, old and reference log-probs)',
              'reorder': 'reorder step (old log-probs)',
              'reference': 'reference step (reference log-probs on their own mesh)'}


def abstract_params(model_cfg: tfm.ModelConfig, param_shardings):
  """The params of ``model_cfg`` as ShapeDtypeStructs with ``param_shardings``."""
  shapes = sharding.abstract_model(model_cfg)[1]
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      shapes, param_shardings)


def lower_grpo_steps(programs: GRPOPrograms, params, grpo: GRPOConfig, model_cfg,
                     steps=('learner', 'rollout')) -> dict[str, Any]:
  """The GRPO programs' ``steps`` lowered at the run's shapes and shardings from ``params``
  (ShapeDtypeStructs, ``abstract_params``): {'learner': the micro-step at the full completion
  width, 'rollout': generation with the old and reference log-probs, 'reference' (with a
  reference mesh of its own): the reference log-probs there, 'reorder' (with
  ``advantage.order_by_advantage_sign`` when 'rollout' is asked): the step that then computes the
  old log-probs} as jax.stages.Lowered, what ``jaxrl_ga.plan`` and ``jaxrl_ga.fit`` compile."""
  engine = programs.engine
  ref = params if grpo.loss.beta > 0 and not engine.ref_is_base else None
  out = {}
  if 'learner' in steps:
    example = engine.abstract_micro_batch(params, ref)
    trained, frozen = lora.partition(params, model_cfg)  # LoRA: the base is a frozen argument
    lstate = programs.learner.abstract_init(trained, example, frozen)
    out['learner'] = programs.learner.step_fn.lower(lstate, example,
                                                    *([] if frozen is None else [frozen]))
  if 'rollout' in steps:
    out['rollout'] = engine.step_fn.lower(*engine.abstract_step_args(params, ref))
    if engine.reference_fn is not None:
      out['reference'] = engine.reference_fn.lower(*engine.abstract_reference_args(ref))
    state = engine.abstract_state()
    if engine.defer_old_logps:
      order = jax.ShapeDtypeStruct((grpo.schedule.completions_per_rollout,), jax.numpy.int32,
                                   sharding=sharding.replicated(programs.engine.mesh))
      out['reorder'] = engine.reorder_fn.lower(params, engine.abstract_buffer(params, ref),
                                               state, engine.abstract_advantages(), order)
  return out


def fitted_grpo_programs(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh, param_shardings, *,
                         eos_id: int, pad_id: int, grpo: Optional[GRPOConfig] = None,
                         graphdef: Any = None, table: Optional[schedule.ScheduleTable] = None,
                         say: Callable[[str], None] = fit.say, **roles) -> GRPOPrograms:
  """``build_grpo_programs`` with the memory knobs ``jaxrl_ga.fit`` chooses for the device:
  every step (learner, rollout, reorder) compiled and checked before the first runs (ConfigError
  when explicit knobs do not fit); the trainer's steps then find their executables compiled.
  ``roles``: build_grpo_programs' rollout and reference meshes and shardings."""
  g = cfg.grpo if grpo is None else grpo
  graphdef = sharding.abstract_model(model_cfg)[0] if graphdef is None else graphdef
  params = abstract_params(model_cfg, param_shardings)

  def build(remat, chunk):
    progs = build_grpo_programs(with_memory_knobs(cfg, remat, chunk), model_cfg, mesh,
                                param_shardings, eos_id=eos_id, pad_id=pad_id, grpo=g,
                                graphdef=graphdef, table=table, **roles)
    return progs, lambda: [(STEP_NAMES[k], v) for k, v in
                           lower_grpo_steps(progs, params, g, model_cfg).items()]

  return fit.choose(cfg.model, build, memory_limit(cfg, mesh), stage='grpo',
                    positions=g.sampling.max_completion_length,
                    batch_setting='grpo.schedule.micro_batch_size',
                    accum_setting='grpo.schedule.grad_accum_steps', say=say)[0]


def _fitted_learner(cfg: RunConfig, build: Callable[[RunConfig], learner_lib.Learner],
                    model_cfg, mesh, param_shardings, example: dict, *, stage: str,
                    positions: int, say: Callable[[str], None]) -> learner_lib.Learner:
  """``build(cfg)`` with the memory knobs fit chooses for its micro-step on ``example`` (a
  micro-batch, real or abstract)."""
  params = abstract_params(model_cfg, param_shardings)
  example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         example)

  def built(remat, chunk):
    lrn = build(with_memory_knobs(cfg, remat, chunk))

    def lower():
      trained, frozen = lora.partition(params, model_cfg)
      state = lrn.abstract_init(trained, example, frozen)
      return [(STEP_NAMES['learner'],
               lrn.step_fn.lower(state, example, *([] if frozen is None else [frozen])))]
    return lrn, lower

  return fit.choose(cfg.model, built, memory_limit(cfg, mesh), stage=stage, positions=positions,
                    batch_setting=f'{stage}.micro_batch_size',
                    accum_setting=f'{stage}.grad_accum_steps', say=say)[0]


def fitted_sft_learner(cfg: RunConfig, model_cfg, mesh, param_shardings, graphdef,
                       sft: SFTConfig, example: dict, say: Callable[[str], None] = fit.say
                       ) -> learner_lib.Learner:
  """``build_sft_learner`` with the memory knobs fit chooses for its micro-step on
  ``example`` (the first micro-batch)."""
  return _fitted_learner(
      cfg, lambda c: build_sft_learner(c, model_cfg, mesh, param_shardings, graphdef, sft),
      model_cfg, mesh, param_shardings, example, stage='sft', positions=sft.max_length,
      say=say)


def fitted_dpo_learner(cfg: RunConfig, model_cfg, mesh, param_shardings, graphdef,
                       dpo: DPOConfig, example: dict, say: Callable[[str], None] = fit.say
                       ) -> learner_lib.Learner:
  """``build_dpo_learner`` with the memory knobs fit chooses for its micro-step on ``example``
  (the first micro-batch)."""
  return _fitted_learner(
      cfg, lambda c: build_dpo_learner(c, model_cfg, mesh, param_shardings, graphdef, dpo),
      model_cfg, mesh, param_shardings, example, stage='dpo', positions=dpo.max_length,
      say=say)


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
