"""The plan's library: the run's GRPO programs lowered and compiled for a TPU topology, without a
TPU, and the report made of the compiler's numbers (what ``python -m jaxrl_ga.plan`` prints; its
module docstring describes the report).

``jaxrl_ga.plan`` is the command line: it sets ``JAX_PLATFORMS=cpu`` before JAX is imported and
then imports this module, which imports JAX. ``plan.lower_grpo`` etc. are this module's
(``jaxrl_ga.plan`` hands its attributes on).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from jax.experimental import topologies

from jaxrl_ga import fit
from jaxrl_ga import flops as flops_lib
from jaxrl_ga import programs as programs_lib
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import AUTO_CHUNK
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.fit import CHIPS  # plan.CHIPS for users (benchmarks/accelerator.py)
from jaxrl_ga.host_memory import quiet_libtpu_env  # pylint: disable=unused-import (plan's API)
from jaxrl_ga.models import policy

STEP_KEYS = ('argument_bytes', 'output_bytes', 'temp_bytes', 'peak_bytes', 'flops',
             'bytes_accessed', 'optimal_seconds')
NOTE = ('Compiler numbers and estimates, not a measurement: memory from the TPU compiler\'s '
        'memory analysis; flops from the model\'s shapes; times from a roofline of the chip\'s '
        'published peaks (an upper bound on speed, so MFU is an upper bound).')


def topology_devices(topology: str, num_slices: int = 1):
  """The devices of a TPU topology such as 'v5e:2x4' or 'v4:2x2x4' (libtpu's compiler; no TPU
  needed), ``num_slices`` slices of it. v4 and v5p chips are megacore: one device per chip, as
  on a TPU VM (MaxText's accelerator_to_spec_map does the same). Raises ConfigError for a
  topology libtpu does not know or without libtpu."""
  if not re.fullmatch(r'v\d+[a-z]*:\d+(x\d+)*', topology or ''):
    raise ConfigError(f'--topology={topology!r}: expected <chip>:<shape> such as v5e:2x4, '
                      'v5p:2x2x1, v4:2x2x4 or v6e:2x2.')
  try:
    kwargs = {'chip_config_name': 'megacore'} if topology.split(':')[0] in (
        'v4', 'v5', 'v5p') else {}
    if num_slices > 1:
      kwargs['num_slices'] = num_slices
    dims = [int(x) for x in topology.split(':')[1].split('x')]
    if math.prod(dims) < 4:  # fewer chips than libtpu's default host (2x2x1), e.g. v5e:1x1
      kwargs['chips_per_host_bounds'] = tuple(dims) + (1,) * (3 - len(dims))
    desc = topologies.get_topology_desc(platform='tpu', topology_name=topology, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f'--topology={topology!r}: libtpu could not describe it ({msg}); install '
                      "libtpu (pip install 'jax[tpu]') and use a shape libtpu knows, e.g. "
                      'v5e:2x4.') from None
  return list(desc.devices)


# -- analytic costs (the FLOP model: jaxrl_ga.flops) ----------------------------------------------
def _dtype_bytes(name: str) -> int:
  return 2 if name == 'bfloat16' else 4


# -- building the steps abstractly (the model: models/policy.planned_model_config) -------------
@dataclasses.dataclass
class Steps:
  """The lowered steps of a GRPO run on a mesh (lowered, not yet compiled)."""
  mesh: Any
  model_cfg: Any
  programs: Any  # programs.GRPOPrograms: the trainer's programs and their table
  rollout: Any  # jax.stages.Lowered
  learner: Any
  reorder: Any  # the reorder step of deferred old log-probs; None without
  learner_rows: int  # sequences per micro-step (global)
  rollout_rows: int  # completions per rollout (global)
  recompute_rows: int  # old-log-prob rows of the rollout with the most marked slices
  decode: Any = None  # the decode estimate: the rollout's loop body at the mean fill; None without
  decode_rows: int = 0  # rows that step decodes (global): the pool's slots, or a batch's rows
  decode_cache_slots: int = 0  # the KV cache slots it reads: their mean over a whole completion
  # every other entry of the programs' table, lowered ('decode': the loop body at the real
  # shapes, 'evaluation': the held-out evaluation's generation)
  others: dict = dataclasses.field(default_factory=dict)


def lower_grpo(cfg, model_cfg, devices, *, remat: Optional[str] = None,
               logprob_chunk_size: Optional[int] = None, steps=None,
               eos_id: int = 0, pad_id: int = 0, multi_turn: bool = False) -> Steps:
  """Lowers the GRPO programs of ``cfg`` (a RunConfig) on ``devices``: the programs the trainer
  runs, the entries of the same factory's table (``programs.build_grpo_programs``: layers
  scanned or unrolled, remat, the log-prob chunk, the shared prompt forward, deferred old
  log-probs, LoRA), lowered at the config's shapes and shardings from abstract params.
  ``steps``: the entries to lower (default: every one; 'rollout' brings 'reorder', with
  ``grpo.advantage.order_by_advantage_sign``, and the decode estimate). ``remat`` /
  ``logprob_chunk_size`` override ``cfg.model``'s. ``eos_id`` / ``pad_id``: the tokenizer's
  (constants of the generation steps; they change neither their memory nor their flops).
  ``multi_turn``: rollouts are episodes (its 'multi_turn' segment program lands in ``others``)."""

  knobs = {k: v for k, v in (('remat', remat), ('logprob_chunk_size', logprob_chunk_size))
           if v is not None}
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **knobs))
  # model.attention='auto' for these devices (a TPU topology's: 'splash'), not the host's CPU.
  cfg, _ = programs_lib.resolve_attention(cfg, model_cfg, devices[0])
  g = cfg.grpo
  sched = g.schedule
  # Each role's mesh (mesh.rollout / mesh.reference: slices of ``devices``), as the run builds them.
  meshes = sharding.role_meshes(cfg.mesh, devices)
  mesh = meshes['actor']
  for m in dict.fromkeys(meshes.values()):  # as GRPOStage.validate / validate_roles
    schedule.validate(sched, sharding.data_parallel_size(m))
  graphdef, shapes, axes = sharding.abstract_model(model_cfg)
  on = {id(m): sharding.param_shardings(shapes, axes, m) for m in meshes.values()}
  progs = programs_lib.build_grpo_programs(
      cfg, model_cfg, mesh, on[id(mesh)], eos_id=eos_id, pad_id=pad_id, graphdef=graphdef,
      rollout_mesh=meshes['rollout'], rollout_shardings=on[id(meshes['rollout'])],
      reference_mesh=meshes['reference'], reference_shardings=on[id(meshes['reference'])],
      multi_turn=multi_turn)
  engine = progs.engine
  if steps is None:
    steps = tuple(progs.table)
  elif 'rollout' in steps:
    steps = tuple(steps) + ('reorder',)
  lowered = programs_lib.lower(progs, steps)
  rollout, reorder, learner = (lowered.pop(k, None) for k in ('rollout', 'reorder', 'learner'))
  marks = int(progs.schedule.slice_recompute.sum(axis=1).max()) \
      if g.sampling.old_logprob_source == 'recompute' else 0
  b = sched.micro_batch_size
  rows = decode_rows(engine.sampler, sched.completions_per_rollout)
  tc = g.sampling.max_completion_length
  slots = g.sampling.max_prompt_length + tc // 2
  # The decode estimate: the rollout's own loop body (programs.decode_program) with a KV cache
  # at the mean fill of a completion, Tp + Tc // 2 slots, read whole (block 0: no loop over the
  # filled blocks, so that the compiler's cost analysis counts all of it).
  decode = programs_lib.decode_program(engine, progs.params, completion_length=tc // 2 + 1,
                                       block=0).lower() if 'rollout' in steps else None
  return Steps(mesh=mesh, model_cfg=model_cfg, programs=progs, rollout=rollout, learner=learner,
               reorder=reorder, learner_rows=b, rollout_rows=sched.completions_per_rollout,
               recompute_rows=marks * b, decode=decode, decode_rows=rows,
               decode_cache_slots=slots, others=lowered)


def fitted_steps(cfg, model_cfg, devices, limit: float, chip: str):
  """``lower_grpo`` at the memory knobs ``jaxrl_ga.fit`` chooses against ``limit`` bytes per
  chip ('auto' knobs: the cheapest whose steps fit; when none does, the least memory, which the
  report then shows not fitting). -> (``cfg`` with the knobs chosen, the Steps)."""
  spec = cfg.model
  built = {}

  def build(remat, chunk):
    st = built.setdefault((remat, chunk), lower_grpo(
        cfg, model_cfg, devices, remat=remat, logprob_chunk_size=chunk,
        multi_turn=bool(cfg.grpo.tools or cfg.grpo.environment)))  # episodes: jaxrl_ga.tools
    return st, lambda: [(programs_lib.STEP_NAMES[k], v) for k, v in (
        ('learner', st.learner), ('rollout', st.rollout), ('reorder', st.reorder),
        ('multi_turn', st.others.get('multi_turn'))) if v is not None]

  try:
    steps, remat, chunk = fit.choose(
        spec, build, (int(limit), f"the {chip}'s HBM less --headroom"), stage='plan',
        positions=cfg.grpo.sampling.max_completion_length,
        batch_setting='grpo.schedule.micro_batch_size',
        accum_setting='grpo.schedule.grad_accum_steps', say=lambda line: None)
  except ConfigError:  # nothing fits: report the least memory
    remat = fit.remat_candidates(spec.remat)[-1]
    chunk = fit.chunk_candidates(spec.logprob_chunk_size,
                                 cfg.grpo.sampling.max_completion_length)[-1]
    steps = build(remat, chunk)[0]
  return programs_lib.with_memory_knobs(cfg, remat, chunk), steps


def decode_rows(sampler, completions: int) -> int:
  """Rows one iteration of the rollout's decode loop decodes (global): the slot pool's slots
  (``sampling.decode_slots``), else a generation chunk's rows (``rollout_micro_batch_size``; 0:
  all ``completions`` at once)."""
  size = sampler.slots or sampler.chunk_size
  return min(size, completions) if size else completions


def decode_steps(sampler, completions: int, completion_length: int) -> int:
  """Decode-loop iterations of a rollout whose completions all reach ``completion_length``
  tokens (token 0 comes from the prefill): the pool's (its tokens over its slots), or every
  chunk's ``completion_length - 1``."""
  rows, tokens = decode_rows(sampler, completions), completion_length - 1
  if sampler.slots:
    return -(-completions * tokens // rows)
  return completions // rows * tokens


# -- compiling and reporting ---------------------------------------------------------------------
def compile_step(lowered) -> dict[str, Any]:
  """Compiles; -> the compiler's numbers, or for a program the compiler rejects for memory,
  the peak it reported (``compiled`` False, ``error``)."""
  compiled, peak, error = fit.compile_or_oom(lowered)
  if compiled is None:
    out = {k: None for k in STEP_KEYS}
    out.update(compiled=False, error=error, executable=None, peak_bytes=peak)
    return out
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  opt = float(cost.get('optimal_seconds', -1.0))
  return {
      'compiled': True, 'executable': compiled,
      'argument_bytes': int(mem.argument_size_in_bytes),
      'output_bytes': int(mem.output_size_in_bytes),
      'alias_bytes': int(mem.alias_size_in_bytes),
      'temp_bytes': int(mem.temp_size_in_bytes),
      'peak_bytes': peak,  # what the step holds at once (fit.step_bytes)
      'compiler_flops': float(cost.get('flops', 0.0)),
      'compiler_bytes_accessed': float(cost.get('bytes accessed', 0.0)),
      'optimal_seconds': opt if opt > 0 else None,
  }


def chip_spec(devices) -> dict[str, Any]:
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise ConfigError(f'no chip spec for device kind {kind!r}; known: {", ".join(CHIPS)}.')
  return CHIPS[kind]


def plan(cfg, topology: str, *, hf_config: Optional[str] = None, headroom: float = 0.1,
         devices=None, num_slices: int = 1) -> dict[str, Any]:
  """Compiles ``cfg``'s GRPO steps for ``topology``; -> the report (see the module doc)."""
  if 'grpo' not in cfg.stages:
    raise ConfigError(f'stages={",".join(cfg.stages)}: the plan compiles the GRPO steps; '
                      'include grpo in --config.stages.')
  if not cfg.grpo.sampling.max_prompt_length:
    raise ConfigError('grpo.sampling.max_prompt_length=0 is chosen from the data when a run '
                      'reads it; the plan compiles one width: set it (a run prints the width it '
                      'chose in its first [grpo] prompt line).')
  devices = devices or topology_devices(topology, num_slices)
  chip = chip_spec(devices)
  m = policy.planned_model_config(cfg, hf_config)
  cfg, _ = programs_lib.resolve_attention(cfg, m, devices[0])  # the report's; as lower_grpo's
  auto = [k for k, v in (('remat', cfg.model.remat == 'auto'),
                         ('logprob_chunk_size', cfg.model.logprob_chunk_size == AUTO_CHUNK)) if v]
  cfg, steps = fitted_steps(cfg, m, devices, (1.0 - headroom) * chip['hbm_bytes'], chip['name'])
  n = len(devices)
  hosts = len({d.process_index for d in devices})
  g = cfg.grpo
  tp, tc = g.sampling.max_prompt_length, g.sampling.max_completion_length
  dt = _dtype_bytes(m.dtype)
  weights = flops_lib.param_count(m) * dt  # every chip reads the (gathered) weights in full
  report_steps = {}

  engine = steps.programs.engine
  deferred = steps.reorder is not None

  # rollout (generation, old log-probs unless deferred to the reorder, reference log-probs)
  r = compile_step(steps.rollout)
  flops = flops_lib.rollout_flops(
      m, steps.rollout_rows, tp, tc, generation_share=engine.gen_share,
      old_logp_rows=0 if deferred else steps.recompute_rows,
      old_logp_share=engine.micro_batch_share,
      ref_rows=steps.rollout_rows if engine.use_ref else 0, ref_share=engine.share_prompts) / n
  # Decode reads: every step the weights and its rows' filled cache (on average the mean fill).
  slot_bytes = m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_size * dt
  n_steps = decode_steps(engine.sampler, steps.rollout_rows, tc)
  analytic_bytes = (n_steps + 2) * weights + n_steps * (
      steps.decode_rows / n) * steps.decode_cache_slots * slot_bytes
  r.update(_timing(r, flops, flops, analytic_bytes, chip))
  r['completions_per_second'] = steps.rollout_rows / r['roofline_seconds']
  r['decode_tokens_per_second'] = steps.rollout_rows * tc / r['roofline_seconds']
  report_steps['rollout'] = r
  decode = _decode_report(compile_step(steps.decode), steps, engine, n_steps, chip)

  # the reorder by advantage sign, which then computes the old log-probs (rows in any order)
  if deferred:
    ro = compile_step(steps.reorder)
    flops = flops_lib.rollout_flops(m, 0, tp, tc, old_logp_rows=steps.recompute_rows) / n
    ro.update(_timing(ro, flops, flops, weights, chip))
    report_steps['reorder'] = ro

  # learner
  lr = compile_step(steps.learner)
  counts = flops_lib.learner_flops(m, steps.learner_rows, tp, tc, engine.learner_options)
  lr.update(_timing(lr, counts['executed'] / n, counts['model'] / n, 3 * weights, chip))
  lr['tokens_per_second'] = steps.learner_rows * (tp + tc) / lr['roofline_seconds']
  report_steps['learner'] = lr

  # The table's other programs, memory only: the held-out evaluation's generation and the
  # decode loop's body at the run's shapes (the decode estimate above times it).
  others = {name: compile_step(lowered) for name, lowered in steps.others.items()}

  limit = (1.0 - headroom) * chip['hbm_bytes']
  for step in [*report_steps.values(), *others.values()]:
    step['fits'] = bool(step['compiled'] and step['peak_bytes'] <= limit)
    step['hbm_fraction'] = None if step['peak_bytes'] is None else \
        step['peak_bytes'] / chip['hbm_bytes']
  fits = all(s['fits'] for s in [*report_steps.values(), *others.values()])
  sched = g.schedule
  micro_per_opt = sched.optimizer_every
  rollouts_per_opt = micro_per_opt / sched.micro_steps_per_rollout
  per_rollout = [s for name, s in report_steps.items() if name != 'learner']
  opt_seconds = (micro_per_opt * lr['roofline_seconds']
                 + rollouts_per_opt * sum(s['roofline_seconds'] for s in per_rollout))
  return {
      'topology': topology, 'chip': chip['name'], 'chips': n, 'hosts': hosts,
      'slices': len({getattr(d, 'slice_index', 0) for d in devices}),
      'mesh': dict(steps.mesh.shape), 'hbm_bytes_per_chip': chip['hbm_bytes'],
      'headroom': headroom, 'fits': fits,
      'model': {'params': flops_lib.param_count(m), 'layers': m.num_hidden_layers,
                'hidden_size': m.hidden_size, 'vocab_size': m.vocab_size,
                'dtype': m.dtype, 'param_dtype': m.param_dtype,
                'remat': cfg.model.remat, 'logprob_chunk_size': cfg.model.logprob_chunk_size,
                'auto': auto,  # the knobs set to 'auto', chosen (above) against the HBM
                'attention': cfg.model.attention,
                'lora': None if not m.lora.rank else {
                    'rank': m.lora.rank, 'alpha': m.lora.alpha, 'targets': list(m.lora.targets),
                    'trainable_params': m.num_hidden_layers * flops_lib.lora_params_per_layer(m)}},
      'optimizer_step_seconds_estimate': opt_seconds,
      'mfu_estimate': (micro_per_opt * lr['model_flops']
                       + rollouts_per_opt * sum(s['model_flops'] for s in per_rollout))
                      / (opt_seconds * chip['peak_flops']),
      'completions_per_second_estimate': (rollouts_per_opt * steps.rollout_rows) / opt_seconds,
      'steps': {k: {kk: vv for kk, vv in v.items() if kk != 'executable'}
                for k, v in report_steps.items()},
      'programs': {k: {kk: vv for kk, vv in v.items() if kk != 'executable'}
                   for k, v in others.items()},
      'prompt_share': {'generation': engine.gen_share, 'old_logprobs': engine.micro_batch_share},
      'decode': {k: v for k, v in decode.items() if k != 'executable'},
      'knobs': [] if fits else knobs(cfg, report_steps),
      'note': NOTE,
      '_executables': {**{k: v['executable'] for k, v in report_steps.items()},
                       **{f'program/{k}': v['executable'] for k, v in others.items()},
                       'decode_step': decode['executable']},
  }


def _decode_report(step, steps: Steps, engine, n_steps: int, chip) -> dict[str, Any]:
  """The rollout's decode loop from the compiler's cost analysis of one step (``steps.decode``):
  its time, max(flops / peak, bytes / HBM bandwidth), or the compiler's cost-model time when
  that is sane and longer; decode tokens/s = rows per step / that time."""
  g = engine.sampling_cfg
  out = {'mode': 'slot_pool' if engine.sampler.slots else 'batched',
         'rows_per_step': steps.decode_rows, 'cache_slots': steps.decode_cache_slots,
         'max_cache_slots': g.max_prompt_length + g.max_completion_length - 1,
         'compiled': step['compiled'], 'executable': step['executable']}
  if not step['compiled']:
    return {**out, 'error': step['error']}
  flops, nbytes = step['compiler_flops'], step['compiler_bytes_accessed']
  timing = _timing(step, flops, flops, 0.0, chip)  # the compiler's bytes, a sane cost model
  roof, opt = timing['roofline_seconds'], timing.get('optimal_seconds')
  seconds = max(roof, opt or 0.0)
  return {**out, 'compiler_flops': flops, 'compiler_bytes_accessed': nbytes,
          'optimal_seconds': opt, 'roofline_seconds': roof, 'step_seconds': seconds,
          'tokens_per_second': steps.decode_rows / seconds,
          'steps_at_max_length': n_steps, 'seconds_at_max_length': n_steps * seconds}


def _timing(step, flops, model_flops, analytic_bytes, chip) -> dict[str, Any]:
  compiler_bytes = step.get('compiler_bytes_accessed') or 0.0
  bytes_accessed = max(compiler_bytes, analytic_bytes)
  compute = flops / chip['peak_flops']
  roof = max(compute, bytes_accessed / chip['hbm_bandwidth'])
  out = {'flops': flops, 'model_flops': model_flops, 'bytes_accessed': bytes_accessed,
         'roofline_seconds': roof, 'mfu_estimate': model_flops / (roof * chip['peak_flops'])}
  if step.get('optimal_seconds') is not None:
    out['optimal_seconds'] = _sane_optimal(step['optimal_seconds'], flops, chip)
  return out


def _sane_optimal(opt: Optional[float], flops: float, chip) -> Optional[float]:
  """The compiler's cost-model time, or None: the cost model counts a loop body once too, and a
  time below the flops at the chip's peak is not a time this program can take."""
  return opt if opt is not None and opt >= flops / chip['peak_flops'] else None


def knobs(cfg, steps: dict) -> list[str]:
  """Settings that lower the peak of the steps that do not fit."""
  out = []
  sched = cfg.grpo.schedule
  if not steps['learner']['fits']:
    if cfg.model.remat == 'none':
      out.append('--config.model.remat=full (or save_dots): recompute each decoder layer in '
                 'the backward instead of keeping its activations')
    if cfg.model.logprob_chunk_size == 0:
      out.append('--config.model.logprob_chunk_size=64: never hold the float32 [b, Tc, V] '
                 'logits at once')
  if not steps['rollout']['fits'] and cfg.grpo.sampling.rollout_micro_batch_size == 0:
    out.append('--config.grpo.sampling.rollout_micro_batch_size=<a divisor of S*B>: generate '
               'fewer rows at once (smaller KV cache)')
  out.append(f'--config.grpo.schedule.micro_batch_size={sched.micro_batch_size // 2} with '
             f'grad_accum_steps={2 * sched.grad_accum_steps} and steps_per_generation='
             f'{2 * sched.steps_per_generation}: half the rows per micro-step, same update')
  out.append(f'--config.mesh.fsdp (now {cfg.mesh.fsdp}): shard params and optimizer state over '
             'more chips')
  return out


def render_text(rep: dict[str, Any]) -> str:
  gib = lambda x: 'n/a' if x is None else f'{x / 2**30:.2f} GiB'
  auto = lambda knob: ' (auto)' if knob in rep['model']['auto'] else ''
  lines = [f'topology {rep["topology"]}: {rep["chips"]} x {rep["chip"]} on {rep["hosts"]} '
           f'host(s), {rep["slices"]} slice(s), HBM {gib(rep["hbm_bytes_per_chip"])} per chip; mesh {rep["mesh"]}',
           f'model: {rep["model"]["params"] / 1e9:.2f}B params, remat={rep["model"]["remat"]}'
           f'{auto("remat")}, logprob_chunk_size={rep["model"]["logprob_chunk_size"]}'
           f'{auto("logprob_chunk_size")}, '
           f'attention={rep["model"]["attention"]}'
           + ('' if not rep['model']['lora'] else
              f'; LoRA rank {rep["model"]["lora"]["rank"]} on '
              f'{",".join(rep["model"]["lora"]["targets"])}: '
              f'{rep["model"]["lora"]["trainable_params"] / 1e6:.1f}M trained params, '
              f'base weights {rep["model"]["param_dtype"]}, frozen'), '']
  for name, s in rep['steps'].items():
    status = 'fits' if s['fits'] else ('DOES NOT FIT' if s['compiled'] else
                                       'REJECTED by the compiler')
    lines.append(f'{name}: {status} (peak {gib(s["peak_bytes"])}'
                 + (f' = {100 * s["hbm_fraction"]:.0f}% of HBM)' if s['hbm_fraction'] else ')'))
    if s['compiled']:
      opt = s['optimal_seconds']
      lines.append(f'  per chip: arguments {gib(s["argument_bytes"])}, outputs '
                   f'{gib(s["output_bytes"])}, temporaries {gib(s["temp_bytes"])}')
      lines.append(f'  flops {s["flops"]:.3e} (model {s["model_flops"]:.3e}), bytes '
                   f'{s["bytes_accessed"]:.3e}; roofline >= {s["roofline_seconds"] * 1e3:.1f} ms, '
                   f'cost model {"n/a" if opt is None else f"{opt * 1e3:.1f} ms"}, '
                   f'MFU <= {100 * s["mfu_estimate"]:.0f}%')
    else:
      lines.append(f'  {s["error"]}')
    if 'tokens_per_second' in s:
      lines.append(f'  learner tokens/s <= {s["tokens_per_second"]:.0f}')
    if 'decode_tokens_per_second' in s:
      lines.append(f'  decode tokens/s <= {s["decode_tokens_per_second"]:.0f}, completions/s <= '
                   f'{s["completions_per_second"]:.1f}')
  for name, s in rep.get('programs', {}).items():
    status = 'fits' if s['fits'] else ('DOES NOT FIT' if s['compiled'] else
                                       'REJECTED by the compiler')
    label = 'decode step (the full cache)' if name == 'decode' else name
    lines.append(f'{label}: {status} (peak {gib(s["peak_bytes"])}'
                 + (f' = {100 * s["hbm_fraction"]:.0f}% of HBM)' if s['hbm_fraction'] else ')'))
    if not s['compiled']:
      lines.append(f'  {s["error"]}')
  d = rep['decode']
  how = (f'a slot pool of {d["rows_per_step"]} slots' if d['mode'] == 'slot_pool' else
         f'{d["rows_per_step"]} rows at a time')
  lines.append(f'decode: {how}; prompts prefilled once per {rep["prompt_share"]["generation"]} '
               'rows')
  if d['compiled']:
    opt = d['optimal_seconds']
    lines.append(f'  one step at the mean KV fill ({d["cache_slots"]} of {d["max_cache_slots"]} '
                 f'slots): flops {d["compiler_flops"]:.3e}, bytes '
                 f'{d["compiler_bytes_accessed"]:.3e} per chip; >= '
                 f'{d["step_seconds"] * 1e3:.2f} ms (roofline {d["roofline_seconds"] * 1e3:.2f}'
                 f' ms, cost model {"n/a" if opt is None else f"{opt * 1e3:.2f} ms"})')
    lines.append(f'  decode tokens/s <= {d["tokens_per_second"]:.0f}; a rollout at max length: '
                 f'{d["steps_at_max_length"]} steps, >= {d["seconds_at_max_length"]:.1f} s')
  else:
    lines.append(f'  decode step: {d["error"]}')
  lines.append(f'optimizer step >= {rep["optimizer_step_seconds_estimate"]:.2f} s estimated '
               f'({rep["completions_per_second_estimate"]:.1f} completions/s, MFU <= '
               f'{100 * rep["mfu_estimate"]:.0f}%)')
  lines.append('fits: ' + ('yes' if rep['fits'] else
                           f'NO (needs {100 * (1 - rep["headroom"]):.0f}% of HBM or less)'))
  if rep['knobs']:
    lines.append('knobs that lower memory:')
    lines.extend(f'  {k}' for k in rep['knobs'])
  lines.append(rep['note'])
  return '\n'.join(lines)


def public(rep: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in rep.items() if not k.startswith('_')}
