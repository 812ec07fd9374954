"""configs/ ships with the package: `--config=configs/<name>.py` works from any directory, after a
pip install (setup.py builds configs/ into jaxrl_ga/configs) and in a checkout; a file of that
name in the current directory wins; a missing one is one error line naming --config, status 2.
No training: the CLIs stop at parsing (main) or print the schedule (explain, numpy only)."""

import os
import subprocess
import sys

import pytest

from jaxrl_ga.config import ConfigError, load_config_file, resolve_config_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_checkout_configs_resolve_from_another_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.path.samefile(resolve_config_path('configs/grpo_arith.py'),
                          os.path.join(ROOT, 'configs', 'grpo_arith.py'))
  # dpo_arith.py builds on grpo_arith.py through its own __file__: that works from here too.
  assert load_config_file('configs/dpo_arith.py', 'smoke').stages == 'sft,dpo'


def test_a_config_in_the_current_directory_wins(tmp_path, monkeypatch):
  (tmp_path / 'configs').mkdir()
  (tmp_path / 'configs' / 'grpo_arith.py').write_text(
      'def get_config(arg=""):\n  return {"mine": arg}\n')
  monkeypatch.chdir(tmp_path)
  assert load_config_file('configs/grpo_arith.py', 'x') == {'mine': 'x'}


def test_a_missing_config_names_the_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=r'configs/nope\.py not found in .*configs/grpo_arith\.py'):
    resolve_config_path('configs/nope.py')


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """What a pip install puts in site-packages (setup.py's build_py), away from the checkout."""
  lib = tmp_path_factory.mktemp('site-packages')
  subprocess.run([sys.executable, 'setup.py', '-q', 'build_py', f'--build-lib={lib}'], cwd=ROOT,
                 check=True, capture_output=True)
  assert sorted(os.listdir(lib)) == ['jaxrl_ga']  # configs/ lives inside the package
  return str(lib)


def _cli(installed, cwd, *args):
  env = dict(os.environ, PYTHONPATH=installed, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=120)


def test_installed_configs_work_from_another_directory(installed, tmp_path):
  done = _cli(installed, tmp_path, 'jaxrl_ga.explain', '--config=configs/grpo_arith.py:smoke')
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Samples per rollout' in done.stdout
  # It ran the installed package and config, not the checkout's.
  probe = subprocess.run(
      [sys.executable, '-c', 'from jaxrl_ga import config; '
       'print(config.resolve_config_path("configs/grpo_arith.py"))'],
      cwd=tmp_path, env=dict(os.environ, PYTHONPATH=installed), capture_output=True, text=True,
      check=True)
  assert probe.stdout.strip() == os.path.join(installed, 'jaxrl_ga', 'configs', 'grpo_arith.py')


def test_a_missing_config_is_one_line_with_status_2(installed, tmp_path):
  done = _cli(installed, tmp_path, 'jaxrl_ga.main', '--config=configs/nope.py:smoke',
              f'--workdir={tmp_path / "w"}')
  assert done.returncode == 2
  [line] = done.stderr.strip().splitlines()
  assert line.startswith('error: --config=configs/nope.py:smoke: config file configs/nope.py '
                         'not found') and 'configs/grpo_arith.py' in line
  assert not (tmp_path / 'w').exists()
