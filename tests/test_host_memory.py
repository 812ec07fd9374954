"""jaxrl_ga.host_memory: with reuse_freed_memory() called before JAX starts, a jitted call whose
temporary buffer is over 64 MiB no longer faults fresh pages in at every call; without it (the
control, same program) it does at every call. Page faults are counted by the kernel (getrusage's ru_minflt) in
a fresh interpreter. The CLIs' --reuse_freed_memory=auto decides from JAX_PLATFORMS and a fake
PCI bus (reuse_freed_memory recorded, not called, in this process)."""

import os
import platform
import subprocess
import sys

import pytest

from jaxrl_ga import host_memory

_PROGRAM = r'''
import resource, sys
if sys.argv[1] == 'reuse':
  from jaxrl_ga import host_memory
  print(host_memory.reuse_freed_memory(), file=sys.stderr)
import jax, jax.numpy as jnp

@jax.jit
def f(x):
  y = jnp.cumsum(jnp.sin(x), axis=0)  # a [4096, 8192] float32 temporary: 128 MiB
  return jnp.sum(y * jnp.cos(x))

x = jnp.ones((4096, 8192), jnp.float32)
for _ in range(10):  # until the heap has grown to hold what a call and the last one overlap on
  f(x).block_until_ready()
for _ in range(7):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
'''


def _faults_per_call(mode: str) -> list[int]:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  out = subprocess.run([sys.executable, '-c', _PROGRAM, mode], env=env, capture_output=True,
                       text=True, timeout=300, check=True)
  return [int(n) for n in out.stdout.split()]


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='mallopt is glibc\'s')
def test_freed_buffers_are_reused_instead_of_faulted_in_again():
  # 128 MiB is 32,768 pages of 4 KiB: glibc's default maps the temporary afresh at every call.
  assert min(_faults_per_call('system')) > 30_000
  # Reused: most calls fault nothing. A call that starts before the last one's buffers are freed
  # (XLA frees them on its own thread) may still grow the heap, once, onto fresh pages.
  assert sorted(_faults_per_call('reuse'))[3] < 1_000  # the median of 7 calls


def test_reuse_freed_memory_reports_each_setting():
  if platform.libc_ver()[0] != 'glibc':
    assert host_memory.reuse_freed_memory() == {}
    return
  # Run in a child: the settings are process-wide.
  out = subprocess.run(
      [sys.executable, '-c', 'from jaxrl_ga import host_memory; '
       'print(sorted(host_memory.reuse_freed_memory().items()))'],
      capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == ("[('M_ARENA_MAX', True), ('M_MMAP_MAX', True), "
                                "('M_TRIM_THRESHOLD', True)]")


@pytest.fixture
def applied(monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, 'reuse_freed_memory', lambda: calls.append(1) or {'set': True})
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  return calls


@pytest.mark.parametrize('vendors, platforms, expected', [
    (['0x8086'], None, True),  # a CPU host
    (['0x8086', '0x1ae0'], None, False),  # a Cloud TPU VM
    (['0x8086', '0x10de'], None, False),  # an NVIDIA GPU
    (['0x8086', '0x1ae0'], 'cpu', True),  # JAX_PLATFORMS decides when set
    (['0x8086'], 'tpu', False),
    (['0x8086'], 'cuda,cpu', False),
])
def test_auto_is_on_only_without_an_accelerator(fake_pci, monkeypatch, applied, vendors,
                                                platforms, expected):
  if platforms is not None:
    monkeypatch.setenv('JAX_PLATFORMS', platforms)
  got = host_memory.apply_flag('auto', pci_root=fake_pci(vendors))
  assert (got == {'set': True}) == expected
  assert len(applied) == int(expected)


def test_true_and_false_override_auto(fake_pci, applied):
  tpu = fake_pci(['0x1ae0'])
  assert host_memory.apply_flag('true', pci_root=tpu) == {'set': True}
  assert host_memory.apply_flag('false', pci_root=tpu) == {}
  assert len(applied) == 1
  with pytest.raises(ValueError, match='reuse_freed_memory'):
    host_memory.apply_flag('maybe')


def test_an_installed_libtpu_is_quiet_on_a_host_without_a_tpu(fake_pci):
  """main and sample start JAX with no libtpu warnings (and no stack trace) on a CPU host, as a
  user runs them after the [test] extra installed libtpu; on a TPU VM nothing is changed."""
  env = dict(os.environ)
  env.pop('JAX_PLATFORMS', None)
  for key in ('TPU_SKIP_MDS_QUERY', 'TPU_WORKER_HOSTNAMES', 'TPU_ACCELERATOR_TYPE'):
    env.pop(key, None)
  code = ('import os, sys; from jaxrl_ga import host_memory; '
          'print(host_memory.quiet_absent_tpu(sys.argv[1])); import jax; jax.devices(); '
          'print(os.environ.get("TPU_SKIP_MDS_QUERY"))')
  cpu_host = subprocess.run([sys.executable, '-c', code, fake_pci(['0x8086'])], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
  assert cpu_host.stdout.split() == ['True', '1']
  assert 'TPU' not in cpu_host.stderr and 'Source Location Trace' not in cpu_host.stderr
  tpu_vm = subprocess.run([sys.executable, '-c', code.replace('import jax; jax.devices(); ', ''),
                           fake_pci(['0x8086', '0x1ae0'])], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
  assert tpu_vm.stdout.split() == ['False', 'None']
