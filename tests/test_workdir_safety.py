"""A workdir one run at a time (run.lock), and a full disk: one line naming the path, the earlier
checkpoints intact, and the same command resuming exactly once space is freed.

A full disk is simulated without root by RLIMIT_FSIZE, the kernel's limit on the size of any file
a process writes (``ulimit -f``): the part of a write below the limit is written, the rest fails
with EFBIG (File too large), at whatever write reaches it: orbax's tensorstore writes,
metrics.jsonl, an export's safetensors file. The code has one path for every failed write (any
OSError, or a library's error carrying an OS error number, becomes ``fileio.WriteError``), so
this is the path of ENOSPC too. The lock of a gs:// workdir is raced by two processes through
gcsfs against a Cloud Storage emulator on 127.0.0.1 (tests/gcs_emulator.py), and a run in a
bucket keeps its orbax checkpoints there and resumes from them (also after a replacement of one
was cut short)."""

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import gcs_emulator
import helpers
import smoke_configs

from jaxrl_ga import checkpoint
from jaxrl_ga import fileio
from jaxrl_ga import api
from jaxrl_ga import workdir_lock
from jaxrl_ga.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke']


def _env(devices=8):
  """A subprocess's environment: conftest.py's XLA flags and matmul precision (with 8 devices, a
  CLI run computes what a run in this process does, bit for bit)."""
  return dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1',
              XLA_FLAGS=helpers.xla_flags(devices), JAX_DEFAULT_MATMUL_PRECISION='highest')


# Runs argv[2:] with its files limited to argv[1] bytes. SIGXFSZ ignored: a write past the
# limit fails with EFBIG instead of killing the process (Python ignores it too, at start-up).
_LIMITED = ('import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); '
            'resource.setrlimit(resource.RLIMIT_FSIZE, '
            '(int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1])); '
            'os.execv(sys.argv[2], sys.argv[2:])')


def _cli(args, timeout=300, cmd=None, file_size_limit=None):
  """The CLI (or ``cmd``) with ``args``; ``file_size_limit``: no file it writes grows past that
  many bytes (a full disk for the files that would)."""
  limited = [sys.executable, '-c', _LIMITED, str(file_size_limit)] if file_size_limit else []
  return subprocess.run(limited + (cmd or MAIN) + args, cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=timeout)


def _dead_pid() -> int:
  p = subprocess.Popen(['true'])
  p.wait()
  return p.pid


# -- one run per workdir ------------------------------------------------------------------------
def test_a_second_run_on_a_held_workdir_stops_at_once_naming_the_holder(tmp_path):
  """A live CLI run holds the workdir: a second one exits 2 with one line naming the first's host
  and pid, before anything compiles; SIGTERM stops the first, which releases the lock."""
  workdir = tmp_path / 'run'
  lock = workdir / workdir_lock.LOCK_NAME
  first = subprocess.Popen(MAIN + [f'--workdir={workdir}', '--config.stages=grpo',
                                   '--config.grpo.num_steps=1000'],
                           cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
  try:
    deadline = time.time() + 120
    while not lock.exists() or not lock.read_text():
      assert first.poll() is None, first.communicate()[1][-3000:]
      assert time.time() < deadline, f'no {lock} after 120 s'
      time.sleep(0.2)
    second = _cli([f'--workdir={workdir}', '--config.stages=grpo'], timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith(f'error: --workdir={workdir} is in use by another run (host '
                           f'{socket.gethostname()}, pid {first.pid}, since '), last
    assert last.endswith('wait for it to end, or give another --workdir.')
    assert 'Traceback' not in second.stderr and 'Compiling' not in second.stderr
    assert first.poll() is None  # the holder was not disturbed
    # The library's entry point refuses it too.
    with pytest.raises(ConfigError, match=f'pid {first.pid}'):
      api.run(smoke_configs.smoke(stages='grpo'), str(workdir))
  finally:
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
  assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert not lock.exists()  # released on the SIGTERM path


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
  lock_path = tmp_path / workdir_lock.LOCK_NAME
  dead = _dead_pid()
  lock_path.write_text(json.dumps({'host': socket.gethostname(), 'pid': dead, 'start': 1,
                                   'since': 'yesterday'}))
  with caplog.at_level('WARNING'):
    lock = workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  assert (f'taking over the lock of a run that is no longer running (host '
          f'{socket.gethostname()}, pid {dead}, since yesterday)') in caplog.text
  assert json.loads(lock_path.read_text())['pid'] == os.getpid()
  lock.release()
  assert not lock_path.exists()


def test_a_reused_pid_is_not_the_holder_and_another_host_is_never_guessed(tmp_path):
  lock_path = tmp_path / workdir_lock.LOCK_NAME
  # This process's pid with another start time: a pid reused after the holder died.
  lock_path.write_text(json.dumps({'host': socket.gethostname(), 'pid': os.getppid(),
                                   'start': -5, 'since': 'then'}))
  workdir_lock.WorkdirLock(str(tmp_path)).acquire().release()
  # A holder on another host cannot be checked from here: the message names the file to delete.
  lock_path.write_text(json.dumps({'host': 'other-host', 'pid': 1234, 'start': 5,
                                   'since': 'then'}))
  with pytest.raises(ConfigError) as e:
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  assert str(e.value) == (
      f'--workdir={tmp_path} is in use by another run (host other-host, pid 1234, since then): '
      f'wait for it to end, or give another --workdir. If that run is no longer running, delete '
      f'{lock_path}.')
  assert json.loads(lock_path.read_text())['host'] == 'other-host'  # left as it was


def test_the_lock_is_released_when_a_run_stops_with_an_error(tmp_path):
  with pytest.raises(ConfigError, match='no such directory'):
    api.run(smoke_configs.smoke(**{'model.hf_path': '/nonexistent/dir'}), str(tmp_path))
  assert not (tmp_path / workdir_lock.LOCK_NAME).exists()
  workdir_lock.WorkdirLock(str(tmp_path)).acquire().release()


# -- a bucket workdir: two processes race through gcsfs ----------------------------------------
_CONTENDER = """
import sys
from jaxrl_ga import workdir_lock
from jaxrl_ga.config import ConfigError
try:
  lock = workdir_lock.WorkdirLock(sys.argv[1]).acquire()
except ConfigError as e:
  print(f'refused: {e}', flush=True)
  sys.exit()
print('acquired', flush=True)
sys.stdin.read()  # held until the test closes stdin
lock.release()
"""


def _race(gcs, workdir, name):
  """Two processes take the lock of ``workdir`` (object ``name`` of the emulator's bucket), none
  of their requests on it answered before both have sent one. -> the winner's Popen (holding the
  lock until its stdin closes), after asserting that exactly one won and that the other stopped
  with the line naming the winner."""
  try:
    import gcsfs  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pytest.fail("gcsfs is missing: the test extra installs it (pip install -e '.[test]').")
  env = dict(_env(1), **gcs.client_env())
  clients = ['contender-0', 'contender-1']  # each one's requests carry it as userProject
  gcs.hold(name, set(clients))
  procs = [subprocess.Popen([sys.executable, '-c', _CONTENDER, workdir], cwd=ROOT,
                            env=dict(env, FSSPEC_GS_REQUESTER_PAYS=c, FSSPEC_GCS_REQUESTER_PAYS=c),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for c in clients]
  lines = [p.stdout.readline().strip() for p in procs]
  won = [p for p, line in zip(procs, lines) if line == 'acquired']
  assert len(won) == 1, (lines, [p.communicate(timeout=60)[1][-2000:] for p in procs])
  lost = lines[1 - procs.index(won[0])]
  assert lost.startswith(f'refused: --workdir={workdir} is in use by another run (host '
                         f'{socket.gethostname()}, pid {won[0].pid}, since '), lost
  record = json.loads(gcs.objects[('bucket', name)][0])
  assert record['pid'] == won[0].pid
  for p in procs:
    if p is not won[0]:
      assert p.wait(timeout=60) == 0
  return won[0]


def test_two_processes_racing_for_a_bucket_workdir_one_wins(tmp_path):
  """gs:// workdir through gcsfs against a Cloud Storage emulator on 127.0.0.1: two processes
  whose first requests on run.lock arrive before either is answered; one holds the lock, the
  other stops naming it (a check-then-write lock lets both through). Released, the object is
  gone. A stale record (a dead process of this host) is taken over by exactly one of two."""
  del tmp_path
  workdir, name = 'gs://bucket/runs/a', 'runs/a/run.lock'
  with gcs_emulator.GCSEmulator() as gcs:
    winner = _race(gcs, workdir, name)
    _, err = winner.communicate('', timeout=60)  # closes stdin: the winner releases
    assert winner.returncode == 0, err[-2000:]
    assert ('bucket', name) not in gcs.objects

    dead = _dead_pid()
    gcs.put('bucket', name, json.dumps({'host': socket.gethostname(), 'pid': dead, 'start': 1,
                                        'since': 'yesterday'}).encode())
    winner = _race(gcs, workdir, name)
    _, err = winner.communicate('', timeout=60)
    assert winner.returncode == 0, err[-2000:]
    assert (f'taking over the lock of a run that is no longer running (host '
            f'{socket.gethostname()}, pid {dead}, since yesterday)') in err
    assert ('bucket', name) not in gcs.objects


@pytest.mark.slow
def test_a_bucket_workdir_keeps_its_checkpoints_there_and_the_same_command_resumes(tmp_path):
  """--workdir=gs://bucket/run against the emulator: orbax writes checkpoints 3 and 6 into the
  bucket (the arrays through tensorstore's own Cloud Storage client, the rest through gcsfs). Then
  checkpoint 6 is made a save cut short (its commit_success.txt, which orbax writes last in a
  bucket, deleted): the same command resumes from checkpoint 3 read back from the bucket and
  writes a checkpoint 6 bitwise equal to the uninterrupted run's; metrics.jsonl, rewritten in the
  bucket at the resume, holds each step once, as the uninterrupted run left it."""
  command = ['--workdir=gs://bucket/run', '--config.stages=grpo', '--config.grpo.num_steps=2',
             '--config.checkpoint.every_steps=1']
  ckpts = 'run/checkpoints/grpo'
  with gcs_emulator.GCSEmulator() as gcs:
    env = dict(_env(), **gcs.client_env())
    run = lambda: subprocess.run(MAIN + command, cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)
    done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    assert _entries(gcs, f'{ckpts}/') == {'3', '6'}, gcs.names('bucket')
    assert ('bucket', 'run/run.lock') not in gcs.objects
    gcs.copy_out('bucket', 'run/', tmp_path / 'uninterrupted')
    del gcs.objects[('bucket', f'{ckpts}/6/commit_success.txt')]
    cut_short = max(generation for _, generation in gcs.objects.values())

    resumed = run()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert '[grpo] resumed at micro-step 3 (optimizer step 1)' in resumed.stdout
    rewritten = gcs.names('bucket', f'{ckpts}/6/')  # by the resumed run: none left from before
    assert all(gcs.objects[('bucket', n)][1] > cut_short for n in rewritten), rewritten
    gcs.copy_out('bucket', 'run/', tmp_path / 'resumed')
  want, got = tmp_path / 'uninterrupted', tmp_path / 'resumed'
  assert checkpoint.all_steps(got / 'checkpoints' / 'grpo') == [3, 6]
  _assert_same_state(_state(got / 'checkpoints' / 'grpo', 6),
                     _state(want / 'checkpoints' / 'grpo', 6))
  rows = _grpo_rows(got)
  assert [(r['phase'], r['step']) for r in rows] == [('grpo_eval', 0), ('grpo', 2),
                                                      ('grpo_eval', 2)]
  assert rows == _grpo_rows(want)


def _entries(gcs, prefix: str) -> set[str]:
  """The names right below ``prefix`` in the emulator's bucket (a listing with a delimiter)."""
  return {n[len(prefix):].split('/')[0] for n in gcs.names('bucket', prefix)}


_REPLACE = """
import os, sys
import numpy as np
from jaxrl_ga import checkpoint
ckpts = checkpoint.Checkpointer(sys.argv[2])
if sys.argv[1] == 'replace':  # step 3 saved, then rewritten; killed before the old one is deleted
  ckpts.save(3, {'w': np.zeros(3)}, meta={'done': False})
  ckpts.wait()
  type(ckpts.directory).rmtree = lambda *args, **kwargs: os._exit(0)
  ckpts.save(3, {'w': np.ones(3)}, meta={'done': True}, replace=True)
state, meta, _ = ckpts.restore_raw(3)
print(state['w'].tolist(), meta, checkpoint.all_steps(sys.argv[2]))
"""


def test_a_replacement_cut_short_in_a_bucket_leaves_one_complete_checkpoint():
  """save(replace=True) in a bucket (how a stage marks its last checkpoint done): the old step 3
  is moved to 3.replaced, the new one written in place, and the process dies before the old one
  is deleted. If the new one committed, the next Checkpointer keeps it and deletes 3.replaced; if
  its commit_success.txt never landed, the incomplete 3 goes and the old one comes back (taking
  an existing 3 for the new one would delete the only complete copy)."""
  directory, prefix = 'gs://bucket/run/checkpoints/grpo', 'run/checkpoints/grpo/'
  with gcs_emulator.GCSEmulator() as gcs:
    env = dict(_env(1), **gcs.client_env())
    run = lambda mode: subprocess.run([sys.executable, '-c', _REPLACE, mode, directory],
                                      cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=120)
    cut = run('replace')
    assert cut.returncode == 0 and not cut.stdout, cut.stderr[-3000:]
    assert _entries(gcs, prefix) == {'3', '3.replaced'}
    left = dict(gcs.objects)

    committed = run('restore')
    assert committed.stdout == "[1.0, 1.0, 1.0] {'done': True} [3]\n", committed.stderr[-3000:]
    assert _entries(gcs, prefix) == {'3'}

    gcs.objects.clear()
    gcs.objects.update(left)
    del gcs.objects[('bucket', f'{prefix}3/commit_success.txt')]
    uncommitted = run('restore')
    assert uncommitted.stdout == "[0.0, 0.0, 0.0] {'done': False} [3]\n", (
        uncommitted.stderr[-3000:])
    assert f'restoring {directory}/3: its replacement never completed' in uncommitted.stderr
    assert _entries(gcs, prefix) == {'3'}


# -- a full disk --------------------------------------------------------------------------------
@contextlib.contextmanager
def _file_size_limit(limit_bytes: int):
  """Inside, this process's writes past ``limit_bytes`` of a file fail with EFBIG."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def _state(ckpts, step):
  state, meta, _ = checkpoint.Checkpointer(ckpts).restore_raw(step)
  return state, meta


def _assert_same_state(a, b):
  """Every array of two restored checkpoints bitwise equal, and the same progress."""
  import jax  # pylint: disable=g-import-not-at-top
  (state_a, meta_a), (state_b, meta_b) = a, b
  assert jax.tree.structure(state_a) == jax.tree.structure(state_b)
  raw = lambda x: (jax.random.key_data(x)
                   if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(raw(x), raw(y)), state_a, state_b)
  progress = lambda m: (m['micro_step'], m['data_position'], m['done'])
  assert progress(meta_a) == progress(meta_b)


def _grpo_rows(workdir):
  rows = [json.loads(l) for l in open(workdir / 'metrics.jsonl', encoding='utf-8')]
  return [r for r in rows if r['phase'].startswith('grpo')]


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_save_stops_cleanly_and_the_same_command_resumes(
    tmp_path, capsys):
  """GRPO trains 2 steps (checkpoints 3, 6), is raised to 4 steps with no file allowed past
  64 KiB: checkpoint 9's array files cannot be written. One line names it, exit 1, checkpoint 6
  reads back as it was; without the limit the same run (api.run in this process, what the CLI
  runs, its programs compiled already) ends where an uninterrupted run ends, bit for bit, and
  metrics.jsonl holds each step once."""
  args = ['--config.stages=grpo', '--config.checkpoint.every_steps=1']
  ref = tmp_path / 'ref'
  ref_ckpts = ref / 'checkpoints' / 'grpo'
  workdir = tmp_path / 'run'
  ckpts = workdir / 'checkpoints' / 'grpo'
  ref_states = {}
  for steps in (2, 4):  # the uninterrupted run, in this process; the CLI runs below resume it
    api.run(smoke_configs.smoke(stages='grpo', **{'grpo.num_steps': steps,
                                                  'checkpoint.every_steps': 1}), str(ref))
    ref_states.update({s: _state(ref_ckpts, s) for s in checkpoint.all_steps(ref_ckpts)})
    if steps == 2:
      shutil.copytree(ref, workdir)  # the run that meets the full disk: these 2 steps done
  command = [f'--workdir={workdir}', '--config.grpo.num_steps=4'] + args
  full = _cli(command, file_size_limit=64 << 10)
  assert full.returncode == 1, full.stderr[-3000:]
  assert full.stderr.strip().splitlines()[-1] == (
      f'error: cannot write {ckpts}/9: File too large; the checkpoints before it are intact '
      f'(the newest: step 6). Free space (or fix the storage), then re-run the same command: it '
      f'resumes from the last complete checkpoint.')
  assert 'Traceback' not in full.stderr and 'Event loop is closed' not in full.stderr
  assert checkpoint.all_steps(ckpts) == [3, 6]
  for step in (3, 6):  # intact and readable: as the unlimited run wrote them
    _assert_same_state(_state(ckpts, step), ref_states[step])
  assert not (workdir / workdir_lock.LOCK_NAME).exists()

  capsys.readouterr()
  api.run(smoke_configs.smoke(stages='grpo', **{'grpo.num_steps': 4,
                                                'checkpoint.every_steps': 1}), str(workdir))
  assert '[grpo] finished at step 2; grpo.num_steps=4: training on' in capsys.readouterr().out
  assert checkpoint.all_steps(ckpts)[-1] == 12
  _assert_same_state(_state(ckpts, 12), ref_states[12])
  rows, ref_rows = _grpo_rows(workdir), _grpo_rows(ref)
  assert [(r['phase'], r['step']) for r in rows] == [(r['phase'], r['step']) for r in ref_rows]
  for row, ref_row in zip(rows, ref_rows):
    assert row == ref_row


_UNAWAITED = """
import asyncio, gc, sys
from jaxrl_ga import checkpoint
if sys.argv[1] == 'failed':
  checkpoint._note_write_failed()  # what a CheckpointWriteError does
async def save():
  pass
pending = save()  # orbax's abandoned save: a coroutine nobody awaits
del pending
gc.collect()
print('end', flush=True)
"""


def test_after_a_failed_write_an_abandoned_coroutine_prints_nothing_after_the_error(tmp_path):
  """The full-disk error must be the last line on stderr. Under load (CI, 2 cores), an asyncio
  coroutine of orbax's failed save was collected unawaited after it and printed a RuntimeWarning.
  Once a write failed that warning is ignored; before, it still prints (so the check can fail)."""
  env = dict(_env(1), PYTHONWARNINGS='default')
  run = lambda mode: subprocess.run([sys.executable, '-c', _UNAWAITED, mode], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=120)
  before, failed = run('ok'), run('failed')
  assert before.returncode == failed.returncode == 0, before.stderr + failed.stderr
  assert "coroutine 'save' was never awaited" in before.stderr
  assert 'never awaited' not in failed.stderr and failed.stdout == 'end\n', failed.stderr


def test_a_metrics_row_that_does_not_fit_leaves_no_partial_row(tmp_path):
  """metrics.jsonl on a full disk: the write fails with one error naming the file, and the part
  of the row that was written is cut off again, so a resumed run appends whole rows."""
  path = tmp_path / 'metrics.jsonl'
  first = json.dumps({'phase': 'grpo', 'step': 1, 'pad': 'x' * 3900}) + '\n'
  writer = fileio.TextAppender(path)
  writer.write(first)
  room = 4096 - len(first)
  assert room > 0
  row = json.dumps({'phase': 'grpo', 'step': 2, 'pad': 'y' * (room + 100)}) + '\n'
  with _file_size_limit(4096):  # the first `room` bytes of the row are written, then EFBIG
    with pytest.raises(fileio.WriteError) as e:
      writer.write(row)
  assert str(e.value) == f'cannot write {path}: File too large'
  assert path.read_text() == first  # the `room` bytes that were written are gone again
  writer.write(row)
  writer.close()
  assert path.read_text() == first + row


@pytest.mark.slow
def test_an_export_to_a_full_disk_leaves_the_previous_export(tmp_path):
  from jaxrl_ga import export as export_lib  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'run'  # the run and the exports that succeed: in this process
  api.run(smoke_configs.smoke(stages='grpo', **{'grpo.num_steps': 1}), str(workdir))
  export = [sys.executable, '-m', 'jaxrl_ga.export']
  out = tmp_path / 'exports' / 'hf'
  export_lib.export_checkpoint(str(workdir), str(out))
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  assert max(map(len, before.values())) > 16 << 10  # the weights cannot be written below
  full = _cli([f'--checkpoint={workdir}', f'--out={out}', '--overwrite'], cmd=export,
              file_size_limit=16 << 10)
  assert full.returncode == 1, full.stderr[-3000:]
  assert full.stderr.strip().splitlines()[-1] == (
      f'error: cannot write {out}: File too large; --out={out} is unchanged. Free space, then '
      f'run the export again.')
  assert 'Traceback' not in full.stderr
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert os.listdir(out.parent) == ['hf']  # no staging directory left behind
  export_lib.export_checkpoint(str(workdir), str(out), overwrite=True)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the same checkpoint's


@pytest.mark.slow
def test_several_processes_decide_once_for_the_whole_job(tmp_path):
  """Two processes of one job (jax.distributed) on a held workdir: process 0 reads the lock and
  both stop with its line (process 1 never looks at the file), exit 2, nothing compiled."""
  lock = workdir_lock.WorkdirLock(str(tmp_path)).acquire()  # this test process is the holder
  try:
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    env = _env(devices=4)
    procs = [subprocess.Popen(MAIN + [f'--workdir={tmp_path}', '--num_processes=2',
                                      f'--coordinator_address=127.0.0.1:{port}',
                                      f'--process_id={i}'],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
  finally:
    lock.release()
  expected = (f'error: --workdir={tmp_path} is in use by another run (host '
              f'{socket.gethostname()}, pid {os.getpid()}, since ')
  for p, err in zip(procs, errs):
    assert p.returncode == 2, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(expected), err[-3000:]
    assert 'Traceback' not in err
