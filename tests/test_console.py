"""The CLI's console: absl, orbax and JAX INFO lines are off by default; --verbose (or absl's own
--verbosity=0) brings them back; warnings print either way.

The child parses flags with jaxrl_ga.main's parser under absl's app.run, as the CLI does, then
creates an orbax CheckpointManager (which logs INFO lines) and logs one warning: no training."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INFO = re.compile(r'^I\d{4} ', re.M)  # absl's prefix of an INFO line: I<mmdd> <time> ...

CHILD = textwrap.dedent('''
    import os
    from absl import app, flags, logging
    import orbax.checkpoint as ocp
    from jaxrl_ga import main as main_lib

    def run(argv):
      ocp.CheckpointManager(os.path.join(flags.FLAGS.workdir, 'ckpt')).close()
      logging.warning('a warning prints')
      print('own progress line', flush=True)

    app.run(run, flags_parser=main_lib.parse_flags)
''')


def _console(tmp_path, *extra):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  done = subprocess.run(
      [sys.executable, '-c', CHILD, '--config=configs/grpo_arith.py:smoke',
       f'--workdir={tmp_path}', *extra],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'own progress line' in done.stdout
  assert 'a warning prints' in done.stderr
  return done.stderr


def test_default_console_has_no_info_lines(tmp_path):
  err = _console(tmp_path)
  assert not INFO.search(err), err[:3000]
  assert 'checkpoint_manager.py' not in err


@pytest.mark.parametrize('flag', ['--verbose', '--verbosity=0'])
def test_verbose_brings_orbax_info_lines_back(tmp_path, flag):
  err = _console(tmp_path, flag)
  orbax_info = [l for l in err.splitlines() if INFO.match(l) and 'checkpoint_manager.py' in l]
  assert orbax_info, err[:3000]
