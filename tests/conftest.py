"""Test set-up: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ['JAX_PLATFORMS'] = 'cpu'
_flag = '--xla_force_host_platform_device_count=8'
if _flag not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()

import jax  # noqa: E402  (after the environment is set)

jax.config.update('jax_default_matmul_precision', 'highest')
