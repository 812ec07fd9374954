"""grpo.sync_ref_model (TRL 1.16's, from TR-DPO): the reference follows the policy every
ref_model_sync_steps optimizer steps with ref_model_mixup_alpha, is checkpointed with the rest of
the state, and is in the checkpoints' fingerprint (issue 45).

One GRPO run of 4 optimizer steps (K = 3, S = 2: 12 micro-steps) syncing every 2 steps, with a
checkpoint after every step; the reference in each checkpoint must be the mixing recursion
computed here in numpy from the checkpoints' policies. The same run stopped one micro-step after
the first sync and resumed gives the same params and reference bit for bit. The sampler-side IS
correction is on in both runs, so its metrics go through the trainer too.
"""

import json

import numpy as np
import pytest

import helpers
import smoke_configs
from jaxrl_ga import api
from jaxrl_ga import checkpoint
from jaxrl_ga.config import ConfigError

ALPHA, EVERY, STEPS = 0.6, 2, 4
SETTINGS = {'grpo.num_steps': STEPS, 'grpo.loss.beta': 0.04, 'grpo.sync_ref_model': True,
            'grpo.ref_model_sync_steps': EVERY, 'grpo.ref_model_mixup_alpha': ALPHA,
            'grpo.loss.sampler_is_correction': True,
            'checkpoint.every_steps': 1, 'checkpoint.max_to_keep': STEPS}


def _cfg(**more):
  return smoke_configs.smoke('grpo_arith', stages='grpo', **{**SETTINGS, **more})


def _trainer(workdir, cfg=None):
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = cfg or _cfg()
  ctx, params = api.build_context(cfg, str(workdir))
  return grpo.GRPOLoop(ctx, cfg.grpo), params


def _leaves(tree):
  flat = {}

  def walk(node, prefix):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(v, f'{prefix}/{k}')
    else:
      flat[prefix] = np.asarray(node)
  walk(tree, '')
  return flat


@pytest.mark.slow
def test_reference_follows_the_policy_and_resumes_bitwise(tmp_path):
  trainer, params = _trainer(tmp_path / 'a')
  initial = {k: np.asarray(v, np.float64) for k, v in _leaves(_to_dicts(params)).items()}
  want, _ = trainer.run(params)

  ckpts = checkpoint.Checkpointer(str(tmp_path / 'a' / 'checkpoints' / 'grpo'), read_only=True)
  per_step = 3  # micro-steps per optimizer step: checkpoints are numbered by micro-step
  assert ckpts.all_steps() == [per_step * n for n in range(1, STEPS + 1)]
  ref = initial
  for step in range(1, STEPS + 1):
    stored, _, _ = ckpts.restore_raw(per_step * step)
    policy = _leaves(stored['learner']['params'])
    if step % EVERY == 0:  # TRL: on_step_end at global_step % ref_model_sync_steps == 0
      ref = {k: (1 - ALPHA) * ref[k] + ALPHA * policy[k].astype(np.float64) for k in ref}
    got = _leaves(stored['ref_params'])
    assert got.keys() == ref.keys()
    for k in ref:
      np.testing.assert_allclose(got[k], ref[k], rtol=2e-6, atol=1e-7, err_msg=f'{step}{k}')
  moved = max(float(np.max(np.abs(ref[k] - initial[k]))) for k in ref)
  assert moved > 1e-6, moved  # the reference really moved
  rows = [json.loads(l) for l in open(tmp_path / 'a' / 'metrics.jsonl')]
  grpo_rows = [r for r in rows if r['phase'] == 'grpo']
  assert grpo_rows and all(
      np.isfinite(r['sampling/importance_sampling_ratio/mean']) for r in grpo_rows)

  got, _ = helpers.run_grpo_in_pieces(_trainer, tmp_path / 'b', (7,),
                                      total_micro_steps=3 * STEPS)
  helpers.assert_trees_equal(got, want)
  final = lambda d: checkpoint.Checkpointer(str(d / 'checkpoints' / 'grpo'),
                                            read_only=True).restore_raw(3 * STEPS)[0]['ref_params']
  helpers.assert_trees_equal(final(tmp_path / 'b'), final(tmp_path / 'a'))


def _to_dicts(tree):
  """An nnx State / nested mapping of arrays as nested dicts (what restore_raw returns)."""
  if hasattr(tree, 'items'):
    return {str(k): _to_dicts(v) for k, v in tree.items()}
  return getattr(tree, 'value', tree)


def test_a_resume_with_another_sync_setting_is_refused(tmp_path):
  """The sync settings are in the checkpoints' fingerprint (a resume that changes one is
  refused, naming it); at their defaults they are left out, as before they existed."""
  fingerprint = lambda cfg: api.build_context(cfg, str(tmp_path))[0].fingerprint('grpo')
  stored = fingerprint(_cfg())
  for name, value in (('grpo.ref_model_sync_steps', 3), ('grpo.ref_model_mixup_alpha', 0.5),
                      ('grpo.sync_ref_model', False)):
    ckpt = checkpoint.Checkpointer(str(tmp_path / name), fingerprint=fingerprint(
        _cfg(**{name: value})))
    with pytest.raises(checkpoint.CheckpointMismatchError, match=name):
      ckpt.check_fingerprint(1, stored)
  plain = fingerprint(smoke_configs.smoke('grpo_arith', stages='grpo'))['grpo']
  assert 'sync_ref_model' not in plain and 'sampler_is_correction' not in plain['loss']
  assert stored['grpo']['sync_ref_model'] and stored['grpo']['loss']['sampler_is_correction']


def test_lora_is_refused_before_anything_compiles(tmp_path):
  cfg = _cfg(**{'model.lora.rank': 4})
  with pytest.raises(ConfigError, match='grpo.sync_ref_model=True with model.lora.rank=4'):
    api.build_context(cfg, str(tmp_path))
