"""log.report_to=wandb, offline (WANDB_MODE=offline, every W&B directory in tmp_path, W&B's server
address a closed local port, so nothing reaches the network): a GRPO run through the CLI whose W&B
run file, read back record by record, holds what metrics.jsonl and completions.jsonl hold (same
names, steps and values) and the run's config; a resumed run continues the same W&B run; a failed
run's W&B run is marked failed; without a login or without wandb installed, one line naming the
fix."""

import glob
import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import pytest
import helpers

from jaxrl_ga import api
from jaxrl_ga.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith('WANDB_')}  # no key, no project
  dirs = {name: str(tmp_path / name.lower()) for name in (
      'WANDB_DIR', 'WANDB_CACHE_DIR', 'WANDB_CONFIG_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR')}
  for d in dirs.values():
    os.makedirs(d, exist_ok=True)
  # A login, an upload or a version check would go to the closed port 9 and fail.
  return env | dirs | {'WANDB_MODE': 'offline', 'WANDB_SILENT': 'true',
                       'WANDB_BASE_URL': 'http://127.0.0.1:9', 'JAX_PLATFORMS': 'cpu',
                       'PYTHONPATH': ROOT, 'XLA_FLAGS': helpers.xla_flags(8)}


def _records(path: str):
  """The protobuf records of a .wandb file: W&B's LevelDB-style log (a 7-byte file header
  ':W&B' 0xBEE1 0; 32 KiB blocks of chunks, each with a 7-byte header: CRC-32 of type byte and
  data, length, type full/first/middle/last) of wandb_internal_pb2.Record messages."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data = open(path, 'rb').read()
  assert data[:7] == struct.pack('<4sHB', b':W&B', 0xBEE1, 0)
  block, pos, chunks = 32768, 7, []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    crc, n, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if kind == 0:
      break
    body = data[pos + 7:pos + 7 + n]
    assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc
    pos += 7 + n
    chunks.append(body)
    if kind in (1, 4):  # full, last
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b''.join(chunks))
      chunks = []
      yield record


def _runs(wandb_dir) -> list[dict]:
  """Each offline run under ``wandb_dir`` in start order: its id, project, name, resume flag,
  config, history rows ({name: value}, W&B's own '_' keys left out) and exit code."""
  runs = []
  for path in glob.glob(os.path.join(wandb_dir, 'wandb', 'offline-run-*', '*.wandb')):
    run = {'dir': os.path.dirname(path), 'history': []}
    for r in _records(path):
      if r.HasField('run'):
        run.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name,
                   resume=r.run.resume, start=r.run.start_time.ToNanoseconds(),
                   config={u.key: json.loads(u.value_json) for u in r.run.config.update})
      elif r.HasField('history'):
        row = {(i.key or '/'.join(i.nested_key)): json.loads(i.value_json)
               for i in r.history.item}
        run['history'].append({k: v for k, v in row.items() if not k.startswith('_')})
      elif r.HasField('exit'):
        run['exit_code'] = r.exit.exit_code
    runs.append(run)
  return sorted(runs, key=lambda run: run['start'])


def _phase_rows(history: list[dict]) -> list[dict]:
  """W&B history rows as metrics.jsonl rows: phase (from its '<phase>/step' key), step and the
  scalars (tables left out)."""
  rows = []
  for row in history:
    phase = next(k[:-len('/step')] for k in row if k.endswith('/step'))
    scalars = {k[len(phase) + 1:]: v for k, v in row.items()
               if k.startswith(phase + '/') and k != f'{phase}/step'}
    if not any(k.startswith('completions/') for k in scalars):
      rows.append({'phase': phase, 'step': row[f'{phase}/step'], **scalars})
  return rows


def _jsonl(path) -> list[dict]:
  return [json.loads(line) for line in open(path)]


@pytest.mark.slow  # a whole CLI run
def test_an_offline_wandb_run_holds_the_runs_metrics_completions_and_config(tmp_path):
  env, workdir = _env(tmp_path), tmp_path / 'wd'
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={workdir}', '--config.stages=grpo', '--config.grpo.num_steps=2',
       '--config.grpo.log_every=1', '--config.grpo.completions_every=1',
       '--config.grpo.completions_logged=2', '--config.checkpoint.every_steps=1',
       '--config.log.report_to=tensorboard,wandb', '--config.log.wandb_project=arith'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  (run,) = _runs(env['WANDB_DIR'])
  assert run['exit_code'] == 0  # finished cleanly
  assert (workdir / 'wandb_run_id').read_text() == run['id']
  assert (run['project'], run['name']) == ('arith', 'wd')  # the name: the workdir's
  assert run['config']['stages'] == ['grpo'] and run['config']['grpo']['num_steps'] == 2
  assert run['config']['log']['report_to'] == ['tensorboard', 'wandb']
  # metrics.jsonl's rows (a non-finite value is null there and absent in W&B and TensorBoard)
  want = [{k: v for k, v in row.items() if v is not None}
          for row in _jsonl(workdir / 'metrics.jsonl')]
  assert [(r['phase'], r['step']) for r in want] == [('grpo_eval', 0), ('grpo', 1), ('grpo', 2),
                                                     ('grpo_eval', 2)]
  assert _phase_rows(run['history']) == want
  # Each logged rollout's completions, a table of completions.jsonl's rows at their step.
  completions = _jsonl(workdir / 'completions.jsonl')
  tables = [(row['grpo/step'], json.load(open(os.path.join(run['dir'], 'files',
                                                           row['grpo/completions/path']))))
            for row in run['history'] if 'grpo/completions/path' in row]
  assert len(tables) == 3  # K = 3, S = 2: rollouts at micro-steps 0, 2, 4
  got = [{'step': step, **dict(zip(t['columns'], values))} for step, t in tables
         for values in t['data']]
  keys = ('step', 'prompt', 'completion', 'reward', 'advantage')
  assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in completions]
  assert 'tensorboard' in os.listdir(workdir)  # and TensorBoard too
  assert 'wandb' not in os.listdir(workdir)  # W&B's files go to WANDB_DIR when it is set


def test_a_resumed_run_continues_the_same_wandb_run_and_a_failed_one_is_marked(tmp_path):
  """Two MetricWriters on one workdir (a run, then its resume that fails): one W&B run id, the
  second resuming it, rows in each, exit codes 0 and 1."""
  script = textwrap.dedent(f'''
      from jaxrl_ga.config import LogConfig
      from jaxrl_ga.trainers import reporting
      log = LogConfig(report_to='wandb')
      for step, failed in ((1, False), (2, True)):
        writer = reporting.MetricWriter({str(tmp_path / 'wd')!r}, log, {{'seed': step}})
        writer.write('sft', step, {{'loss': 0.5 / step}})
        writer.close(quiet=failed)
  ''')
  env = _env(tmp_path)
  done = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  first, second = _runs(env['WANDB_DIR'])
  assert first['id'] == second['id'] == (tmp_path / 'wd' / 'wandb_run_id').read_text()
  assert second['resume'] and second['config']['seed'] == 2
  assert [_phase_rows(r['history']) for r in (first, second)] == [
      [{'phase': 'sft', 'step': 1, 'loss': 0.5}], [{'phase': 'sft', 'step': 2, 'loss': 0.25}]]
  assert (first['exit_code'], second['exit_code']) == (0, 1)


def test_an_online_run_without_a_login_is_one_config_error(tmp_path):
  """Online (no WANDB_MODE), without an API key (HOME and W&B's config in tmp_path, W&B's
  server a closed port): MetricWriter, which api.build_context makes before the weights are
  read, raises one ConfigError naming the fixes."""
  script = textwrap.dedent(f'''
      from jaxrl_ga.config import ConfigError, LogConfig
      from jaxrl_ga.trainers import reporting
      try:
        reporting.MetricWriter({str(tmp_path / 'wd')!r}, LogConfig(report_to='wandb'))
      except ConfigError as e:
        print(e)
  ''')
  env = {k: v for k, v in _env(tmp_path).items() if k != 'WANDB_MODE'} | {'HOME': str(tmp_path)}
  done = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True,
                        text=True, timeout=300, stdin=subprocess.DEVNULL)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith('log.report_to names wandb, but W&B could not start a run (')
  assert done.stdout.endswith('; run `wandb login` or set WANDB_API_KEY, or WANDB_MODE=offline.\n')


def test_wandb_not_installed_is_one_line_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb fails as if not installed
  with pytest.raises(ConfigError) as e:
    api.make_config(os.path.join(ROOT, 'configs', 'grpo_arith.py'), **{'log.report_to': 'tensorboard,wandb'})
  assert str(e.value) == ("log.report_to names wandb, which is not installed; pip install "
                          "'jaxrl_ga[wandb]' (or pip install wandb), or drop wandb from "
                          "log.report_to.")
