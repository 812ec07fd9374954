"""End-to-end: every config runs at smoke size; a stopped GRPO run resumes bitwise; SIGTERM leaves
a restorable checkpoint; the CLI rejects invalid configs before compiling; export round-trips."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxrl_ga import main as main_lib
from jaxrl_ga.config import ConfigError, RunConfig, from_mapping, load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smoke(name: str, **overrides) -> RunConfig:
  d = load_config_file(os.path.join(ROOT, 'configs', f'{name}.py'), 'smoke').to_dict()
  for key, value in overrides.items():
    node = d
    *path, last = key.split('.')
    for p in path:
      node = node[p]
    node[last] = value
  return from_mapping(RunConfig, d)


def _env():
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'
  return env


@pytest.mark.parametrize('name', ['sft_arith', 'grpo_arith', 'dpo_arith'])
def test_each_config_runs_end_to_end(name, tmp_path):
  summary = main_lib.run(_smoke(name), str(tmp_path))
  assert 0.0 <= summary['eval/accuracy_after'] <= 1.0
  files = set(os.listdir(tmp_path))
  assert {'metrics.jsonl', 'summary.json', 'tokenizer', 'checkpoints', 'tensorboard'} <= files
  lines = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert all('phase' in l and 'step' in l for l in lines)
  if name == 'grpo_arith':
    grpo = [l for l in lines if l['phase'] == 'grpo']
    assert grpo and all('reward/mean' in l for l in grpo)
    assert summary['schedule/counts_per_period'] == {'trl_static': 6, 'rollout_rule': 2,
                                                     'slice_rule': 1}
    # The run paid exactly the slice rule's forward passes.
    assert (summary['grpo/old_logprob_forward_passes'] ==
            summary['schedule/recompute_counts_this_run']['slice_rule'])
    # Export the trained policy; our loader reads back the checkpoint's params exactly, and the
    # directory holds what transformers reads (config.json with the architecture, tokenizer).
    from jaxrl_ga import checkpoint, export  # pylint: disable=g-import-not-at-top
    from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
    out = tmp_path / 'hf'
    export.export_checkpoint(str(tmp_path / 'checkpoints' / 'grpo'), str(out))
    stored, _, fingerprint = checkpoint.Checkpointer(
        str(tmp_path / 'checkpoints' / 'grpo')).restore_raw(
            checkpoint.latest_step(str(tmp_path / 'checkpoints' / 'grpo')))
    cfg = hf.model_config_from_hf(str(out))
    assert cfg.hidden_size == fingerprint['model']['hidden_size']
    reloaded = hf.load_params(str(out), cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 reloaded, stored['learner']['params'])
    assert json.load(open(out / 'config.json'))['architectures'] == ['Qwen2ForCausalLM']
    assert (out / 'tokenizer.json').exists()
    # The plot command draws the run's curves.
    from jaxrl_ga import plot  # pylint: disable=g-import-not-at-top
    pngs = plot.plot_run(str(tmp_path))
    assert {os.path.basename(p) for p in pngs} >= {'sft.png', 'grpo.png', 'accuracy.png'}
    for p in pngs:
      data = open(p, 'rb').read()
      assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000


def test_grpo_resume_is_bitwise_exact(tmp_path):
  """Stopped after optimizer step 1 (micro-step 3: the middle of rollout 1, K=3, S=2) and again
  one micro-step into the next window, then resumed: same params as an uninterrupted run."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = _smoke('grpo_arith', stages='grpo', **{'grpo.num_steps': 3,
                                               'checkpoint.every_steps': 0})

  def trainer(workdir):
    ctx, params = main_lib.build_context(cfg, str(workdir))
    return grpo.GRPOTrainer(ctx, cfg.grpo), params

  t, params = trainer(tmp_path / 'a')
  want, _ = t.run(params)
  for stop in (3, 4, None):
    t, params = trainer(tmp_path / 'b')
    got, summary = t.run(params, stop_at_micro_step=stop)
    if stop is not None:
      assert summary['stopped_at_micro_step'] == stop
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
               want)


def test_sigterm_leaves_a_restorable_checkpoint(tmp_path):
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
         f'--workdir={tmp_path}', '--config.stages=grpo', '--config.grpo.num_steps=400',
         '--config.checkpoint.every_steps=0']
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 240
  metrics = tmp_path / 'metrics.jsonl'
  while time.time() < deadline:  # wait until GRPO is training
    if metrics.exists() and '"phase": "grpo"' in metrics.read_text():
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  ckpts = os.listdir(tmp_path / 'checkpoints' / 'grpo')
  assert len(ckpts) == 1 and int(ckpts[0]) > 0
  stopped_at = int(ckpts[0])
  # Resume (to a shorter run that ends right after the stop point) from that checkpoint.
  cmd[-2] = f'--config.grpo.num_steps={stopped_at // 3 + 1}'
  done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f'grpo: resumed at micro-step {stopped_at}' in done.stderr


def test_cli_rejects_invalid_config_before_compiling(tmp_path):
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py',
         f'--workdir={tmp_path}', '--config.grpo.schedule.micro_batch_size=6']
  env = dict(_env(), JAX_LOG_COMPILES='1')
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert 'error:' in done.stderr and 'num_generations' in done.stderr
  assert 'Traceback' not in done.stderr
  assert 'Compiling' not in done.stderr
  assert not (tmp_path / 'checkpoints').exists()


def test_run_config_names_unknown_settings():
  with pytest.raises(ConfigError, match=r'grpo\.schedule\.grad_acum_steps'):
    from_mapping(RunConfig, {'grpo': {'schedule': {'grad_acum_steps': 3}}})
