"""The TPU config loads and validates, and `explain` accepts it (no hub access, no TPU)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxrl_ga import schedule, sharding
from jaxrl_ga.config import RunConfig, from_mapping

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_CONFIG = os.path.join(REPO, 'configs', 'grpo_gsm8k_tpu.py')
DEVICES = {'v5e-8': 8, 'v4-32': 16}


def _load(path):
  spec = importlib.util.spec_from_file_location('config_under_test', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize('arg', sorted(DEVICES))
def test_tpu_config_validates(arg):
  cfg = from_mapping(RunConfig, _load(TPU_CONFIG).get_config(arg).to_dict())
  assert cfg.stages == ('grpo',)
  assert cfg.task.name == 'gsm8k'
  assert cfg.model.hf_path == 'Qwen/Qwen2.5-0.5B-Instruct'
  assert (cfg.model.dtype, cfg.model.param_dtype) == ('bfloat16', 'float32')
  mesh = cfg.mesh
  assert mesh.data * mesh.fsdp * mesh.tensor == DEVICES[arg]
  schedule.validate(cfg.grpo.schedule, mesh.data * mesh.fsdp)  # B divisible by data*fsdp
  table = schedule.build_table(cfg.grpo.schedule)
  assert cfg.grpo.schedule.grad_accum_steps % cfg.grpo.schedule.steps_per_generation  # unaligned
  assert table.period_rollouts > 1


def test_tpu_config_default_and_unknown_arg():
  module = _load(TPU_CONFIG)
  assert module.get_config().to_dict() == module.get_config('v5e-8').to_dict()
  with pytest.raises(ValueError, match='v4-32'):
    module.get_config('v3-8')


def test_v5e_mesh_builds_on_8_devices():
  cfg = from_mapping(RunConfig, _load(TPU_CONFIG).get_config('v5e-8').to_dict())
  mesh = sharding.make_mesh(cfg.mesh)  # conftest simulates 8 CPU devices
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'tensor': 1}


@pytest.mark.parametrize('arg', sorted(DEVICES))
def test_explain_accepts_tpu_config(arg):
  proc = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.explain', f'--config={TPU_CONFIG}:{arg}',
       f'--num_devices={DEVICES[arg]}'], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert f'Data-parallel size (mesh data*fsdp): {DEVICES[arg]}' in proc.stdout
  assert 'slice rule (jaxrl_ga)' in proc.stdout


# Published parameter counts (the model cards): the table's shapes are those models'.
TUNIX_ROWS = {'qwen3-0.6b-v5e-1': 0.60e9, 'gemma3-1b-v5e-4': 1.00e9, 'llama3.2-1b-v5e-4': 1.24e9,
              'gemma3-4b-v5p-2': 3.88e9, 'llama3.1-8b-v5p-2': 8.03e9, 'qwen3-14b-v5p-2': 14.8e9}


def test_tunix_table_configs_validate():
  from jaxrl_ga import flops  # pylint: disable=g-import-not-at-top
  module = _load(os.path.join(REPO, 'configs', 'grpo_tunix_table.py'))
  for arg, published in TUNIX_ROWS.items():
    cfg = from_mapping(RunConfig, module.get_config(arg).to_dict())
    assert cfg.grpo.schedule.num_generations == 4, arg
    schedule.validate(cfg.grpo.schedule, cfg.mesh.data * cfg.mesh.fsdp)
    params = flops.param_count(cfg.model.architecture_config())
    assert abs(params / published - 1) < 0.03, (arg, params)
