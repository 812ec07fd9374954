"""The implicit-bias study (implicit_bias.py beside this file) end to end at toy size: both arms,
finite alignments, and the sequential arm's K optimizer steps per accumulate step, read from the
learner's own counter.

Runs the script's CLI in a subprocess on one CPU device (this suite simulates 8) with XLA's
backend optimizations off: the run is compile-bound (two learner steps with the alignment
diagnostic, two rollout steps, the probe): 31-35 s of CPU, 39-52 s wall on the shared 2-core CPU
at load average 3-5.

CI runs it through tests/test_implicit_bias.py (the README's test command); here it can also run
alone: python -m pytest -q studies/implicit_bias/smoke_test.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
K = 2  # the script's K = S


@pytest.mark.slow  # 39-52 s wall
def test_both_arms_record_finite_alignment_and_sequential_steps_k_times_per_sample(tmp_path):
  # The smoke model with one layer: half the program to compile.
  config = tmp_path / 'tiny.py'
  config.write_text(
      'from jaxrl_ga.config import load_config_file\n\n\n'
      "def get_config(arg=''):\n"
      f"  c = load_config_file({os.path.join(ROOT, 'configs', 'grpo_arith.py')!r}, 'smoke')\n"
      '  c.model.num_hidden_layers = 1\n'
      '  return c\n')
  out, png = tmp_path / 'implicit_bias.json', tmp_path / 'implicit_bias.png'
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, XLA_FLAGS=(
      '--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 '
      '--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false '
      '--xla_cpu_parallel_codegen_split_count=1'))
  cmd = [sys.executable, os.path.join(HERE, 'implicit_bias.py'),
         f'--base_config={config}', '--seeds=0', '--rollouts=4', '--eval_every=2',
         '--eval_examples=16', f'--grad_accum_steps={K}', '--micro_batch_size=8',
         '--num_generations=4', '--nowarm_start', f'--runs_dir={tmp_path / "runs"}',
         f'--out={out}', f'--plot={png}']
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert png.stat().st_size > 0

  results = json.loads(out.read_text())
  arms = results['seeds'][0]['arms']
  assert set(arms) == {'accumulate', 'sequential'}
  for arm in arms.values():
    cos = np.asarray(arm['rollouts']['cosine'], float)  # JSON null (NaN) -> nan: fails below
    assert len(cos) == 4 and np.all(np.isfinite(cos)) and np.all(np.abs(cos) <= 1)
    assert np.all(np.isfinite(np.asarray(arm['rollouts']['dot'], float)))
    logged = np.asarray(arm['learner_diagnostic']['cosine'], float)
    logged_dot = np.asarray(arm['learner_diagnostic']['dot'], float)
    # The learner's cosine is NaN exactly where a (sign-sorted) micro-batch is one-sided.
    assert len(logged) == arm['optimizer_steps']
    np.testing.assert_array_equal(np.isnan(logged), logged_dot == 0)
    assert np.all(np.abs(logged[~np.isnan(logged)]) <= 1)
  assert np.all(np.isfinite(np.asarray(arms['accumulate']['learner_diagnostic']['cosine'], float)))

  acc, seq = arms['accumulate'], arms['sequential']
  # The learner's optimizer-step counter at each rollout (one rollout = K micro-batches).
  assert acc['rollouts']['optimizer_step'] == [0, 1, 2, 3]
  assert seq['rollouts']['optimizer_step'] == [0, K, 2 * K, 3 * K]
  assert acc['rollouts']['samples_before'] == seq['rollouts']['samples_before']
  assert acc['eval']['rollout'] == seq['eval']['rollout'] == [0, 2, 4]  # equal samples
  assert seq['optimizer_steps_per_sample'] == K * acc['optimizer_steps_per_sample']
  np.testing.assert_allclose(seq['learning_rate'], acc['learning_rate'] / np.sqrt(K), rtol=1e-6)
  # Rollout 0 is the same rollout in both arms; the accumulate arm's window diagnostic is the
  # script's per-rollout measure.
  np.testing.assert_allclose(seq['rollouts']['cosine'][0], acc['rollouts']['cosine'][0],
                             atol=1e-4)
  assert results['accumulate_probe_vs_learner_max_abs_cosine_diff'] < 1e-4
  assert len(results['machine']['load_avg_start']) == 3
