"""A stage setting added later must leave the default fingerprint as it was (trainers/context.py,
LATER_STAGE_SETTINGS): a run saved before the setting existed resumes, since the fingerprint of
its checkpoints is compared with the one of the resumed run.

The stored hashes are of the default fingerprints (RunConfig() and a one-layer architecture) as
``RunContext.fingerprint`` computed them at commit 9bb9ee4, the last before issue 45's settings
(sync_ref_model, loss.sampler_is_*, loss.objective, ...), in a worktree of that commit. A new
setting left off LATER_STAGE_SETTINGS (or a changed default) changes them and fails here.
"""

import dataclasses
import hashlib
import json

import pytest

from jaxrl_ga import config as config_lib
from jaxrl_ga.models import transformer
from jaxrl_ga.trainers import context

AT_9BB9EE4 = {
    'grpo': 'a62d2762ae287995f86b9c9ac2c043d1bf4bfd82b87343f7681fb2cee57b1492',
    'sft': '55091772d90e6796c9cf3b8bcd6f273cf9c2cc658c374a6cc1326edf65304134',
    'dpo': 'e34545b046b28695afa99db0138b9a6c1d61850e93d694bbd4bdfc186816d625',
}


def default_fingerprint(stage, cfg=None):
  fields = {f.name: None for f in dataclasses.fields(context.RunContext) if
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
  arch = transformer.ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8,
                                 num_hidden_layers=1, num_attention_heads=1,
                                 num_key_value_heads=1)
  ctx = context.RunContext(**(fields | {'cfg': cfg or config_lib.RunConfig(), 'model_cfg': arch}))
  return ctx.fingerprint(stage)


@pytest.mark.parametrize('stage', sorted(AT_9BB9EE4))
def test_default_fingerprint_is_the_one_before_issue_45(stage):
  fp = default_fingerprint(stage)
  got = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
  assert got == AT_9BB9EE4[stage], (
      f'the default {stage} fingerprint changed: add the new setting to '
      f'trainers/context.LATER_STAGE_SETTINGS; now {json.dumps(fp[stage], sort_keys=True)}')


def test_a_later_setting_off_its_default_is_in_the_fingerprint():
  """The test above would pass if the fingerprint dropped every setting: one set away from its
  default must change it."""
  loss = config_lib.GRPOLossConfig(objective='sapo', aggregation='sequence')
  cfg = dataclasses.replace(config_lib.RunConfig(),
                            grpo=config_lib.GRPOConfig(loss=loss))
  fp = default_fingerprint('grpo', cfg)
  assert fp['grpo']['loss']['objective'] == 'sapo'
  assert fp != default_fingerprint('grpo')
