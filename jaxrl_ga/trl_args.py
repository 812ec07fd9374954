"""TRL 1.16's ``GRPOConfig`` field names as settings of a run (``api.make_config(trl_args=...)``).

A script ported from TRL keeps its keyword arguments: each name with a 1:1 equivalent here maps
to one dotted setting (TRL_GRPO_ARGS), its value converted where TRL's spelling differs
(``scale_rewards=True``, ``max_tool_calling_iterations=None``). A name with no equivalent, or
none at all, is a ConfigError naming it. ``loss_type`` goes to ``grpo.loss.loss_type``, which
sets the (objective, aggregation) pair it means (config.TRL_LOSS_TYPES). TRL's
``use_bias_correction_kl`` default (True) is not applied: only the names given are mapped.
``entropy_coef`` > 0 maps only with a token-mean aggregation and ``top_entropy_quantile`` 1,
where this project's bonus is TRL's (:func:`_check_entropy_coef`).
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxrl_ga import config
from jaxrl_ga.errors import ConfigError

# TRL 1.16 GRPOConfig (and its transformers TrainingArguments) name -> our dotted setting.
TRL_GRPO_ARGS = {
    'loss_type': 'grpo.loss.loss_type',
    'beta': 'grpo.loss.beta',
    'epsilon': 'grpo.loss.epsilon_low',
    'epsilon_high': 'grpo.loss.epsilon_high',
    'delta': 'grpo.loss.delta',
    'importance_sampling_level': 'grpo.loss.importance_level',
    'entropy_coef': 'grpo.loss.entropy_coef',
    'sapo_temperature_pos': 'grpo.loss.sapo_temperature_pos',
    'sapo_temperature_neg': 'grpo.loss.sapo_temperature_neg',
    'vespo_k_pos': 'grpo.loss.vespo_k_pos',
    'vespo_lambda_pos': 'grpo.loss.vespo_lambda_pos',
    'vespo_k_neg': 'grpo.loss.vespo_k_neg',
    'vespo_lambda_neg': 'grpo.loss.vespo_lambda_neg',
    'top_entropy_quantile': 'grpo.loss.top_entropy_quantile',
    'use_bias_correction_kl': 'grpo.loss.use_bias_correction_kl',
    'vllm_importance_sampling_correction': 'grpo.loss.sampler_is_correction',
    'vllm_importance_sampling_mode': 'grpo.loss.sampler_is_mode',
    'vllm_importance_sampling_clip_min': 'grpo.loss.sampler_is_clip_min',
    'vllm_importance_sampling_clip_max': 'grpo.loss.sampler_is_clip_max',
    'vllm_importance_sampling_cap': 'grpo.loss.sampler_is_clip_max',  # TRL's deprecated name
    'off_policy_mask_threshold': 'grpo.loss.off_policy_mask_threshold',
    'scale_rewards': 'grpo.advantage.scale_rewards',
    'mask_truncated_completions': 'grpo.advantage.mask_truncated_completions',
    'multi_objective_aggregation': 'grpo.advantage.multi_objective_aggregation',
    'num_generations': 'grpo.schedule.num_generations',
    'steps_per_generation': 'grpo.schedule.steps_per_generation',
    'num_iterations': 'grpo.schedule.num_iterations',
    'gradient_accumulation_steps': 'grpo.schedule.grad_accum_steps',
    'max_completion_length': 'grpo.sampling.max_completion_length',
    'temperature': 'grpo.sampling.temperature',
    'top_p': 'grpo.sampling.top_p',
    'top_k': 'grpo.sampling.top_k',
    'sync_ref_model': 'grpo.sync_ref_model',
    'ref_model_sync_steps': 'grpo.ref_model_sync_steps',
    'ref_model_mixup_alpha': 'grpo.ref_model_mixup_alpha',
    'max_tool_calling_iterations': 'grpo.max_tool_calls',
    'max_steps': 'grpo.num_steps',
    'logging_steps': 'grpo.log_every',
    'learning_rate': 'grpo.optimizer.learning_rate',
    'weight_decay': 'grpo.optimizer.weight_decay',
    'adam_beta1': 'grpo.optimizer.b1',
    'adam_beta2': 'grpo.optimizer.b2',
    'adam_epsilon': 'grpo.optimizer.eps',
    'warmup_steps': 'grpo.optimizer.warmup_steps',
    'max_grad_norm': 'grpo.optimizer.max_grad_norm',
    'seed': 'seed',
    'chat_template_kwargs': 'model.chat_template_kwargs',  # a dict or its JSON text, as TRL's
}

# TRL's values whose spelling differs from ours: name -> {TRL value: ours}.
_VALUES = {
    'scale_rewards': {True: 'group', False: 'none'},
    'max_tool_calling_iterations': {None: 0},
    'top_k': {None: 0},  # TRL before 1.0: None disabled it, as 0 does
}


def trl_overrides(trl_args: Mapping[str, Any]) -> dict[str, Any]:
  """TRL GRPOConfig keyword arguments -> {dotted setting: value} (:func:`api.make_config`'s
  overrides). ``epsilon`` alone sets both clipping bounds (TRL's ``epsilon_high=None``); two
  names of the same setting with different values, or a name not in TRL_GRPO_ARGS, raise a
  one-line ConfigError naming it."""
  out, source = {}, {}
  for name, value in trl_args.items():
    if name not in TRL_GRPO_ARGS:
      raise ConfigError(
          f'trl_args: {name!r} is not a TRL GRPOConfig name this project maps (unknown, or '
          f'without a 1:1 setting here); set its equivalent among the run\'s settings '
          f'(docs/configuration.md) or drop it. Mapped: {", ".join(sorted(TRL_GRPO_ARGS))}.')
    if name == 'warmup_steps' and isinstance(value, float) and 0 < value < 1:
      raise ConfigError(f'trl_args: warmup_steps={value!r} is a ratio of max_steps in '
                        f'transformers 5; give the number of steps (ceil({value!r} x max_steps)) '
                        f'instead.')
    if name == 'epsilon_high' and value is None:
      continue  # TRL's default: epsilon's value (below)
    if name in _VALUES and _hashable(value) and value in _VALUES[name]:
      value = _VALUES[name][value]
    if name == 'chat_template_kwargs':  # the setting's form: a JSON object's text, '' for none
      value = config.template_kwargs_json(value, 'trl_args: chat_template_kwargs')
    setting = TRL_GRPO_ARGS[name]
    if setting in out and out[setting] != value:
      raise ConfigError(f'trl_args: {source[setting]}={trl_args[source[setting]]!r} and '
                        f'{name}={trl_args[name]!r} both set {setting}; give one.')
    out[setting], source[setting] = value, name
  if 'epsilon' in trl_args and trl_args.get('epsilon_high') is None:
    out['grpo.loss.epsilon_high'] = trl_args['epsilon']
  _check_entropy_coef(trl_args)
  return out


# The aggregations whose entropy bonus is TRL 1.16's (its token mean of H): the window's token
# mean (dapo, cispo, vespo) and the micro-batch's (bnpo).
_TOKEN_MEAN_AGGREGATIONS = ('token', 'microbatch_token')


def _check_entropy_coef(trl_args: Mapping[str, Any]) -> None:
  """entropy_coef maps 1:1 only where this project's bonus (aggregated as the policy term,
  docs/design.md) is TRL 1.16's (the token mean of H over the tokens the policy term acts on,
  whatever the loss type): a token-mean aggregation and top_entropy_quantile 1. Elsewhere it is
  a ConfigError, as a name without a 1:1 setting is."""
  coef = trl_args.get('entropy_coef') or 0
  if not (isinstance(coef, (int, float)) and coef > 0):
    return
  loss_type = trl_args.get('loss_type', 'dapo')  # TRL 1.16's default
  aggregation = config.TRL_LOSS_TYPES.get(loss_type, (None, 'token'))[1]
  rho = trl_args.get('top_entropy_quantile', 1.0)
  if aggregation in _TOKEN_MEAN_AGGREGATIONS and rho == 1:
    return
  why = (f'loss_type={loss_type!r} (this project\'s bonus follows its {aggregation!r} '
         f'normalizer)' if aggregation not in _TOKEN_MEAN_AGGREGATIONS else
         f'top_entropy_quantile={rho!r} (this project\'s bonus is over every token\'s count)')
  raise ConfigError(
      f'trl_args: entropy_coef={coef!r} has no 1:1 setting with {why}: TRL 1.16 adds the token '
      f'mean of the entropy whatever the loss type, this project aggregates the bonus as the '
      f'policy term (docs/design.md). Use loss_type dapo, bnpo, cispo or vespo with '
      f'top_entropy_quantile=1, or set grpo.loss.entropy_coef as a run setting, on this '
      f'project\'s scale.')


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True
