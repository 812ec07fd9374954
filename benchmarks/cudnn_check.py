r"""Where cuDNN's fused attention leaves the float32 einsum (issue 47): a bisection for a GPU session.

  python benchmarks/cudnn_check.py --out=/tmp/cudnn_check.json            # an NVIDIA GPU, < 2 min
  python benchmarks/cudnn_check.py --implementation=xla --out=/tmp/x.json  # CPU: the script runs

What is known (BENCHMARKS.md, "Accelerator", run 3 on an H200, jax 0.11.2, cuDNN 9.19): one
attention call with a constant mask (``jaxrl_ga.models.attention.cudnn_attention`` on random
q, k, v; left/right padding; B=4, T=24 or 128, head size 24 or 64) is as close to the float32
einsum as the bf16 einsum, forward and gradients; at B=2, T=576, 14/2 heads, rows without any
key gave NaN in dq (now ``cudnn_operands`` gives them a key). The learner's loss and gradient on
the model-family fixtures (tests/test_attention_gpu.py) still differ: relative error 0.82 where the
bf16 einsum's is 0.034, from the self-attention calls (the shared-prompt cross attention alone
matches), and 76 with the kernel's causal flag off. So something between the two cases matters;
each row below adds one of the differences to the passing case:

  base      B=4, T=24, 4/2 heads of 24, left and right padding, the mask a constant
  runtime   the mask an argument of the jitted function (computed on the device, not folded)
  batch5    B=5 (the fixture test's full rows)
  packed    a packed SFT row (3 segments, then padding)
  odd       T=23, through ``cudnn_operands``' added query and key
  scan      two layers under ``lax.scan``, the mask a loop invariant, each layer's output the
            next one's input through a fixed random projection
  nocausal  the mask alone, cuDNN's causal flag off (the fixtures gave 76 this way)
  all       runtime + batch5 + packed + odd + scan
  pad128    base with T and S padded to 128 (``cudnn_operands(length_multiple=128)``): whole
            128-key tiles, the workaround of cuDNN's SM90 backward bug with an explicit mask
            (pytorch/pytorch#196678: the padded tail of the last key tile scored 0, not masked)
  all128    all, padded to 128

Per row: the largest error of the output (on rows with a key) and of dq, dk, dv, relative to the
float32 einsum's largest magnitude, next to the bf16 einsum's own. Public API only:
``jax.nn.dot_product_attention`` through ``attention.cudnn_attention``, ``attention.causal_mask``,
``attention.einsum_attention``.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

import machine  # benchmarks/machine.py (no torch or JAX at import)

_IMPL = flags.DEFINE_enum('implementation', 'cudnn', ['cudnn', 'xla'],
                          "'xla' checks the script itself on a machine without cuDNN.")
_OUT = flags.DEFINE_string('out', 'benchmarks/results/cudnn_check.json', 'JSON output.')
CASES = ('base', 'runtime', 'batch5', 'packed', 'odd', 'scan', 'nocausal', 'all', 'pad128',
         'all128')


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import attention  # pylint: disable=g-import-not-at-top

  def attend(impl, q, k, v, mask, causal, multiple=2):
    if impl == 'cudnn':
      return attention.cudnn_attention(q, k, v, mask, causal=causal, length_multiple=multiple)
    if impl == 'xla':  # cuDNN's operands (cudnn_operands), through XLA's attention
      q2, k2, v2, m2 = attention.cudnn_operands(q, k, v, mask, multiple)
      return jax.nn.dot_product_attention(q2, k2, v2, mask=m2[:, None],
                                          implementation='xla')[:, :q.shape[1]]
    return attention.einsum_attention(q, k, v, mask)

  def case(name):
    parts = ({'runtime', 'batch5', 'packed', 'odd', 'scan'} if name.startswith('all')
             else {name})
    parts |= {'pad128'} if name.endswith('128') else set()
    b = 5 if 'batch5' in parts else 4
    t = 23 if 'odd' in parts else 24
    ids = np.zeros((b, t), np.int32)
    for row, (left, right) in enumerate([(0, 0), (3, 2), (7, 5), (1, 9), (2, 0)][:b]):
      ids[row, left:t - right] = 1
    if 'packed' in parts:
      ids[-1] = 0
      ids[-1, :6], ids[-1, 6:15], ids[-1, 15:20] = 1, 2, 3
    return parts, b, t, np.asarray(attention.causal_mask(jnp.asarray(ids)))

  def run(name, impl, dtype):
    parts, b, t, mask = case(name)
    rng = np.random.default_rng(0)
    n, kv, h, layers = 4, 2, 24, 2 if 'scan' in parts else 1
    x = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    mix = jnp.asarray(rng.normal(size=(layers, h, h)) / np.sqrt(h), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, n, h)) * mask.any(-1)[:, :, None, None], jnp.float32)
    causal = 'nocausal' not in parts

    def forward(x, k, v, m):
      def layer(q, p):  # q: this layer's queries; the output, mixed, is the next one's
        out = attend(impl, q.astype(dtype), k.astype(dtype), v.astype(dtype), m, causal,
                     128 if 'pad128' in parts else 2)
        return jnp.einsum('btnh,hg->btng', out.astype(jnp.float32), p), None
      return jax.lax.scan(layer, x, mix)[0]

    def loss(x, k, v, m):
      return jnp.sum(forward(x, k, v, m) * w)

    if 'runtime' in parts:
      fn = jax.jit(lambda x, k, v, m: (forward(x, k, v, m),
                                       jax.grad(loss, argnums=(0, 1, 2))(x, k, v, m)))
      out, grads = fn(x, k, v, jnp.asarray(mask))
    else:
      fn = jax.jit(lambda x, k, v: (forward(x, k, v, jnp.asarray(mask)), jax.grad(
          lambda *a: loss(*a, jnp.asarray(mask)), argnums=(0, 1, 2))(x, k, v)))
      out, grads = fn(x, k, v)
    return mask.any(-1), [np.asarray(a, np.float32) for a in (out, *grads)]

  def relative(got, ref, rows):
    err = [np.abs(got[0] - ref[0])[rows].max() / np.abs(ref[0][rows]).max()]
    err += [np.abs(a - r).max() / max(np.abs(r).max(), 1e-30) for a, r in zip(got[1:], ref[1:])]
    return [float(e) for e in err]

  print(f'jax {jax.__version__}, {jax.devices()[0].device_kind}; {_IMPL.value} against the '
        'float32 einsum: relative error of (out, dq, dk, dv)', flush=True)
  print('| case | bf16 einsum | bf16 ' + _IMPL.value + ' | NaN |\n|---|---|---|---|')
  results = {'jax': jax.__version__, 'device': jax.devices()[0].device_kind,
             'implementation': _IMPL.value, 'cases': {}}
  for name in CASES:
    rows, ref = run(name, 'einsum', jnp.float32)
    _, einsum = run(name, 'einsum', jnp.bfloat16)
    try:
      _, got = run(name, _IMPL.value, jnp.bfloat16)
      nan = bool(any(np.isnan(g).any() for g in got))
      err = relative(got, ref, rows)
    except Exception as e:  # pylint: disable=broad-except
      nan, err = None, f'{type(e).__name__}: {str(e).splitlines()[0][:100]}'
    base = relative(einsum, ref, rows)
    fmt = lambda e: ' '.join(f'{x:.1e}' for x in e) if isinstance(e, list) else e
    print(f'| {name} | {fmt(base)} | {fmt(err)} | {nan} |', flush=True)
    results['cases'][name] = {'einsum_bf16': base, 'got': err, 'nan': nan}
  with open(_OUT.value, 'w') as f:
    json.dump(results, f, indent=1)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  machine.run(main)
