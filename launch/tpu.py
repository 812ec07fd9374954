#!/usr/bin/env python3
r"""Cloud TPU VM launcher for jaxrl_ga: create, set up, run on every worker, logs, checkpoints.

  python launch/tpu.py create --accelerator-type=v5litepod-8 --name=rl --zone=us-west4-a \
      --project=my-proj
  python launch/tpu.py setup  --name=rl --zone=us-west4-a --project=my-proj
  python launch/tpu.py run    --name=rl --zone=us-west4-a --project=my-proj -- \
      python -m jaxrl_ga.main --config=configs/grpo_gsm8k_tpu.py:v5e-8 --workdir=/home/me/runs/g
  python launch/tpu.py logs   --name=rl --zone=us-west4-a --project=my-proj --follow
  python launch/tpu.py delete --name=rl --zone=us-west4-a --project=my-proj

Every subcommand builds ``gcloud`` argument lists and runs them without a shell
(``subprocess.run(argv)``), so no local shell ever re-reads a value. What the remote shell of a
worker must read (the ``--command`` of ``gcloud compute tpus tpu-vm ssh``) is assembled with
``shlex.quote``: a user command with spaces, quotes, ``$`` or ``;`` reaches the worker's shell as
one word and runs there exactly as typed. ``--dry-run`` prints the commands, one per line, as a
shell script (``shlex.join``; local steps as ``#`` comments) and runs nothing.

``--name``, ``--zone`` and ``--project`` default to the environment variables TPU_NAME,
TPU_ZONE and TPU_PROJECT. Standard library only: it runs wherever ``gcloud`` does.

On the workers: the code in ~/jaxrl_ga, a Python >= 3.11 virtual environment (made by ``uv``; the
TPU images ship Python 3.10, which current jax does not support) in ~/jaxrl_ga_venv, logs in
~/logs/<log-name>.<hostname>.log (one per worker: hostnames end in -w-<worker index>).
See launch/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional, Sequence

# -- accelerator shapes ---------------------------------------------------------------------------
# generation -> (accelerator-type prefix, valid sizes (the number after the dash), default runtime
# image, what the number counts, chips per jax device). v4 and v5p count TensorCores (2 per chip,
# one jax device per chip: megacore); v5e and v6e count chips.
_V5P_SIZES = (8, 16, 32, 64) + tuple(range(128, 12288 + 1, 128))
GENERATIONS = {
    'v4': ('v4', (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096), 'tpu-ubuntu2204-base',
           'TensorCores', 2),
    'v5e': ('v5litepod', (1, 4, 8, 16, 32, 64, 128, 256), 'v2-alpha-tpuv5-lite', 'chips', 1),
    'v5p': ('v5p', _V5P_SIZES, 'v2-alpha-tpuv5', 'TensorCores', 2),
    'v6e': ('v6e', (1, 4, 8, 16, 32, 64, 128, 256), 'v2-alpha-tpuv6e', 'chips', 1),
}
_PREFIX_TO_GEN = {prefix: gen for gen, (prefix, *_) in GENERATIONS.items()}
_PREFIX_TO_GEN['v5e'] = 'v5e'  # alias: v5e-8 means v5litepod-8
ACCELERATOR_EXAMPLES = ('v4-8, v4-32, v5litepod-8 (or v5e-8), v5litepod-16, v5p-8, v5p-128, '
                        'v6e-8, v6e-64')

# -- worker layout -------------------------------------------------------------------------------
REMOTE_CODE = '$HOME/jaxrl_ga'
REMOTE_VENV = '$HOME/jaxrl_ga_venv'
REMOTE_LOGS = '$HOME/logs'
REMOTE_TARBALL = 'jaxrl_ga.tar.gz'  # scp destination, relative to the worker's home directory
UV_INSTALL_URL = 'https://astral.sh/uv/install.sh'

_NAME_RE = re.compile(r'^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$')
_ZONE_RE = re.compile(r'^[a-z]+-[a-z]+[0-9]+-[a-z]$')
_PROJECT_RE = re.compile(r'^([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$')
_LOG_NAME_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9._-]*$')
_ENV_KEY_RE = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
_EXTRAS_RE = re.compile(r'^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$')
_PYTHON_RE = re.compile(r'^3\.[0-9]+(\.[0-9]+)?$')
MIN_PYTHON_MINOR = 11  # setup.py's python_requires: jax 0.10's


class LaunchError(Exception):
  """A bad input; the message names the flag and how to fix it."""


def parse_accelerator(value: str) -> tuple[str, str, int]:
  """'v5e-8' -> ('v5e', 'v5litepod-8', 8 jax devices). Raises LaunchError listing valid types."""
  match = re.fullmatch(r'(v4|v5e|v5litepod|v5p|v6e)-([0-9]+)', value.strip().lower())
  if match:
    gen = _PREFIX_TO_GEN[match.group(1)]
    prefix, sizes, _, unit, per_device = GENERATIONS[gen]
    size = int(match.group(2))
    if size in sizes:
      return gen, f'{prefix}-{size}', size // per_device
    shown = ', '.join(str(s) for s in sizes[:12]) + (', ...' if len(sizes) > 12 else '')
    raise LaunchError(
        f'--accelerator-type={value!r}: {gen} has no slice of {size} {unit}; valid sizes: '
        f'{shown} ({prefix}-N). Or pass --skip-accelerator-check to hand the value to gcloud '
        f'unchecked.')
  raise LaunchError(
      f'--accelerator-type={value!r} is not a known TPU type; use <generation>-<size> with '
      f'generation v4, v5litepod (alias v5e), v5p or v6e, e.g. {ACCELERATOR_EXAMPLES}. Or pass '
      f'--skip-accelerator-check to hand the value to gcloud unchecked.')


def default_runtime(accelerator_type: str) -> Optional[str]:
  for prefix, gen in _PREFIX_TO_GEN.items():
    if accelerator_type.startswith(prefix + '-'):
      return GENERATIONS[gen][2]
  return None


# -- remote shell snippets -----------------------------------------------------------------------
def remote_path(path: str) -> str:
  """A worker path for the remote shell: '~/x y' -> '"$HOME"/'x y'' (the remote $HOME expands;
  nothing else does)."""
  if path == '~':
    return '"$HOME"'
  if path.startswith('~/'):
    rest = path[2:]
    return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
  return shlex.quote(path)


def _env_pairs(env: Sequence[str]) -> list[tuple[str, str]]:
  """--env items as (KEY, VALUE): KEY=VALUE, or KEY alone for this machine's $KEY (a secret then
  stays out of the command line and the shell history)."""
  out = []
  for item in env:
    key, sep, value = item.partition('=')
    if not _ENV_KEY_RE.match(key):
      raise LaunchError(f'--env {item!r}: expected KEY=VALUE (or KEY, taken from this machine\'s '
                        f'environment) with KEY a shell variable name.')
    if not sep:
      if key not in os.environ:
        raise LaunchError(f'--env {key}: ${key} is not set here; set it, or give --env '
                          f'{key}=VALUE.')
      value = os.environ[key]
    out.append((key, value))
  return out


def _env_exports(env: Sequence[str]) -> list[str]:
  return [f'export {key}={shlex.quote(value)}' for key, value in _env_pairs(env)]


def masked(argv: Sequence[str], env: Sequence[str]) -> list[str]:
  """``argv`` with each --env value shown as *** (what is printed: a token must not reach a
  terminal, a CI log or a shared screen)."""
  exports = [(f'export {k}={shlex.quote(v)}', f'export {k}=***') for k, v in _env_pairs(env)]
  out = []
  for arg in argv:
    for secret, shown in exports:
      arg = arg.replace(secret, shown)
    out.append(arg)
  return out


def setup_script(extras: str, python: str, git_url: Optional[str], git_ref: Optional[str]) -> str:
  """The command every worker runs for `setup` (one line, POSIX sh)."""
  new = f'"{REMOTE_CODE}.new"'
  steps = [f'rm -rf {new}']
  if git_url:
    steps.append(f'git clone --quiet -- {shlex.quote(git_url)} {new}')
    if git_ref:
      steps.append(f'git -C {new} checkout --quiet {shlex.quote(git_ref)}')
  else:
    steps += [f'mkdir -p {new}', f'tar -xzf "$HOME/{REMOTE_TARBALL}" -C {new}',
              f'rm -f "$HOME/{REMOTE_TARBALL}"']
  steps += [
      f'rm -rf "{REMOTE_CODE}"', f'mv {new} "{REMOTE_CODE}"', f'mkdir -p "{REMOTE_LOGS}"',
      'export PATH="$HOME/.local/bin:$PATH"',
      '{ command -v uv >/dev/null || python3 -m pip install --user --quiet --upgrade uv || '
      f'curl -LsSf {UV_INSTALL_URL} | sh; }}',
      f'uv venv --quiet --allow-existing --python {python} "{REMOTE_VENV}"',
      f'uv pip install --quiet --python "{REMOTE_VENV}/bin/python" -e "{REMOTE_CODE}[{extras}]"',
      f'"{REMOTE_VENV}/bin/python" -c {shlex.quote(_SETUP_CHECK)}',
  ]
  return ' && '.join(steps)


# Imports only: touching the TPU backend on one worker of a pod slice would wait for the others.
_SETUP_CHECK = ('import socket, jax, jaxrl_ga; '
                'print(socket.gethostname(), "ready: jax", jax.__version__)')


def run_script(command: str, log_name: str, env: Sequence[str], foreground: bool) -> str:
  """`run`: the user's command, as one quoted word, under bash in ~/jaxrl_ga with the venv active;
  output appended to ~/logs/<log_name>.<hostname>.log; in a process group of its own whose id is
  kept in a pid file for `stop`. Detached (setsid nohup) unless ``foreground``; refused while a run
  of the same log name is alive on the worker."""
  word = shlex.quote(command)
  pre = [f'mkdir -p "{REMOTE_LOGS}"', f'cd "{REMOTE_CODE}"', f'. "{REMOTE_VENV}/bin/activate"']
  parts = [' && '.join(pre) + ' || exit 1'] + _env_exports(env) + [
      'h=$(hostname)', f'log="{REMOTE_LOGS}/{log_name}.$h.log"',
      f'pidf="{REMOTE_LOGS}/{log_name}.$h.pid"',
      # A run of this log name still alive: refused (its pid file, which `stop` reads, and its
      # log would be taken over).
      # (A leader that is a zombie, not yet reaped, has ended.)
      'p=$(cat "$pidf" 2>/dev/null); if [ -n "$p" ] && kill -0 -- "-$p" 2>/dev/null && '
      '[ "$(ps -o stat= -p "$p" | cut -c1)" != Z ]; then '
      f'echo "$h: a run with --log-name={log_name} is still running (process group $p); stop '
      'it first (launch/tpu.py stop) or give another --log-name" >&2; exit 1; fi']
  # sh records its own pid, which setsid made the id of a new process group (so `stop` can
  # signal the whole run), then execs bash on the command: pid file and command are passed as
  # arguments, never re-quoted. The log is appended to: a re-run (a resume) keeps the last one's.
  launch = f"sh -c 'echo $$ > \"$0\"; exec bash -c \"$1\"' \"$pidf\" {word}"
  if foreground:  # setsid -w waits and returns the command's status; Ctrl-C here leaves it running
    parts += [f'{{ setsid -w {launch} < /dev/null; echo $? > "$log.rc"; }} 2>&1 | tee -a "$log"',
              'exit "$(cat "$log.rc")"']
  else:
    parts += [f'setsid nohup {launch} >> "$log" 2>&1 < /dev/null &',
              'echo "$h: started in the background; log $log"']
  # `a & b` must not become `a &; b`: join with '; ' except after a trailing '&'.
  out = ''
  for part in parts:
    out += part + (' ' if part.endswith('&') else '; ')
  return out.rstrip('; ').rstrip()


def logs_script(log_name: str, lines: int, follow: bool) -> str:
  tail = f'tail -n {int(lines)}' + (' -F' if follow else '')
  sed = 'sed -u' if follow else 'sed'
  return (f'h=$(hostname); {tail} "{REMOTE_LOGS}/{log_name}.$h.log" 2>&1 | '
          f'{sed} "s/^/[$h] /"')


def stop_script(log_name: str, signal: str) -> str:
  pid = f'"{REMOTE_LOGS}/{log_name}.$h.pid"'
  return (f'h=$(hostname); if [ -f {pid} ]; then p=$(cat {pid}); '
          f'kill -s {signal} -- "-$p" && echo "$h: sent SIG{signal} to process group $p"; '
          f'else echo "$h: no pid file for log name {log_name}"; fi')


# -- gcloud argv ---------------------------------------------------------------------------------
def _loc(args) -> list[str]:
  return [f'--zone={args.zone}', f'--project={args.project}']


def ssh_argv(args, worker: str, script: str) -> list[str]:
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.name, *_loc(args),
          f'--worker={worker}', f'--command={script}']


def _queued_id(args) -> str:
  qid = args.queued_resource_id or args.name
  if not _NAME_RE.match(qid):
    raise LaunchError(f'--queued-resource-id={qid!r}: use lowercase letters, digits and "-", '
                      f'starting with a letter.')
  return qid


def create_commands(args) -> list[list[str]]:
  if args.skip_accelerator_check:
    accel = args.accelerator_type
  else:
    accel = parse_accelerator(args.accelerator_type)[1]
  version = args.version or default_runtime(accel)
  if not version:
    raise LaunchError(f'--version: no default runtime image for {accel!r}; pass --version.')
  if args.queued:
    argv = ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', _queued_id(args),
            f'--node-id={args.name}', *_loc(args), f'--accelerator-type={accel}',
            f'--runtime-version={version}']
    if args.spot:
      argv.append('--spot')
    if args.reserved:
      argv.append('--reserved')
    if args.valid_until_duration:
      argv.append(f'--valid-until-duration={args.valid_until_duration}')
  else:
    if args.valid_until_duration:
      raise LaunchError('--valid-until-duration needs --queued (a queued resource).')
    argv = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', args.name, *_loc(args),
            f'--accelerator-type={accel}', f'--version={version}']
    if args.spot:
      argv.append('--spot')
    if args.reserved:
      argv.append('--reserved')
  return [argv]


def tarball_path(name: str) -> str:
  return os.path.join(tempfile.gettempdir(), f'jaxrl_ga-{name}.tar.gz')


def setup_commands(args) -> list[list[str]]:
  if not _EXTRAS_RE.match(args.extras):
    raise LaunchError(f'--extras={args.extras!r}: expected a comma-separated list like tpu,data.')
  if not _PYTHON_RE.match(args.python):
    raise LaunchError(f'--python={args.python!r}: expected a version like 3.12.')
  if int(args.python.split('.')[1]) < MIN_PYTHON_MINOR:
    raise LaunchError(f'--python={args.python}: jax, flax, orbax and transformers need Python '
                      f'3.{MIN_PYTHON_MINOR} or newer; give e.g. --python=3.12.')
  if not args.git_url:
    repo_files(args.repo)  # not a git checkout: the same error as the real run, dry run or not
  if args.git_ref and not args.git_url:
    raise LaunchError('--git-ref needs --git-url.')
  for flag, value in (('--git-url', args.git_url), ('--git-ref', args.git_ref)):
    if value is not None and (not value or value.startswith('-')):
      raise LaunchError(f'{flag}={value!r}: must not be empty or start with "-".')
  cmds = []
  if not args.git_url:
    cmds.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball_path(args.name),
                 f'{args.name}:{REMOTE_TARBALL}', *_loc(args), f'--worker={args.worker}'])
  cmds.append(ssh_argv(args, args.worker,
                       setup_script(args.extras, args.python, args.git_url, args.git_ref)))
  return cmds


def run_commands(args) -> list[list[str]]:
  command = args.command
  if args.argv:
    if command:
      raise LaunchError('give the remote command either as --command or after --, not both.')
    command = shlex.join(args.argv)
  if not command or not command.strip():
    raise LaunchError('--command: nothing to run; pass --command "..." or the command after --.')
  return [ssh_argv(args, args.worker,
                   run_script(command, args.log_name, args.env, args.foreground))]


def logs_commands(args) -> list[list[str]]:
  if args.lines < 1:
    raise LaunchError(f'--lines={args.lines}: must be >= 1.')
  return [ssh_argv(args, args.worker, logs_script(args.log_name, args.lines, args.follow))]


def stop_commands(args) -> list[list[str]]:
  return [ssh_argv(args, args.worker, stop_script(args.log_name, args.signal))]


def _check_bucket(value: str, flag: str) -> None:
  if not value.startswith('gs://') or len(value) <= len('gs://'):
    raise LaunchError(f'{flag}={value!r}: expected a bucket path gs://BUCKET/PATH.')


def _ckpt_commands(args, src: str, dst: str, remote: str) -> list[list[str]]:
  """gcloud storage rsync --recursive SRC DST, here (--local) or on a worker; ``remote`` names
  the side ('src' or 'dst') that is a filesystem path."""
  if args.local:
    if remote == 'src':
      src = os.path.expanduser(src)
    else:
      dst = os.path.expanduser(dst)
    return [['gcloud', 'storage', 'rsync', '--recursive', src, dst]]
  if remote == 'src':
    script = f'gcloud storage rsync --recursive {remote_path(src)} {shlex.quote(dst)}'
  else:
    script = (f'mkdir -p {remote_path(dst)} && '
              f'gcloud storage rsync --recursive {shlex.quote(src)} {remote_path(dst)}')
  return [ssh_argv(args, args.worker, script)]


def _check_dir(value: str, flag: str) -> None:
  if not value or value.startswith('-') or value.startswith('gs://'):
    raise LaunchError(f'{flag}={value!r}: expected a directory path (not a bucket, not starting '
                      f'with "-"), e.g. ~/runs/gsm8k.')


def ckpt_upload_commands(args) -> list[list[str]]:
  _check_dir(args.src, '--src')
  _check_bucket(args.dest, '--dest')
  return _ckpt_commands(args, args.src, args.dest, 'src')


def ckpt_download_commands(args) -> list[list[str]]:
  _check_bucket(args.src, '--src')
  _check_dir(args.dest, '--dest')
  return _ckpt_commands(args, args.src, args.dest, 'dst')


def delete_commands(args) -> list[list[str]]:
  if args.queued:
    argv = ['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', _queued_id(args),
            *_loc(args), '--force']
  else:
    argv = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', args.name, *_loc(args)]
  if args.yes:
    argv.append('--quiet')
  return [argv]


def status_commands(args) -> list[list[str]]:
  if args.queued:
    return [['gcloud', 'compute', 'tpus', 'queued-resources', 'describe', _queued_id(args),
             *_loc(args)]]
  return [['gcloud', 'compute', 'tpus', 'tpu-vm', 'describe', args.name, *_loc(args)]]


# -- packing the working tree -------------------------------------------------------------------
def repo_files(repo: str) -> list[str]:
  """Tracked and untracked-but-not-ignored files of the working tree (uncommitted edits
  included; .git and ignored build outputs excluded)."""
  try:
    out = subprocess.run(['git', '-C', repo, 'ls-files', '-z', '--cached', '--others',
                          '--exclude-standard'], check=True, capture_output=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise LaunchError(f'--repo={repo!r} is not a git checkout ({e}); pass --repo=<checkout> or '
                      f'--git-url=<url> to clone on the workers instead.') from None
  names = sorted({n for n in out.decode().split('\0') if n})
  return [n for n in names if os.path.lexists(os.path.join(repo, n))]  # skip deleted files


def pack(repo: str, out_path: str) -> int:
  files = repo_files(repo)
  with tarfile.open(out_path, 'w:gz') as tar:
    for name in files:
      tar.add(os.path.join(repo, name), arcname=name, recursive=False)
  return len(files)


# -- CLI -----------------------------------------------------------------------------------------
def _worker(value: str) -> str:
  if value == 'all' or value.isdigit():
    return value
  raise argparse.ArgumentTypeError(f'{value!r}: use "all" or a worker index (0, 1, ...)')


def _log_name(value: str) -> str:
  if _LOG_NAME_RE.match(value):
    return value
  raise argparse.ArgumentTypeError(f'{value!r}: use letters, digits, ".", "_" and "-" only')


class _OneLineParser(argparse.ArgumentParser):
  """argparse's errors as one line (``prog: error: message``, status 2), without the usage block:
  the project's rule for bad input; --help still prints the usage."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def build_parser() -> argparse.ArgumentParser:
  parser = _OneLineParser(
      prog='launch/tpu.py', description=__doc__.split('\n\n')[0].strip(),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='--name/--zone/--project default to $TPU_NAME/$TPU_ZONE/$TPU_PROJECT. '
             'Every subcommand takes --dry-run. See launch/README.md.')
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument('--name', default=os.environ.get('TPU_NAME'),
                      help='TPU VM (node) name [$TPU_NAME]')
  common.add_argument('--zone', default=os.environ.get('TPU_ZONE'),
                      help='zone, e.g. us-central2-b [$TPU_ZONE]')
  common.add_argument('--project', default=os.environ.get('TPU_PROJECT'),
                      help='Google Cloud project id [$TPU_PROJECT]')
  common.add_argument('--dry-run', action='store_true',
                      help='print the commands (a shell script) and run nothing')
  queued = argparse.ArgumentParser(add_help=False)
  queued.add_argument('--queued', action='store_true',
                      help='a queued resource (gcloud compute tpus queued-resources)')
  queued.add_argument('--queued-resource-id', help='queued resource id (default: --name)')
  sub = parser.add_subparsers(dest='subcommand', required=True, metavar='SUBCOMMAND',
                              parser_class=_OneLineParser)

  def add(name, help_, parents=(), worker_default=None):
    p = sub.add_parser(name, help=help_, description=help_, parents=[common, *parents])
    if worker_default is not None:
      p.add_argument('--worker', type=_worker, default=worker_default,
                     help=f'"all" or a worker index (default: {worker_default})')
    return p

  p = add('create', 'Create a TPU VM slice, or request one as a queued resource (--queued).',
          [queued])
  p.add_argument('--accelerator-type', required=True,
                 help=f'e.g. {ACCELERATOR_EXAMPLES}')
  p.add_argument('--version', help='runtime image (default by generation: v4 '
                 'tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e '
                 'v2-alpha-tpuv6e)')
  p.add_argument('--spot', action='store_true', help='Spot capacity (preemptible, cheaper)')
  p.add_argument('--reserved', action='store_true', help='use reserved capacity')
  p.add_argument('--valid-until-duration',
                 help='give up a queued request after this long, e.g. 6h (--queued only)')
  p.add_argument('--skip-accelerator-check', action='store_true',
                 help='pass --accelerator-type to gcloud without checking it against the table')

  p = add('setup', 'Install jaxrl_ga on the workers: copy the working tree (or clone '
          '--git-url), make a venv, pip install -e ".[EXTRAS]".', worker_default='all')
  p.add_argument('--repo', default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 help='local checkout to copy (default: this one)')
  p.add_argument('--git-url', help='clone this URL on every worker instead of copying --repo')
  p.add_argument('--git-ref', help='branch, tag or commit to check out (with --git-url)')
  p.add_argument('--extras', default='tpu,data', help='setup.py extras (default: tpu,data)')
  p.add_argument('--python', default='3.12', help='venv Python version (default: 3.12)')

  p = add('run', 'Run a command on the workers (default all) in ~/jaxrl_ga with the venv '
          'active; detached, output to ~/logs/LOG_NAME.<hostname>.log.', worker_default='all')
  p.add_argument('--command', help='the command, one string (or give it after --)')
  p.add_argument('--log-name', type=_log_name, default='run', help='log file stem (default: run)')
  p.add_argument('--env', action='append', default=[], metavar='KEY[=VALUE]',
                 help='export this variable for the command (repeatable); KEY alone takes its '
                 'value from this machine\'s environment. Values are printed as ***')
  p.add_argument('--foreground', action='store_true',
                 help='wait for the command and stream its output (also logged)')
  p.add_argument('argv', nargs=argparse.REMAINDER, help='-- COMMAND ARGS... (instead of '
                 '--command; joined with shlex.join)')

  p = add('logs', 'Print (or --follow) the run logs of a worker or of all.', worker_default='all')
  p.add_argument('--log-name', type=_log_name, default='run')
  p.add_argument('--lines', type=int, default=100, help='last N lines (default: 100)')
  p.add_argument('--follow', action='store_true', help='keep following (tail -F); Ctrl-C stops')

  p = add('stop', 'Signal a detached run (its process group) on the workers; SIGTERM makes '
          'jaxrl_ga.main write a checkpoint and exit.', worker_default='all')
  p.add_argument('--log-name', type=_log_name, default='run')
  p.add_argument('--signal', default='TERM', choices=['TERM', 'INT', 'KILL'])

  for name, help_, src_help, dest_help, worker in (
      ('ckpt-upload', 'Sync a run directory of a worker (or, --local, of this machine) to a '
       'bucket: gcloud storage rsync --recursive.', 'run directory on the worker, e.g. '
       '~/runs/gsm8k (or local with --local)', 'gs://BUCKET/PATH', '0'),
      ('ckpt-download', 'Sync a bucket path to a directory on a worker (or, --local, on this '
       'machine): gcloud storage rsync --recursive.', 'gs://BUCKET/PATH', 'directory on the '
       'worker, e.g. ~/runs/gsm8k (or local with --local)', '0')):
    p = add(name, help_, worker_default=worker)
    p.add_argument('--src', required=True, help=src_help)
    p.add_argument('--dest', required=True, help=dest_help)
    p.add_argument('--local', action='store_true',
                   help='run gcloud storage here instead of on a worker (no TPU flags needed)')

  p = add('delete', 'Delete the TPU VM (or, --queued, the queued resource and its VM).',
          [queued])
  p.add_argument('--yes', action='store_true', help='do not ask (gcloud --quiet)')

  add('status', 'Describe the TPU VM (or, --queued, the queued resource).', [queued])
  return parser


_BUILDERS = {
    'create': create_commands, 'setup': setup_commands, 'run': run_commands,
    'logs': logs_commands, 'stop': stop_commands, 'ckpt-upload': ckpt_upload_commands,
    'ckpt-download': ckpt_download_commands, 'delete': delete_commands,
    'status': status_commands,
}


def _check_location(args) -> None:
  if getattr(args, 'local', False):
    return
  for flag, env, pattern, example in (
      ('name', 'TPU_NAME', _NAME_RE, 'my-tpu'), ('zone', 'TPU_ZONE', _ZONE_RE, 'us-central2-b'),
      ('project', 'TPU_PROJECT', _PROJECT_RE, 'my-project-123')):
    value = getattr(args, flag)
    if not value:
      raise LaunchError(f'--{flag} is required (or set ${env}), e.g. --{flag}={example}.')
    if not pattern.match(value):
      raise LaunchError(f'--{flag}={value!r} does not look like a {flag} (e.g. {example}).')


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.subcommand == 'run' and args.argv and args.argv[0] == '--':
    args.argv = args.argv[1:]
  try:
    _check_location(args)
    commands = _BUILDERS[args.subcommand](args)
  except LaunchError as e:
    parser.exit(2, f'{parser.prog} {args.subcommand}: error: {e}\n')
  packs = args.subcommand == 'setup' and not args.git_url
  notes: list[str] = []
  if args.subcommand == 'create' and not args.skip_accelerator_check:
    _, accel, devices = parse_accelerator(args.accelerator_type)
    notes.append(f'# {accel}: jax.device_count() will be {devices} (the mesh size product)')
  if args.dry_run:
    for note in notes:
      print(note)
    if packs:
      print(f'# local: pack the files of {args.repo} listed by `git ls-files --cached --others '
            f'--exclude-standard` into {tarball_path(args.name)}')
    for argv_ in commands:
      print(shlex.join(masked(argv_, getattr(args, 'env', []))))
    return 0
  gcloud = shutil.which('gcloud')
  if gcloud is None:
    parser.exit(2, f'{parser.prog}: error: gcloud is not on PATH; install the Google Cloud SDK '
                '(https://cloud.google.com/sdk) or use --dry-run to print the commands.\n')
  for note in notes:
    print(note, file=sys.stderr)
  tarball = None
  try:
    if packs:
      tarball = tarball_path(args.name)
      n = pack(args.repo, tarball)
      print(f'# packed {n} files of {args.repo} into {tarball}', file=sys.stderr)
    for argv_ in commands:
      print('+ ' + shlex.join(masked(argv_, getattr(args, 'env', []))), file=sys.stderr,
            flush=True)
      rc = subprocess.run([gcloud, *argv_[1:]], check=False).returncode
      if rc:
        print(f'{parser.prog}: gcloud exited with status {rc}', file=sys.stderr)
        return rc
  except LaunchError as e:
    parser.exit(2, f'{parser.prog} {args.subcommand}: error: {e}\n')
  except KeyboardInterrupt:
    return 130
  finally:
    if tarball and os.path.exists(tarball):
      os.remove(tarball)
  return 0


if __name__ == '__main__':
  sys.exit(main())
