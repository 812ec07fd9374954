"""The run context (everything a stage needs besides its own config) and the policy it starts
from: the architecture (``model_config``) and the sharded params (``build_model``)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Optional

import jax

from jaxrl_ga import checkpoint
from jaxrl_ga import fileio
from jaxrl_ga import lora
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, RunConfig
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm


@dataclasses.dataclass
class RunContext:
  """Everything a stage needs besides its own config."""
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

  @property
  def is_primary(self) -> bool:
    return jax.process_index() == 0

  @property
  def eos_id(self) -> int:
    return int(self.tokenizer.eos_token_id)

  @property
  def pad_id(self) -> int:
    return int(self.tokenizer.pad_token_id)

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
    data = {} if not self.cfg.data.train else {'data': dataclasses.asdict(self.cfg.data)}
    return _jsonable({'stage': stage, 'seed': self.cfg.seed, stage: stage_cfg,
                      'model': dataclasses.asdict(self.model_cfg),
                      'model_source': self.cfg.model.hf_path,
                      'task': dataclasses.asdict(self.cfg.task), **data})


# Stage settings that may change when a run resumes: how long it trains and how often it logs,
# evaluates and probes. Everything else of the stage is in its checkpoints' fingerprint.
RESUMABLE_SETTINGS = ('num_steps', 'log_every', 'eval_every', 'target_accuracy', 'probe_every',
                      'probe_examples', 'completions_every', 'completions_logged')


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


class TrainedPart:
  """What a stage's learner trains of its input ``params`` and what stays frozen: with LoRA
  (``model.lora``) the adapters and the base weights (held here, passed to every learner step,
  never checkpointed: a resumed run rebuilds them from its input), else all params and None."""

  def __init__(self, ctx: RunContext, params):
    self.trained, self.frozen = lora.partition(params, ctx.model_cfg)
    self.shardings, self.frozen_shardings = lora.partition(ctx.param_shardings, ctx.model_cfg)

  def policy(self, trained) -> Any:
    """The whole policy's params from the learner's (``state.params``)."""
    return tfm.combine(self.frozen, trained)


# -- the policy ------------------------------------------------------------------------------------
def model_config(cfg: RunConfig, vocab_size: int) -> tfm.ModelConfig:
  """The policy's architecture, read from ``model.hf_path``'s config (no weights) or built from
  the ``model.*`` fields with the tokenizer's ``vocab_size``; with ``model.lora``'s adapters."""
  return dataclasses.replace(_base_model_config(cfg, vocab_size), lora=cfg.model.lora)


def _base_model_config(cfg: RunConfig, vocab_size: int) -> tfm.ModelConfig:
  spec = cfg.model
  if spec.hf_path:
    from jaxrl_ga.models import gguf  # pylint: disable=g-import-not-at-top
    if gguf.is_gguf_source(spec.hf_path):
      return gguf.model_config(gguf.resolve(spec.hf_path), dtype=spec.dtype,
                               param_dtype=spec.param_dtype)
    try:
      return hf.model_config_from_hf(spec.hf_path, dtype=spec.dtype,
                                     param_dtype=spec.param_dtype)
    except (OSError, ValueError, KeyError) as e:  # unknown model_type, unsupported feature
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ConfigError(f'model.hf_path={spec.hf_path}: {first} (supported: Qwen2ForCausalLM '
                        f'and LlamaForCausalLM checkpoints, or a llama GGUF file)') from None
  return spec.architecture_config(vocab_size)


def build_model(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh):
  """(graphdef, params, shardings) of ``model_cfg``: from HF weights or freshly initialised.
  With LoRA the params hold the base weights and fresh adapters (``jaxrl_ga.lora``); the same
  base on every call (a resumed run rebuilds it so)."""
  shardings_fn = functools.partial(sharding.param_shardings, mesh=mesh)
  if cfg.model.hf_path:
    _, _, params = hf.load_model(cfg.model.hf_path, dtype=cfg.model.dtype,
                                 param_dtype=cfg.model.param_dtype, shardings_fn=shardings_fn)
    graphdef, shapes, axes = sharding.abstract_model(model_cfg)
    shardings = shardings_fn(shapes, axes)
    if model_cfg.lora.rank:
      params = tfm.combine(params, lora.init_adapters(model_cfg, cfg.seed,
                                                      lora.split(shardings)[0]))
    return graphdef, params, shardings
  return sharding.init_params(model_cfg, cfg.seed, mesh)
