"""The GRPO stage (``GRPOStage``), its loop (``GRPOLoop.run``) and one rollout's host work
(``_new_rollout``: prompts in, rewards and advantages computed on the host); everything
per-token runs in the jitted rollout and learner steps. The schedule: the design doc,
docs/design, "Schedule semantics".

Micro-step s trains slice s % S of rollout s // E (E = S*mu); a rollout is generated when
s % E == 0 by the current policy; the schedule table decides, inside the rollout step, which
slices get old log-probs. A checkpoint holds the learner state (MultiSteps mid-accumulation
included), the rollout state (counter, forward passes, RNG), the current rollout buffer and its
advantages, the reference params and the data position, so a run stopped anywhere — in the middle
of a rollout or of an accumulation window — resumes bitwise.

LoRA (model.lora): the learner trains the adapters of the stage's input params; its base weights
are frozen, held by the trainer (never in a checkpoint: a resumed run gets them from its input
params again) and passed to every step; the reference policy (beta > 0) is the policy with its
adapters disabled, so no reference params are held either. After an SFT stage that reference is
the base before SFT (as TRL's with a PEFT model), not the SFT result as without LoRA; a console
line says so.

Roles (docs/design.md, "Roles"): before each rollout the policy's params are synced to the
rollout role (``sharding.sync_weights``: nothing moves when it shares the actor's mesh), the
reference params once per run; the rollout's buffer comes back on the actor's mesh with the
policy version that generated it, which every micro-step checks (``_check_policy_version``) and
the log reports (``rollout/policy_version``, ``rollout/policy_lag``). With grpo.sync_ref_model the
reference follows the policy every ref_model_sync_steps optimizer steps (``_sync_reference``) and
is synced to its role again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import data
from jaxrl_ga import placement
from jaxrl_ga import programs as programs_lib
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga import tools as tools_lib
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga.config import GRPOConfig, RunConfig, ScheduleConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import base as task_base
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import evaluation
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage
from jaxrl_ga.trainers import text

_LOG_KEYS = ('loss', 'reward/mean', 'reward/accuracy', 'kl', 'clip_ratio/region_mean',
             'grad_norm')


@dataclasses.dataclass(frozen=True)
class RolloutEvent:
  """What ``GRPOLoop(on_rollout=...)`` receives after each rollout (the public hook for
  benchmarks and studies: read, don't modify). Read it during the call: the next learner step
  donates ``learner``'s buffers."""
  micro_step: int  # the micro-step the rollout was generated at
  buffer: Any  # rollout.RolloutBuffer, [S, B, ...], in training order
  advantages: Any  # [S, B]
  learner: Any  # the learner state that will train on it (its params generated it)
  host_stats: dict[str, float]  # reward/*, rollout/* metrics
  generate_s: float  # the jitted rollout step (generation, old and reference log-probs), waited for
  host_s: float  # decoding, rewards and advantages on the host


# Rows of the training stream whose columns the reward functions' dry call passes
# (GRPOStage.check_inputs).
DRY_CALL_ROWS = 2


class GRPOStage(stage.Stage):
  """Online RL with group-relative advantages (``stages=grpo``); its loop: ``GRPOLoop``."""

  name = 'grpo'
  config_type = GRPOConfig
  announces_chosen_lengths = False  # the first rollout's prompt line says it

  def validate(self, cfg: RunConfig, dp: int) -> None:
    g = cfg.grpo.schedule.num_generations
    if g < 2:  # ScheduleConfig allows 1: SFT's and DPO's schedules, the learner benchmarks'
      raise ConfigError(f'grpo.schedule.num_generations={g}: a group of one completion has '
                        f'advantage 0 (its reward minus its group\'s mean), so GRPO would train '
                        f'nothing; use 2 or more (TRL\'s num_generations must be >= 2 too).')
    schedule.validate(cfg.grpo.schedule, dp)
    if cfg.grpo.sync_ref_model and cfg.model.lora.rank:
      raise ConfigError(f'grpo.sync_ref_model=True with model.lora.rank={cfg.model.lora.rank}: '
                        'the LoRA reference is the base weights (adapters off), which never '
                        'train; set grpo.sync_ref_model=False or train without LoRA.')
    before = cfg.stages[:cfg.stages.index('grpo')] if 'grpo' in cfg.stages else ()
    if cfg.model.lora.rank and cfg.grpo.loss.beta > 0 and before:
      print(f'[grpo] LoRA: the KL reference is the base weights with the adapters off (TRL\'s '
            f'PEFT reference), not the policy after {",".join(before)} as without LoRA.',
            flush=True)
    stage.check_rollout_chunk(
        self.name, cfg.grpo.sampling, cfg.grpo.schedule.completions_per_rollout,
        'the completions of a rollout, steps_per_generation*micro_batch_size')

  def validate_roles(self, cfg: RunConfig, meshes: dict) -> None:
    """The rollout's and reference's own meshes (``mesh.rollout``/``mesh.reference`` set): one
    process only, no LoRA reference elsewhere, and the schedule valid on their data
    parallelism."""
    for role in ('rollout', 'reference'):
      devices = getattr(cfg.mesh, role).devices
      if not devices or role not in meshes:
        continue
      if jax.process_count() > 1:
        raise ConfigError(f'mesh.{role}.devices={devices!r}: a role on devices of its own runs '
                          f'on one process only; leave it unset on {jax.process_count()} '
                          'processes.')
      if role == 'reference' and cfg.model.lora.rank and cfg.grpo.loss.beta > 0:
        raise ConfigError(f'mesh.reference.devices={devices!r} with model.lora.rank='
                          f'{cfg.model.lora.rank}: the reference is the policy\'s own base '
                          'weights (adapters off), computed where the rollout runs; leave '
                          'mesh.reference unset.')
      programs_lib.resolve_attention(cfg, cfg.model, meshes[role].devices.flat[0])
      try:
        schedule.validate(cfg.grpo.schedule, sharding.data_parallel_size(meshes[role]))
      except ConfigError as e:
        raise ConfigError(f'mesh.{role} (devices={devices!r}): {e}') from None

  def optimizer_every(self, stage_cfg: GRPOConfig) -> int:
    return stage_cfg.schedule.optimizer_every

  def owned_positions(self, cfg: RunConfig, mesh):
    """The prompts of a rollout whose rows this process holds (rollout.local_prompts)."""
    own = set(rollout_lib.local_prompts(cfg.grpo.schedule, mesh).tolist())
    per_rollout = cfg.grpo.schedule.prompts_per_rollout
    return lambda position: position % per_rollout in own

  def check_inputs(self, cfg: RunConfig, task, model_cfg) -> None:
    """Each reward function, called on DRY_CALL_ROWS rows of the training stream (of your data:
    this process's own first rows, as no other process parses them) with placeholder
    completions, keeps its contract (``rewards.check_on_dry_call``: one finite float or None per
    completion; ConfigError naming the function otherwise). A refusal on one process stops
    every process."""
    fns = task.reward_functions()
    if not fns:
      return
    k = len(rewards_lib.DRY_COMPLETIONS)
    if type(task) is data.DataTask:  # pylint: disable=unidiomatic-typecheck  (GRPO's rows)
      first = task.first_epoch(cfg.seed, cfg.grpo.schedule.prompts_per_rollout)
      examples = first[:DRY_CALL_ROWS]  # each process owns >= 1 prompt of every rollout
    else:
      examples = [task.train_example(i, cfg.seed + stage.LENGTH_CHECK_STREAM)
                  for i in range(DRY_CALL_ROWS)]

    def dry_call():
      fields = task_base.reward_fields(examples, k)
      keywords = rewards_lib.trl_keywords(  # placeholder completion ids: their bytes
          [list(c.encode()) for c in rewards_lib.DRY_COMPLETIONS] * len(examples),
          rewards_lib.TrainerState(0, cfg.grpo.num_steps))
      if getattr(task, 'dry_call_fields', None):  # episodes' columns (jaxrl_ga.tools)
        fields |= task.dry_call_fields(examples, rewards_lib.DRY_COMPLETIONS)
      try:
        rewards_lib.check_on_dry_call(fns, [e.prompt for e in examples for _ in range(k)],
                                      fields, keywords)
      except rewards_lib.RewardError as e:
        raise ConfigError(str(e)) from None

    stage.on_every_process('a reward function is refused', dry_call)

  def programs(self, ctx: context.RunContext, stage_cfg: GRPOConfig,
               table: Optional[schedule.ScheduleTable] = None,
               multi_turn: bool = False) -> programs_lib.GRPOPrograms:
    """The engine and learner, every step compiled and checked against the device's memory
    (jaxrl_ga.fit), 'auto' knobs chosen; ``table``: the schedule table (default
    ``schedule.build_table(stage_cfg.schedule)``); ``multi_turn``: rollouts are episodes
    (``GRPOLoop(make_interaction=...)``)."""
    return programs_lib.fitted_grpo_programs(
        ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.param_shardings, eos_id=ctx.generation_stops,
        pad_id=ctx.pad_id, grpo=stage_cfg, graphdef=ctx.graphdef, table=table,
        multi_turn=multi_turn,
        rollout_mesh=ctx.roles['rollout'].mesh,
        rollout_shardings=ctx.roles['rollout'].param_shardings,
        reference_mesh=ctx.roles['reference'].mesh,
        reference_shardings=ctx.roles['reference'].param_shardings)

  def run(self, ctx: context.RunContext, params) -> tuple[Any, dict[str, Any]]:
    return GRPOLoop(ctx, ctx.cfg.grpo, make_interaction=tools_lib.make_interaction(ctx)).run(params)


def _older_buffer_policy_version(sched: ScheduleConfig) -> checkpoint.AddedLeaf:
  """A GRPO checkpoint written before the rollout buffer carried its policy version lacks
  ``buffer.policy_version``; it is restored with the version that generated its buffer. A
  checkpoint at micro-step m holds the rollout started last before m, at micro-step
  (m - 1) - (m - 1) % E (E micro-steps per rollout; none before m = 1: the starting zeros),
  generated by the params of that micro-step // K optimizer steps (what
  ``GRPOLoop._check_policy_version`` expects of it)."""
  e, k = sched.micro_steps_per_rollout, sched.optimizer_every

  def without(abstract):  # the buffer's other fields, as orbax stores a dataclass: by name
    b = abstract['buffer']
    return {**abstract, 'buffer': {f.name: getattr(b, f.name) for f in dataclasses.fields(b)
                                   if f.name != 'policy_version'}}

  def fill(state, meta, abstract):
    made_at = max(meta['micro_step'] - 1, 0) // e * e
    version = placement.put(np.asarray(made_at // k, np.int32),
                            abstract['buffer'].policy_version.sharding)
    buffer = rollout_lib.RolloutBuffer(**state['buffer'], policy_version=version)
    return ({**state, 'buffer': buffer},
            f'its rollout buffer is given policy version {made_at // k}, the optimizer steps '
            f'done when it was generated (micro-step {made_at}; grpo.schedule: {k} micro-steps '
            f'per optimizer step, {e} per rollout)')

  return checkpoint.AddedLeaf('buffer.policy_version', without, fill)


class GRPOLoop:
  """The GRPO stage's loop: builds the engines once; ``run(params)`` trains (resuming if a
  checkpoint exists).

  Hooks (optional): ``on_rollout(RolloutEvent)`` after each rollout; ``on_micro_step(micro_step,
  started, out)`` after each learner step is dispatched (``started``: time.perf_counter() before
  it; ``out``: the step's device outputs, not waited for). ``table``: the schedule table, by
  default ``schedule.build_table(cfg.schedule)`` (benchmarks/recompute.py runs other recompute
  rules' marks).

  Multi-turn rollouts (docs/design.md, "Multi-turn rollouts"): ``make_interaction(examples) ->
  episodes.Interaction`` builds the host side of each rollout from its examples (the rollout's
  rows in [S, B] slice-major order, row j*B+i: ``Interaction.submit``'s row); with it every
  rollout is a batch of episodes and only the policy's tokens train. One process only.
  """

  def __init__(self, ctx: context.RunContext, cfg: GRPOConfig,
               on_rollout: Optional[Callable[[RolloutEvent], None]] = None,
               on_micro_step: Optional[Callable[[int, float, dict], None]] = None,
               table: Optional[schedule.ScheduleTable] = None,
               make_interaction: Optional[Callable[[list], Any]] = None):
    cfg = ctx.with_chosen_lengths('grpo', cfg)  # a prompt width of 0: the one chosen
    self.ctx, self.cfg = ctx, cfg
    self.on_rollout, self.on_micro_step = on_rollout, on_micro_step
    self.make_interaction = make_interaction
    if make_interaction is not None and jax.process_count() > 1:
      raise ConfigError(f'multi-turn rollouts (tools, environments) run on one process for now; '
                        f'this run has {jax.process_count()} processes: run it on one host.')
    # The schedule is validated against the mesh by GRPOStage.validate (api.validate_against_mesh).
    # The stage's programs (programs.GRPOPrograms): its steps, its starting state, its table;
    # every step compiled and checked against the device's memory (jaxrl_ga.fit).
    self.programs = GRPOStage().programs(ctx, cfg, table,
                                         multi_turn=make_interaction is not None)
    self.table = self.programs.schedule
    self.engine, self.learner = self.programs.engine, self.programs.learner
    self.part = None  # context.TrainedPart of the params being trained (set by run)
    self.rewards = ctx.task.reward_functions()
    self.prompts_per_rollout = cfg.schedule.prompts_per_rollout
    # The learner's completion widths (grpo.length_buckets) and the current rollout's, per slice.
    self.widths = rollout_lib.length_widths(cfg.sampling.max_completion_length,
                                            cfg.length_buckets)
    self._slice_widths = None
    self._policy_version = None  # of the current rollout's buffer (host int)
    self._ref_on_role = None  # the reference params on the reference role (set by run)
    # grpo.sync_ref_model: the reference's mixing step, (policy, reference) -> reference.
    self._mix_reference = jax.jit(functools.partial(mix_reference,
                                                    alpha=cfg.ref_model_mixup_alpha),
                                  out_shardings=ctx.param_shardings)

  # -- the state that a checkpoint holds ---------------------------------------------------------
  def policy(self, state) -> Any:
    """The policy's params: the learner's, with the frozen base weights under LoRA."""
    return self.part.policy(state['learner'].params)

  def run(self, params, stop_at_micro_step: Optional[int] = None
          ) -> tuple[Any, dict[str, Any]]:
    """Trains from ``params`` (or resumes). -> (params, summary).

    ``stop_at_micro_step`` checkpoints and returns early after that micro-step, as a SIGTERM
    would (summary['stopped_at_micro_step'] says so): the hook the exact-resume test uses.
    """
    ctx, cfg = self.ctx, self.cfg
    sched = cfg.schedule
    k, s_, e = sched.optimizer_every, sched.steps_per_generation, sched.micro_steps_per_rollout
    ckpt = ctx.checkpointer('grpo')
    self.part = context.TrainedPart(ctx, params)  # LoRA: the adapters train, the base is frozen
    self._slice_widths = None  # set by each rollout; from the restored buffer on a resume
    self._policy_version = None  # likewise
    state, meta = stage.restore(ctx, ckpt, 'grpo', self.programs.init_state(params), k,
                                added=(_older_buffer_policy_version(sched),))
    # The reference changes only with grpo.sync_ref_model (_sync_reference): on its role once.
    self._ref_on_role = sharding.sync_weights(state['ref_params'], ctx.roles['reference'])
    if not stage.trains_on('grpo', meta, cfg.num_steps, k):
      return self.policy(state), meta['summary']
    summary = meta['summary']  # saved with every checkpoint
    resumed_from = meta['micro_step']
    # With the run's tools (ctx.tool_setup) the held-out rows are greedy episodes, the same
    # prompts with the tools announced; another make_interaction keeps the single-turn one.
    evaluator = evaluation.Evaluator(ctx, self.programs.table['evaluation'],
                                     runner=self.programs.eval_episodes,
                                     make_interaction=tools_lib.make_interaction(ctx))
    def evaluate(st):
      evaluator.trainer_state = rewards_lib.TrainerState(meta['micro_step'] // k, cfg.num_steps)
      return evaluator.evaluate(self.policy(st))
    if 'eval/accuracy_before' not in summary:
      results = stage.evaluate_or_save(ctx, ckpt, state, meta, evaluate)
      summary.update(_eval_summary(results, 'before'))
      reporting.report_accuracy(ctx, 'grpo', 0, results, 'before GRPO')

    if len(self.widths) > 1:
      self._compile_widths(params, state)
    t_start = time.time()
    with stage.StageLoop(ctx, 'grpo', ckpt, meta, num_steps=cfg.num_steps, optimizer_every=k,
                         log_every=cfg.log_every, log_keys=_LOG_KEYS, eval_every=cfg.eval_every,
                         max_consecutive_nonfinite=cfg.optimizer.max_consecutive_nonfinite,
                         stop_at_micro_step=stop_at_micro_step) as loop:
      lag = 0  # the window's largest policy lag (rollout/policy_lag)
      while not loop.done:
        s = loop.micro_step
        if s % e == 0:  # a new rollout, generated by the current policy
          # In meta, so that a run resumed in the middle of a rollout still logs its statistics.
          meta['host_stats'] = self._new_rollout(state, meta)
          if s == resumed_from:
            _report_prompt_padding(meta['host_stats'], cfg.sampling.max_prompt_length,
                                   self.engine.share_prompts,
                                   ctx.widths_from_data.get('grpo.sampling.max_prompt_length'))
        if self._slice_widths is None:  # resumed in the middle of a rollout
          self._slice_widths = self.engine.slice_widths(state['buffer'], self.widths)
          self._policy_version = int(state['buffer'].policy_version)
        lag = max(lag, self._check_policy_version(s))
        batch = self.engine.micro_batch(state['buffer'], s % s_, state['advantages'],
                                        width=int(self._slice_widths[s % s_]))
        started = time.perf_counter()
        state['learner'], out = self.learner.step(state['learner'], batch, self.part.frozen)
        if self.on_micro_step is not None:
          self.on_micro_step(s, started, out)
        step = loop.micro_step_done(state, out)
        if step:  # an optimizer step fired
          self._sync_reference(state, step)
          loop.log(step, out, meta.get('host_stats', {}) | {
              'rollout/forward_passes_total': state['rollout'].forward_passes,
              'rollout/policy_lag': float(lag)})
          lag = 0
          if loop.eval_due(step):
            loop.report_eval(step, evaluate(state))
          loop.save_if_due(step, state)
        if loop.stop_requested(state):
          break

    params = self.policy(state)
    this_run = {'grpo/resumed_from_micro_step': resumed_from,
                'grpo/micro_steps_this_run': meta['micro_step'] - resumed_from}
    if loop.stopped:
      return params, summary | this_run | {'stopped_at_micro_step': meta['micro_step']}
    results = stage.evaluate_or_save(ctx, ckpt, state, meta, evaluate)
    summary.update(_eval_summary(results, 'after'))
    reporting.report_accuracy(ctx, 'grpo', cfg.num_steps, results, 'after GRPO')
    rollouts = int(state['rollout'].counter)
    summary.update({
        'grpo/optimizer_steps': cfg.num_steps, 'grpo/rollouts': rollouts,
        'grpo/old_logprob_forward_passes': int(state['rollout'].forward_passes),
        'grpo/wall_time_s': time.time() - t_start,
        'grpo/nonfinite_skipped': int(state['learner'].nonfinite_skipped),
        'schedule/counts_per_period': dict(self.table.counts),
        'schedule/period_rollouts': self.table.period_rollouts,
        'schedule/recompute_counts_this_run': _counts_for(self.table, rollouts),
    })
    stage.finish(ckpt, state, meta, summary)
    return params, summary | this_run

  def _sync_reference(self, state, step: int) -> None:
    """grpo.sync_ref_model: after every ref_model_sync_steps-th optimizer step the reference
    becomes alpha * policy + (1 - alpha) * reference (TRL's SyncRefModelCallback, at its
    on_step_end), before that step's checkpoint, which so holds it; rollouts from then on get
    their reference log-probs from it. A new array: the old reference may be the caller's
    params, so it is not donated."""
    cfg = self.cfg
    if not cfg.sync_ref_model or step % cfg.ref_model_sync_steps:
      return
    state['ref_params'] = self._mix_reference(self.policy(state), state['ref_params'])
    self._ref_on_role = sharding.sync_weights(state['ref_params'], self.ctx.roles['reference'])

  def _check_policy_version(self, micro_step: int) -> int:
    """The learner trains micro-step ``micro_step`` on the rollout generated at the start of its
    rollout period (micro-step s - s % E) by the params of the optimizer steps done then: the
    buffer's policy version must be that count, else it is another policy's rollout. -> the
    policy lag: optimizer steps between the params that generated the rollout and the learner's
    now."""
    sched = self.cfg.schedule
    want = (micro_step - micro_step % sched.micro_steps_per_rollout) // sched.optimizer_every
    if self._policy_version != want:
      raise RuntimeError(
          f'micro-step {micro_step} trains on a rollout of policy version '
          f'{self._policy_version} (optimizer steps of the params that generated it), but its '
          f'rollout is the one generated after optimizer step {want}.')
    return micro_step // sched.optimizer_every - self._policy_version

  def _compile_widths(self, params, state) -> None:
    """grpo.length_buckets > 1: the learner step compiled for every width before the loop, so
    that a width a micro-batch first needs mid-run does not stall training for a compile."""
    batches = [self.engine.abstract_micro_batch(params, state['ref_params'], width=w)
               for w in self.widths]
    widths = ', '.join(map(str, self.widths))
    print(f'[grpo] compiling the learner step for completion widths {widths} '
          f'(grpo.length_buckets={self.cfg.length_buckets})', flush=True)
    started = time.perf_counter()
    self.learner.compile_for(state['learner'], batches, self.part.frozen)
    print(f'[grpo] compiled {len(batches)} learner widths in {time.perf_counter() - started:.1f} s',
          flush=True)

  # -- one rollout: generation on device, rewards and advantages on the host ---------------------
  def _new_rollout(self, state, meta) -> dict[str, float]:
    """Generates the next rollout into state['buffer'] and state['advantages'] (in place);
    advances the data position. -> the rollout's host metrics (rewards, lengths, ...).

    Each process loads, encodes, decodes and scores only the rows its devices hold (on one
    process: all of them); only the per-row rewards are gathered, for the group advantages.
    """
    examples, tokens, mask, interaction = self._prompt_rows(meta['data_position'])
    meta['data_position'] += self.prompts_per_rollout
    t_start = time.perf_counter()
    self._policy_version = meta['micro_step'] // self.cfg.schedule.optimizer_every
    buffer, state['rollout'], rollout_metrics = self.engine.rollout_rows(
        sharding.sync_weights(self.policy(state), self.ctx.roles['rollout']),
        self._ref_on_role, state['rollout'], tokens, mask, self._policy_version,
        interaction=interaction)
    if self.on_rollout is not None:  # decoding below waits for it anyway
      jax.block_until_ready(buffer)
    t_generated = time.perf_counter()
    rewards, reward_metrics, scored = self._score(buffer, examples,  # [S*B], every process
                                                  interaction)
    state['buffer'], state['advantages'], adv = self._advantages(state, buffer, rewards)
    self._slice_widths = self.engine.slice_widths(state['buffer'], self.widths)
    rollout_index = meta['micro_step'] // self.cfg.schedule.micro_steps_per_rollout
    if self.cfg.completions_every and rollout_index % self.cfg.completions_every == 0:
      self._log_completions(meta['micro_step'], examples, scored, rewards, adv, interaction)
    host_stats = reward_metrics | {k: float(np.asarray(v))
                                   for k, v in jax.device_get(rollout_metrics).items()}
    if hasattr(interaction, 'metrics'):  # tools/*: calls, failures, per tool (jaxrl_ga.tools)
      host_stats |= interaction.metrics()
    # The completion positions the learner computes per row (grpo.length_buckets).
    host_stats['rollout/learn_width'] = float(np.mean(self._slice_widths))
    host_stats['rollout/policy_version'] = float(self._policy_version)
    if self.on_rollout is not None:
      self.on_rollout(RolloutEvent(
          micro_step=meta['micro_step'],
          buffer=state['buffer'], advantages=state['advantages'], learner=state['learner'],
          host_stats=host_stats, generate_s=t_generated - t_start,
          host_s=time.perf_counter() - t_generated))
    return host_stats

  def _prompt_rows(self, position: int):
    """This process's rows of the rollout's prompts (those at data ``position`` onwards). ->
    (the examples of its rows [S*nb], prompt tokens and mask: global [S, B, Tp] arrays, the
    rollout's Interaction or None). Multi-turn: each row's prompt is its episode's (an
    environment's reset text appended, the tools announced: ``tools.Episodes.padded_prompts``)."""
    ctx, cfg = self.ctx, self.cfg
    s, b = cfg.schedule.steps_per_generation, cfg.schedule.micro_batch_size
    rows = self.engine.local_rows()  # this process's i of [S, B]
    index = self.engine.prompt_index[:, rows].reshape(-1)  # the prompt of each local row

    def host_part():
      examples = {int(p): ctx.task.train_example(position + int(p), ctx.cfg.seed)
                  for p in np.unique(index)}
      rows_examples = [examples[int(p)] for p in index]
      interaction = (None if self.make_interaction is None
                     else self.make_interaction(rows_examples))
      if hasattr(interaction, 'padded_prompts'):
        tokens, mask = interaction.padded_prompts(cfg.sampling.max_prompt_length, ctx.pad_id)
        _check_shared_prompts(tokens, mask, self.engine.share_prompts)
      else:
        ids = {p: text.encode_prompt(ctx.tokenizer, ex.prompt) for p, ex in examples.items()}
        tokens, mask = text.left_pad([ids[int(p)] for p in index],
                                     cfg.sampling.max_prompt_length, ctx.pad_id,
                                     'grpo.sampling.max_prompt_length')
      return rows_examples, interaction, tokens, mask

    # A row that only this process reads (a bad row past the up-front checks, a prompt too long,
    # an environment's reset that raises) stops every process, not this one alone while the
    # others wait at the next collective.
    rows_examples, interaction, tokens, mask = stage.on_every_process(
        f'the prompts of the rollout at data position {position} failed', host_part,
        catch=(Exception,))
    place = lambda x: placement.from_local(
        x.reshape(s, len(rows), -1), rows, (s, b, x.shape[-1]),
        self.engine.prompt_sharding, axis=1)
    return rows_examples, place(tokens), place(mask), interaction

  def _score(self, buffer, examples, interaction=None) -> tuple[np.ndarray, dict[str, float]]:
    """Decodes and scores this process's completions, then gathers the per-row scores of every
    process. -> (total reward of each row [S*B] in [S, B] order, the reward metrics, (this
    process's completion texts, {reward name: its values on them}, the rewards' log_extra
    columns)). The rewards get TRL 1.16's keywords too (``rewards.trl_keywords``). Multi-turn (an
    ``interaction`` with ``final_text``, jaxrl_ga.tools): a row's text is its last assistant
    turn, and the rewards also get the episode's columns (``completions_messages``,
    ``environments``; docs/your_data.md, "Tools and environments")."""
    ctx, sched = self.ctx, self.cfg.schedule
    s, b = sched.steps_per_generation, sched.micro_batch_size
    rows = self.engine.local_rows()
    local = lambda x: placement.local_part(x, axis=1)[1].reshape(s * len(rows), -1)
    tokens, mask = local(buffer.completion_tokens), local(buffer.completion_mask)
    texts = text.decode_completions(ctx.tokenizer, tokens, mask)
    log = rewards_lib.RewardLog()  # TRL's reward keywords: ids, trainer_state, log_*
    keywords = rewards_lib.trl_keywords(
        [np.asarray(t)[np.asarray(m) > 0] for t, m in zip(tokens, mask)],
        rewards_lib.TrainerState(self._policy_version, self.cfg.num_steps), log)
    fields = task_base.reward_fields(examples)
    prompts = [ex.prompt for ex in examples]
    if hasattr(interaction, 'final_text'):  # (the engine handed it every turn, the cut ones too)
      texts = [interaction.final_text(r) for r in range(len(texts))]
      fields = {**fields, **interaction.reward_fields()}
      if hasattr(interaction, 'reward_prompts'):  # an environment's reset text appended (TRL's)
        prompts = interaction.reward_prompts()
    names = [r.name for r in self.rewards]
    error, per_fn = None, {}
    try:
      total, per_fn = rewards_lib.compute_rewards(self.rewards, prompts, texts, fields, keywords)
      marked = next((r.name for r in self.rewards if r.marks_correctness), None)
      if marked is not None:  # > 0 counts as correct; NaN (None: does not apply) does not
        correct = np.nan_to_num(per_fn[marked]) > 0
      else:
        correct = [ctx.task.is_correct(ex, t) for ex, t in zip(examples, texts)]
      fields = np.stack([total, np.asarray(correct, np.float32)] + [per_fn[k] for k in names])
    except Exception as e:  # pylint: disable=broad-except
      # Every host must still reach the gather below, or the others wait there forever: this
      # one sends a flag instead of rewards, and every host raises after the gather.
      error = e
      fields = np.zeros((2 + len(names), len(texts)), np.float32)
    failed = np.full((1, len(texts)), 0.0 if error is None else jax.process_index() + 1.0,
                     np.float32)
    fields = np.concatenate([fields, failed])
    fields = fields.reshape(len(fields), s, len(rows)).transpose(2, 0, 1)  # [nb, F, S]
    fields = placement.gather_rows(fields, rows, b, ctx.mesh).transpose(1, 2, 0)  # [F, S, B]
    if error is not None:
      raise error
    if fields[-1].any():
      hosts = sorted({int(p) - 1 for p in np.unique(fields[-1]) if p})
      raise rewards_lib.RewardError(
          f'the reward computation failed on process(es) {hosts} (their log has the error); '
          f'every process stops.')
    total, correct = fields[0].reshape(-1), fields[1]
    # [S*B, F] every function's rewards, for advantage.multi_objective_aggregation
    self._rewards_per_function = fields[2:2 + len(names)].reshape(len(names), -1).T
    scored = total[~rewards_lib.unscorable(self._rewards_per_function)]  # as TRL logs them
    adv_cfg = self.cfg.advantage
    spreads = rewards_lib.reward_statistics(  # TRL's reward_std, rewards/*/std, frac_*_zero_std
        self._rewards_per_function, [r.weight for r in self.rewards], names,
        self.cfg.schedule.num_generations, adv_cfg.scale_rewards,
        adv_cfg.multi_objective_aggregation)
    return total, {'reward/mean': float(scored.mean()) if scored.size else float('nan'),
                   **spreads,
                   'reward/accuracy': float(correct.mean()),
                   **{f'reward/{k}': float(np.nanmean(fields[2 + i]))
                      for i, k in enumerate(names) if not np.isnan(fields[2 + i]).all()},
                   **_log_metric_means(log),  # averaged over every process's values
                   }, (texts, per_fn, log.extra)

  def _log_completions(self, micro_step: int, examples, scored, rewards: np.ndarray,
                       adv: np.ndarray, interaction=None) -> None:
    """grpo.completions_logged of process 0's rows of this rollout (each with its prompt,
    completion, reward functions' values, total reward and advantage, the rewards' log_extra
    columns; multi-turn: ``messages``,
    the whole conversation with each turn's role) -> completions.jsonl and TensorBoard text, at
    the optimizer step the rollout starts training."""
    if jax.process_index() != 0:
      return
    texts, per_fn, extra = scored
    sched = self.cfg.schedule
    rows = self.engine.local_rows()
    # Local row j of slice i is global row i*B + rows[j] of the [S*B] rewards and advantages.
    index = (np.arange(sched.steps_per_generation)[:, None] * sched.micro_batch_size
             + np.asarray(rows)[None, :]).reshape(-1)
    records = []
    for j in range(min(self.cfg.completions_logged, len(texts))):
      records.append({
          'prompt': examples[j].prompt, 'completion': texts[j],
          **{f'reward/{k}': (None if np.isnan(v[j]) else float(v[j])) for k, v in per_fn.items()},
          'reward': float(rewards[index[j]]), 'advantage': float(adv[index[j]]),
          **({'messages': interaction.messages(j)} if hasattr(interaction, 'messages') else {}),
          **{k: v[j] for k, v in extra.items() if j < len(v)}})  # the rewards' log_extra
    self.ctx.writer.write_completions('grpo', micro_step // sched.optimizer_every, micro_step,
                                     records)

  def _advantages(self, state, buffer, rewards: np.ndarray):
    """Group advantages of the rewards, on the device -> (buffer, advantages [S, B], the same on
    the host [S*B] in rollout order); with
    advantage.order_by_advantage_sign the rows are reordered (positive first) and only then get
    their old log-probs (state['rollout'] counts those passes)."""
    cfg = self.cfg
    sched = cfg.schedule
    if cfg.advantage.multi_objective_aggregation == 'normalize_then_sum':
      adv = rewards_lib.normalize_then_sum_advantages(
          self._rewards_per_function, [r.weight for r in self.rewards], sched.num_generations)
    else:  # a completion no reward function scores: NaN, out of the statistics, advantage 0
      unscored = rewards_lib.unscorable(self._rewards_per_function)
      adv = rewards_lib.group_advantages(np.where(unscored, np.nan, rewards),
                                         sched.num_generations, cfg.advantage.scale_rewards)
    adv_dev = placement.put(adv.reshape(sched.steps_per_generation, sched.micro_batch_size),
                            self.engine.advantage_sharding)
    if not cfg.advantage.order_by_advantage_sign:
      return buffer, adv_dev, adv
    order = np.argsort(-adv, kind='stable')  # positive first, negative last
    buffer, state['rollout'], adv_dev = self.engine.reorder(
        self.policy(state), buffer, state['rollout'], adv_dev, jnp.asarray(order, jnp.int32))
    return buffer, adv_dev, adv


def _log_metric_means(log: rewards_lib.RewardLog) -> dict[str, float]:
  """The rewards' ``log_metric`` values of this rollout, each name's mean over the values of
  every process (TRL 1.16: the union of the names, then each one's gathered sum and count); a
  name one process never logged counts only the others'."""
  if jax.process_count() == 1:
    return log.means()
  encoded = json.dumps(sorted(log.metrics)).encode('utf-8')
  width = int(placement.per_process(np.int32(len(encoded))).max())
  rows = placement.per_process(np.frombuffer(encoded.ljust(width, b' '), np.uint8))
  names = sorted(set().union(*(json.loads(r.tobytes()) for r in rows)))
  if not names:
    return {}
  stats = np.asarray([[sum(log.metrics.get(n, [])), len(log.metrics.get(n, []))]
                      for n in names], np.float32)
  total = placement.per_process(stats).sum(0)  # [names, 2]
  return {n: float(total[i, 0] / total[i, 1]) for i, n in enumerate(names) if total[i, 1] > 0}


def mix_reference(policy, reference, alpha: float):
  """TRL's reference update (SyncRefModelCallback._sync_target_model, TR-DPO):
  reference * (1 - alpha) + alpha * policy, computed in float32 and stored in the reference's
  dtype."""
  mix = lambda p, r: (r.astype(jnp.float32) * (1.0 - alpha)
                      + alpha * p.astype(jnp.float32)).astype(r.dtype)
  return jax.tree.map(mix, policy, reference)


def _check_shared_prompts(tokens: np.ndarray, mask: np.ndarray, share: int) -> None:
  """Rows i*R .. i*R+R-1 share one prompt forward (model.share_prompt_prefix: R = ``share``):
  an environment's reset text that differs between a prompt's completions would be silently
  replaced by the first one's. Refused instead."""
  if share <= 1:
    return
  t = np.where(mask > 0, tokens, -1).reshape(-1, share, tokens.shape[-1])
  differ = np.flatnonzero((t != t[:, :1]).any(axis=(1, 2)))
  if differ.size:
    raise ConfigError(
        f'grpo.environment: reset() gave the completions of one prompt different texts (rows '
        f'{int(differ[0]) * share}..{int(differ[0]) * share + share - 1}), but they share one '
        'prompt forward (model.share_prompt_prefix=True): set model.share_prompt_prefix=False, '
        'or make reset() the same for the rows of one prompt.')


def _report_prompt_padding(host_stats: dict[str, float], max_prompt_length: int,
                           share: int, data_longest: Optional[int] = None) -> None:
  """After a run's first rollout: its prompts' real lengths against the padded width (the
  sampler's prefill and every learner step compute all max_prompt_length positions, so a width
  far above the data's longest prompt is work spent on padding), where that width came from
  (``data_longest``: chosen from the data's longest prompt, of that many tokens), and how many
  rows share each prompt's forward (model.share_prompt_prefix)."""
  if jax.process_index() != 0:
    return
  longest, mean = host_stats['rollout/prompt_length_max'], host_stats['rollout/prompt_length']
  chosen = ('' if data_longest is None else
            f', chosen from the data: its longest prompt has {data_longest} tokens')
  print(f'[grpo] the first rollout\'s prompts: {mean:.0f} tokens on average, {longest:.0f} at '
        f'most, left-padded to grpo.sampling.max_prompt_length={max_prompt_length} '
        f'({1 - mean / max_prompt_length:.0%} of the prompt positions are padding{chosen})',
        flush=True)
  if share > 1:
    print(f'[grpo] each prompt\'s forward runs once per {share} of its completions '
          '(model.share_prompt_prefix)', flush=True)


def _eval_summary(results: dict[str, Any], when: str) -> dict[str, Any]:
  """An evaluation in the summary: eval/accuracy_<when>, eval/<reward or metric>_<when>."""
  return {f'eval/{k}_{when}': v for k, v in results.items()}


def _counts_for(table, rollouts: int) -> dict[str, int]:
  """Old-log-prob forward passes (slice units) over ``rollouts`` rollouts under each rule."""
  s = table.config.steps_per_generation
  trl_every = bool(table.counts['trl_static'])
  rollout_units = np.array([s * int(x) for x in table.rollout_recompute])
  slice_units = np.array([int(x.sum()) for x in table.slice_recompute])
  idx = np.arange(rollouts) % table.period_rollouts
  return {'trl_static': s * rollouts if trl_every else 0,
          'rollout_rule': int(rollout_units[idx].sum()),
          'slice_rule': int(slice_units[idx].sum())}
