"""What keeps a run from going silently wrong: bad input refused before any stage runs (one line,
exit status 2), unreadable checkpoints set aside with a fallback, non-finite windows stopping the
run, and exports that never mix with an earlier export."""

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import helpers
import smoke_configs

from jaxrl_ga import checkpoint
from jaxrl_ga import export
from jaxrl_ga import api
from jaxrl_ga.config import ConfigError, RunConfig, from_mapping, load_config_file
from jaxrl_ga.trainers import stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_smoke = smoke_configs.smoke


def _env():
  return dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1',
              XLA_FLAGS=helpers.xla_flags(8))


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """A finished 2-step GRPO stage with checkpoints at micro-steps 3 and 6, every rollout's
  completions in completions.jsonl."""
  workdir = tmp_path_factory.mktemp('finished')
  api.run(_smoke(stages='grpo', **{'grpo.num_steps': 2, 'checkpoint.every_steps': 1,
                                   'grpo.completions_every': 1}),
               str(workdir))
  assert checkpoint.all_steps(workdir / 'checkpoints' / 'grpo') == [3, 6]
  return workdir


@pytest.mark.parametrize('overrides,named', [
    ({'model.hf_path': '/nonexistent/dir'}, 'model.hf_path=/nonexistent/dir: no such directory'),
    ({'model.hf_path': 'relative_dir_that_is_not_there'}, 'no such directory or file'),
    ({'model.max_position_embeddings': 4}, 'exceeds model.max_position_embeddings=4'),
    ({'grpo.sampling.rollout_micro_batch_size': 3},
     'grpo.sampling.rollout_micro_batch_size=3 must divide the 16 rows'),
    ({'grpo.sampling.max_prompt_length': 3}, 'set grpo.sampling.max_prompt_length to 6 or more'),
    ({'sft.max_length': 5}, 'set sft.max_length to 10 or more'),
])
def test_bad_settings_are_refused_before_any_stage(tmp_path, overrides, named):
  """Each is found before SFT (the first stage) trains a step or anything compiles."""
  with pytest.raises(ConfigError) as e:
    api.run(_smoke(**overrides), str(tmp_path))
  assert named in str(e.value)
  assert not (tmp_path / 'checkpoints' / 'sft').exists() or not os.listdir(
      tmp_path / 'checkpoints' / 'sft')


def test_bad_model_and_task_files_are_named(tmp_path):
  bad_model = tmp_path / 'model'
  bad_model.mkdir()
  (bad_model / 'config.json').write_text(json.dumps({'model_type': 'not_a_model_type'}))
  with pytest.raises(ConfigError, match='not_a_model_type'):
    api.run(_smoke(**{'model.hf_path': str(bad_model)}), str(tmp_path / 'a'))
  data = tmp_path / 'gsm8k.jsonl'
  data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": oops\n')
  cfg = from_mapping(RunConfig, dict(
      load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke').to_dict(),
      task={'name': 'gsm8k', 'options': {'source': str(data)}}))
  with pytest.raises(ConfigError, match=rf'{data}:2: not a JSON record'):
    api.run(cfg, str(tmp_path / 'b'))
  (tmp_path / 'file').write_text('x')
  with pytest.raises(ConfigError, match='is a file, not a directory'):
    api.run(_smoke(), str(tmp_path / 'file'))


def test_a_misspelled_override_is_one_line_with_status_2(tmp_path):
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={tmp_path}', '--config.grpo.schedul.grad_accum_steps=2'],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith(
      "error: --config.grpo.schedul.grad_accum_steps: no setting named 'schedul'")
  assert 'Traceback' not in done.stderr and 'Compiling' not in done.stderr


@pytest.mark.slow
def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path,
                                                                       capsys, caplog):
  """The same run again (in this process, as finished_run's) on a copy of its workdir."""
  workdir = tmp_path / 'run'
  shutil.copytree(finished_run, workdir)
  ckpts = workdir / 'checkpoints' / 'grpo'
  with open(ckpts / '6' / 'state' / '_sharding', 'r+b') as f:
    f.truncate(10)
  capsys.readouterr()
  with caplog.at_level(logging.WARNING):
    api.run(_smoke(stages='grpo', **{'grpo.num_steps': 2, 'checkpoint.every_steps': 1,
                                     'grpo.completions_every': 1}), str(workdir))
  assert f'checkpoint {ckpts}/6 cannot be read' in caplog.text
  assert '[grpo] resumed at micro-step 3 (optimizer step 1)' in capsys.readouterr().out
  assert checkpoint.all_steps(ckpts) == [3, 6] and (ckpts / '6.unreadable').is_dir()
  # The re-trained step 6 equals the original one: the fallback resumed exactly.
  redone, _, _ = checkpoint.Checkpointer(ckpts).restore_raw(6)
  original, _, _ = checkpoint.Checkpointer(finished_run / 'checkpoints' / 'grpo').restore_raw(6)
  jax.tree.map(np.testing.assert_array_equal, redone['learner']['params'],
               original['learner']['params'])
  # The rollouts after micro-step 3 were generated again: logged once, as the first time.
  logged = (workdir / 'completions.jsonl').read_text(encoding='utf-8')
  assert logged == (finished_run / 'completions.jsonl').read_text(encoding='utf-8')
  assert [json.loads(l)['micro_step'] for l in logged.splitlines()] == [0] * 8 + [2] * 8 + [4] * 8

  # With every checkpoint unreadable: one clear error, no traceback.
  for step in (3, 6):
    shutil.rmtree(ckpts / str(step) / 'state')
  fingerprint, _ = checkpoint.Checkpointer(ckpts).read_record(6)
  ck = checkpoint.Checkpointer(ckpts, fingerprint=fingerprint)
  with pytest.raises(checkpoint.CheckpointUnreadableError, match='fresh --workdir'):
    ck.restore_latest({'x': jax.ShapeDtypeStruct((1,), np.float32)})


def test_non_finite_windows_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path):
  """A learning rate of 1e30 makes every window after the first non-finite. The run stops after
  optimizer.max_consecutive_nonfinite = 2 of them; its last checkpoint is step 1's; the
  learning-rate metric follows AdamW's count (cosine decay: it stays at schedule(1) while the
  windows are skipped)."""
  cfg = _smoke('sft_arith', **{'sft.num_steps': 8, 'sft.log_every': 1,
                               'checkpoint.every_steps': 1,
                               'sft.optimizer.learning_rate': 1e30,
                               'sft.optimizer.lr_schedule': 'cosine',
                               'sft.optimizer.total_steps': 8,
                               'sft.optimizer.max_consecutive_nonfinite': 2})
  with pytest.raises(stage.NonFiniteError, match='2 optimizer-step windows in a row'):
    api.run(cfg, str(tmp_path))
  k = cfg.sft.grad_accum_steps
  assert checkpoint.all_steps(tmp_path / 'checkpoints' / 'sft') == [1 * k]
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  lr = {r['step']: r['learning_rate'] for r in rows if r['phase'] == 'sft'}
  cosine = lambda count: 0.5 * 1e30 * (1 + np.cos(np.pi * count / 8))
  np.testing.assert_allclose([lr[1], lr[2], lr[3]], [cosine(0), cosine(1), cosine(1)],
                             rtol=1e-6)


def test_export_refuses_a_non_empty_directory_and_replaces_it_whole(finished_run, tmp_path):
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  ckpts = str(finished_run / 'checkpoints' / 'grpo')
  out = tmp_path / 'hf'
  out.mkdir()
  (out / 'model.safetensors.index.json').write_text('{"weight_map": {}}')  # an older export's
  with pytest.raises(ValueError, match='not empty'):
    export.export_checkpoint(ckpts, str(out))
  export.export_checkpoint(ckpts, str(out), overwrite=True)
  assert not (out / 'model.safetensors.index.json').exists()
  umask = os.umask(0)
  os.umask(umask)
  assert (os.stat(out / 'model.safetensors').st_mode & 0o777) == 0o666 & ~umask
  stored, _, _ = checkpoint.Checkpointer(ckpts).restore_raw(6)
  reloaded = hf.load_params(str(out), hf.model_config_from_hf(str(out)))
  jax.tree.map(np.testing.assert_array_equal, reloaded, stored['learner']['params'])
  with pytest.raises(ValueError, match='is a file'):
    export.export_checkpoint(ckpts, str(out / 'config.json'))
  # A damaged weights file is named by the loader.
  with open(out / 'model.safetensors', 'r+b') as f:
    f.truncate(1000)
  with pytest.raises(ValueError, match=f'{out}/model.safetensors: not a readable safetensors'):
    hf.load_params(str(out), hf.model_config_from_hf(str(out)))


def test_export_and_sample_consoles_hold_only_their_result(finished_run, tmp_path):
  """No orbax INFO lines (nor anything else) around the result a user asked for."""
  ckpts = str(finished_run / 'checkpoints' / 'grpo')
  done = subprocess.run([sys.executable, '-m', 'jaxrl_ga.export', f'--checkpoint={ckpts}',
                         f'--out={tmp_path / "hf"}'], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == f'exported {ckpts}/6 to {tmp_path / "hf"}'
  assert not [l for l in done.stderr.splitlines() if l.strip()], done.stderr[-3000:]
