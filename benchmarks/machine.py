"""What the benchmark scripts share: the machine facts every JSON records, the XLA ops a call ran
(a jax.profiler trace), random GRPO micro-batches, a blocking timer and the JSON writer.
Imported by the scripts in this directory, which run as ``python benchmarks/NAME.py``."""

import datetime
import glob
import gzip
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'transformers', 'torch', 'trl',
             'accelerate')


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      return next(l.split(':', 1)[1].strip() for l in f if l.startswith('model name'))
  except (OSError, StopIteration):
    return platform.processor()


def git_state() -> dict:
  """The commit and the locally modified files of the checkout being measured."""
  def git(*args):
    try:
      return subprocess.run(['git', *args], cwd=_REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      return None
  status = git('status', '--short')
  return {'git_commit': git('rev-parse', 'HEAD'),
          'git_modified': status.splitlines() if status else []}


def machine_info(**extra) -> dict:
  """Date (UTC), CPU, cores, memory, Python and package versions, JAX's devices, the git commit,
  the load average now; ``extra`` entries are added (a script's own settings)."""
  import jax  # pylint: disable=g-import-not-at-top
  versions = {}
  for name in _PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  try:
    with open('/proc/meminfo', encoding='utf-8') as f:
      mem_gib = next(int(l.split()[1]) for l in f if l.startswith('MemTotal')) / 2**20
  except (OSError, StopIteration):
    mem_gib = None
  dev = jax.devices()[0]
  return {'date_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'hostname': platform.node(), 'cpu_model': cpu_model(), 'cpu_count': os.cpu_count(),
          'cpus_usable': len(os.sched_getaffinity(0)), 'mem_total_gib': mem_gib,
          'python': platform.python_version(), **versions,
          'device': f'{dev.platform}:{dev.device_kind}', 'device_count': jax.device_count(),
          'load_avg_start': os.getloadavg(), **git_state(), **extra}


# Trace events that are not XLA ops, or that contain other ops (loops, conditionals).
_NOT_OPS = re.compile(r'^(\$|ThunkExecutor|ThreadpoolListener|PjitFunction|SlinkyThreadPool|'
                      r'Common|while|conditional|call|end: )')


def traced_ops(run, reps: int) -> tuple[float, list[tuple[str, str, float]]]:
  """Traces ``reps`` calls of ``run()`` with jax.profiler. -> (wall s per call (traced), the XLA
  op executions as (name, name without its numeric suffix, ms))."""
  import jax  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:
    t0 = time.perf_counter()
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(reps):
        run()
    wall = (time.perf_counter() - t0) / reps
    (path,) = glob.glob(os.path.join(d, '**', 'perfetto_trace.json.gz'), recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)
  events = events['traceEvents'] if isinstance(events, dict) else events
  return wall, [(e['name'], re.sub(r'(\.\d+)+$', '', e['name']), e.get('dur', 0) / 1e3)
                for e in events if e.get('ph') == 'X' and not _NOT_OPS.match(e['name'])]


def random_grpo_batch(rng, b: int, tp: int, tc: int, vocab: int, nonfinite: bool = False) -> dict:
  """One on-policy GRPO micro-batch (numpy) with ragged prompts (left-padded, 1..tp tokens) and
  completions (right-padded, 1..tc tokens); ``nonfinite`` puts a NaN in one advantage."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  prompt_len = rng.integers(1, tp + 1, size=b)
  comp_len = rng.integers(1, tc + 1, size=b)
  prompt_mask = (np.arange(tp)[None] >= tp - prompt_len[:, None]).astype(np.int32)
  comp_mask = (np.arange(tc)[None] < comp_len[:, None]).astype(np.int32)
  batch = dict(
      prompt_tokens=rng.integers(0, vocab, (b, tp)).astype(np.int32) * prompt_mask,
      prompt_mask=prompt_mask,
      completion_tokens=rng.integers(0, vocab, (b, tc)).astype(np.int32) * comp_mask,
      completion_mask=comp_mask, advantages=rng.normal(size=b).astype(np.float32),
      old_logps=np.zeros((b, tc), np.float32), has_old=np.zeros((b,), bool))
  if nonfinite:
    batch['advantages'][0] = np.nan
  return batch


def param_count(params) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return sum(int(x.size) for x in jax.tree.leaves(params))


def timed(fn, *args):
  """-> (fn(*args) with its arrays ready, wall seconds)."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def write_json(path: str, payload: dict, default=str) -> None:
  """Writes a script's results (its directory created) and says where; ``default`` converts what
  json cannot (as json.dump's)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(payload, f, indent=1, default=default)
  print(f'wrote {path}')
