"""launch/tpu.py against a fake `gcloud` on PATH that records its argv (no network, no cloud).

Each test runs the CLI in a subprocess, as a user would, and checks the exact argument lists that
reached gcloud: subcommand, node name, --zone, --project, --worker, accelerator type, and that a
remote command with spaces and both kinds of quotes arrives as one argument which the worker's
shell runs exactly as typed (checked by running the recorded --command with bash).
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, 'launch', 'tpu.py')
NAME, ZONE, PROJECT = 'rl-test', 'us-central2-b', 'my-proj-123'
LOC = ['--name', NAME, '--zone', ZONE, '--project', PROJECT]
SSH = ['compute', 'tpus', 'tpu-vm', 'ssh', NAME, f'--zone={ZONE}', f'--project={PROJECT}']
# Spaces, both quote kinds, $, a backslash and ';': all must survive to the worker's shell.
TRICKY = """printf '%s|%s|%s\\n' "two words" 'say "hi"' "it's \\$HOME; ok\""""
TRICKY_OUTPUT = """two words|say "hi"|it's $HOME; ok\n"""

FAKE_GCLOUD = textwrap.dedent('''\
    #!{python}
    """Fake gcloud: appends {{"argv": [...], "tar": [...]}} as one JSON line to $FAKE_GCLOUD_LOG."""
    import json, os, sys, tarfile
    record = {{"argv": sys.argv[1:]}}
    for arg in sys.argv[1:]:  # a tarball handed to scp: record what it holds
        if arg.endswith(".tar.gz") and os.path.isfile(arg):
            with tarfile.open(arg) as tar:
                record["tar"] = tar.getnames()
    with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")
    sys.exit(int(os.environ.get("FAKE_GCLOUD_RC", "0")))
    ''')


class FakeGcloud:

  def __init__(self, tmp_path):
    self.bin = tmp_path / 'bin'
    self.bin.mkdir()
    exe = self.bin / 'gcloud'
    exe.write_text(FAKE_GCLOUD.format(python=sys.executable))
    exe.chmod(0o755)
    self.log = tmp_path / 'gcloud_calls.jsonl'
    self.env = {k: v for k, v in os.environ.items() if not k.startswith('TPU_')}
    self.env.update(PATH=f'{self.bin}{os.pathsep}{os.environ.get("PATH", "")}',
                    FAKE_GCLOUD_LOG=str(self.log))

  def run(self, *args, env=None, check=True):
    proc = subprocess.run([sys.executable, LAUNCH, *args], env={**self.env, **(env or {})},
                          capture_output=True, text=True, timeout=60)
    if check:
      assert proc.returncode == 0, proc.stderr
    return proc

  def calls(self):
    if not self.log.exists():
      return []
    return [json.loads(line) for line in self.log.read_text().splitlines()]

  def argvs(self):
    return [c['argv'] for c in self.calls()]


@pytest.fixture
def gcloud(tmp_path):
  return FakeGcloud(tmp_path)


def _load_launcher():
  spec = importlib.util.spec_from_file_location('launch_tpu', LAUNCH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def launch_inproc(gcloud, monkeypatch, capsys):
  """Runs the CLI's main() in this process (fast, for the many error cases), with the fake
  gcloud first on PATH; returns (exit status, stderr)."""
  for key in list(os.environ):
    if key.startswith('TPU_'):
      monkeypatch.delenv(key)
  monkeypatch.setenv('PATH', gcloud.env['PATH'])
  monkeypatch.setenv('FAKE_GCLOUD_LOG', gcloud.env['FAKE_GCLOUD_LOG'])
  module = _load_launcher()

  def run(*args):
    capsys.readouterr()
    try:
      status = module.main(list(args))
    except SystemExit as e:
      status = e.code
    return status, capsys.readouterr().err

  return run


def _script(argv):
  """The remote script of an ssh argv (its last element, --command=...)."""
  assert argv[-1].startswith('--command='), argv
  return argv[-1][len('--command='):]


# -- create / delete / status --------------------------------------------------------------------
def test_create_single_slice(gcloud):
  gcloud.run('create', *LOC, '--accelerator-type=v5e-8', '--spot', '--reserved')
  assert gcloud.argvs() == [[
      'compute', 'tpus', 'tpu-vm', 'create', NAME, f'--zone={ZONE}', f'--project={PROJECT}',
      '--accelerator-type=v5litepod-8', '--version=v2-alpha-tpuv5-lite', '--spot', '--reserved']]


@pytest.mark.parametrize('accel, version', [
    ('v4-32', 'tpu-ubuntu2204-base'), ('v5p-128', 'v2-alpha-tpuv5'),
    ('v6e-8', 'v2-alpha-tpuv6e'), ('v5litepod-16', 'v2-alpha-tpuv5-lite')])
def test_create_queued_resource(gcloud, accel, version):
  gcloud.run('create', *LOC, f'--accelerator-type={accel}', '--queued',
             '--queued-resource-id=rl-qr', '--valid-until-duration=6h')
  assert gcloud.argvs() == [[
      'compute', 'tpus', 'queued-resources', 'create', 'rl-qr', f'--node-id={NAME}',
      f'--zone={ZONE}', f'--project={PROJECT}', f'--accelerator-type={accel}',
      f'--runtime-version={version}', '--valid-until-duration=6h']]


def test_create_version_override_and_env_defaults(gcloud):
  env = {'TPU_NAME': NAME, 'TPU_ZONE': ZONE, 'TPU_PROJECT': PROJECT}
  gcloud.run('create', '--accelerator-type=v4-8', '--version=v2-alpha-tpuv4', env=env)
  assert gcloud.argvs() == [[
      'compute', 'tpus', 'tpu-vm', 'create', NAME, f'--zone={ZONE}', f'--project={PROJECT}',
      '--accelerator-type=v4-8', '--version=v2-alpha-tpuv4']]


def test_delete_and_status(gcloud):
  gcloud.run('delete', *LOC)
  gcloud.run('delete', *LOC, '--queued', '--yes')
  gcloud.run('status', *LOC)
  gcloud.run('status', *LOC, '--queued', '--queued-resource-id=rl-qr')
  loc = [f'--zone={ZONE}', f'--project={PROJECT}']
  assert gcloud.argvs() == [
      ['compute', 'tpus', 'tpu-vm', 'delete', NAME, *loc],
      ['compute', 'tpus', 'queued-resources', 'delete', NAME, *loc, '--force', '--quiet'],
      ['compute', 'tpus', 'tpu-vm', 'describe', NAME, *loc],
      ['compute', 'tpus', 'queued-resources', 'describe', 'rl-qr', *loc]]


# -- setup -----------------------------------------------------------------------------------------
def test_setup_copies_the_working_tree_to_every_worker(gcloud):
  gcloud.run('setup', *LOC)
  calls = gcloud.calls()
  assert len(calls) == 2
  scp = calls[0]['argv']
  assert scp[:5] == ['compute', 'tpus', 'tpu-vm', 'scp', scp[4]]
  assert scp[4].endswith(f'jaxrl_ga-{NAME}.tar.gz')
  assert scp[5:] == [f'{NAME}:jaxrl_ga.tar.gz', f'--zone={ZONE}', f'--project={PROJECT}',
                     '--worker=all']
  members = calls[0]['tar']
  for path in ('setup.py', 'jaxrl_ga/config.py', 'launch/tpu.py', 'tests/test_launch.py'):
    assert path in members
  assert not any(m.startswith('.git/') or '__pycache__' in m for m in members)
  assert not os.path.exists(scp[4]), 'the local tarball is removed after the copy'
  ssh = calls[1]['argv']
  assert ssh[:-1] == [*SSH, '--worker=all']
  script = _script(ssh)
  assert 'tar -xzf "$HOME/jaxrl_ga.tar.gz" -C "$HOME/jaxrl_ga.new"' in script
  assert '-e "$HOME/jaxrl_ga[tpu,data]"' in script
  assert '--python 3.12' in script


def test_setup_from_git_url_skips_the_copy(gcloud):
  gcloud.run('setup', *LOC, '--git-url=https://example.com/o/jaxrl_ga.git', '--git-ref=v1',
             '--extras=tpu', '--worker=1')
  (ssh,) = gcloud.argvs()
  assert ssh[:-1] == [*SSH, '--worker=1']
  words = shlex.split(_script(ssh))
  assert words[words.index('clone') + 2:words.index('clone') + 4] == [
      '--', 'https://example.com/o/jaxrl_ga.git']
  assert words[words.index('checkout') + 2] == 'v1'
  assert '$HOME/jaxrl_ga[tpu]' in words


def test_setup_stops_at_the_first_gcloud_failure(gcloud):
  proc = gcloud.run('setup', *LOC, env={'FAKE_GCLOUD_RC': '5'}, check=False)
  assert proc.returncode == 5
  assert len(gcloud.calls()) == 1  # the scp failed: no ssh


# -- run / logs / stop -----------------------------------------------------------------------------
def test_run_sends_the_command_as_one_argument(gcloud):
  gcloud.run('run', *LOC, '--command', TRICKY)
  (argv,) = gcloud.argvs()
  assert argv[:-1] == [*SSH, '--worker=all']
  words = shlex.split(_script(argv))
  assert TRICKY in words  # one word for the worker's shell, byte for byte
  assert 'setsid' in words


def test_run_after_double_dash_quotes_each_argument(gcloud):
  gcloud.run('run', *LOC, '--worker=0', '--log-name=gsm8k', '--', 'python', '-m',
             'jaxrl_ga.main', '--config=configs/grpo_gsm8k_tpu.py:v5e-8',
             '--workdir=/home/me/runs/a b')
  (argv,) = gcloud.argvs()
  assert argv[:-1] == [*SSH, '--worker=0']
  words = shlex.split(_script(argv))
  command = ("python -m jaxrl_ga.main --config=configs/grpo_gsm8k_tpu.py:v5e-8 "
             "'--workdir=/home/me/runs/a b'")
  assert command in words
  assert 'log="$HOME/logs/gsm8k.$h.log"' in _script(argv)


def _fake_worker_home(tmp_path):
  home = tmp_path / 'home'
  (home / 'jaxrl_ga').mkdir(parents=True)
  (home / 'jaxrl_ga_venv' / 'bin').mkdir(parents=True)
  (home / 'jaxrl_ga_venv' / 'bin' / 'activate').write_text('export VENV_ACTIVE=yes\n')
  return home


def _as_worker(script, home, timeout=20):
  """Runs a recorded --command as the worker's login shell would (bash -c)."""
  env = {'HOME': str(home), 'PATH': os.environ['PATH']}
  return subprocess.run(['bash', '-c', script], env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_run_command_executes_intact_on_the_worker(gcloud, tmp_path):
  """The recorded --command, run by bash, runs the user's command as typed, in ~/jaxrl_ga with
  the venv active and the --env variables set, logs per host, and returns its status."""
  command = TRICKY + '; echo "$VENV_ACTIVE $(basename "$PWD") $TOKEN"; exit 3'
  gcloud.run('run', *LOC, '--foreground', '--env', 'TOKEN=a b\'"c', '--command', command)
  home = _fake_worker_home(tmp_path)
  proc = _as_worker(_script(gcloud.argvs()[0]), home)
  expected = TRICKY_OUTPUT + 'yes jaxrl_ga a b\'"c\n'
  assert proc.stdout == expected
  assert proc.returncode == 3
  host = subprocess.run(['hostname'], capture_output=True, text=True, check=True).stdout.strip()
  assert (home / 'logs' / f'run.{host}.log').read_text() == expected


def _alive(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not os.path.isdir('/proc'), reason='needs /proc')
def test_detached_run_returns_at_once_and_stop_ends_it(gcloud, tmp_path):
  home = _fake_worker_home(tmp_path)
  gcloud.run('run', *LOC, '--log-name=bg', '--command', 'echo started; exec sleep 60')
  gcloud.run('stop', *LOC, '--log-name=bg')
  run_argv, stop_argv = gcloud.argvs()
  assert stop_argv[:-1] == [*SSH, '--worker=all']
  t0 = time.time()
  proc = _as_worker(_script(run_argv), home, timeout=10)  # must not wait for the command
  assert proc.returncode == 0, proc.stderr
  assert time.time() - t0 < 5
  host = subprocess.run(['hostname'], capture_output=True, text=True, check=True).stdout.strip()
  pid_file, log = home / 'logs' / f'bg.{host}.pid', home / 'logs' / f'bg.{host}.log'
  deadline = time.time() + 5
  while not (pid_file.exists() and pid_file.read_text().strip()
             and log.exists() and log.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  pid = int(pid_file.read_text())
  try:
    assert _alive(pid)
    assert os.getpgid(pid) == pid  # its own process group, so stop can signal all of it
    assert log.read_text() == 'started\n'
    # The same log name again while it runs: refused (its pid file and log stay the first run's).
    again = _as_worker(_script(run_argv), home, timeout=10)
    assert again.returncode == 1 and 'is still running' in again.stderr, again.stderr
    assert int(pid_file.read_text()) == pid
    proc = _as_worker(_script(stop_argv), home)
    assert proc.returncode == 0, proc.stderr
    assert f'sent SIGTERM to process group {pid}' in proc.stdout
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
      time.sleep(0.05)
    assert not _alive(pid)
    # Once it has ended a run of that name starts, and its log is appended to (a resume keeps
    # the first attempt's output).
    again = _as_worker(_script(run_argv), home, timeout=10)
    assert again.returncode == 0, again.stderr
    deadline = time.time() + 5
    while log.read_text().count('started') < 2 and time.time() < deadline:
      time.sleep(0.05)
    assert log.read_text() == 'started\nstarted\n'
    os.killpg(int(pid_file.read_text()), 9)
  finally:
    if _alive(pid):
      os.kill(pid, 9)


def test_logs(gcloud):
  gcloud.run('logs', *LOC, '--worker=1', '--lines=50', '--log-name=gsm8k')
  gcloud.run('logs', *LOC, '--follow')
  (one, every) = gcloud.argvs()
  assert one[:-1] == [*SSH, '--worker=1']
  assert 'tail -n 50 "$HOME/logs/gsm8k.$h.log"' in _script(one)
  assert every[:-1] == [*SSH, '--worker=all']
  assert 'tail -n 100 -F "$HOME/logs/run.$h.log"' in _script(every)


def test_logs_script_prefixes_lines_with_the_host(gcloud, tmp_path):
  gcloud.run('logs', *LOC, '--lines=2')
  home = _fake_worker_home(tmp_path)
  host = subprocess.run(['hostname'], capture_output=True, text=True, check=True).stdout.strip()
  (home / 'logs').mkdir()
  (home / 'logs' / f'run.{host}.log').write_text('a\nb\nc\n')
  proc = _as_worker(_script(gcloud.argvs()[0]), home)
  assert proc.stdout == f'[{host}] b\n[{host}] c\n'


# -- checkpoints -----------------------------------------------------------------------------------
def test_ckpt_upload_and_download(gcloud, tmp_path):
  gcloud.run('ckpt-upload', *LOC, '--src=~/runs/my run', '--dest=gs://bkt/runs/x')
  gcloud.run('ckpt-download', *LOC, '--src=gs://bkt/runs/x', '--dest=~/runs/x', '--worker=all')
  local = str(tmp_path / 'local copy')
  gcloud.run('ckpt-download', '--src=gs://bkt/runs/x', f'--dest={local}', '--local')
  up, down, down_local = gcloud.argvs()
  assert up[:-1] == [*SSH, '--worker=0']
  assert _script(up) == 'gcloud storage rsync --recursive "$HOME"/\'runs/my run\' gs://bkt/runs/x'
  assert down[:-1] == [*SSH, '--worker=all']
  assert _script(down) == ('mkdir -p "$HOME"/runs/x && '
                           'gcloud storage rsync --recursive gs://bkt/runs/x "$HOME"/runs/x')
  assert down_local == ['storage', 'rsync', '--recursive', 'gs://bkt/runs/x', local]


def test_ckpt_needs_a_bucket(gcloud):
  proc = gcloud.run('ckpt-upload', *LOC, '--src=~/runs/x', '--dest=/tmp/x', check=False)
  assert proc.returncode == 2 and '--dest' in proc.stderr and 'gs://' in proc.stderr
  assert gcloud.calls() == []


# -- dry run and errors ----------------------------------------------------------------------------
@pytest.mark.parametrize('args', [
    ['create', '--accelerator-type=v4-32'],
    ['create', '--accelerator-type=v6e-8', '--queued', '--spot'],
    ['setup'],
    ['run', '--command', TRICKY],
    ['logs', '--worker=0'],
    ['stop'],
    ['ckpt-upload', '--src=~/runs/x', '--dest=gs://b/x'],
    ['ckpt-download', '--src=gs://b/x', '--dest=~/runs/x'],
    ['delete', '--yes'],
    ['status'],
])
def test_dry_run_prints_what_it_would_run(gcloud, args):
  dry = gcloud.run(*args, *LOC, '--dry-run')
  assert gcloud.calls() == [], 'dry run must not call gcloud'
  printed = [shlex.split(line) for line in dry.stdout.splitlines() if not line.startswith('#')]
  gcloud.run(*args, *LOC)
  assert printed == [['gcloud', *argv] for argv in gcloud.argvs()]


def test_dry_run_works_without_gcloud(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith('TPU_')}
  env['PATH'] = str(tmp_path)  # no gcloud here
  args = [sys.executable, LAUNCH, 'create', *LOC, '--accelerator-type=v4-32']
  proc = subprocess.run([*args, '--dry-run'], env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      '# v4-32: jax.device_count() will be 16 (the mesh size product)',
      f'gcloud compute tpus tpu-vm create {NAME} --zone={ZONE} --project={PROJECT} '
      '--accelerator-type=v4-32 --version=tpu-ubuntu2204-base']
  proc = subprocess.run(args, env=env, capture_output=True, text=True)
  assert proc.returncode == 2 and 'gcloud is not on PATH' in proc.stderr


@pytest.mark.parametrize('accel, fragment', [
    ('v4-12', 'v4 has no slice of 12 TensorCores'),
    ('v5litepod-2', 'v5e has no slice of 2 chips'),
    ('v7-8', 'not a known TPU type'),
])
def test_invalid_accelerator_type(gcloud, launch_inproc, accel, fragment):
  status, err = launch_inproc('create', *LOC, f'--accelerator-type={accel}')
  assert status == 2
  assert '--accelerator-type' in err and fragment in err
  assert 'v5litepod-8' in err or '(v4-N)' in err or '(v5litepod-N)' in err
  assert gcloud.calls() == []


def test_skip_accelerator_check(gcloud):
  gcloud.run('create', *LOC, '--accelerator-type=v5p-96', '--version=v2-alpha-tpuv5',
             '--skip-accelerator-check')
  assert '--accelerator-type=v5p-96' in gcloud.argvs()[0]


def test_missing_zone_exits_with_a_message_naming_the_flag(gcloud):
  proc = gcloud.run('run', '--name', NAME, '--project', PROJECT, '--command', 'true',
                    check=False)
  assert proc.returncode == 2
  assert '--zone is required' in proc.stderr and 'TPU_ZONE' in proc.stderr
  assert gcloud.calls() == []


@pytest.mark.parametrize('flag, env', [('zone', 'TPU_ZONE'), ('project', 'TPU_PROJECT'),
                                       ('name', 'TPU_NAME')])
def test_missing_location_flag(gcloud, launch_inproc, flag, env):
  args = list(LOC)
  i = args.index(f'--{flag}')
  del args[i:i + 2]
  status, err = launch_inproc('status', *args)
  assert status == 2
  assert f'--{flag} is required' in err and env in err
  assert gcloud.calls() == []


@pytest.mark.parametrize('args, fragment', [
    (['run'], '--command'),
    (['run', '--command', 'x', '--', 'y'], 'not both'),
    (['run', '--env', 'A B=1', '--command', 'x'], '--env'),
    (['run', '--log-name', '../x', '--command', 'x'], '--log-name'),
    (['logs', '--worker', 'first'], '--worker'),
    (['create', '--accelerator-type=v4-8', '--valid-until-duration=1h'], 'needs --queued'),
    (['setup', '--git-url=--upload-pack=x'], '--git-url'),
    (['setup', '--git-url=https://h/r.git', '--git-ref=-x'], '--git-ref'),
    (['setup', '--git-ref=main'], '--git-ref needs --git-url'),
    (['setup', '--python=3.12; rm'], '--python'),
    (['setup', '--python=3.10'], 'need Python 3.11 or newer'),  # the TPU images' own, too old
    (['setup', '--repo=/', '--dry-run'], 'is not a git checkout'),  # the dry run as the real one
    (['run', '--env', 'JAXRL_GA_TEST_UNSET_VAR', '--command', 'x'], 'is not set here'),
    (['ckpt-upload', '--src=-rf', '--dest=gs://b/x'], '--src'),
    (['ckpt-download', '--src=gs://b/x', '--dest=gs://c/y'], '--dest'),
    (['status', '--zone', 'us central'], '--zone'),
    (['status', '--queued', '--queued-resource-id=--x'], '--queued-resource-id'),
])
def test_bad_inputs_are_rejected(gcloud, launch_inproc, args, fragment):
  status, err = launch_inproc(args[0], *LOC, *args[1:])
  assert status == 2
  assert fragment in err
  assert gcloud.calls() == []


@pytest.mark.parametrize('args, fragment', [
    (['run', '--worker=x', '--command=ls'], "argument --worker: 'x': use \"all\" or a worker"),
    (['stop', '--signal=HUP'], 'argument --signal: invalid choice'),
    (['create'], 'the following arguments are required: --accelerator-type'),
])
def test_argument_errors_are_one_line(gcloud, launch_inproc, args, fragment):
  """argparse's own errors: one line, status 2, no usage block (before: 5 usage lines)."""
  status, err = launch_inproc(args[0], *LOC, *args[1:])
  assert status == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
  assert err.startswith(f'launch/tpu.py {args[0]}: error: ')


def test_env_values_are_never_printed_and_a_bare_key_comes_from_here(gcloud, tmp_path):
  """--env values (tokens) are shown as *** in the dry run and in the commands a run echoes;
  the worker still gets them. ``--env KEY`` takes this machine's $KEY (out of the shell
  history). Before, both printed the token in full."""
  secret, other = 'hf_SECRET123', 's3cr"et \'2'
  args = ['run', *LOC, '--env', f'HF_TOKEN={secret}', '--env', 'OTHER', '--foreground',
          '--command', 'echo "$HF_TOKEN|$OTHER"']
  dry = gcloud.run(*args, '--dry-run', env={'OTHER': other})
  real = gcloud.run(*args, env={'OTHER': other})
  for shown in (dry.stdout, real.stderr):
    assert 'export HF_TOKEN=***;' in shown and 'export OTHER=***;' in shown, shown
    assert secret not in shown and 's3cr' not in shown
  proc = _as_worker(_script(gcloud.argvs()[0]), _fake_worker_home(tmp_path))
  assert proc.stdout == f'{secret}|{other}\n', proc.stderr
