r"""The ceiling of a decode step on CPU: decode-shaped products in XLA, PyTorch and NumPy.

  python benchmarks/skinny_products.py --out=benchmarks/results/skinny_products.json

A decode step multiplies ``rows`` (the batch: 8-32) activations by every weight matrix once. Its
roofline bound (``decode.py``) is the larger of streaming the weights at the machine's
weight-streaming rate and the FLOPs at its matmul peak (``machine.Roofline``, measured in this
process). This script asks how close any library here gets to that bound on the products alone:
``[rows, 576] @ [576, 1536]`` (SmolLM2-135M's MLP shape) over ``--matrices`` distinct float32
matrices (212 MB at 60, so every read is cold), timed in alternating order per round:

  * XLA: one jitted function returning every product (what a decode step's layers run);
  * PyTorch (``torch.matmul``, ``--torch_threads``) and NumPy (its BLAS), a product per matrix;
  * each library again with the weights stored transposed (``[1536, 576]``, the product
    contracting both operands' last axes: ``lax.dot_general``, ``x @ w.t()``, ``x @ w.T``), the
    layout in which a row of the weight is one output's dot product.

It prints, per row count and library, the median time, the GB/s of the weights and GFLOP/s, and
each as a fraction of the same process's streaming rate and matmul peak; the better of the two is
the fraction of the binding bound that a decode step made only of these products could reach.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import machine  # benchmarks/machine.py

machine.reuse_freed_memory(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

torch = machine.optional_module('torch')  # the peer's side: --help works without it

_ROWS = flags.DEFINE_list('rows', ['8', '32'], 'Row counts (the decode batch).')
_MATRICES = flags.DEFINE_integer('matrices', 60, 'Distinct weight matrices per call.')
_ROUNDS = flags.DEFINE_integer('rounds', 15, 'Timed rounds per row count.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 0, 'torch.set_num_threads; 0 = the '
                                      'usable CPU cores.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)
_OUT = flags.DEFINE_string('out', 'benchmarks/results/skinny_products.json', 'JSON output.')

D, F = 576, 1536  # SmolLM2-135M's hidden and MLP sizes


def main(argv):
  del argv
  machine.require(torch=torch)
  threads = _TORCH_THREADS.value or len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  info = machine.machine_info(rounds=_ROUNDS.value, matrices=_MATRICES.value,
                              torch_threads=threads)
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal((D, F), np.float32) for _ in range(_MATRICES.value)]
  on_xla = [jnp.asarray(w) for w in weights]
  on_torch = [torch.from_numpy(w) for w in weights]
  xla_chain = jax.jit(lambda x, ws: [x @ w for w in ws])
  transposed = [np.ascontiguousarray(w.T) for w in weights]  # [F, D]: the stored layout
  on_xla_t = [jnp.asarray(w) for w in transposed]
  on_torch_t = [torch.from_numpy(w) for w in transposed]
  contract_last = (((1,), (1,)), ((), ()))
  xla_chain_t = jax.jit(lambda x, ws: [jax.lax.dot_general(x, w, contract_last) for w in ws])
  weight_bytes = _MATRICES.value * D * F * 4
  roofline = machine.Roofline()
  results, lines = [], []
  for rows in map(int, _ROWS.value):
    x = rng.standard_normal((rows, D), np.float32)
    x_xla, x_torch = jnp.asarray(x), torch.from_numpy(x)
    calls = {'XLA': lambda: jax.block_until_ready(xla_chain(x_xla, on_xla)),
             'PyTorch': lambda: [x_torch @ w for w in on_torch],
             'NumPy': lambda: [x @ w for w in weights],
             'XLA, W^T stored': lambda: jax.block_until_ready(xla_chain_t(x_xla, on_xla_t)),
             'PyTorch, W^T stored': lambda: [x_torch @ w.t() for w in on_torch_t],
             'NumPy, W^T stored': lambda: [x @ w.T for w in transposed]}
    for call in calls.values():
      call()  # compile / warm up
    # The two layouts compute the same products.
    np.testing.assert_allclose(np.asarray(xla_chain_t(x_xla, on_xla_t)[0]),
                               np.asarray(xla_chain(x_xla, on_xla)[0]), rtol=1e-4, atol=1e-4)
    samples = {name: [] for name in calls}
    for r in range(_ROUNDS.value):
      for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
        t0 = time.perf_counter()
        calls[name]()
        samples[name].append(time.perf_counter() - t0)
      if r % 5 == 0:
        roofline.measure()
    bounds = roofline.summary()
    flops = 2 * rows * D * F * _MATRICES.value
    for name, times in samples.items():
      s = statistics.median(times)
      row = dict(rows=rows, library=name, ms=1e3 * s, gb_per_s=weight_bytes / s / 1e9,
                 gflop_per_s=flops / s / 1e9,
                 of_streaming=weight_bytes / s / bounds['bandwidth_bytes_per_s'],
                 of_peak=flops / s / bounds['peak_flops_per_s'], samples_s=times)
      row['of_binding_bound'] = max(row['of_streaming'], row['of_peak'])
      results.append(row)
      lines.append(f"| {rows} | {name} | {row['ms']:.2f} | {row['gb_per_s']:.1f} "
                   f"({100 * row['of_streaming']:.0f}%) | {row['gflop_per_s']:.0f} "
                   f"({100 * row['of_peak']:.0f}%) | {100 * row['of_binding_bound']:.0f}% |")
      print(lines[-1], flush=True)
  bounds = roofline.summary()
  print(f'\n{machine.roofline_text(bounds)}\n')
  print(f'| rows | library | ms per {_MATRICES.value} products | GB/s (of streaming) | '
        'GFLOP/s (of peak) | of the binding bound |\n|---|---|---|---|---|---|')
  print('\n'.join(lines))
  machine.write_json(_OUT.value, {'machine': info, 'roofline': bounds, 'results': results})


if __name__ == '__main__':
  machine.run(main)
