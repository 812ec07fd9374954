"""Test set-up: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ['JAX_PLATFORMS'] = 'cpu'
_flag = '--xla_force_host_platform_device_count=8'
if _flag not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()

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
