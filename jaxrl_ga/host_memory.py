"""Host memory for XLA:CPU: keep freed memory for reuse instead of mapping it fresh every step.

XLA:CPU allocates each call's temporary buffer (and its outputs) with ``posix_memalign`` from
the thread that runs the call. glibc serves a request over 64 MiB made from a thread other than
the main one with a fresh ``mmap`` (a thread's own heap is at most 64 MiB; setting
``M_MMAP_MAX`` to 0 does not stop that fallback), and ``free`` unmaps it again. So every step the
kernel zero-fills every page of those buffers on first touch: on SmolLM2-135M's GRPO learner
micro-step, 8 x (56 + 64) tokens, 670,000 minor page faults (2.7 GB) per call and about a fifth
of its time (BENCHMARKS.md, issue 15).

``reuse_freed_memory()`` sets three ``mallopt(3)`` parameters so that the process's threads
allocate from glibc's main heap, which grows with ``brk`` and is never trimmed: freed buffers are
reused by the next step, already faulted in. The cost is that the process's resident memory stays
at its peak (what it frees is kept for reuse, not returned to the OS), and that all threads share
one allocator arena. The equivalent environment, set before Python starts, is
``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<a huge number>``.

It has to run before JAX starts its backend, whose threads take an arena at their first
allocation and keep it (called after ``jax.devices()`` it changes nothing), and best before
other libraries start threads (import torch after it). The CLIs (``jaxrl_ga.main``,
``jaxrl_ga.sample``) call it first thing when ``--reuse_freed_memory=auto`` (the default) finds
no accelerator (``accelerator_expected``); the benchmarks call it at the top of the script. On
platforms without glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform

TPU_PCI_VENDOR = '0x1ae0'  # Google: a Cloud TPU VM's chips (jax's own TPU detection checks it)
NVIDIA_PCI_VENDOR = '0x10de'

# glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_SETTINGS = (  # (parameter, name, value); mallopt(3) documents each value used here
    (M_ARENA_MAX, 'M_ARENA_MAX', 1),  # every thread allocates from the main arena (brk heap)
    (M_MMAP_MAX, 'M_MMAP_MAX', 0),  # no request is served by mmap (in the main arena)
    (M_TRIM_THRESHOLD, 'M_TRIM_THRESHOLD', -1),  # -1: the heap's top is never trimmed
)


def reuse_freed_memory() -> dict[str, bool]:
  """Sets glibc's malloc to keep freed memory for reuse (see the module docstring).

  Returns {parameter name: whether mallopt accepted it}; {} where the C library is not glibc.
  Safe to call more than once.
  """
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return {}
  libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6', use_errno=True)
  mallopt = libc.mallopt
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return {name: bool(mallopt(param, value)) for param, name, value in _SETTINGS}


def pci_vendors(pci_root: str = '/sys/bus/pci/devices') -> set[str]:
  """The PCI vendor ids ('0x1ae0', ...) of the devices under ``pci_root``."""
  vendors = set()
  for path in glob.glob(os.path.join(pci_root, '*', 'vendor')):
    try:
      with open(path, encoding='ascii') as f:
        vendors.add(f.read().strip())
    except OSError:
      continue
  return vendors


def on_tpu_vm(pci_root: str = '/sys/bus/pci/devices') -> bool:
  """A Google TPU on the PCI bus (vendor 0x1ae0), as jax's own TPU detection checks."""
  return TPU_PCI_VENDOR in pci_vendors(pci_root)


def accelerator_expected(pci_root: str = '/sys/bus/pci/devices') -> bool:
  """Whether JAX will run on an accelerator, judged without starting its backend: from
  ``JAX_PLATFORMS`` when set (anything besides 'cpu'), else a TPU or NVIDIA device on the PCI
  bus."""
  platforms = [p.strip() for p in os.environ.get('JAX_PLATFORMS', '').split(',') if p.strip()]
  if platforms:
    return any(p != 'cpu' for p in platforms)
  return bool({TPU_PCI_VENDOR, NVIDIA_PCI_VENDOR} & pci_vendors(pci_root))


def quiet_libtpu_env() -> None:
  """libtpu warns about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES (and jax queries the GCE
  metadata server) when no TPU is attached; compiling for a topology needs none of them. Set
  before jax initialises its backends; values already set win."""
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-8')
  # Compiling takes no chip: let several processes (tests, plans) load libtpu at once.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


def quiet_absent_tpu(pci_root: str = '/sys/bus/pci/devices') -> bool:
  """On a host without a TPU (none on the PCI bus, JAX_PLATFORMS unset), an installed libtpu
  (the [test] extra brings one for ``plan``) prints warnings and a stack trace when JAX starts
  its backends, none of which a user can act on: quiet it (:func:`quiet_libtpu_env`). Returns
  whether it did."""
  if os.environ.get('JAX_PLATFORMS') or on_tpu_vm(pci_root):
    return False
  quiet_libtpu_env()
  return True


def apply_flag(mode: str, pci_root: str = '/sys/bus/pci/devices') -> dict[str, bool]:
  """The CLIs' ``--reuse_freed_memory``: 'true' calls ``reuse_freed_memory()``, 'false' does
  nothing, 'auto' calls it unless ``accelerator_expected()``. Returns what it set."""
  if mode not in ('auto', 'true', 'false'):
    raise ValueError(f'--reuse_freed_memory={mode!r}: use auto, true or false.')
  if mode == 'false' or (mode == 'auto' and accelerator_expected(pci_root)):
    return {}
  return reuse_freed_memory()
