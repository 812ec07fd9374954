"""Forward pass on several meshes of 8 simulated devices equals the single-device forward."""

import jax
import numpy as np
import pytest

from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, MeshConfig
from jaxrl_ga.models import transformer as tfm

CFG = tfm.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                      rope_theta=1e4)


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, size=(8, 12)).astype(np.int32)
  mask = np.ones((8, 12), np.int32)
  mask[::2, :3] = 0  # half the rows left-padded
  mask[1::4, -2:] = 0  # some rows right-padded
  return tokens, mask


def _forward(mesh_cfg):
  mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:np.prod([mesh_cfg.data, mesh_cfg.fsdp,
                                                                mesh_cfg.tensor])])
  graphdef, params, shardings = sharding.init_params(CFG, seed=0, mesh=mesh)
  tokens, mask = _batch()
  bs = sharding.batch_sharding(mesh)
  fwd = jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m),
                in_shardings=(shardings, bs, bs))
  logits = fwd(params, jax.device_put(tokens, bs), jax.device_put(mask, bs))
  return mesh, params, np.asarray(logits), mask


@pytest.fixture(scope='module')
def reference():
  _, params, logits, mask = _forward(MeshConfig(1, 1, 1))
  return jax.device_get(params), logits, mask


@pytest.mark.parametrize('shape', [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_forward_matches_on_mesh(reference, shape):
  ref_params, ref_logits, mask = reference
  mesh, params, logits, _ = _forward(MeshConfig(*shape))
  # Same init on every mesh (born sharded, same values).
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, ref_params)
  valid = mask.astype(bool)
  np.testing.assert_allclose(logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
  # Params are sharded as the rules say (dims that divide their mesh axes).
  _, fsdp, tensor = shape
  assert params['layers']['q_proj'].sharding.spec == jax.sharding.PartitionSpec(
      None, 'fsdp', 'tensor')
  assert params['embed'].sharding.spec == jax.sharding.PartitionSpec('tensor', 'fsdp')
  assert params['lm_head'].sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor')
  assert params['layers']['down_proj'].sharding.spec == jax.sharding.PartitionSpec(
      None, 'tensor', 'fsdp')
  assert params['final_norm'].sharding.spec == jax.sharding.PartitionSpec(None)
  # The actual per-device shard shapes follow the mesh.
  shard = params['layers']['gate_proj'].addressable_shards[0].data
  assert shard.shape == (2, 64 // fsdp, 128 // tensor)


def test_indivisible_dim_is_replicated():
  mesh = sharding.make_mesh(MeshConfig(1, 1, 8))
  spec = sharding.logical_to_spec(('layers', 'embed', 'kv_heads'), (2, 64, 12), mesh)
  assert spec == jax.sharding.PartitionSpec(None, 'fsdp', None)


def test_mesh_errors_name_the_sizes():
  with pytest.raises(ConfigError, match='data=3, fsdp=1, tensor=1 needs 3 devices'):
    sharding.make_mesh(MeshConfig(3, 1, 1))
  with pytest.raises(ConfigError, match='at most one mesh size may be -1'):
    MeshConfig(-1, -1, 1)
  mesh = sharding.make_mesh(MeshConfig(-1, 2, 2))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}


def test_per_host_row_helpers_round_trip():
  # On one process every row is local; the helpers must still place, read back and gather rows
  # exactly as a plain device_put of the global array does, also for a [S, B] layout (axis 1).
  mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
  rows = placement.local_indices((8,), sharding.batch_sharding(mesh, 1))
  np.testing.assert_array_equal(rows, np.arange(8))
  built = []
  batch = placement.shard_rows(lambda r: built.append(list(r)) or
                              {'x': np.arange(8 * 3).reshape(8, 3)[r] * 10}, 8, mesh)
  assert built == [list(range(8))]
  assert batch['x'].sharding.spec == sharding.batch_sharding(mesh, 2).spec
  np.testing.assert_array_equal(np.asarray(batch['x']), np.arange(24).reshape(8, 3) * 10)
  slab = np.arange(2 * 8 * 5).reshape(2, 8, 5)
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ('data', 'fsdp')))
  # Rows handed over in another order are put where they belong.
  perm = np.array([3, 1, 0, 2, 7, 6, 5, 4])
  x = placement.from_local(slab[:, perm], perm, slab.shape, sh, axis=1)
  np.testing.assert_array_equal(np.asarray(x), slab)
  idx, vals = placement.local_part(x, axis=1)
  np.testing.assert_array_equal(idx, np.arange(8))
  np.testing.assert_array_equal(vals, slab)
  np.testing.assert_array_equal(placement.gather_rows(slab[0][perm], perm, 8, mesh), slab[0])
  with pytest.raises(ValueError, match='its devices hold row'):
    placement.from_local(slab[:, :4], np.arange(4), slab.shape, sh, axis=1)
