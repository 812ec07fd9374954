"""What the benchmark scripts share: the machine facts every JSON records, the machine's roofline
(matmul peak and weight-streaming bandwidth, measured in the running process; the FLOP counts
are ``jaxrl_ga.flops``'s), the XLA ops a call
ran (a jax.profiler trace), random GRPO micro-batches, a blocking timer and the JSON writer, and
``run``: absl's ``app.run`` with the project's rule for bad input (one ``error:`` line, status 2).
Imported by the scripts in this directory, which run as ``python benchmarks/NAME.py``."""

import dataclasses
import datetime
import glob
import gzip
import importlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


class BadInput(Exception):
  """A bad flag value, or a package the benchmark needs that is missing: :func:`run` prints it as
  one ``error:`` line and exits with status 2, before any work."""


def run(main) -> None:
  """``app.run(main)``, where an unknown or malformed flag, ``app.UsageError`` or
  :class:`BadInput` is one ``error: ...`` line on stderr and exit status 2 (absl alone prints
  the usage block and exits 1); ``--help`` works as absl's."""
  # lazy: this module imports only the standard library at import
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  def refuse(message) -> None:
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      refuse(e)

  def body(argv):
    try:
      return main(argv)
    except (BadInput, app.UsageError) as e:
      refuse(e)

  app.run(body, flags_parser=parse)


def optional_module(name: str):
  """The module ``name``, or None when it is not installed (a peer's package: torch, trl),
  so that ``--help`` and flag errors work without it; :func:`require` then refuses to run."""
  try:
    return importlib.import_module(name)
  except ImportError:
    return None


def require(**modules) -> None:
  """BadInput naming the modules (name=module) that :func:`optional_module` did not find."""
  missing = [name for name, module in modules.items() if module is None]
  if missing:
    raise BadInput(f'this benchmark needs {", ".join(missing)} (the peers\' side), not installed '
                   f'here: pip install -e \'.[bench]\' (torch==2.13.0 for a CPU build), in a '
                   f'virtualenv of its own.')


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What reuse_freed_memory() set (recorded by machine_info); {} when it was off or not called.
_MALLOC_SETTINGS: dict = {}

SYSTEM_MALLOC_HELP = (
    'Keep glibc\'s malloc defaults. Without it the script sets malloc to keep freed memory for '
    'reuse in this process, for both sides (jaxrl_ga.host_memory.reuse_freed_memory, as the CLI '
    'does on a CPU host), at import, before torch and JAX start their threads.')


def reuse_freed_memory(argv: list[str]) -> dict:
  """``jaxrl_ga.host_memory.reuse_freed_memory()`` unless argv has the scripts' ``--system_malloc``.
  It has to run at import, before torch and JAX start threads and before absl parses the flags,
  so it reads argv; the script still defines the flag (``SYSTEM_MALLOC_HELP``) for absl."""
  if {'--system_malloc', '--system_malloc=true', '--system_malloc=True'} & set(argv):
    return {}
  from jaxrl_ga import host_memory  # pylint: disable=g-import-not-at-top
  _MALLOC_SETTINGS.update(host_memory.reuse_freed_memory())
  return dict(_MALLOC_SETTINGS)


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
          'load_avg_start': os.getloadavg(), 'malloc_reuse_freed_memory': dict(_MALLOC_SETTINGS),
          **git_state(), **extra}


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


def grpo_programs(model, mesh, param_shardings, *, micro_batch_size: int, prompt_length: int,
                  completion_length: int, grad_accum_steps: int, loss=None, optimizer=None,
                  lazy_inner: bool = True, **settings):
  """The GRPO stage's programs (``jaxrl_ga.programs.build_grpo_programs``, the trainer's) for
  ``model`` (a ``ModelConfig``) on ``mesh`` with ``param_shardings`` (``sharding.init_params``'
  third value): micro-batches of ``micro_batch_size`` rows of
  ``prompt_length`` + ``completion_length`` tokens (``random_grpo_batch``'s shapes), K =
  ``grad_accum_steps``, S = mu = 1, G = 1 (no rows share a prompt), no KL term, the forward's
  knobs fixed (layers scanned, remat 'none', no log-prob chunks, einsum attention, no shared
  prompt forward). ``loss``, ``optimizer``: a ``GRPOLossConfig``, an ``OptimizerConfig`` (default:
  the config's); ``lazy_inner``: build_grpo_programs'; ``settings``: dotted config overrides on
  top (``'model.scan_layers': False``). A benchmark takes its jitted steps from ``.table``
  ('learner': the micro-step, its abstract arguments) and its starting state from
  ``.init_state(params)``."""
  from jaxrl_ga import api, config, programs  # pylint: disable=g-import-not-at-top
  overrides = {
      'stages': 'grpo', 'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 1,
      'model.scan_layers': True, 'model.remat': 'none', 'model.logprob_chunk_size': 0,
      'model.attention': 'einsum', 'model.share_prompt_prefix': False,
      'grpo.schedule.micro_batch_size': micro_batch_size, 'grpo.schedule.num_generations': 1,
      'grpo.schedule.steps_per_generation': 1, 'grpo.schedule.num_iterations': 1,
      'grpo.schedule.grad_accum_steps': grad_accum_steps,
      'grpo.sampling.max_prompt_length': prompt_length,
      'grpo.sampling.max_completion_length': completion_length}
  for key, value in (('grpo.loss', loss), ('grpo.optimizer', optimizer)):
    if value is not None:
      overrides[key] = config.settings_dict(value)
  overrides.update({'grpo.loss.beta': 0.0, **settings})  # no reference log-probs in the batch
  cfg = api.make_config(None, **overrides)
  return programs.build_grpo_programs(cfg, model, mesh, param_shardings,
                                      eos_id=model.vocab_size, pad_id=0, lazy_inner=lazy_inner)


def load_on_one_device(source: str):
  """``policy.load_model(source)`` placed on a one-device mesh with the trainer's param shardings
  (what the programs' builders take). -> (model config, graphdef, params, mesh, shardings)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import sharding  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import MeshConfig  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import policy  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  held = {}

  def shardings_fn(shapes, axes):
    held['shardings'] = sharding.param_shardings(shapes, axes, mesh)
    return held['shardings']

  model_cfg, graphdef, params = policy.load_model(source, shardings_fn=shardings_fn)
  return model_cfg, graphdef, params, mesh, held['shardings']


@dataclasses.dataclass(frozen=True)
class Size:
  """A model and the learner micro-batch shape a script times it at (B x (prompt + completion)),
  with its timed rounds."""
  name: str
  model: Any  # jaxrl_ga.models.transformer.ModelConfig
  micro_batch_size: int
  prompt_length: int
  completion_length: int
  rounds: int

  @property
  def tokens(self) -> int:
    return self.micro_batch_size * (self.prompt_length + self.completion_length)


def param_count(params) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return sum(int(x.size) for x in jax.tree.leaves(params))


def timed(fn, *args):
  """-> (fn(*args) with its arrays ready, wall seconds)."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


# FLOPs: jaxrl_ga.flops, the FLOP model jaxrl_ga.plan uses too.


# The 'big' model several scripts run (d=512, 8 layers, MLP 1536, 8 heads of 64): one definition.
BIG_MODEL_FLAGS = ('big_hidden_size', 'big_layers', 'big_intermediate_size', 'big_heads',
                   'big_kv_heads')


def define_big_model_flags(**defaults: int):
  """Defines the big model's size flags (``BIG_MODEL_FLAGS``) for a script; ``defaults``
  (``ModelConfig`` field -> value) replace the d=512 model's for a script that runs another by
  default. -> a function that gives, once the flags are parsed, its ``ModelConfig`` size fields."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  fields = (('hidden_size', 512, 'hidden size'), ('num_hidden_layers', 8, 'decoder layers'),
            ('intermediate_size', 1536, 'MLP width'), ('num_attention_heads', 8, 'attention heads'),
            ('num_key_value_heads', 8, 'key/value heads'))
  unknown = set(defaults) - {field for field, _, _ in fields}
  if unknown:
    raise ValueError(f'define_big_model_flags: no size flag for {sorted(unknown)}.')
  holders = {field: flags.DEFINE_integer(name, defaults.get(field, default), f'Big model: {what}.')
             for name, (field, default, what) in zip(BIG_MODEL_FLAGS, fields)}
  return lambda: {field: holder.value for field, holder in holders.items()}


def kv_cache_bytes(m, rows: int, positions: float, itemsize: int = 4) -> float:
  """Bytes of keys and values of ``positions`` cache slots for ``rows`` rows, every layer: what
  one decode step's attention reads when it attends over that many slots."""
  return 2 * m.num_hidden_layers * rows * m.num_key_value_heads * m.head_size * positions * \
      itemsize


# -- the roofline: matmul peak and weight-streaming bandwidth, measured in this process ------------
def peak_matmul_fn(n: int = 2048):
  """(fn, args, flops): one jitted float32 ``[n, n] @ [n, n]`` (2 n^3 FLOPs), the machine's
  matmul peak. ``fn(*args)`` returns the product (block on it to time it)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
  return jax.jit(jnp.matmul), (a, b), 2 * n ** 3


class Roofline:
  """The two rates a step is bounded by, measured with jitted float32 XLA programs in this
  process (so under the load the timings of the same run see):

    * ``peak_flops_per_s``: the matmul peak, ``[n, n] @ [n, n]`` (``peak_matmul_fn``), 2 n^3 /
      the best of ``reps`` calls;
    * ``bandwidth_bytes_per_s``: the rate weights can be streamed from memory: ``count`` distinct
      float32 ``[d, f]`` matrices (``count * d * f * 4`` bytes, several times the last-level
      cache, so every matrix is read cold: the others evicted it since its last read), read by
      one jitted program in two ways, each the best of ``reps`` calls: ``stream_matmul`` = the
      skinny products ``[rows, d] @ [d, f]`` with every matrix (what a decode step does with
      its weights), ``stream_sum`` = the sum of every matrix's elements (a plain read). The
      bandwidth is the larger of the two: the best weight-read rate seen.

  ``measure()`` takes one sample of each (call it in every round of a benchmark, interleaved
  with the timed calls); ``summary()`` gives the medians over the samples, the numbers the
  bounds use, with the samples. Defaults: n = 2048 (17.2 GFLOP), d x f = 512 x 1536 (a d=512
  model's MLP matrix), 128 matrices = 403 MB, rows = 8.
  """

  def __init__(self, n: int = 2048, d: int = 512, f: int = 1536, count: int = 128, rows: int = 8,
               reps: int = 3):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    self.n, self.d, self.f, self.count, self.rows, self.reps = n, d, f, count, rows, reps
    self._peak, self._peak_args, self.peak_flops = peak_matmul_fn(n)
    key = jax.random.key(3)
    self._ws = [jax.random.normal(jax.random.fold_in(key, i), (d, f), jnp.float32)
                for i in range(count)]
    self._x = jax.random.normal(jax.random.fold_in(key, count), (rows, d), jnp.float32)
    self.stream_bytes = count * d * f * 4
    self._stream_matmul = jax.jit(lambda x, ws: [x @ w for w in ws])
    self._stream_sum = jax.jit(lambda ws: [jnp.sum(w) for w in ws])
    self.samples: list[dict] = []
    self.measure()  # compiles the three programs; the first sample is dropped
    self.samples = []

  def _best(self, fn, *args) -> float:
    best = float('inf')
    for _ in range(self.reps):
      best = min(best, timed(fn, *args)[1])
    return best

  def measure(self) -> dict:
    """One sample: {'peak_flops_per_s', 'stream_matmul_bytes_per_s', 'stream_sum_bytes_per_s',
    'bandwidth_bytes_per_s'} (each the best of ``reps`` calls)."""
    mm = self.stream_bytes / self._best(self._stream_matmul, self._x, self._ws)
    sm = self.stream_bytes / self._best(self._stream_sum, self._ws)
    s = {'peak_flops_per_s': self.peak_flops / self._best(self._peak, *self._peak_args),
         'stream_matmul_bytes_per_s': mm, 'stream_sum_bytes_per_s': sm,
         'bandwidth_bytes_per_s': max(mm, sm), 'load_avg_1min': os.getloadavg()[0]}
    self.samples.append(s)
    return s

  def summary(self) -> dict:
    """Medians over the samples (``measure()`` is called first if there are none), the settings
    and the samples."""
    if not self.samples:
      self.measure()
    keys = ('peak_flops_per_s', 'stream_matmul_bytes_per_s', 'stream_sum_bytes_per_s',
            'bandwidth_bytes_per_s')
    return {**{k: statistics.median(s[k] for s in self.samples) for k in keys},
            'settings': {'peak_matmul_n': self.n, 'stream_matrix': [self.d, self.f],
                         'stream_matrices': self.count, 'stream_bytes': self.stream_bytes,
                         'stream_matmul_rows': self.rows, 'reps_per_sample': self.reps},
            'samples': self.samples}


def roofline_text(r: dict) -> str:
  """One line for a script's output: the measured peak and bandwidth."""
  return (f"matmul peak {r['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, weight streaming "
          f"{r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (skinny matmul "
          f"{r['stream_matmul_bytes_per_s'] / 1e9:.1f}, "
          f"sum {r['stream_sum_bytes_per_s'] / 1e9:.1f});"
          f" medians of {len(r['samples'])} samples")


def trl_grpo_settings(cfg) -> dict:
  """TRL ``GRPOConfig`` arguments for the GRPO settings of a jaxrl_ga ``RunConfig`` ``cfg``: the
  schedule (B, G, S, mu, K), the completion length, sampling, the loss (beta, clipping, TRL's
  loss_type for the aggregation), the advantage scaling, the reward weights and AdamW at a
  constant rate. Each script adds its own device, logging and step-count settings."""
  from jaxrl_ga import tasks  # pylint: disable=g-import-not-at-top  (no JAX)
  g = cfg.grpo
  sched, sampling, loss = g.schedule, g.sampling, g.loss
  task = tasks.get_task(cfg.task.name, **dict(cfg.task.options))
  return dict(
      per_device_train_batch_size=sched.micro_batch_size,
      num_generations=sched.num_generations,
      steps_per_generation=sched.steps_per_generation,
      num_iterations=sched.num_iterations,
      gradient_accumulation_steps=sched.grad_accum_steps,
      max_completion_length=sampling.max_completion_length,
      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
      beta=loss.beta, epsilon=loss.epsilon_low, epsilon_high=loss.epsilon_high,
      loss_type={'token': 'dapo', 'sequence': 'grpo', 'constant': 'dr_grpo'}[loss.aggregation],
      scale_rewards=g.advantage.scale_rewards,
      reward_weights=[r.weight for r in task.reward_functions()],
      learning_rate=g.optimizer.learning_rate, lr_scheduler_type='constant',
      weight_decay=g.optimizer.weight_decay, max_grad_norm=g.optimizer.max_grad_norm,
      adam_beta1=g.optimizer.b1, adam_beta2=g.optimizer.b2, adam_epsilon=g.optimizer.eps,
      seed=cfg.seed, shuffle_dataset=False)


def write_json(path: str, payload: dict, default=str) -> None:
  """Writes a script's results (its directory created) and says where; ``default`` converts what
  json cannot (as json.dump's)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(payload, f, indent=1, default=default)
  print(f'wrote {path}')
