"""Validation errors: each names the setting(s) and a fix, and the fixes it suggests are valid."""

import re

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from jaxrl_ga import schedule
from jaxrl_ga.config import (ConfigError, DPOLossConfig, GRPOLossConfig, ModelSpec, RunConfig,
                             ScheduleConfig, from_mapping)

SCHEDULE_INTS = ('micro_batch_size', 'num_generations', 'steps_per_generation', 'num_iterations',
                 'grad_accum_steps')


def _suggested(message: str, setting: str) -> list[int]:
  """The numbers a message suggests for ``setting``, as in 'set micro_batch_size to 4 or 8'."""
  match = re.search(rf'{setting} (?:to|a multiple of [^:]*:) (\d+(?: or \d+)*)', message)
  assert match, (setting, message)
  return [int(x) for x in match.group(1).split(' or ')]


@pytest.mark.parametrize('name', SCHEDULE_INTS)
@pytest.mark.parametrize('value', [0, -2, 1.5, True, '4', None])
def test_schedule_rejects_non_positive_integers(name, value):
  with pytest.raises(ConfigError, match=rf'^{name} must be a positive integer, got .*'
                                        rf'set {name} to 1 or more'):
    ScheduleConfig(**{name: value})


def test_schedule_accepts_numpy_integers_as_int():
  cfg = ScheduleConfig(micro_batch_size=np.int64(8), grad_accum_steps=np.int32(4))
  assert type(cfg.micro_batch_size) is int and type(cfg.grad_accum_steps) is int


def test_schedule_rejects_unknown_update_mode_and_non_bool_strict():
  with pytest.raises(ConfigError, match="update_mode='seq'.*did you mean 'sequential'"):
    ScheduleConfig(update_mode='seq')
  with pytest.raises(ConfigError, match='strict_on_policy must be True or False'):
    ScheduleConfig(strict_on_policy='yes')


def test_group_must_lie_inside_one_rollout():
  with pytest.raises(ConfigError) as e:
    ScheduleConfig(micro_batch_size=3, num_generations=4, steps_per_generation=2)
  message = str(e.value)
  assert 'steps_per_generation*micro_batch_size = 2*3 = 6' in message
  assert 'num_generations = 4' in message
  assert 'set micro_batch_size to 2 or 4' in message
  assert 'num_generations to 3 or 6' in message


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(2, 16))
def test_group_error_suggestions_are_valid(b, s, g):
  assume((s * b) % g)
  with pytest.raises(ConfigError) as e:
    ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s)
  message = str(e.value)
  for setting, field in (('micro_batch_size', 'micro_batch_size'),
                         ('steps_per_generation', 'steps_per_generation'),
                         ('num_generations', 'num_generations')):
    values = dict(micro_batch_size=b, num_generations=g, steps_per_generation=s)
    if setting == 'num_generations' and s * b == 1:
      continue  # no group size >= 2 divides a rollout of 1 completion
    for suggestion in _suggested(message, f'set {setting}' if setting == 'micro_batch_size'
                                 else setting):
      values[field] = suggestion
      ScheduleConfig(**values)  # does not raise


def test_strict_on_policy_suggests_aligned_values():
  cfg = ScheduleConfig(micro_batch_size=4, num_generations=4, steps_per_generation=2,
                       grad_accum_steps=3, strict_on_policy=True)
  with pytest.raises(ConfigError) as e:
    schedule.validate(cfg)
  message = str(e.value)
  assert message.startswith('strict_on_policy=True')
  assert ('make grad_accum_steps a multiple of steps_per_generation*num_iterations = 2: 2 or 4'
          in message)
  assert 'set steps_per_generation to 1 or 3' in message
  # TRL PR #3493's example: K=4, S=3.
  with pytest.raises(ConfigError, match=r'grad_accum_steps .*= 3: 3 or 6; or set '
                                        r'steps_per_generation to 2 or 4'):
    schedule.check_strict_on_policy(ScheduleConfig(
        micro_batch_size=6, num_generations=2, steps_per_generation=3, grad_accum_steps=4))
  with pytest.raises(ConfigError, match="update_mode='sequential'.*update_mode='accumulate'"):
    schedule.check_strict_on_policy(ScheduleConfig(update_mode='sequential'))
  schedule.check_strict_on_policy(ScheduleConfig(steps_per_generation=2, grad_accum_steps=4))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12), st.sampled_from([2, 4, 8]),
       st.sampled_from([1, 2, 4, 8]))
def test_strict_on_policy_suggestions_are_on_policy(k, s, mu, b, g):
  assume((s * b) % g == 0)
  cfg = ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s,
                       num_iterations=mu, grad_accum_steps=k)
  aligned = k % (s * mu) == 0
  if aligned:
    schedule.check_strict_on_policy(cfg)
    return
  with pytest.raises(ConfigError) as e:
    schedule.check_strict_on_policy(cfg)
  message = str(e.value)
  for new_k in _suggested(message, 'grad_accum_steps'):
    schedule.check_strict_on_policy(ScheduleConfig(
        micro_batch_size=b, num_generations=g, steps_per_generation=s, num_iterations=mu,
        grad_accum_steps=new_k))
  if 'set steps_per_generation' in message:
    for new_s in _suggested(message, 'set steps_per_generation'):
      table = schedule.build_table(ScheduleConfig(
          micro_batch_size=b, num_generations=g, steps_per_generation=new_s, num_iterations=mu,
          grad_accum_steps=k, strict_on_policy=True))
      assert not table.off_policy.any()


def test_micro_batch_must_split_over_data_parallel_shards():
  cfg = ScheduleConfig(micro_batch_size=6, num_generations=2, steps_per_generation=3)
  with pytest.raises(ConfigError) as e:
    schedule.validate_for_mesh(cfg, 4)
  message = str(e.value)
  assert 'micro_batch_size = 6' in message and 'mesh data*fsdp = 4' in message
  assert 'set micro_batch_size to 4 or 8' in message
  assert 'data*fsdp divides 6 (e.g. 3 or 6)' in message
  with pytest.raises(ConfigError, match='data-parallel size'):
    schedule.validate_for_mesh(cfg, 0)
  with pytest.raises(ConfigError, match='mesh data\\*fsdp = 4'):
    schedule.validate(cfg, data_parallel_size=4)
  schedule.validate_for_mesh(cfg, 3)
  schedule.validate(cfg, data_parallel_size=6)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 8), st.integers(1, 16))
def test_mesh_error_suggestions_are_valid(b, s, g, dp):
  assume((s * b) % g == 0 and b % dp)
  cfg = ScheduleConfig(micro_batch_size=b, num_generations=g, steps_per_generation=s)
  with pytest.raises(ConfigError) as e:
    schedule.validate_for_mesh(cfg, dp)
  for new_b in _suggested(str(e.value), 'set micro_batch_size'):
    schedule.validate_for_mesh(ScheduleConfig(micro_batch_size=new_b, num_generations=g,
                                              steps_per_generation=s), dp)


@pytest.mark.parametrize('trl_name, ours', [('dapo', 'token'), ('grpo', 'sequence'),
                                            ('dr_grpo', 'constant'),
                                            ('bnpo', 'microbatch_token')])
def test_grpo_aggregation_names_trl_aliases(trl_name, ours):
  with pytest.raises(ConfigError, match=rf"loss.aggregation='{trl_name}'.*TRL's '{trl_name}' "
                                        rf"is '{ours}' here"):
    GRPOLossConfig(aggregation=trl_name)


def test_loss_names_that_do_not_exist():
  with pytest.raises(ConfigError, match="loss.aggregation='tokens'.*did you mean 'token'.*"
                                        "set loss.aggregation to one of 'token', 'sequence'"):
    GRPOLossConfig(aggregation='tokens')
  with pytest.raises(ConfigError, match="loss.importance_level='seq'"):
    GRPOLossConfig(importance_level='seq')
  with pytest.raises(ConfigError, match="dpo.loss_type='exo_pair'.*set dpo.loss_type to one of "
                                        "'sigmoid'"):
    DPOLossConfig(loss_type='exo_pair')
  with pytest.raises(ConfigError, match="dpo.aggregation='mean'.*'pair', 'token'"):
    DPOLossConfig(aggregation='mean')


def test_from_mapping_names_unknown_settings():
  with pytest.raises(ConfigError, match='grpo.schedule.grad_acum_steps'):
    from_mapping(ScheduleConfig, {'grad_acum_steps': 4}, prefix='grpo.schedule.')
  cfg = from_mapping(ScheduleConfig, {'grad_accum_steps': 4, 'steps_per_generation': 2})
  assert cfg.optimizer_every == 4 and cfg.micro_steps_per_rollout == 2


@pytest.mark.parametrize('setting, value, message', [
    ('grpo.sampling.top_k', None, r"^grpo.sampling.top_k=None must be an integer; set it"),
    ('grpo.sampling.top_p', '0.9', r"^grpo.sampling.top_p='0.9' must be a number;"),
    ('grpo.loss.beta', None, r'^grpo.loss.beta=None must be a number;'),
    ('grpo.advantage.mask_truncated_completions', 'yes', r'must be True or False'),
    ('model.hf_path', 3, r'^model.hf_path=3 must be a string'),
    ('grpo.num_steps', True, r'^grpo.num_steps=True must be an integer'),
    # Values that ran (and failed after compiling, or with a traceback) before:
    ('seed', -1, r'^seed=-1 must be an integer >= 0'),
    ('grpo.optimizer.eps', float('nan'), r'^grpo.optimizer.eps=nan is not a number'),
    ('model.rope_theta', -1.0, r'^model.rope_theta=-1.0 must be > 0'),
    ('model.rms_norm_eps', 0.0, r'^model.rms_norm_eps=0.0 must be > 0'),
    ('grpo.optimizer.b1', 1.5, r'optimizer.b1=1.5 must be in \[0, 1\)'),
    ('grpo.optimizer.b2', -1.0, r'optimizer.b2=-1.0 must be in \[0, 1\)'),
    ('grpo.optimizer.eps', -1.0, r'optimizer.eps=-1.0 must be a finite number >= 0'),
    ('grpo.optimizer.weight_decay', -1.0, r'optimizer.weight_decay=-1.0 must be a finite'),
    ('grpo.optimizer.sequential_lr_scale', -1.0, r'optimizer.sequential_lr_scale=-1.0 must be'),
    ('stages', 'sft,sft', r"^stages='sft,sft': sft is given twice"),
])
def test_wrong_types_and_values_are_one_line_config_errors(setting, value, message):
  """The CLI's values are typed by ml_collections; the Python API's reached the dataclasses'
  comparisons and raised a TypeError traceback."""
  from jaxrl_ga import api  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=message):
    api.make_config(**{setting: value})


def test_numpy_scalars_become_python_values():
  from jaxrl_ga import api  # pylint: disable=import-outside-toplevel
  cfg = api.make_config(**{'grpo.num_steps': np.int64(3), 'grpo.loss.beta': np.float32(0.5)})
  assert type(cfg.grpo.num_steps) is int and type(cfg.grpo.loss.beta) is float
  assert (cfg.grpo.num_steps, cfg.grpo.loss.beta) == (3, 0.5)


@pytest.mark.parametrize('name', ['scan_layers', 'share_prompt_prefix'])
def test_model_switches_must_be_bools(name):
  with pytest.raises(ConfigError, match=rf'model.{name}=1 must be True or False'):
    ModelSpec(**{name: 1})


@pytest.mark.parametrize('stage', ['sft', 'grpo', 'dpo'])
def test_every_stage_sets_its_evaluation_cadence_with_eval_every(stage):
  """One name for "a held-out evaluation every N optimizer steps" in every stage."""
  assert getattr(from_mapping(RunConfig, {stage: {'eval_every': 3}}), stage).eval_every == 3
  with pytest.raises(ConfigError, match=rf'^{stage}\.eval_every must be >= 0 \(0: '):
    from_mapping(RunConfig, {stage: {'eval_every': -1}})


def test_every_stage_a_config_accepts_is_registered_with_its_config_and_k():
  """config.STAGES and the registry that api.run goes through hold the same stages, in order;
  each stage's config is the RunConfig field of its name, and its K is micro-steps per optimizer
  step (GRPO's sequential mode: one optimizer step per micro-step, docs/design.md)."""
  from jaxrl_ga import config  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import registry  # pylint: disable=g-import-not-at-top
  assert tuple(registry.STAGES) == config.STAGES
  cfg = from_mapping(RunConfig, {'sft': {'grad_accum_steps': 3}, 'dpo': {'grad_accum_steps': 5},
                                 'grpo': {'schedule': {'grad_accum_steps': 4,
                                                       'update_mode': 'sequential'}}})
  for name, stage in registry.STAGES.items():
    assert stage.name == name and isinstance(getattr(cfg, name), stage.config_type)
  k = {name: stage.optimizer_every(getattr(cfg, name))
       for name, stage in registry.STAGES.items()}
  assert k == {'sft': 3, 'grpo': 1, 'dpo': 5}
