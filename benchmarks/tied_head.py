r"""The tied lm head at decode shapes: ``h @ embed.T`` against the same product in vocabulary blocks.

  python benchmarks/tied_head.py --out=benchmarks/results/tied_head.json

With tied embeddings the next-token logits are ``h [rows, D] @ embed[V, D].T``. At decode time
``rows`` is the batch (8-64), so the product reads the whole table once per step and is bound by
how fast it streams the table. ``decode.py``'s profile showed XLA:CPU's plain product at about
half the rate of a plain read of the table (SmolLM2: 16 ms of a 59 ms decode step). This script
times, per row count and vocabulary shape, in alternating order within each round:

  * plain: ``jnp.matmul(h, embed.T)``, the head of the training forward;
  * blocked: ``einsum('bd,cvd->cbv', h, embed.reshape(32, V / 32, D))`` transposed back to
    [rows, V], the form ``Transformer.decode`` and ``prefill`` use on CPU for 2-64 rows with a
    vocabulary of 16k or more (``jaxrl_ga/models/transformer.py``);
  * a plain sum of the table, the read rate the table could stream at.

It reports medians (ms, and GB/s of the table's bytes) and the paired ratio plain / blocked, and
checks that both forms agree (max abs difference). Shapes: SmolLM2-135M's table (49,152 x 576)
and the d=512 benchmark model's vocabulary (32,000 x 512); random float32 values.
"""

from __future__ import annotations

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

_ROWS = flags.DEFINE_list('rows', ['1', '8', '32', '64', '128', '256'], 'Row counts (the batch).')
_ROUNDS = flags.DEFINE_integer('rounds', 15, 'Timed rounds per row count.')
_BLOCKS = flags.DEFINE_integer('blocks', 32, 'Vocabulary blocks of the blocked form.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)
_OUT = flags.DEFINE_string('out', 'benchmarks/results/tied_head.json', 'JSON output.')

SHAPES = (('smollm2', 49152, 576), ('vocab32000', 32000, 512))


def _time(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def main(argv):
  del argv
  blocks = _BLOCKS.value
  info = machine.machine_info(blocks=blocks, rounds=_ROUNDS.value)
  results, lines = [], []
  for name, v, d in SHAPES:
    embed = jnp.asarray(np.random.default_rng(0).standard_normal((v, d), np.float32))
    table_bytes = v * d * 4
    total = jax.jit(lambda e: jnp.sum(e, 0))
    for rows in map(int, _ROWS.value):
      h = jnp.asarray(np.random.default_rng(1).standard_normal((rows, d), np.float32))
      plain = jax.jit(lambda h, e: jnp.matmul(h, e.T, preferred_element_type=jnp.float32))
      blocked = jax.jit(lambda h, e: jnp.einsum(
          'bd,cvd->cbv', h, e.reshape(blocks, v // blocks, d),
          preferred_element_type=jnp.float32).transpose(1, 0, 2).reshape(h.shape[0], v))
      diff = float(jnp.max(jnp.abs(plain(h, embed) - blocked(h, embed))))
      total(embed).block_until_ready()
      samples = {'plain': [], 'blocked': [], 'sum': []}
      for r in range(_ROUNDS.value):
        order = ('plain', 'blocked', 'sum') if r % 2 == 0 else ('sum', 'blocked', 'plain')
        for which in order:
          if which == 'sum':
            samples[which].append(_time(total, embed))
          else:
            samples[which].append(_time(plain if which == 'plain' else blocked, h, embed))
      med = {k: statistics.median(x) for k, x in samples.items()}
      paired = statistics.median(a / b for a, b in zip(samples['plain'], samples['blocked']))
      row = dict(shape=name, vocab=v, hidden=d, rows=rows, max_abs_diff=diff,
                 ms={k: 1e3 * x for k, x in med.items()},
                 gb_per_s={k: table_bytes / x / 1e9 for k, x in med.items()},
                 plain_over_blocked_paired=paired, samples_s=samples)
      results.append(row)
      line = (f"| {name} | {v} x {d} | {rows} | {row['ms']['plain']:.2f} "
              f"({row['gb_per_s']['plain']:.1f}) | {row['ms']['blocked']:.2f} "
              f"({row['gb_per_s']['blocked']:.1f}) | {row['ms']['sum']:.2f} "
              f"({row['gb_per_s']['sum']:.1f}) | {paired:.2f}x | {diff:.1e} |")
      lines.append(line)
      print(line, flush=True)
  print('\n| table | V x D | rows | plain ms (GB/s) | blocked ms (GB/s) | plain sum ms (GB/s) '
        '| plain / blocked (paired) | max abs diff |\n|---|---|---|---|---|---|---|---|')
  print('\n'.join(lines))
  machine.write_json(_OUT.value, {'machine': info, 'results': results})


if __name__ == '__main__':
  machine.run(main)
