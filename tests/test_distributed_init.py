"""main.init_distributed: explicit flags, automatic on a Cloud TPU VM (recognized by a Google TPU,
PCI vendor 0x1ae0, on the PCI bus), nothing otherwise. jax.distributed.initialize is recorded,
not called; the PCI bus is a fake directory tree (conftest.fake_pci)."""

from absl import app
import jax
import pytest

from jaxrl_ga import main


@pytest.fixture
def calls(monkeypatch):
  seen = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: seen.append(kw))
  monkeypatch.setattr(jax.config, 'update', lambda *a: seen.append(a))
  return seen


def test_tpu_vm_is_initialized_automatically(fake_pci, calls):
  root = fake_pci(['0x8086', '0x1ae0'])  # an Intel bridge and a Google TPU
  assert main.init_distributed(pci_root=root) == 'tpu_vm'
  assert calls == [{}]  # no arguments: jax reads the workers from the TPU VM metadata


def test_other_machines_stay_single_process(fake_pci, calls):
  root = fake_pci(['0x8086', '0x10de'])  # Intel, NVIDIA
  assert main.init_distributed(pci_root=root) == 'none'
  assert calls == []


def test_explicit_flags_win_and_are_checked(fake_pci, calls):
  root = fake_pci(['0x1ae0'])
  assert main.init_distributed('10.0.0.1:1234', 4, 2, pci_root=root) == 'explicit'
  assert calls == [('jax_cpu_collectives_implementation', 'gloo'),
                   {'coordinator_address': '10.0.0.1:1234', 'num_processes': 4,
                    'process_id': 2}]
  with pytest.raises(app.UsageError, match='needs --num_processes and --process_id'):
    main.init_distributed('10.0.0.1:1234', 4, None, pci_root=root)
  with pytest.raises(app.UsageError, match='need --coordinator_address'):
    main.init_distributed(None, 2, 0, pci_root=root)
