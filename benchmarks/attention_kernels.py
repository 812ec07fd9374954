r"""One attention call of the GRPO learner, forward + backward, by each kernel (issue 47).

  python benchmarks/attention_kernels.py --out=/tmp/attention_kernels.json      # a GPU, < 2 min
  python benchmarks/attention_kernels.py --tiny --out=/tmp/attention_kernels.json  # CPU: it runs

Why: at issue 47's shape the learner step took 0.44 s with ``model.attention='flash'`` and 0.22 s
with cuDNN's kernel (H200, BENCHMARKS.md, "Accelerator"), though attention is ~3% of its FLOPs;
cuDNN fails the project's value check (``attention.CUDNN_FAILED``). This measures how much of the
step one layer's attention is under each kernel, and how far each is from the float32 einsum, at
the learner's own shape and mask, so that the next GPU session knows what a fused kernel buys:

  rows     B rows of a left-padded prompt (``--prompt`` slots, ``--prompt_real`` tokens) followed
           by a right-padded completion (``--completion`` slots, uneven lengths down to a
           quarter), one sequence of T = prompt + completion; the mask ``attention.causal_mask``
  einsum   ``attention.einsum_attention`` (the [B, N, T, T] scores kept for the backward)
  flash    ``attention.flash_attention`` (key blocks, online softmax; GPUs' 'auto')
  xla      ``jax.nn.dot_product_attention(implementation='xla')``
  cudnn    ``attention.cudnn_attention`` (NVIDIA GPUs only; refused by model.attention)
  pallas   jax's Pallas Triton FlashAttention (``jax.experimental.pallas.ops.gpu.attention.mha``):
           causal, the padding as segment ids (0 padding, 1 tokens), k and v repeated for the
           query heads (it has no GQA); GPUs, or ``--tiny`` on CPU in Pallas' interpreter

Each: one jitted function returning the output and the gradients of sum(out * w) with respect
to q, k and v (w random on the rows with a real query); compile time apart; the median of
``--rounds`` timed calls; the largest error of out, dq, dk, dv (real query rows only) relative to
the float32 einsum's largest magnitude. Public APIs only.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags

import machine  # benchmarks/machine.py (no torch or JAX at import)
from jaxrl_ga import host_memory  # no JAX at import

IMPLS = ('einsum', 'flash', 'xla', 'cudnn', 'pallas')
_IMPLS = flags.DEFINE_list('impls', list(IMPLS), 'Kernels to run (of ' + ', '.join(IMPLS) + ').')
_TINY = flags.DEFINE_bool('tiny', False, 'A CPU-sized shape (B=2, 8 + 24 slots, 4/2 heads of 16).')
_BATCH = flags.DEFINE_integer('batch', 64, 'B rows (issue 47: 8 prompts x G=8).')
_PROMPT = flags.DEFINE_integer('prompt', 64, 'Prompt slots (left-padded).')
_PROMPT_REAL = flags.DEFINE_integer('prompt_real', 43, 'Prompt tokens per row.')
_COMPLETION = flags.DEFINE_integer('completion', 512, 'Completion slots (right-padded).')
_HEADS = flags.DEFINE_integer('heads', 14, 'Query heads.')
_KV_HEADS = flags.DEFINE_integer('kv_heads', 2, 'Key/value heads.')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 64, 'Head size.')
_LAYERS = flags.DEFINE_integer('layers', 24, 'Layers: the per-call time times this is printed.')
_ROUNDS = flags.DEFINE_integer('rounds', 10, 'Timed calls per kernel.')
_OUT = flags.DEFINE_string('out', '/tmp/attention_kernels.json', 'JSON output.')

TINY = dict(batch=2, prompt=8, prompt_real=5, completion=24, heads=4, kv_heads=2, head_dim=16,
            rounds=2)


def main(argv):
  del argv
  unknown = [name for name in _IMPLS.value if name not in IMPLS]
  if unknown:
    raise machine.BadInput(f'--impls: {", ".join(unknown)} not among {", ".join(IMPLS)}.')
  host_memory.quiet_absent_tpu()  # before JAX starts: an idle libtpu's warnings on a CPU host
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import attention  # pylint: disable=g-import-not-at-top

  s = {k: getattr(flags.FLAGS, k) for k in TINY}
  if _TINY.value:
    s.update(TINY)
  b, n, kv, h = s['batch'], s['heads'], s['kv_heads'], s['head_dim']
  t = s['prompt'] + s['completion']
  gpu = jax.default_backend() == 'gpu'
  rng = np.random.default_rng(0)
  ids = np.zeros((b, t), np.int32)
  lengths = rng.integers(s['completion'] // 4, s['completion'] + 1, b)
  for row in range(b):
    ids[row, s['prompt'] - s['prompt_real']:s['prompt'] + lengths[row]] = 1
  mask = attention.causal_mask(jnp.asarray(ids))
  real = ids.astype(bool)  # rows whose output is read
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, m, h)), jnp.float32) for m in (n, kv, kv))
  w = jnp.asarray(rng.normal(size=(b, t, n, h)) * real[:, :, None, None], jnp.float32)

  def pallas(q, k, v, m):
    del m
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental.pallas.ops.gpu import attention as triton
    r = n // kv  # q head i uses kv head i // r (attention.einsum_attention's grouping)
    block = 64 if t % 64 == 0 else t
    sizes = triton.BlockSizes(block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32,
                              block_q_dq=32, block_kv_dq=32)
    return triton.mha(q, jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2),
                      jnp.asarray(ids), sm_scale=1.0 / np.sqrt(h), causal=True,
                      block_sizes=sizes, interpret=not gpu)

  kernels = {
      'einsum': attention.einsum_attention,
      'flash': attention.flash_attention,
      'xla': lambda q, k, v, m: jax.nn.dot_product_attention(
          q, k, v, mask=m[:, None], scale=1.0 / np.sqrt(h), implementation='xla'),
      'cudnn': lambda q, k, v, m: attention.cudnn_attention(q, k, v, m, causal=True),
      'pallas': pallas,
  }

  def program(fn, dtype):
    def loss(q, k, v):
      out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask)
      return jnp.sum(out.astype(jnp.float32) * w), out
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v: (lambda r: (r[0][1], *r[1]))(grad(q, k, v)))

  def relative(got, ref):
    rows = real
    err = [np.abs(got[0] - ref[0])[rows].max() / np.abs(ref[0][rows]).max()]
    err += [np.abs(a - r).max() / max(np.abs(r).max(), 1e-30) for a, r in zip(got[1:], ref[1:])]
    return [float(e) for e in err]

  as_np = lambda xs: [np.asarray(x, np.float32) for x in xs]
  ref = as_np(program(attention.einsum_attention, jnp.float32)(q, k, v))
  dev = jax.devices()[0]
  print(f'jax {jax.__version__}, {dev.device_kind}; B={b}, T={t} ({s["prompt"]} + '
        f'{s["completion"]}), {n}/{kv} heads of {h}, bfloat16; per call and x{_LAYERS.value} '
        'layers; error of (out, dq, dk, dv) against the float32 einsum', flush=True)
  print('| kernel | compile s | fwd+bwd ms | x layers ms | relative error | NaN |\n'
        '|---|---|---|---|---|---|', flush=True)
  results = {'jax': jax.__version__, 'device': dev.device_kind, 'shape': dict(s, t=t),
             'layers': _LAYERS.value, 'kernels': {}}
  for name in _IMPLS.value:
    if name not in kernels:
      raise app.UsageError(f'--impls: {name!r} is not one of {", ".join(IMPLS)}')
    if name == 'cudnn' and not gpu:
      print(f'| {name} | | | | skipped: needs an NVIDIA GPU | |', flush=True)
      continue
    try:
      fn = program(kernels[name], jnp.bfloat16)
      start = time.perf_counter()
      got = jax.block_until_ready(fn(q, k, v))
      compile_s = time.perf_counter() - start
      times = []
      for _ in range(s['rounds']):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
      ms = 1e3 * statistics.median(times)
      got = as_np(got)
      err, nan = relative(got, ref), bool(any(np.isnan(g).any() for g in got))
      row = {'compile_s': compile_s, 'ms': ms, 'ms_layers': ms * _LAYERS.value,
             'error': err, 'nan': nan}
      print(f'| {name} | {compile_s:.1f} | {ms:.2f} | {ms * _LAYERS.value:.1f} | '
            f'{" ".join(f"{e:.1e}" for e in err)} | {nan} |', flush=True)
    except Exception as e:  # pylint: disable=broad-except
      row = {'error': f'{type(e).__name__}: {str(e).splitlines()[0][:160]}'}
      print(f'| {name} | | | | {row["error"]} | |', flush=True)
    results['kernels'][name] = row
  with open(_OUT.value, 'w') as f:
    json.dump(results, f, indent=1)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  machine.run(main)
