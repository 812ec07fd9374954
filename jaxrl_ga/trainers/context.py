"""The run context (everything a stage needs besides its own config), its roles (``Role``: a mesh
and the policy's shardings on it) and the part of the policy a stage trains (``TrainedPart``).
The policy's architecture and params: ``models/policy.py``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

import jax

from jaxrl_ga import checkpoint
from jaxrl_ga import fileio
from jaxrl_ga import lora
from jaxrl_ga.config import ROLES, RunConfig
from jaxrl_ga.models import families
from jaxrl_ga.models import transformer as tfm


@dataclasses.dataclass(frozen=True)
class Role:
  """One role of a run (config.ROLES; docs/design.md, "Roles"): its mesh and the policy's
  param shardings on it. 'actor': the learner and the old log-probs; 'rollout': generation;
  'reference': the reference log-probs."""
  name: str
  mesh: Any
  param_shardings: Any


@dataclasses.dataclass
class RunContext:
  """Everything a stage needs besides its own config. ``mesh`` and ``param_shardings`` are the
  actor's; ``roles`` names every role's."""
  cfg: RunConfig
  workdir: str
  mesh: Any
  task: Any  # jaxrl_ga.tasks.base.Task
  tokenizer: Any  # transformers tokenizer
  model_cfg: tfm.ModelConfig
  graphdef: Any
  param_shardings: Any
  writer: Any  # reporting.MetricWriter
  # SIGTERM/SIGINT -> a flag for the whole run (main.run holds it); None: each stage loop holds
  # its own.
  guard: Optional[checkpoint.PreemptionGuard] = None
  # metric(prompts, completions, **columns) of the held-out evaluation (eval.metric, or the
  # Python API's metric=); None: none.
  eval_metric: Optional[Callable[..., Any]] = None
  # {setting: the data's longest prompt, in tokens} of each width chosen from the data (a
  # ``max_prompt_length`` of 0, api.validate_lengths); ``cfg`` holds the width chosen.
  widths_from_data: dict[str, int] = dataclasses.field(default_factory=dict)
  # The roles given devices of their own (mesh.rollout, mesh.reference; sharding.role_meshes):
  # name -> Role. The rollout's is by default the actor's (``mesh``, ``param_shardings``), the
  # reference's the rollout's (the rollout step then computes the reference log-probs).
  own_meshes: dict[str, Role] = dataclasses.field(default_factory=dict)
  # The run's tools and environments (grpo.tools, grpo.environment, or the Python API's;
  # jaxrl_ga.tools.ToolSetup); None: single-turn rollouts.
  tool_setup: Any = None
  # The ids that end a generated completion (policy.stop_ids: the tokenizer's eos first, then the
  # model's generation config's); empty: the tokenizer's eos alone.
  stop_ids: tuple[int, ...] = ()

  @property
  def roles(self) -> dict[str, Role]:
    """{name: Role} of every role of config.ROLES."""
    actor = Role(ROLES[0], self.mesh, self.param_shardings)
    rollout = self.own_meshes.get('rollout') or dataclasses.replace(actor, name='rollout')
    reference = (self.own_meshes.get('reference')
                 or dataclasses.replace(rollout, name='reference'))
    return {'actor': actor, 'rollout': rollout, 'reference': reference}

  @property
  def is_primary(self) -> bool:
    return jax.process_index() == 0

  @property
  def eos_id(self) -> int:
    """The tokenizer's eos: what SFT and DPO rows end with (TRL's)."""
    return int(self.tokenizer.eos_token_id)

  @property
  def generation_stops(self) -> tuple[int, ...]:
    """The ids that end a generated completion (``stop_ids``, else the tokenizer's eos): what
    the rollout, DPO's generation and the held-out evaluation stop at."""
    return tuple(self.stop_ids) or (self.eos_id,)

  @property
  def pad_id(self) -> int:
    return int(self.tokenizer.pad_token_id)

  def with_chosen_lengths(self, stage: str, stage_cfg):
    """``stage_cfg`` (a stage's config, e.g. a caller's ``cfg.grpo``) with each length it
    leaves at 0 that the run chose from the data (``widths_from_data``) set as in ``cfg``."""
    for setting in self.widths_from_data:
      name, *path = setting.split('.')
      if name == stage:
        stage_cfg = _filled(stage_cfg, getattr(self.cfg, stage), path)
    return stage_cfg

  def checkpointer(self, stage: str) -> checkpoint.Checkpointer:
    return checkpoint.Checkpointer(
        fileio.join(self.workdir, 'checkpoints', stage),
        max_to_keep=self.cfg.checkpoint.max_to_keep, fingerprint=self.fingerprint(stage))

  def fingerprint(self, stage: str) -> dict[str, Any]:
    """Every setting that changes what a stage checkpoint's state means: a resume with another
    value is refused. Lengths and cadences (RESUMABLE_SETTINGS, eval.*, checkpoint.*) and the
    mesh (orbax restores onto any sharding) may change."""
    stage_cfg = dataclasses.asdict(getattr(self.cfg, stage))
    for name in RESUMABLE_SETTINGS:
      stage_cfg.pop(name, None)
    stage_cfg.get('optimizer', {}).pop('max_consecutive_nonfinite', None)
    if not stage_cfg.get('reward_funcs', True):
      del stage_cfg['reward_funcs']  # the task's own rewards: as before the setting existed
    if stage == 'grpo':  # TRL's name of (objective, aggregation), None once they are set
      stage_cfg['loss'].pop('loss_type', None)
    _drop_later_defaults(stage_cfg, dataclasses.asdict(type(getattr(self.cfg, stage))()))
    data = {} if not self.cfg.data.train else {'data': dataclasses.asdict(self.cfg.data)}
    model = dataclasses.asdict(self.model_cfg)
    for name in _LATER_MODEL_FIELDS:  # unset: as before the fields existed (older runs resume)
      if not model.get(name):
        model.pop(name, None)
    if self.cfg.model.chat_template_kwargs:  # the prompts' tokens; unset: as before it existed
      model['chat_template_kwargs'] = self.cfg.model.chat_template_kwargs
    return _jsonable({'stage': stage, 'seed': self.cfg.seed, stage: stage_cfg,
                      'model': model,
                      'model_source': self.cfg.model.hf_path,
                      'task': dataclasses.asdict(self.cfg.task), **data})


# ModelConfig fields added after checkpoints were first written: the settings only some families
# read (Gemma 3's, Mistral's; models/families.py); left out of the fingerprint while unset.
_LATER_MODEL_FIELDS = families.FAMILY_SETTINGS

# Stage settings added after checkpoints were first written: left out of the fingerprint at their
# defaults, as before they existed (older runs resume); any other value is in it, so a resume that
# changes one is refused.
LATER_STAGE_SETTINGS = ('sync_ref_model', 'ref_model_sync_steps', 'ref_model_mixup_alpha',
                        'loss.sampler_is_correction', 'loss.sampler_is_mode',
                        'loss.sampler_is_clip_min', 'loss.sampler_is_clip_max',
                        'loss.off_policy_mask_threshold',
                        # jaxrl_ga.tools
                        'tools', 'environment', 'max_tool_calls',
                        # TRL 1.16's objectives and options (losses.grpo_loss)
                        'loss.objective', 'loss.sapo_temperature_pos', 'loss.sapo_temperature_neg',
                        'loss.vespo_k_pos', 'loss.vespo_lambda_pos', 'loss.vespo_k_neg',
                        'loss.vespo_lambda_neg', 'loss.top_entropy_quantile',
                        'loss.use_bias_correction_kl', 'advantage.multi_objective_aggregation',
                        # sft: TRL's loss-mask options (jaxrl_ga.sft_data)
                        'assistant_only_loss', 'completion_only_loss')


def _drop_later_defaults(stage_cfg: dict, defaults: dict) -> None:
  for name in LATER_STAGE_SETTINGS:
    *path, last = name.split('.')
    node, default = stage_cfg, defaults
    for key in path:
      node, default = node.get(key, {}), default.get(key, {})
    if last in node and node[last] == default.get(last):
      del node[last]


# Stage settings that may change when a run resumes: how long it trains and how often it logs,
# evaluates and probes. Everything else of the stage is in its checkpoints' fingerprint.
RESUMABLE_SETTINGS = ('num_steps', 'log_every', 'eval_every', 'target_accuracy', 'probe_every',
                      'probe_examples', 'completions_every', 'completions_logged', 'tool_timeout_s')


def _filled(node, chosen, path: list[str]):
  """``node`` with its field at ``path`` (nested dataclasses) taken from ``chosen`` if 0."""
  value = getattr(node, path[0])
  if len(path) > 1:
    value = _filled(value, getattr(chosen, path[0]), path[1:])
  elif not value:
    value = getattr(chosen, path[0])
  return dataclasses.replace(node, **{path[0]: value})


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


class TrainedPart:
  """What a stage's learner trains of its input ``params`` and what stays frozen: with LoRA
  (``model.lora``) the adapters and the base weights (held here, passed to every learner step,
  never checkpointed: a resumed run rebuilds them from its input), else all params and None."""

  def __init__(self, ctx: RunContext, params):
    self.trained, self.frozen = lora.partition(params, ctx.model_cfg)

  def policy(self, trained) -> Any:
    """The whole policy's params from the learner's (``state.params``)."""
    return tfm.combine(self.frozen, trained)

