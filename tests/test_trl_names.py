"""TRL 1.16's names for the GRPO settings (issue 45): ``loss.loss_type`` and the Python API's
``make_config(trl_args=...)`` (jaxrl_ga/trl_args.py) give the very RunConfig, and so the very
checkpoint fingerprint, of our own settings; a TRL name without an equivalent is one line naming
it. The expected pairs are written out here from TRL 1.16's GRPOConfig help (loss_type)."""

import dataclasses

import pytest

from jaxrl_ga import api
from jaxrl_ga import config as config_lib
from jaxrl_ga.config import ConfigError, GRPOLossConfig

from test_fingerprint_defaults import default_fingerprint

# TRL's loss_type -> (objective, aggregation) as TRL 1.16's _compute_loss normalizes it.
PAIRS = {'grpo': ('clip', 'sequence'), 'dr_grpo': ('clip', 'constant'),
         'bnpo': ('clip', 'microbatch_token'), 'dapo': ('clip', 'token'),
         'cispo': ('cispo', 'token'), 'sapo': ('sapo', 'sequence'),
         'luspo': ('clip', 'sequence_sum'), 'vespo': ('vespo', 'token')}
EXTRA = {'cispo': {'epsilon_high': 5.0}}  # CISPO's cap must be >= 1


@pytest.mark.parametrize('loss_type', sorted(PAIRS))
def test_loss_type_is_its_pair(loss_type):
  objective, aggregation = PAIRS[loss_type]
  extra = EXTRA.get(loss_type, {})
  named = GRPOLossConfig(loss_type=loss_type, **extra)
  ours = GRPOLossConfig(objective=objective, aggregation=aggregation, **extra)
  assert named == ours and named.loss_type is None
  # The pair given too (or one of its halves) agrees.
  assert GRPOLossConfig(loss_type=loss_type, aggregation=aggregation, **extra) == ours
  run = lambda loss: dataclasses.replace(config_lib.RunConfig(),
                                         grpo=config_lib.GRPOConfig(loss=loss))
  assert default_fingerprint('grpo', run(named)) == default_fingerprint('grpo', run(ours))
  if loss_type != 'dapo':  # the pair is in the fingerprint: not the default one
    assert default_fingerprint('grpo', run(named)) != default_fingerprint('grpo')


def test_cli_override_is_the_pair():
  """What ``--config.grpo.loss.loss_type=sapo`` does: set the ConfigDict's typed placeholder,
  then build the RunConfig from it (api.make_config)."""
  cd = config_lib.load_config_file('configs/grpo_arith.py')
  cd.grpo.loss.loss_type = 'sapo'
  got = api.make_config(cd)
  cd.grpo.loss.loss_type = None
  want = api.make_config(cd, **{'grpo.loss.objective': 'sapo',
                                'grpo.loss.aggregation': 'sequence'})
  assert got == want and got.grpo.loss.objective == 'sapo'


def test_trl_args_are_our_settings():
  trl = dict(loss_type='cispo', epsilon=0.25, epsilon_high=4.0, beta=0.04,
             vllm_importance_sampling_correction=True, vllm_importance_sampling_mode='token_mask',
             vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0,
             off_policy_mask_threshold=0.5, top_entropy_quantile=0.2,
             use_bias_correction_kl=True, sync_ref_model=True, ref_model_sync_steps=8,
             ref_model_mixup_alpha=0.9, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5,
             importance_sampling_level='sequence', scale_rewards=False,
             multi_objective_aggregation='normalize_then_sum', mask_truncated_completions=True,
             num_generations=4, steps_per_generation=4, num_iterations=2,
             gradient_accumulation_steps=2, max_completion_length=32, temperature=0.7,
             learning_rate=3e-6, max_steps=7, seed=5, max_tool_calling_iterations=None)
  ours = {'grpo.loss.objective': 'cispo', 'grpo.loss.aggregation': 'token',
          'grpo.loss.epsilon_low': 0.25, 'grpo.loss.epsilon_high': 4.0, 'grpo.loss.beta': 0.04,
          'grpo.loss.sampler_is_correction': True, 'grpo.loss.sampler_is_mode': 'token_mask',
          'grpo.loss.sampler_is_clip_min': 0.5, 'grpo.loss.sampler_is_clip_max': 2.0,
          'grpo.loss.off_policy_mask_threshold': 0.5, 'grpo.loss.top_entropy_quantile': 0.2,
          'grpo.loss.use_bias_correction_kl': True, 'grpo.sync_ref_model': True,
          'grpo.ref_model_sync_steps': 8, 'grpo.ref_model_mixup_alpha': 0.9,
          'grpo.loss.sapo_temperature_pos': 2.0, 'grpo.loss.sapo_temperature_neg': 0.5,
          'grpo.loss.importance_level': 'sequence', 'grpo.advantage.scale_rewards': 'none',
          'grpo.advantage.multi_objective_aggregation': 'normalize_then_sum',
          'grpo.advantage.mask_truncated_completions': True,
          'grpo.schedule.num_generations': 4, 'grpo.schedule.steps_per_generation': 4,
          'grpo.schedule.num_iterations': 2, 'grpo.schedule.grad_accum_steps': 2,
          'grpo.sampling.max_completion_length': 32, 'grpo.sampling.temperature': 0.7,
          'grpo.optimizer.learning_rate': 3e-6, 'grpo.num_steps': 7, 'seed': 5,
          'grpo.max_tool_calls': 0}
  got = api.make_config(trl_args=trl)
  assert got == api.make_config(**ours)
  assert got != api.make_config()
  # epsilon alone is both bounds, as TRL's epsilon_high=None
  eps = api.make_config(trl_args={'epsilon': 0.3, 'epsilon_high': None}).grpo.loss
  assert (eps.epsilon_low, eps.epsilon_high) == (0.3, 0.3)
  # TRL's deprecated cap is clip_max
  assert api.make_config(trl_args={'vllm_importance_sampling_cap': 2.5}).grpo.loss == (
      GRPOLossConfig(sampler_is_clip_max=2.5))


def test_trls_older_top_k_none_is_disabled():
  assert api.make_config(trl_args={'top_k': None}).grpo.sampling.top_k == 0


@pytest.mark.parametrize('trl,message', [
    ({'per_device_train_batch_size': 4},
     r"^trl_args: 'per_device_train_batch_size' is not a TRL GRPOConfig name this project maps"),
    ({'use_vllm': True}, r"^trl_args: 'use_vllm' is not a TRL GRPOConfig name"),
    ({'vllm_importance_sampling_cap': 2.0, 'vllm_importance_sampling_clip_max': 3.0},
     r'^trl_args: vllm_importance_sampling_cap=2.0 and vllm_importance_sampling_clip_max=3.0 '
     r'both set grpo.loss.sampler_is_clip_max; give one'),
    ({'loss_type': 'ppo'}, r"loss.loss_type='ppo' is not a known value"),
    ({'loss_type': 'cispo'}, r"loss.epsilon_high=0.2 with loss.objective='cispo'"),
    # transformers 5 reads a warmup_steps under 1 as a ratio of max_steps; as steps, 0.2 was
    # no warmup at all.
    ({'warmup_steps': 0.2}, r"^trl_args: warmup_steps=0.2 is a ratio of max_steps in "
                            r"transformers 5; give the number of steps"),
    # TRL 1.16's bonus is the token mean of H whatever the loss type (its _compute_loss); ours
    # follows the policy term's normalizer: no 1:1 setting for these.
    ({'entropy_coef': 0.1, 'loss_type': 'grpo'},
     r"^trl_args: entropy_coef=0.1 has no 1:1 setting with loss_type='grpo' \(this project's "
     r"bonus follows its 'sequence' normalizer\)"),
    ({'entropy_coef': 0.1, 'loss_type': 'dr_grpo'}, r"loss_type='dr_grpo'"),
    ({'entropy_coef': 0.1, 'loss_type': 'luspo'}, r"loss_type='luspo'"),
    ({'entropy_coef': 0.1, 'loss_type': 'sapo'}, r"loss_type='sapo'"),
    ({'entropy_coef': 0.1, 'top_entropy_quantile': 0.5},
     r"entropy_coef=0.1 has no 1:1 setting with top_entropy_quantile=0.5"),
])
def test_unmapped_or_bad_trl_args_are_one_line(trl, message):
  with pytest.raises(ConfigError, match=message) as e:
    api.make_config(trl_args=trl)
  assert '\n' not in str(e.value)


def test_entropy_coef_maps_where_the_bonus_is_trls_token_mean():
  """The token-mean aggregations keep TRL's bonus (losses.grpo_loss: -c H per token, summed
  and divided by the window's or micro-batch's token count, TRL's mean of H)."""
  for loss_type in ('dapo', 'bnpo', 'cispo', 'vespo', None):
    trl = {'entropy_coef': 0.1, 'top_entropy_quantile': 1.0}
    if loss_type:
      trl['loss_type'] = loss_type
    if loss_type == 'cispo':
      trl['epsilon_high'] = 5.0
    assert api.make_config(trl_args=trl).grpo.loss.entropy_coef == 0.1
  assert api.make_config(trl_args={'entropy_coef': 0.0, 'loss_type': 'grpo'}).grpo.loss.entropy_coef == 0


def test_trl_args_of_a_run_without_a_grpo_stage_are_refused_not_ignored():
  """TRL's names map onto grpo.*: with stages='sft' (or dpo) they set a stage that does not
  run, and the SFT stage kept its own learning rate and steps without a word."""
  for stages in ('sft', 'sft,dpo'):
    with pytest.raises(ConfigError, match=rf'^trl_args: .* stages={stages} has no grpo stage'):
      api.make_config(trl_args={'learning_rate': 2e-5}, stages=stages)
  cfg = api.make_config(trl_args={'learning_rate': 2e-5}, stages='sft,grpo')
  assert cfg.grpo.optimizer.learning_rate == 2e-5


def test_loss_type_contradicting_a_set_pair_is_refused_by_the_api():
  with pytest.raises(ConfigError, match=r"loss.loss_type='sapo' means .* but "
                                        r"loss.objective='vespo' is set"):
    api.make_config(trl_args={'loss_type': 'sapo'}, **{'grpo.loss.objective': 'vespo'})
