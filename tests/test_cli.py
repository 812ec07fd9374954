"""The command-line programs on bad input, as a user meets them: one ``error:`` line naming the
setting or file, exit status 2, no traceback and nothing compiled; the same lines from main,
explain and plan; ``--print_config`` listing every setting; no console line a user cannot act
on; and the README's install and test commands being what CI runs."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from jaxrl_ga import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, cwd=ROOT, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1')
  env.pop('TRANSFORMERS_NO_ADVISORY_WARNINGS', None)
  return subprocess.run([sys.executable, '-m', *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _one_error_line(done) -> str:
  """The run failed with status 2 and one ``error:`` line, nothing else on the console."""
  assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
  lines = [l for l in (done.stdout + done.stderr).splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  assert 'Traceback' not in lines[0] and 'Compiling' not in done.stderr
  return lines[0]


BAD_MODELS = [
    ('/nonexistent/dir', 'error: --model=/nonexistent/dir: no such directory or file'),
    ('s3://b/m', 'error: --model=s3://b/m: s3:// is not a supported model source'),
    ('gs://b/m', 'error: --model=gs://b/m: '),  # gcsfs missing, or the bucket unreadable
    ('{tmp}/broken.gguf', 'error: model {tmp}/broken.gguf: cannot be read as a GGUF file'),
    ('{tmp}/notes.txt', 'error: --model={tmp}/notes.txt is a file but not a .gguf file'),
    ('{tmp}', 'error: --model={tmp}: the directory has no config.json'),
]
# Through the real command (a subprocess each): the GGUF reader's error, and Cloud Storage (whose
# error depends on the environment: gcsfs missing or the bucket unreadable, never a hang).
_BY_SUBPROCESS = ('{tmp}/broken.gguf', 'gs://b/m')


def _bad_models(tmp_path):
  (tmp_path / 'broken.gguf').write_bytes(b'GGUF\x03\x00\x00\x00' + b'\x00' * 7)
  (tmp_path / 'notes.txt').write_text('not a model')
  return [(model.format(tmp=tmp_path), named.format(tmp=tmp_path)) for model, named in BAD_MODELS]


@pytest.mark.parametrize('model,named', [c for c in BAD_MODELS if c[0] in _BY_SUBPROCESS])
def test_sample_names_a_bad_model_in_one_line(tmp_path, model, named):
  _bad_models(tmp_path)
  line = _one_error_line(_run('jaxrl_ga.sample', f'--model={model.format(tmp=tmp_path)}',
                              '--prompt=hi'))
  assert line.startswith(named.format(tmp=tmp_path)), line


def test_sample_loads_every_bad_model_as_one_error(tmp_path):
  """Every bad --model of BAD_MODELS but Cloud Storage, in this process: jaxrl_ga.sample's
  main() prints ``error: {e}`` for the (FileNotFoundError, ValueError) that ``load`` raises, and
  exits 2 (the subprocess cases above check that wrapping; this one each message)."""
  from jaxrl_ga import completions  # pylint: disable=g-import-not-at-top
  for model, named in _bad_models(tmp_path):
    if model.startswith('gs://'):
      continue
    with pytest.raises((FileNotFoundError, ValueError)) as e:
      completions.load(model, 'float32')
    assert f'error: {e.value}'.startswith(named), (model, str(e.value))


def test_config_file_argument_errors_name_the_known_ones_in_every_program():
  lines = [_one_error_line(_run(f'jaxrl_ga.{program}', '--config=configs/grpo_arith.py:nosuch',
                                *extra))
           for program, extra in [('main', ['--workdir=/tmp/unused']), ('explain', []),
                                  ('plan', ['--topology=v5e:2x4'])]]
  assert lines[0] == ("error: --config=configs/grpo_arith.py:nosuch: grpo_arith.py knows no "
                      "argument 'nosuch'; its arguments: '', smoke "
                      "(--config=configs/grpo_arith.py:<argument>).")
  assert lines[1] == lines[0] and lines[2] == lines[0]


@pytest.mark.parametrize('name', ['sft_arith', 'dpo_arith'])
def test_a_config_built_on_another_names_itself_in_its_argument_error(name):
  """sft_arith.py and dpo_arith.py build on grpo_arith.py: a bad argument names the file the
  user gave, not its base."""
  from jaxrl_ga.config import ConfigError, load_config_file  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError) as e:
    load_config_file(f'configs/{name}.py', 'nosuch')
  assert str(e.value).startswith(f"{name}.py knows no argument 'nosuch'; its arguments: '', "
                                 'smoke'), str(e.value)


def test_task_options_are_settable_and_an_unknown_one_names_the_valid_ones():
  done = _run('jaxrl_ga.main', '--config=configs/grpo_gsm8k_tpu.py', '--print_config',
              '--config.task.options.source=/data/train.jsonl',
              '--config.task.options.num_eval=7')
  assert done.returncode == 0, done.stderr[-2000:]
  rows = {l.split()[0]: l for l in done.stdout.splitlines()}
  assert rows['task.options.source'].split()[1] == '/data/train.jsonl'
  assert rows['task.options.num_eval'].split()[1] == '7'
  bad = [_one_error_line(_run(f'jaxrl_ga.{program}', '--config=configs/grpo_gsm8k_tpu.py',
                              '--config.task.options.sorce=/data/train.jsonl', *extra))
         for program, extra in [('main', ['--workdir=/tmp/unused']), ('explain', [])]]
  assert bad[0] == bad[1]
  assert bad[0].startswith("error: --config.task.options.sorce: no setting named 'sorce'")
  # The valid names are the task's config dataclass fields (an independent list).
  from jaxrl_ga.tasks import GSM8KConfig  # pylint: disable=g-import-not-at-top
  valid = ', '.join(sorted(f.name for f in dataclasses.fields(GSM8KConfig)))
  assert f'The settings under --config.task.options: {valid}.' in bad[0]
  assert '--print_config' in bad[0]


def test_a_users_config_file_that_raises_shows_its_traceback(tmp_path):
  path = tmp_path / 'mine.py'
  path.write_text('def get_config(arg=""):\n  return {}["a key my code expects"]\n')
  done = _run('jaxrl_ga.main', f'--config={path}', f'--workdir={tmp_path}')
  assert done.returncode == 2
  assert 'Traceback' in done.stderr and f'{path}", line 2, in get_config' in done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith(f'error: --config={path}: the config '
                                                         'file raised KeyError')


def _leaves(cls, prefix=''):
  """Every setting of a dataclass tree, walked here independently of jaxrl_ga.cli; a field marked
  flat (ModelSpec.arch) sets its own fields under its parent's name (model.hidden_size)."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if f.metadata.get('flat'):
      yield from _leaves(hints[f.name], prefix)
    elif dataclasses.is_dataclass(hints[f.name]):
      yield from _leaves(hints[f.name], f'{prefix}{f.name}.')
    elif not (cls is config_lib.TaskSpec and f.name == 'options'):
      yield prefix + f.name


def test_print_config_lists_every_setting_with_value_default_and_meaning():
  done = _run('jaxrl_ga.main', '--config=configs/grpo_arith.py', '--print_config',
              '--config.grpo.schedule.grad_accum_steps=5')
  assert done.returncode == 0, done.stderr[-2000:]
  rows = {l.split()[0]: l for l in done.stdout.splitlines()[2:]}
  expected = set(_leaves(config_lib.RunConfig))
  from jaxrl_ga.tasks import ArithmeticConfig  # pylint: disable=g-import-not-at-top
  expected |= {f'task.options.{f.name}' for f in dataclasses.fields(ArithmeticConfig)}
  assert set(rows) == expected
  no_meaning = sorted(k for k, row in rows.items() if '  # ' not in row)
  assert not no_meaning, f'settings without a one-line meaning: {no_meaning}'
  k = rows['grpo.schedule.grad_accum_steps']
  default_k = config_lib.ScheduleConfig().grad_accum_steps
  assert k.split()[1] == '5' and f'[default {default_k}]' in k
  assert '[default' not in rows['grpo.loss.beta']  # unchanged settings show their value only


def test_print_config_shows_what_a_run_takes_and_refuses_what_it_refuses():
  """--print_config printed the overrides as given, unchecked: loss_type=cispo showed
  objective clip (a run trains cispo) and a bad aggregation printed with status 0."""
  done = _run('jaxrl_ga.main', '--config=configs/grpo_arith.py', '--print_config',
              '--config.grpo.loss.loss_type=cispo', '--config.grpo.loss.epsilon_high=5.0')
  assert done.returncode == 0, done.stderr[-2000:]
  rows = {l.split()[0]: l.split()[1] for l in done.stdout.splitlines()[2:]}
  assert (rows['grpo.loss.objective'], rows['grpo.loss.aggregation']) == ('cispo', 'token')
  bad = _run('jaxrl_ga.main', '--config=configs/grpo_arith.py', '--print_config',
             '--config.grpo.loss.aggregation=dapo')
  assert bad.returncode == 2 and not bad.stdout
  assert _one_error_line(bad).startswith("error: in grpo.loss: loss.aggregation='dapo' is not a "
                                         "known value (TRL's 'dapo' is 'token' here)")


def test_sample_chat_template_kwargs_bad_input_is_one_line():
  for extra, want in [(['--chat', '--chat_template_kwargs={bad'],
                       "error: --chat_template_kwargs='{bad' is not JSON; give a JSON object"),
                      (['--chat_template_kwargs={"enable_thinking": false}'],
                       'error: --chat_template_kwargs is for the chat template: add --chat.')]:
    done = _run('jaxrl_ga.sample', '--model=/nonexistent/dir', '--prompt=hi', *extra)
    assert done.returncode == 2 and _one_error_line(done).startswith(want), done.stderr


def test_no_console_line_about_pytorch():
  done = _run('jaxrl_ga.sample', '--model=/nonexistent/dir', '--prompt=hi')
  assert 'PyTorch' not in done.stdout + done.stderr


def test_ci_runs_the_readme_test_command_in_a_fresh_virtualenv():
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  with open(os.path.join(ROOT, '.ci', 'run')) as f:
    ci = [l for l in f.read().splitlines() if l.strip()]
  assert ci[-1] in readme.splitlines()
  assert ci[-1].startswith("pip install -e '.[test]'") and 'python -m pytest' in ci[-1]
  assert any('python3 -m venv' in l for l in ci) and any('source "$venv/bin/activate"' in l
                                                         for l in ci)


def test_a_checkpoint_that_does_not_fit_the_state_is_one_error_and_status_2(monkeypatch, capsys):
  """A stage checkpoint whose settings match but whose state tree does not (one written by
  another version of the code) is the user's to fix, as a bad setting is: the command prints
  Checkpointer.restore's message as an ``error:`` and exits 2, no traceback (it exited 1 with
  a 40-line traceback)."""
  from configs import sft_arith
  from jaxrl_ga import api, checkpoint, main_body
  message = ('checkpoint /w/checkpoints/sft/550 does not match the state to restore:\n'
             '  opt_state.x: in the checkpoint, not in the current state')
  def run(cfg, workdir):
    raise checkpoint.CheckpointMismatchError(message)
  monkeypatch.setattr(api, 'run', run)
  with pytest.raises(SystemExit) as e:
    main_body.run(sft_arith.get_config(), '/w')
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err == f'error: {message}\n'
