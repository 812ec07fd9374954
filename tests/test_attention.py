"""Fused attention (``ForwardOptions.attention``, model.attention; issue 36) on the model-family
fixtures: 'xla' (``jax.nn.dot_product_attention``) against transformers' logits, as the einsum is
checked in tests/test_model_families.py: GQA, Gemma 3's mixed sliding layers and
query_pre_attn_scalar, Mistral's window, right and left padding, a packed (SFT) row, the
prefill, the shared-prompt forward; and the learner's gradient against the einsum's. The 'splash'
kernel is TPU only: tests/test_plan.py compiles it with libtpu. Nothing here imports torch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import api
from jaxrl_ga import logprobs
from jaxrl_ga import programs
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, MeshConfig, ModelSpec, RunConfig, from_mapping
from jaxrl_ga.models import hf
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models import transformer as tfm

import helpers

FAMILIES = ('qwen3_tiny', 'gemma3_tiny', 'mistral_tiny')
RTOL = 1e-5  # as tests/test_model_families.py: float32 against HF's float32 logits
XLA = tfm.ForwardOptions(attention='xla')


@functools.cache
def _loaded(name):
  return hf.load_model(helpers.fixture_dir(name))


def _relative_error(ours, ref, real):
  return float(np.abs(np.asarray(ours)[real] - ref[real]).max() / np.abs(ref[real]).max())


@pytest.fixture
def fused_calls(monkeypatch):
  """The implementations ``jax.nn.dot_product_attention`` was traced with: proof that the 'xla'
  path ran (the einsum alone matches the same references)."""
  calls, original = [], jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    calls.append(kwargs.get('implementation'))
    return original(*args, **kwargs)
  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  return calls


def _packed(ref):
  """Rows 0 and 1 of the right-padded batch packed into one row (segment ids 1 and 2, then
  padding), and the HF logits each segment must reproduce (each row's own forward)."""
  mask = ref['right_mask'].astype(bool)
  n0, n1 = int(mask[0].sum()), int(mask[1].sum())
  width = n0 + n1 + 3
  tokens = np.zeros((1, width), np.int32)
  ids = np.zeros((1, width), np.int32)
  tokens[0, :n0], tokens[0, n0:n0 + n1] = ref['right_tokens'][0, :n0], ref['right_tokens'][1, :n1]
  ids[0, :n0], ids[0, n0:n0 + n1] = 1, 2
  want = np.concatenate([ref['right_logits'][0, :n0], ref['right_logits'][1, :n1]])[None]
  real = np.zeros((1, width), bool)
  real[0, :n0 + n1] = True
  want = np.concatenate([want, np.zeros((1, width - n0 - n1, want.shape[-1]), want.dtype)], 1)
  return tokens, ids, want, real


@pytest.mark.parametrize('name', FAMILIES)
def test_xla_attention_forward_matches_hf(name, fused_calls):
  """The training forward with 'xla' attention on a right-padded, a left-padded and a packed
  batch (two fixture rows in one row, segment ids 1 and 2: each must give its own row's HF
  logits, so no token attends across the boundary and positions restart)."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  forward = jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m, XLA))
  cases = {side: (ref[f'{side}_tokens'], ref[f'{side}_mask'], ref[f'{side}_logits'],
                  ref[f'{side}_mask'].astype(bool)) for side in ('right', 'left')}
  cases['packed'] = _packed(ref)
  for case, (tokens, mask, want, real) in cases.items():
    error = _relative_error(forward(params, tokens, mask), want, real)
    print(f'{name} {case} forward, xla attention: max abs logit error / max |logit| = '
          f'{error:.1e}')
    assert error < RTOL, (case, error)
  assert set(fused_calls) == {'xla'}


@pytest.mark.parametrize('name', ['gemma3_tiny', 'mistral_tiny'])
def test_xla_prefill_then_decode_matches_hf(name, fused_calls):
  """The prefill with 'xla' attention (its keys: the prompt's own, written to the cache), then
  the decode steps over that cache: HF's greedy continuation logits at every step."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  prompt, prompt_mask, greedy = ref['left_tokens'], ref['left_mask'], ref['greedy_tokens']
  tp, n = prompt.shape[1], greedy.shape[1]
  logits, cache = jax.jit(lambda p: tfm.merge(graphdef, p).prefill(
      prompt, prompt_mask, tp + n, attention='xla'))(params)
  assert fused_calls  # the prefill's; the decode steps keep their own attention
  fused_calls.clear()
  decode = jax.jit(lambda p, t, c: tfm.merge(graphdef, p).decode(t, c, block=4))
  steps = [logits]
  for t in range(n - 1):
    logits, cache = decode(params, greedy[:, t], cache)
    steps.append(logits)
  steps = np.stack([np.asarray(x) for x in steps], axis=1)
  want = ref['greedy_logits'][:, tp - 1:tp + n - 1]
  error = _relative_error(steps, want, np.ones(want.shape[:2], bool))
  print(f'{name} xla prefill + decode: max abs logit error / max |logit| = {error:.1e}')
  assert error < RTOL, error
  np.testing.assert_array_equal(steps.argmax(-1), greedy)
  assert not fused_calls


def test_xla_shared_prompt_logps_match_hf(fused_calls):
  """The shared-prompt forward (``hidden_after_prefix``: the prompt's attention by 'xla', the
  completions' over [prompt; own] by the einsum) on Mistral, its window cutting into the
  prompt: log_softmax of HF's logits at the greedy continuation."""
  _, graphdef, params = _loaded('mistral_tiny')
  prompt, prompt_mask, greedy, want = helpers.shared_prompt_case('mistral_tiny')
  options = dataclasses.replace(XLA, share_prompts=2)
  logps, _ = jax.jit(lambda p: logprobs.completion_logps(
      tfm.merge(graphdef, p), prompt, prompt_mask, greedy, np.ones_like(greedy), options))(params)
  error = float(np.abs(np.asarray(logps) - want).max())
  print(f'mistral shared-prompt log-probs, xla attention: max abs error = {error:.1e}')
  assert error < 1e-5, error
  assert fused_calls


def test_xla_attention_gradient_equals_einsum(fused_calls):
  """The learner's backward: the gradient of the summed token log-probs of Gemma 3 (mixed
  sliding layers, query_pre_attn_scalar) on a left-padded batch and a packed row is the
  einsum's (checked against HF's forward in tests/test_model_families.py) to float32 rounding,
  and it is not zero."""
  _, graphdef, params = _loaded('gemma3_tiny')
  ref = helpers.reference_arrays('gemma3_tiny')
  tokens, ids, _, _ = _packed(ref)  # one batch: the left-padded rows, further padded, and it
  left = lambda x: np.pad(x, ((0, 0), (tokens.shape[1] - x.shape[1], 0)))
  t = np.concatenate([left(ref['left_tokens']), tokens])
  m = np.concatenate([left(ref['left_mask']), ids])

  def loss(p, options):
    return jnp.sum(logprobs.sequence_logps(tfm.merge(graphdef, p), t, m, m > 0, options)[0])

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  want = jax.tree.leaves(grad(params, tfm.ForwardOptions()))
  assert not fused_calls
  got = jax.tree.leaves(grad(params, XLA))
  assert fused_calls
  scale = max(float(np.abs(np.asarray(w)).max()) for w in want)
  error = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
  print(f'gemma3 gradient, xla vs einsum: max abs diff / max |grad| = {error / scale:.1e}')
  assert scale > 0 and error / scale < 1e-5


def test_model_attention_setting():
  """model.attention reaches the forward options (and so the learners, the log-prob passes and
  the rollout's prefill); its default 'auto' is resolved to an implementation (for a program
  built outside a run, for jax's default device: here the CPU's einsum); ForwardOptions itself
  refuses 'auto'; an unknown name is a ConfigError naming the setting."""
  assert programs.forward_options(ModelSpec(attention='xla')).attention == 'xla'
  assert programs.forward_options(ModelSpec(attention='einsum')).attention == 'einsum'
  assert ModelSpec().attention == 'auto'
  assert programs.forward_options(ModelSpec()).attention == attn_lib.CPU_ATTENTION == 'einsum'
  with pytest.raises(ValueError, match=r"attention='auto'.*resolved once per run"):
    tfm.ForwardOptions(attention='auto')
  with pytest.raises(ConfigError, match=r"model.attention='flashy' is not a known value.*'auto', 'einsum', 'xla', 'splash', 'cudnn', 'flash'"):
    ModelSpec(attention='flashy')


def test_splash_needs_a_tpu():
  """model.attention='splash' and 'cudnn' on CPU devices are ConfigErrors before anything
  compiles (the check the CLI runs with the mesh, ``api.validate_against_mesh``); 'xla' and
  'auto' pass it."""
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  for attention, error in (('xla', None), ('auto', None),
                           ('splash', r"model.attention='splash' is a TPU kernel but the "
                                      r"devices are cpu"),
                           ('cudnn', r"model.attention='cudnn' cannot run here: cuDNN runs on "
                                     r"NVIDIA GPUs, the devices are cpu")):
    cfg = from_mapping(RunConfig, {'model': {'attention': attention}})
    if error is None:
      api.validate_against_mesh(cfg, mesh)
    else:
      with pytest.raises(ConfigError, match=error):
        api.validate_against_mesh(cfg, mesh)


def _reference_attention(q, k, v, ids, window, scale_dim):
  """Float64 attention, one query at a time: a real query (segment id > 0) attends to the keys
  at or before it of its own segment, within ``window`` positions (0: all); GQA head i uses
  key/value head i // (N/K). Padding queries: zeros (they are not compared)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  group = n // k.shape[2]
  out = np.zeros(q.shape)
  for row in range(b):
    for i in range(t):
      if ids[row, i] == 0:
        continue
      keys = [j for j in range(i + 1) if ids[row, j] == ids[row, i] and
              (not window or i - j < window)]
      for head in range(n):
        s = k[row, keys, head // group] @ q[row, i, head] / np.sqrt(scale_dim or h)
        p = np.exp(s - s.max())
        out[row, i, head] = (p / p.sum()) @ v[row, keys, head // group]
  return out


def test_splash_kernel_in_the_pallas_interpreter():
  """The 'splash' attention (the TPU kernel's own code, run by Pallas' interpreter on CPU) on
  one row holding left padding, two packed segments and right padding, GQA (2 query heads per
  key/value head), a length that is not a multiple of the kernel's block: against a float64
  reference, causal with the default scale, then with Gemma's query_pre_attn_scalar and a
  window of 5, where the kernel's own backward is checked against the einsum's autodiff."""
  rng = np.random.default_rng(0)
  b, t, n, kv, h = 1, 24, 2, 1, 16
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32)
             for heads in (n, kv, kv))
  ids = np.zeros((b, t), np.int32)
  ids[0, 3:12], ids[0, 12:21] = 1, 2
  real = ids > 0
  splash = lambda window, scale_dim: lambda q, k, v: attn_lib.splash_attention(
      q, k, v, attn_lib.Segments(jnp.asarray(ids), window), scale_dim, interpret=True)
  positions = attn_lib.positions_from_mask(jnp.asarray(ids))
  dense = attn_lib.causal_mask(jnp.asarray(ids)) & (positions[:, :, None] - positions[:, None, :] < 5)
  einsum = lambda q, k, v: attn_lib.einsum_attention(q, k, v, dense, scale_dim=24.0)
  weight = jnp.asarray(rng.normal(size=(b, t, n, h)) * real[..., None, None], jnp.float32)
  causal = splash(0, None)(q, k, v)
  windowed, vjp = jax.vjp(splash(5, 24.0), q, k, v)
  for out, window, scale_dim in ((causal, 0, None), (windowed, 5, 24.0)):
    want = _reference_attention(q, k, v, ids, window, scale_dim)
    error = float(np.abs(np.asarray(out) - want)[real].max())
    print(f'splash (interpreted), window {window}: max abs error {error:.1e}')
    assert error < 1e-5, (window, error)
  want = jax.vjp(einsum, q, k, v)[1](weight)
  for got, ref in zip(vjp(weight), want):
    assert float(jnp.abs(ref).max()) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)


def test_splash_runs_per_shard_of_the_kernel_mesh_it_is_given():
  """Where the splash kernel runs is an argument (``kernel_mesh``, which the forward's options
  carry), not a module global: with ``sharding.KernelMesh(mesh)`` the jitted call holds one
  shard_map (a manual computation) over the 8 batch shards, without it none, and both give the
  float64 reference's values on every row (Pallas' interpreter on CPU). ``forward_options`` sets
  it for 'splash' on a mesh only."""
  rng = np.random.default_rng(1)
  b, t, n, kv, h = 8, 16, 2, 1, 8
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32)
             for heads in (n, kv, kv))
  ids = np.zeros((b, t), np.int32)
  for row in range(b):  # left padding of `row` slots, then one segment
    ids[row, row:] = 1
  mesh = sharding.make_mesh(MeshConfig(data=-1))
  kernel_mesh = sharding.KernelMesh(mesh)
  segments = attn_lib.Segments(jnp.asarray(ids), 0)
  want = _reference_attention(q, k, v, ids, 0, None)
  real = ids > 0
  for given, manual in ((kernel_mesh, 1), (None, 0)):
    fn = jax.jit(lambda q, k, v, km=given: attn_lib.splash_attention(
        q, k, v, segments, interpret=True, kernel_mesh=km))
    assert fn.lower(q, k, v).as_text().count('sdy.manual_computation') == manual, given
    error = float(np.abs(np.asarray(fn(q, k, v)) - want)[real].max())
    assert error < 1e-5, (given, error)
  assert programs.forward_options(ModelSpec(attention='splash'), mesh=mesh).kernel_mesh == (
      kernel_mesh)
  assert programs.forward_options(ModelSpec(attention='splash')).kernel_mesh is None
  assert programs.forward_options(ModelSpec(attention='flash'), mesh=mesh).kernel_mesh is None


def _arch(name):
  return _loaded(name)[0]


@pytest.mark.parametrize('setting,platform,dtype,name,kind,cc,want,why', [
    # CPU: the einsum (benchmarks/attention.py: 'xla' within 4% of it), whatever the dtype
    ('auto', 'cpu', 'float32', 'qwen3_tiny', 'cpu', None, 'einsum', 'cpu, float32; the fastest'),
    ('auto', 'cpu', 'bfloat16', 'qwen3_tiny', 'cpu', None, 'einsum', 'fastest measured on CPU'),
    # NVIDIA: 'flash' (cuDNN failed the GPU check, attention.CUDNN_FAILED); the reason named
    ('auto', 'gpu', 'bfloat16', 'qwen3_tiny', 'NVIDIA H200', '9.0', 'flash',
     "NVIDIA H200, bfloat16; not cudnn: it failed this project's GPU check"),
    ('auto', 'gpu', 'bfloat16', 'gemma3_tiny', 'NVIDIA A100-SXM4-80GB', '8.0', 'flash', 'A100'),
    ('auto', 'gpu', 'float32', 'qwen3_tiny', 'NVIDIA H200', '9.0', 'flash',
     'not cudnn: model.dtype=float32 (cuDNN takes bfloat16 or float16; set model.dtype=bfloat16)'),
    ('auto', 'gpu', 'bfloat16', 'wide_heads', 'NVIDIA A100-SXM4-80GB', '8.0', 'flash',
     'not cudnn: head size 160 (cuDNN: a multiple of 8, at most 128 on this GPU)'),
    ('auto', 'gpu', 'bfloat16', 'wide_heads', 'NVIDIA H100 80GB HBM3', '9.0', 'flash', 'H100'),
    ('auto', 'gpu', 'bfloat16', 'qwen3_tiny', 'AMD Instinct MI300X', None, 'flash',
     'cuDNN runs on NVIDIA GPUs'),
    # TPU: splash; Gemma 3's mixed layers run 'flash' inside it, named
    ('auto', 'tpu', 'bfloat16', 'mistral_tiny', 'TPU v5 lite', None, 'splash', 'TPU v5 lite'),
    ('auto', 'tpu', 'bfloat16', 'gemma3_tiny', 'TPU v5 lite', None, 'splash',
     'layers mixing sliding and full attention run flash'),
    # explicit values stay as set
    ('xla', 'gpu', 'float32', 'qwen3_tiny', 'NVIDIA H200', '9.0', 'xla', ''),
    ('einsum', 'tpu', 'bfloat16', 'qwen3_tiny', 'TPU v5 lite', None, 'einsum', ''),
])
def test_auto_resolution(setting, platform, dtype, name, kind, cc, want, why):
  """``attention.resolve``: model.attention -> one implementation per backend, dtype and
  model, and the reason the console line names (the table of docs/configuration.md)."""
  cfg = (dataclasses.replace(_arch('qwen3_tiny'), head_dim=160) if name == 'wide_heads'
         else _arch(name))
  impl, reason = attn_lib.resolve(setting, platform, dtype, cfg, kind, cc)
  assert impl == want and why in reason, (impl, reason)
  assert impl in attn_lib.ATTENTION_IMPLS


@pytest.mark.parametrize('setting,platform,dtype,kind,error', [
    ('cudnn', 'gpu', 'float32', 'NVIDIA H200', "'cudnn' cannot run here: model.dtype=float32"),
    ('cudnn', 'tpu', 'bfloat16', 'TPU v5 lite', "'cudnn' cannot run here: cuDNN runs on NVIDIA"),
    ('splash', 'gpu', 'bfloat16', 'NVIDIA H200', "'splash' is a TPU kernel but the devices are gpu"),
    # refused where it could run: it failed the GPU check (training would be silently wrong)
    ('cudnn', 'gpu', 'bfloat16', 'NVIDIA H200', "'cudnn' cannot run here: it failed this project's GPU check"),
])
def test_explicit_attention_the_devices_cannot_run(setting, platform, dtype, kind, error):
  with pytest.raises(ValueError, match=error):
    attn_lib.resolve(setting, platform, dtype, _arch('qwen3_tiny'), kind, '9.0')


def test_resolve_attention_line():
  """``programs.resolve_attention``: the run's config with the implementation in place of
  'auto' and the console line build_context prints (none for an explicit value); a value the
  devices cannot run is a ConfigError."""
  gpu = type('Device', (), {'platform': 'gpu', 'device_kind': 'NVIDIA H200',
                            'compute_capability': '9.0'})()
  cfg = from_mapping(RunConfig, {'model': {'dtype': 'bfloat16'}})
  arch = dataclasses.replace(_arch('qwen3_tiny'), dtype='bfloat16')
  resolved, line = programs.resolve_attention(cfg, arch, gpu)
  assert resolved.model.attention == 'flash'
  assert line == ('model.attention=auto -> flash (NVIDIA H200, bfloat16; not cudnn: '
                  f'{attn_lib.CUDNN_FAILED})')
  assert dataclasses.replace(resolved, model=cfg.model) == cfg  # nothing else changed
  again, line = programs.resolve_attention(resolved, arch, gpu)
  assert again == resolved and line is None
  cpu_cfg, line = programs.resolve_attention(cfg, arch, jax.devices()[0])
  assert cpu_cfg.model.attention == 'einsum' and line.startswith('model.attention=auto -> einsum (cpu')
  with pytest.raises(ConfigError, match="model.attention='cudnn' cannot run here"):
    programs.resolve_attention(from_mapping(RunConfig, {'model': {'attention': 'cudnn'}}),
                               _arch('qwen3_tiny'), gpu)


def test_build_context_resolves_auto_once(tmp_path, capsys):
  """A run with the default model.attention='auto' resolves it in ``api.build_context``, before
  anything compiles: the context's config holds the implementation (here, on CPU, the einsum,
  whose programs are bitwise today's) and the console has the one line naming it."""
  import smoke_configs  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo')
  assert cfg.model.attention == 'auto'
  ctx, _ = api.build_context(cfg, str(tmp_path))
  assert ctx.cfg.model.attention == 'einsum'
  lines = [l for l in capsys.readouterr().out.splitlines() if 'model.attention' in l]
  assert lines == ['[grpo] model.attention=auto -> einsum (cpu, float32; the fastest measured '
                   'on CPU, BENCHMARKS.md)'], lines
  ctx.writer.close(quiet=True)


@pytest.mark.parametrize('t, s, multiple', [(23, 23, 2), (24, 24, 2), (11, 23, 2), (24, 24, 128),
                                             (11, 23, 128)])
def test_cudnn_operands_give_every_query_a_key_and_keep_the_rows_that_have_one(t, s, multiple):
  """What 'cudnn' hands the kernel (``cudnn_operands``): lengths a multiple of 2 (or of 128: whole
  key tiles; the added queries and keys are zeros, the keys masked for the real queries), and every query row at least one key (a row
  without any made cuDNN's backward return NaN on an H200, issue 47). Checked against the mask
  itself, row by row: a row that had a key keeps exactly its keys; one that had none gets its
  diagonal (clipped), which a causal kernel allows."""
  rng = np.random.default_rng(0)
  ids = np.zeros((4, s), np.int32)
  ids[0, 5:], ids[1, :-4], ids[2, 2:9], ids[2, 9:17] = 1, 1, 1, 2  # left, right padding, packed
  full = np.asarray(attn_lib.causal_mask(jnp.asarray(ids)))
  mask = full[:, s - t:] if t < s else full  # the last t queries over s keys
  q = jnp.asarray(rng.normal(size=(4, t, 4, 8)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(4, s, 2, 8)), jnp.bfloat16)
  q2, k2, v2, m2 = (np.asarray(x) for x in attn_lib.cudnn_operands(q, k, k, jnp.asarray(mask),
                                                                   multiple))
  te, se = (-(-n // multiple) * multiple for n in (t, s))  # rounded up to the multiple
  assert q2.shape == (4, te, 4, 8) and k2.shape == v2.shape == (4, se, 2, 8)
  np.testing.assert_array_equal(q2[:, :t], np.asarray(q))
  assert not q2[:, t:].any() and not k2[:, s:].any()
  assert m2.shape == (4, te, se) and m2.any(-1).all()
  had = mask.any(-1)
  assert not had.all()  # the case is there: rows without a key
  for b, i in zip(*np.nonzero(had)):
    np.testing.assert_array_equal(m2[b, i, :s], mask[b, i])
    assert not m2[b, i, s:].any()
  for b, i in zip(*np.nonzero(~np.pad(had, ((0, 0), (0, te - t))))):
    assert np.flatnonzero(m2[b, i]).tolist() == [min(i, se - 1)]
