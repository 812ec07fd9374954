"""Helpers shared by test files (instead of tests importing each other's private functions)."""

import functools
import os
import re

from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
import jax
import numpy as np


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def xla_flags(devices: int = 8) -> str:
  """conftest.py's XLA_FLAGS with ``devices`` simulated CPU devices: the XLA_FLAGS of a
  subprocess a test starts."""
  drop = ('--xla_force_host_platform_device_count',)
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith(drop)]
  return ' '.join([f'--xla_force_host_platform_device_count={devices}', *flags])


def fixture_dir(name: str) -> str:
  """tests/fixtures/<name>: a tiny HF checkpoint written by a fixture script."""
  return os.path.join(FIXTURES, name)


@functools.cache
def reference_arrays(name: str) -> dict:
  """The transformers reference outputs stored with a checkpoint fixture
  (reference_logits.npz: logits, greedy tokens, ...)."""
  with np.load(os.path.join(fixture_dir(name), 'reference_logits.npz')) as f:
    return dict(f)


def shared_prompt_case(name: str, share: int = 2) -> tuple[np.ndarray, ...]:
  """A fixture's left-padded prompts, each repeated ``share`` times, with HF's greedy tokens as
  completions: (prompt, prompt_mask, completion, want), ``want`` the transformers float64
  log-probs of those completion tokens, the reference of the shared-prompt log-prob tests."""
  ref = reference_arrays(name)
  rows = lambda x: np.repeat(x, share, axis=0)
  prompt, prompt_mask, greedy = rows(ref['left_tokens']), rows(ref['left_mask']), rows(
      ref['greedy_tokens'])
  logits = rows(ref['greedy_logits'][:, prompt.shape[1] - 1:-1]).astype(np.float64)
  logps = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return prompt, prompt_mask, greedy, np.take_along_axis(logps, greedy[..., None], -1)[..., 0]


def assert_trees_equal(got, want) -> None:
  """Bitwise equality of two pytrees of arrays."""
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
               want)


def run_grpo_in_pieces(make_trainer, workdir, stops, total_micro_steps: int):
  """``make_trainer(workdir) -> (grpo.GRPOLoop, params)`` run stopped after each micro-step of
  ``stops``, then to the end, each run a fresh trainer resuming from the last one's checkpoint;
  asserts that each resumed where the last stopped and ran only the micro-steps left.
  -> (params, summary) of the last run."""
  previous = 0
  for stop in (*stops, None):
    trainer, params = make_trainer(workdir)
    got, summary = trainer.run(params, stop_at_micro_step=stop)
    assert summary['grpo/resumed_from_micro_step'] == previous
    assert summary['grpo/micro_steps_this_run'] == (stop or total_micro_steps) - previous
    previous = stop
  return got, summary


class FakeGCS(MemoryFileSystem):
  """Cloud Storage in memory (conftest's ``fake_gcs`` registers it for gs://): no appends, a
  compose (``merge``), and the bytes of every upload counted."""
  protocol = ('gcs', 'gs')
  store = {}
  pseudo_dirs = ['']
  uploaded = []  # bytes of every write call the client sends

  def open(self, path, mode='rb', **kwargs):
    if 'a' in mode:  # as Cloud Storage: objects cannot be appended to
      raise NotImplementedError('append is not supported')
    f = super().open(path, mode, **kwargs)
    if 'w' in mode or 'x' in mode:
      write = f.write

      def counted(data):
        FakeGCS.uploaded.append(len(data))
        return write(data)

      f.write = counted
    return f

  def merge(self, path, paths, acl=None):
    """gcsfs's compose: the concatenation of ``paths`` becomes ``path``, server-side (no bytes
    are uploaded)."""
    del acl
    data = b''.join(self.cat_file(p) for p in paths)
    key = self._strip_protocol(path)
    self.store[key] = MemoryFile(self, key, data)


# -- the TPU plan tests (tests/test_plan.py, tests/test_plan_tpu_knobs.py) ------------------------
# prompt and completion lengths (the config's: 320, 512); no weight has these dims
TPU_TP, TPU_TC = 48, 96


def require_libtpu() -> None:
  """Fails (does not skip) without libtpu: the test extra installs it."""
  import pytest  # pylint: disable=g-import-not-at-top
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pytest.fail("libtpu is missing: the test extra installs it (pip install -e '.[test]').")


def pinned_to_one_core():
  """A module fixture's body (``yield from``): this thread, and the threads it starts meanwhile
  (libtpu's compiler pool, started at its first topology), on one core, the xdist worker's own
  (gw0 the first core, gw1 the second, ...), restored after. libtpu spreads a compile over
  every core, which on CI's 2 cores, beside the other worker, costs more CPU than it saves time:
  tests/test_plan.py and tests/test_plan_tpu_knobs.py with ``-n 2 --dist loadfile`` took 369 and
  344 CPU s (216 and 209 s) pinned, 409 and 412 (230 and 234 s) not, 2026-11-28. jax's CPU
  backend starts first, unpinned (its threads keep every core)."""
  if not hasattr(os, 'sched_setaffinity'):  # not Linux: as it is
    yield
    return
  jax.devices('cpu')
  cores = sorted(os.sched_getaffinity(0))
  worker = os.environ.get('PYTEST_XDIST_WORKER', 'gw0')
  index = int(worker[2:]) if worker[2:].isdigit() else 0
  os.sched_setaffinity(0, {cores[index % len(cores)]})
  try:
    yield
  finally:
    os.sched_setaffinity(0, cores)


def tpu_plan_config(**model):
  """configs/grpo_gsm8k_tpu.py:v5e-8 (Qwen2.5-0.5B's shapes) at 2 layers, no remat, no log-prob
  chunking, the einsum attention, TPU_TP + TPU_TC positions; ``model`` overrides model.* ->
  RunConfig. The einsum, not 'auto' (the splash kernel on TPU): under the suite's matmul
  precision 'highest' (conftest.py) Mosaic cannot compile the kernel's bfloat16 products ("Bad
  lhs type"), so its tests lower it without compiling."""
  from jaxrl_ga.config import (  # pylint: disable=g-import-not-at-top
      RunConfig, from_mapping, load_config_file)
  c = load_config_file(os.path.join(ROOT, 'configs', 'grpo_gsm8k_tpu.py'), 'v5e-8')
  c.model.update(**{'num_hidden_layers': 2, 'remat': 'none', 'logprob_chunk_size': 0,
                    'attention': 'einsum', **model})
  c.grpo.sampling.update(max_prompt_length=TPU_TP, max_completion_length=TPU_TC)
  return from_mapping(RunConfig, c.to_dict())


def activation_all_reduces(hlo: str, dims) -> list[str]:
  """all-reduce instructions of an HLO module whose shape has one of ``dims`` (sequence
  lengths: only activations have them)."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r'=\s*(\(?[^=]*?)\s+all-reduce(?:-start)?\(', line)
    if not m:
      continue
    shapes = re.findall(r'\[([\d,]*)\]', m.group(1))  # dims only, not the {layout} tiles
    if any(int(d) in dims for shape in shapes for d in shape.split(',') if d):
      out.append(line.strip()[:200])
  return out
