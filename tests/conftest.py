"""Test set-up: 8 simulated CPU devices and cheap compiles, set before jax is imported anywhere."""

import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
# Smoke-size programs are compile-bound: XLA:CPU's cheap backend passes (no expensive LLVM
# passes, optimization level 0) take about a third off the suite's time, and XLA:CPU's classic
# elemental emitters in place of its MLIR fusion emitters (`xla_cpu_use_fusion_emitters`) about
# half of what is left, and code generation in one piece instead of split over threads that two
# workers on two cores do not have (`xla_cpu_parallel_codegen_split_count=1`) another ~14% of the
# CPU time; every test's tolerance still holds. Subprocesses get the same flags from
# helpers.xla_flags.
_FLAGS = ('--xla_force_host_platform_device_count=8', '--xla_backend_optimization_level=0',
          '--xla_llvm_disable_expensive_passes=true', '--xla_cpu_use_fusion_emitters=false',
          '--xla_cpu_parallel_codegen_split_count=1')
_given = os.environ.get('XLA_FLAGS', '').split()
os.environ['XLA_FLAGS'] = ' '.join(_given + [
    f for f in _FLAGS if f.split('=')[0] not in {g.split('=')[0] for g in _given}])

# One persistent compilation cache for this test session, shared by the subprocesses the tests
# start (CLI runs, multi-process runs, the notebook's kernel): they compile the same smoke-size
# step functions again and again. A fresh directory per session, so no run reuses another's.
# The process that makes the directory (pytest's, or xdist's controller) removes it at the end.
_OWN_CACHE_DIR = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  import tempfile  # noqa: E402
  _OWN_CACHE_DIR = tempfile.mkdtemp(prefix='jaxrl_ga_test_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _OWN_CACHE_DIR
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'

import jax  # noqa: E402  (after the environment is set)

jax.config.update('jax_default_matmul_precision', 'highest')


import logging  # noqa: E402

import pytest  # noqa: E402


class CompileLog(logging.Handler):
  """Counts XLA compilations by function name (from jax's compile log)."""

  def __init__(self):
    super().__init__(level=logging.DEBUG)
    self.names: list[str] = []

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith('Compiling '):
      self.names.append(msg.split()[1])  # e.g. 'jit(_micro_step)'

  def count(self, fn_name: str) -> int:
    return self.names.count(f'jit({fn_name})')


@pytest.fixture
def fake_pci(tmp_path):
  """fake_pci(['0x8086', '0x1ae0']) -> the root of a fake PCI bus (/sys/bus/pci/devices) with a
  device of each vendor id."""
  def make(vendors):
    root = tmp_path / f'pci{len(list(tmp_path.glob("pci*")))}'
    for i, v in enumerate(vendors):
      d = root / f'0000:00:{i:02x}.0'
      d.mkdir(parents=True)
      (d / 'vendor').write_text(v + '\n')
    return str(root)
  return make


@pytest.fixture
def fake_gcs(monkeypatch):
  """gs:// (and gcs://) as an in-memory bucket (helpers.FakeGCS); yields its object store."""
  import fsspec  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  helpers.FakeGCS.store.clear()
  helpers.FakeGCS.uploaded.clear()
  # Set as monkeypatch items so that the real gcsfs serves gs:// again after the test (a test that
  # checks gcsfs's own behaviour may run next in the same worker); register_implementation writes
  # this same dict and has no undo.
  registry = sys.modules[fsspec.get_filesystem_class.__module__]._registry
  for name in ('gcs', 'gs'):
    monkeypatch.setitem(registry, name, helpers.FakeGCS)
  monkeypatch.setenv('EPATH_USE_TF', 'false')
  yield helpers.FakeGCS.store
  helpers.FakeGCS.store.clear()


@pytest.fixture
def compile_log():
  """Yields a CompileLog; compile logging is on only inside the test."""
  log = CompileLog()
  logger = logging.getLogger('jax')
  old_level = logger.level
  logger.addHandler(log)
  logger.setLevel(logging.DEBUG)
  with jax.log_compiles(True):
    yield log
  logger.removeHandler(log)
  logger.setLevel(old_level)


def pytest_collection_modifyitems(config, items):
  """Files with end-to-end (slow) tests run first: with ``-n auto --dist loadfile`` (the README's
  command) each worker takes whole files in this order, so the long files start early and the
  short ones fill in at the end instead of one long file finishing alone."""
  del config
  slow_files = {item.path for item in items if item.get_closest_marker('slow')}
  items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept otherwise


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE_DIR:
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def pytest_configure(config):
  # The README's test command (= CI) runs every test. For quick local work,
  # `python -m pytest -q -n auto tests -m "not slow"` skips the end-to-end checks marked slow
  # (whole CLI runs, real-model training, TPU compiles, multi-process runs, the notebook).
  config.addinivalue_line('markers', 'slow: an end-to-end check of tens of seconds or more; CI '
                          'runs it, `-m "not slow"` skips it for quick local work')
