"""A GRPO run's roles (docs/design.md, "Roles"): the rollout on 4 of 8 simulated devices and the
learner on the other 4 trains bitwise as one 4-device mesh of the same sizes does; syncing the
weights to a role on the actor's mesh copies nothing; a bad ``mesh.rollout`` is one error line."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import helpers
import smoke_configs

from jaxrl_ga import api
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, MeshConfig, RoleMeshConfig
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.trainers import context

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _devices(tree) -> set[int]:
  return {d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def _grpo(workdir, **mesh):
  """A smoke GRPO run of 2 optimizer steps (K=3, E=2: 6 micro-steps, 3 rollouts), the actor on
  devices 0..3 (data=4) and ``mesh`` overrides. -> (trainer factory for helpers'
  run_grpo_in_pieces, {rollouts: buffers on the host, generated: devices of each rollout step's
  output, trained_on: devices of each buffer the learner got})."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 2, 'checkpoint.every_steps': 0, 'mesh.devices': '0:4', 'mesh.data': 4,
      **mesh})
  seen = {'rollouts': [], 'generated': [], 'trained_on': []}

  def on_rollout(event):
    seen['trained_on'].append(_devices(event.buffer))
    seen['rollouts'].append(jax.device_get(event.buffer))

  def make_trainer(workdir):
    ctx, params = api.build_context(cfg, str(workdir))
    trainer = grpo.GRPOTrainer(ctx, cfg.grpo, on_rollout=on_rollout)
    step = trainer.engine._step  # pylint: disable=protected-access

    def spy(*args):  # where the rollout step really ran: its outputs' devices
      out = step(*args)
      seen['generated'].append(_devices(out[0]))
      return out
    trainer.engine._step = spy  # pylint: disable=protected-access
    return trainer, params

  return make_trainer, seen


@pytest.mark.slow
def test_rollout_on_its_own_devices_trains_bitwise_as_one_mesh(tmp_path):
  """Rollout on devices 4..7, learner on 0..3 (both data=4), stopped after micro-step 3 (in the
  middle of rollout 1) and resumed: the same params and the same rollout buffers, bit for bit, as
  an uninterrupted run with every role on one 4-device mesh of the same sizes (the same
  arithmetic on other devices). Each buffer carries the version of the policy that generated it:
  rollout r is generated at micro-step 2r, after (2r) // 3 optimizer steps."""
  one_mesh, want = _grpo(tmp_path)
  trainer, params = one_mesh(tmp_path / 'one')
  want_params, _ = trainer.run(params)
  two_meshes, got = _grpo(tmp_path, **{'mesh.rollout.devices': '4:8', 'mesh.rollout.data': 4})
  got_params, _ = helpers.run_grpo_in_pieces(two_meshes, tmp_path / 'two', (3,),
                                             total_micro_steps=6)

  assert want['generated'] == [{0, 1, 2, 3}] * 3
  assert got['generated'] == [{4, 5, 6, 7}] * 3  # generation ran on the rollout's devices
  assert got['trained_on'] == [{0, 1, 2, 3}] * 3  # and its buffers moved to the learner's
  assert _devices(got_params) == {0, 1, 2, 3}
  helpers.assert_trees_equal(got_params, want_params)
  helpers.assert_trees_equal(got['rollouts'], want['rollouts'])
  assert [int(b.policy_version) for b in got['rollouts']] == [0, 0, 1]


def test_sync_weights_copies_nothing_on_the_actors_mesh_and_moves_to_another():
  cfg = tfm.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
  meshes = sharding.role_meshes(MeshConfig(data=2, fsdp=2, devices='0:4',
                                           rollout=RoleMeshConfig(devices='4:8', fsdp=4)))
  assert meshes['reference'] is meshes['rollout']  # the rollout step computes its log-probs
  _, params, shardings = sharding.init_params(cfg, seed=0, mesh=meshes['actor'])
  host = jax.device_get(params)
  shapes, axes = sharding.abstract_model(cfg)[1:]

  same = sharding.sync_weights(params, context.Role('rollout', meshes['actor'], shardings))
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)):
    assert a is b and _pointers(a) == _pointers(b)

  role = context.Role('rollout', meshes['rollout'],
                      sharding.param_shardings(shapes, axes, meshes['rollout']))
  moved = sharding.sync_weights(params, role)
  assert _devices(moved) == {4, 5, 6, 7} and _devices(params) == {0, 1, 2, 3}
  jax.tree.map(lambda x, sh: assert_sharding(x, sh), moved, role.param_shardings)
  helpers.assert_trees_equal(moved, host)


def assert_sharding(x, sh):
  assert x.sharding == sh, (x.sharding, sh)


def _pointers(x) -> list[int]:
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


@pytest.mark.parametrize('setting,named', [
    ('mesh.rollout.devices=4:12', "error: mesh.rollout.devices='4:12': there are 8 devices"),
    ('mesh.rollout.devices=abc', "error: mesh.rollout.devices='abc' must be a slice"),
    ('mesh.rollout.data=2', 'error: mesh.rollout.data=2 is set but mesh.rollout.devices is not'),
    ('mesh.rollout.devices=4:7', "error: mesh.rollout (devices='4:7'): micro_batch_size = 8 is "
                                 'not divisible by the data-parallel size of the mesh'),
    ('mesh.rollout.fsdp=3', 'error: mesh.rollout.fsdp=3 is set but mesh.rollout.devices'),
])
def test_a_bad_mesh_rollout_is_one_error_line(tmp_path, setting, named):
  """From the CLI, before anything compiles: exit status 2 and one line naming the setting.
  '4:7' is 3 devices (data=-1 takes them all), which the smoke config's 8 rows per micro-step
  do not divide."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1',
             XLA_FLAGS=helpers.xla_flags(8))
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={tmp_path}', '--config.stages=grpo', f'--config.{setting}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
  lines = [l for l in (done.stdout + done.stderr).splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith(named), lines
  assert 'Compiling' not in done.stderr


def test_mesh_rollout_settings_are_validated_where_they_are_read():
  with pytest.raises(ConfigError, match="mesh.devices='0:0' must be a slice"):
    MeshConfig(devices='0:0')
  with pytest.raises(ConfigError, match='mesh.rollout sizes must be positive'):
    MeshConfig(rollout=RoleMeshConfig(devices='0:2', tensor=0))
  with pytest.raises(ConfigError, match="mesh.devices='2:9': there are 8 devices"):
    sharding.role_meshes(MeshConfig(devices='2:9'))
  meshes = sharding.role_meshes(MeshConfig())  # the default: every role on one mesh
  assert meshes['rollout'] is meshes['actor'] and meshes['reference'] is meshes['actor']
  assert meshes['actor'].devices.size == 8
