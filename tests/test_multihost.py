"""Two processes with 4 CPU devices each (jax.distributed, gloo) train SFT then GRPO to the same
params as one process with 8 devices: the token normalization and every sum are global across
hosts, and each host loads only its own part of the data."""

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import safetensors.numpy

import helpers
from jaxrl_ga import checkpoint

pytestmark = pytest.mark.slow  # two-process runs: tens of seconds each

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'multihost_worker.py')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _start(pid, nproc, port, workdir, ndev, **env_extra):
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  env.update(env_extra, XLA_FLAGS=helpers.xla_flags(ndev))
  return subprocess.Popen([sys.executable, WORKER, str(pid), str(nproc), str(port), str(workdir),
                           str(ndev)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _kill_left(procs) -> None:
  """Kills the processes still running (a test that failed or timed out must not leave its
  workers training beside the rest of the suite)."""
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _lines_parsed_by(process: int, num_rows: int, seed: int, eval_fraction: float,
                     positions: int) -> set[int]:
  """The lines (1-based) of a .jsonl file of ``num_rows`` rows that ``process`` (of 2; the
  worker's S=2, B=16, G=4 on 4 devices each) parses, by docs/scaling.md's rules: every held-out
  row, and the training rows at its data positions (those whose prompt, of the S*B/G = 8 of a
  rollout, has one of the process's rows: the first or second half of B) of the first epoch and
  of the run's first ``positions``."""
  held = np.random.default_rng([seed, 4099]).permutation(num_rows)[:max(1, round(
      eval_fraction * num_rows))]
  held = set((held + 1).tolist())
  train = [n for n in range(1, num_rows + 1) if n not in held]
  own = {(s * 16 + i) // 4 for s in range(2) for i in range(8 * process, 8 * process + 8)}
  row = lambda d: train[np.random.default_rng([seed, d // len(train)]).permutation(
      len(train))[d % len(train)]]
  return held | {row(d) for d in range(max(len(train), positions)) if d % 8 in own}


def _check_data_file_run(tmp_path, rows):
  """Each process parsed only its own rows (and the held-out ones); the completions process 0
  logged carry the rewards of their own completions (grpo._log_completions, several hosts)."""
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  cfg = load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke')
  parsed = lambda d, i: set(json.load(open(d / f'parsed_{i}.json')))
  assert parsed(tmp_path / 'one', 0) == set(range(1, len(rows) + 1))
  summary = json.load(open(tmp_path / 'two' / 'run' / 'summary.json'))
  positions = 8 * summary['grpo/rollouts']
  for p in (0, 1):
    want = _lines_parsed_by(p, len(rows), cfg.seed, cfg.data.eval_fraction, positions)
    assert parsed(tmp_path / 'two', p) == want, p
    assert len(want) < 0.8 * len(rows)
  answer = {r['prompt']: r['answer'].split()[-1] for r in rows}
  for run, per_rollout in (('one', 32), ('two', 16)):  # S*B rows; process 0's half of them
    logged = [json.loads(l) for l in open(tmp_path / run / 'run' / 'completions.jsonl')]
    assert len(logged) >= 2 * per_rollout and len(logged) % per_rollout == 0
    assert len({r['reward'] for r in logged}) > 3  # the rewards tell the completions apart
    for r in logged:
      want = len(r['completion']) + 10.0 * (answer[r['prompt']] in r['completion'])
      assert r['reward'] == pytest.approx(want, rel=1e-6), r


@pytest.mark.parametrize('data_file', [False, True])
def test_two_processes_equal_one_process(tmp_path, data_file):
  """Also on a JSONL file (jaxrl_ga.data, GRPO alone): each host builds only its rows' examples
  and parses only its rows of the file (_check_data_file_run)."""
  extra = {}
  if data_file:
    rows = [{'prompt': f'{a}+{b}=', 'answer': f'#### {a + b}'} for a in range(7) for b in range(5)]
    (tmp_path / 'rows.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    extra['JAXRL_GA_TEST_DATA'] = str(tmp_path / 'rows.jsonl')
  port = _free_port()
  procs = [_start(0, 1, 0, tmp_path / 'one', 8, **extra),
           _start(0, 2, port, tmp_path / 'two', 4, **extra),
           _start(1, 2, port, tmp_path / 'two', 4, **extra)]
  try:
    for p in procs:
      out, _ = p.communicate(timeout=420)
      assert p.returncode == 0, out[-4000:]
  finally:
    _kill_left(procs)
  one = np.load(tmp_path / 'one' / 'params.npz')
  two = np.load(tmp_path / 'two' / 'params.npz')
  assert sorted(one.files) == sorted(two.files) and len(one.files) > 5
  num = np.sqrt(sum(np.sum((one[k] - two[k]) ** 2) for k in one.files))
  den = np.sqrt(sum(np.sum(one[k] ** 2) for k in one.files))
  assert num / den <= 1e-5  # float32, relative over all params
  for k in one.files:  # and element by element within float32 noise (Adam amplifies the noise
    np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6)  # of zero-gradient biases)
  # The window losses each run logged (process 0 only writes) are the same too.
  def losses(d):
    rows = [json.loads(l) for l in open(d / 'run' / 'metrics.jsonl')]
    return [r['loss'] for r in rows if r['phase'] == 'grpo']
  assert len(losses(tmp_path / 'one')) == 2  # log_every=1: both steps' (the worker)
  np.testing.assert_allclose(losses(tmp_path / 'two'), losses(tmp_path / 'one'), rtol=1e-5)
  if data_file:  # a reward's log_metric: every process's values averaged (TRL's), not process 0's
    logged = lambda d: [r['test/process_index'] for r in map(
        json.loads, open(d / 'run' / 'metrics.jsonl')) if 'test/process_index' in r]
    assert logged(tmp_path / 'one') and set(logged(tmp_path / 'one')) == {0.0}
    assert len(logged(tmp_path / 'two')) == len(logged(tmp_path / 'one'))
    assert set(logged(tmp_path / 'two')) == {0.5}
  # Each host built only its half of the training examples, and together exactly the ones the
  # single process built (SFT rows and GRPO prompts are split by the rows each host's devices hold).
  loaded = lambda d, i: collections.Counter(
      map(tuple, json.load(open(d / f'loaded_{i}.json', encoding='utf-8'))))
  whole, p0, p1 = loaded(tmp_path / 'one', 0), loaded(tmp_path / 'two', 0), loaded(
      tmp_path / 'two', 1)
  # SFT's 2 steps of B=16 rows; GRPO's S*B/G = 8 prompts a rollout, 3 rollouts for 6 micro-steps.
  assert sum(whole.values()) == (0 if data_file else 2 * 16) + 3 * 8
  assert sum(p0.values()) == sum(p1.values()) == sum(whole.values()) // 2
  assert p0 + p1 == whole
  if data_file:
    _check_data_file_run(tmp_path, rows)
  else:
    _check_exports(tmp_path)


def _check_exports(tmp_path):
  """Both processes of the two-process run exported: process 0 wrote it, process 1 neither
  wrote a second one nor put its own empty staging directory in its place (it did: --out was
  left empty, rc 0 on both). And the two-process checkpoint reads in this one process of 8
  devices, as export and sample read it (orbax refused another topology)."""
  one = safetensors.numpy.load_file(tmp_path / 'one' / 'hf' / 'model.safetensors')
  two = safetensors.numpy.load_file(tmp_path / 'two' / 'hf' / 'model.safetensors')
  assert sorted(two) == sorted(one) and len(one) > 5
  for k in one:
    np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6)
  assert not [n for n in os.listdir(tmp_path / 'two') if n.startswith('.')]  # no staging left
  ckpts = tmp_path / 'two' / 'run' / 'checkpoints' / 'grpo'
  state, _, _ = checkpoint.Checkpointer(ckpts, read_only=True).restore_raw(
      checkpoint.latest_step(ckpts))
  params = np.load(tmp_path / 'two' / 'params.npz')
  got = {jax.tree_util.keystr(p): np.asarray(v)
         for p, v in jax.tree_util.tree_leaves_with_path(state['learner']['params'])}
  assert sorted(got) == sorted(params.files)
  for k in params.files:
    np.testing.assert_array_equal(got[k], params[k])


def test_a_reward_error_on_one_host_stops_every_host(tmp_path):
  """Process 1's reward function raises at the second rollout: without care process 0 would wait
  in the reward gather forever. Both must exit non-zero, quickly, each saying why."""
  port = _free_port()
  extra = {'JAXRL_GA_TEST_REWARD_RAISES_ON': '1', 'JAXRL_GA_TEST_STAGES': 'grpo'}
  procs = [_start(i, 2, port, tmp_path, 4, **extra) for i in (0, 1)]
  outs, ends = [None, None], [None, None]

  def wait(i):
    outs[i] = procs[i].communicate(timeout=300)[0]
    ends[i] = time.time()

  threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  _kill_left(procs)  # a process left waiting: the failure this test guards against
  assert None not in ends, 'a process did not exit within 300 s'
  assert abs(ends[0] - ends[1]) < 60  # both stop within a minute of each other
  assert all(p.returncode != 0 for p in procs), [o[-2000:] for o in outs]
  assert 'reward server unreachable (test, process 1)' in outs[1], outs[1][-3000:]
  assert 'failed on process(es) [1]' in outs[0], outs[0][-3000:]


def test_a_rollout_row_refused_on_one_host_stops_every_host(tmp_path):
  """A row that only process 1 reads, refused at the second rollout (past the up-front checks):
  process 0 waited at the next collective until jax's shutdown timeout (5 minutes), then both
  aborted and process 0 never said why. Both now stop at once, each with one line."""
  port = _free_port()
  extra = {'JAXRL_GA_TEST_ROW_FAILS_ON': '1', 'JAXRL_GA_TEST_STAGES': 'grpo'}
  procs = [_start(i, 2, port, tmp_path, 4, **extra) for i in (0, 1)]
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    _kill_left(procs)
  assert [p.returncode for p in procs] == [1, 1], [o[-2000:] for o in outs]  # the worker's
  assert re.search(r'ConfigError: the prompts of the rollout at data position 8 failed on '
                   r'process\(es\) \[1\] \(their error names it\)', outs[0]), outs[0][-3000:]
  # one of the second rollout's rows that process 1 reads
  assert re.search(r'ConfigError: data row (8|9|1[0-5]) is refused \(test, process 1\)',
                   outs[1]), outs[1][-3000:]


def test_sigterm_to_one_host_stops_every_host_at_the_same_step(tmp_path):
  """The training loop asks jax's preemption service, with no collective per micro-step; SIGTERM
  to one process stops both at one agreed micro-step, with one checkpoint and status 143."""
  port = _free_port()
  extra = {'JAXRL_GA_TEST_GRPO_STEPS': '400', 'JAXRL_GA_TEST_STAGES': 'grpo'}
  procs = [_start(i, 2, port, tmp_path, 4, **extra) for i in (0, 1)]
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  deadline = time.time() + 300
  while time.time() < deadline:  # wait until GRPO trains
    if metrics.exists() and '"phase": "grpo"' in metrics.read_text():
      break
    time.sleep(0.5)
  procs[1].send_signal(signal.SIGTERM)
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    _kill_left(procs)
  assert [p.returncode for p in procs] == [143, 143], [o[-2000:] for o in outs]
  stopped = [re.findall(r'stopped early at micro-step (\d+)', o) for o in outs]
  assert stopped[0] == stopped[1] and len(stopped[0]) == 1, stopped
  steps = os.listdir(tmp_path / 'run' / 'checkpoints' / 'grpo')
  assert steps == stopped[0], steps


def test_a_workdir_not_shared_by_every_host_is_refused_at_start(tmp_path):
  """Per-host workdirs (each process its own directory): orbax's first cooperative save waited
  forever, with no message. Both processes now stop at the start with the same line."""
  port = _free_port()
  procs = [_start(i, 2, port, tmp_path / f'host{i}', 4) for i in (0, 1)]
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    _kill_left(procs)
  for p, out in zip(procs, outs):
    assert p.returncode != 0, out[-3000:]
    assert re.search(r'--workdir=\S+/host\d/run is not shared by every process of the job: '
                     r'process\(es\) \[1\] do not see the file process 0 wrote there', out), (
                         out[-3000:])
    assert 'checkpoint' not in os.listdir(tmp_path / 'host0' / 'run')
  assert not [n for n in os.listdir(tmp_path / 'host0' / 'run') if n.startswith('.shared')]
