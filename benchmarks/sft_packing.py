r"""SFT tokens/s with and without packing (``sft.packing``) on a length-varied chat set.

  python benchmarks/sft_packing.py --out=benchmarks/results/sft_packing.json

The data: ``--num_rows`` chat rows ``{"messages": [user, assistant]}`` written to a temporary
JSONL; the user turn asks "What is a+b?" followed by filler words, the assistant reply states the
sum followed by filler words; each turn's filler length is drawn log-uniformly between 1 and
``--max_words`` words (seeded), so the rendered rows (the model's plain chat template, one token
per character) spread from about 30 tokens to ``--max_length``; rows over it are dropped
(``sft.too_long=drop``, counted). The model: a fresh one of the CPU default's architecture
(hidden 128, MLP 256, 2 layers, 4 heads of which 2 key/value, configs/grpo_arith.py), or other
sizes through the scripts' shared size flags (``--big_hidden_size``, ``--big_layers``, ...;
``machine.BIG_MODEL_FLAGS``).

Both variants are the library's SFT stage pieces: ``api.build_context`` (rows read, rendered,
tokenized and fitted once), ``programs.build_sft_programs`` and ``trainers.sft.micro_batch`` (the
micro-batch the trainer builds at a data position: ``--micro_batch_size`` rows of
``--max_length`` tokens, one example per row, or as many as greedily fill the rows). Each is
compiled first (compile time apart), then timed in interleaved rounds of ``--steps`` learner
steps (K = 1: every step an optimizer step), each round continuing the data stream where that
variant's last one stopped; medians over rounds. Reported per variant: examples/s and real (not
padding) tokens/s, the padding share of the rows, and the speed-up of packing. Packing changes
which examples a step holds, not how a window's loss is normalized (tests/test_sft_data.py shows
the same examples give the same accumulated gradient, packed or not).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import machine  # noqa: E402
from jaxrl_ga import api  # noqa: E402
from jaxrl_ga import host_memory  # noqa: E402
from jaxrl_ga import placement  # noqa: E402
from jaxrl_ga import programs  # noqa: E402
from jaxrl_ga.trainers import context  # noqa: E402
from jaxrl_ga.trainers import sft  # noqa: E402

host_memory.quiet_absent_tpu()  # before JAX starts its backends: an idle libtpu's warnings

_OUT = flags.DEFINE_string('out', 'benchmarks/results/sft_packing.json', 'JSON results path.')
_ROWS = flags.DEFINE_integer('num_rows', 2000, 'chat rows written.')
_MAX_WORDS = flags.DEFINE_integer('max_words', 40, 'most filler words per turn.')
_MAX_LENGTH = flags.DEFINE_integer('max_length', 256, 'sft.max_length (row length).')
_B = flags.DEFINE_integer('micro_batch_size', 8, 'rows per micro-step.')
_STEPS = flags.DEFINE_integer('steps', 5, 'learner steps per variant per round.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'timed rounds.')
# configs/grpo_arith.py's CPU model by default: --big_hidden_size, ... (machine.BIG_MODEL_FLAGS)
_MODEL = machine.define_big_model_flags(hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2)
_SEED = flags.DEFINE_integer('seed', 0, 'data seed.')

WORDS = ('the', 'sum', 'of', 'two', 'numbers', 'is', 'found', 'by', 'adding', 'them', 'so',
         'we', 'carry', 'tens', 'and', 'ones', 'here')


def chat_rows(n: int, max_words: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  filler = lambda: ' '.join(rng.choice(WORDS, int(math.exp(rng.uniform(0, math.log(max_words))))))
  rows = []
  for _ in range(n):
    a, b = rng.integers(0, 100, 2)
    rows.append({'messages': [
        {'role': 'user', 'content': f'What is {a}+{b}? {filler()}'},
        {'role': 'assistant', 'content': f'{a + b}. {filler()}'}]})
  return rows


def main(argv):
  del argv
  tmp = tempfile.mkdtemp(prefix='sft_packing_')
  path = os.path.join(tmp, 'chat.jsonl')
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in chat_rows(_ROWS.value, _MAX_WORDS.value,
                                                          _SEED.value))
  base = {'stages': 'sft', 'data.train': path, 'data.eval_fraction': 0.01,
          'sft.max_length': _MAX_LENGTH.value, 'sft.too_long': 'drop',
          'sft.micro_batch_size': _B.value, 'sft.grad_accum_steps': 1,
          **{f'model.{field}': value for field, value in _MODEL().items()},
          'model.max_position_embeddings': 1024}
  ctx, params = api.build_context(api.make_config('configs/sft_arith.py', **base),
                                  os.path.join(tmp, 'wd'))
  lengths = [len(ids) for ids, _ in ctx.task.sequences]
  part = context.TrainedPart(ctx, params)
  variants = {}
  for packing in (False, True):
    cfg = api.make_config('configs/sft_arith.py', **base, **{'sft.packing': packing})
    v = {'cfg': cfg.sft, 'seed': cfg.seed, 'position': 0, 'times': [], 'examples': 0,
         'tokens': 0, 'slots': 0,
         'programs': programs.build_sft_programs(cfg, ctx.model_cfg, ctx.mesh,
                                                 ctx.param_shardings, ctx.graphdef,
                                                 eos_id=ctx.eos_id, pad_id=ctx.pad_id)}
    v['learner'] = v['programs'].learner
    t0 = time.perf_counter()
    v['state'] = v['programs'].init_state(params)
    v['state'], out = v['learner'].step(v['state'], next_batch(v, ctx), part.frozen)
    jax.block_until_ready(out)
    v.update(compile_s=time.perf_counter() - t0, examples=0, tokens=0, slots=0)
    variants['packed' if packing else 'one per row'] = v

  for _ in range(_ROUNDS.value):  # interleaved rounds; batches built before the clock starts
    for v in variants.values():
      counts = (v['examples'], v['tokens'])
      batches = [next_batch(v, ctx) for _ in range(_STEPS.value)]
      t0 = time.perf_counter()
      for b in batches:
        v['state'], out = v['learner'].step(v['state'], b, part.frozen)
      jax.block_until_ready(out)
      v['times'].append((time.perf_counter() - t0, v['examples'] - counts[0],
                         v['tokens'] - counts[1]))

  rows = {}
  for name, v in variants.items():
    s, ex, tok = (np.array(x, np.float64) for x in zip(*v['times']))
    rows[name] = {'examples_per_s': float(np.median(ex / s)),
                  'tokens_per_s': float(np.median(tok / s)),
                  'step_s': float(np.median(s) / _STEPS.value),
                  'padding_share': 1 - v['tokens'] / v['slots'],
                  'examples_per_step': v['examples'] / (_ROUNDS.value * _STEPS.value),
                  'compile_s': v['compile_s'], 'rounds_s_examples_tokens': v['times']}
  speedup = rows['packed']['tokens_per_s'] / rows['one per row']['tokens_per_s']
  print(f'\nSFT, {len(lengths)} chat rows of {min(lengths)}-{max(lengths)} tokens (median '
        f'{int(np.median(lengths))}; {ctx.task.dropped} over {_MAX_LENGTH.value} dropped), '
        f'{_B.value} rows x {_MAX_LENGTH.value} tokens per step, hidden '
        f'{ctx.model_cfg.hidden_size}, {ctx.model_cfg.num_hidden_layers} layers, '
        f'{jax.devices()[0].platform}\n')
  print('| variant | examples/step | padding | step (s) | examples/s | tokens/s | compile (s) |')
  print('|---|---|---|---|---|---|---|')
  for name, r in rows.items():
    print(f'| {name} | {r["examples_per_step"]:.1f} | {r["padding_share"]:.0%} | '
          f'{r["step_s"]:.3f} | {r["examples_per_s"]:.1f} | {r["tokens_per_s"]:.0f} | '
          f'{r["compile_s"]:.1f} |')
  print(f'\npacking: {speedup:.2f}x the tokens/s (medians of {_ROUNDS.value} rounds of '
        f'{_STEPS.value} steps; tokens: real, not padding)')
  machine.write_json(_OUT.value, {
      'machine': machine.machine_info(load_avg_end=os.getloadavg()),
      'flags': {f: flags.FLAGS[f].value for f in (
          'num_rows', 'max_words', 'max_length', 'micro_batch_size', 'steps', 'rounds', 'seed',
          *machine.BIG_MODEL_FLAGS)},
      'row_lengths': {'min': min(lengths), 'median': float(np.median(lengths)),
                      'max': max(lengths), 'dropped': ctx.task.dropped},
      'variants': rows, 'packing_speedup_tokens_per_s': speedup})


def next_batch(v, ctx):
  """The variant's next micro-batch from its data position (as trainers.sft builds it)."""
  b, used = sft.micro_batch(ctx, v['cfg'], v['position'], v['seed'],
                            placement.batch_rows(_B.value, ctx.mesh))
  v['tokens'] += int(np.sum(b['attention_mask'] > 0))
  v['slots'] += b['tokens'].size
  v['position'] += used
  v['examples'] += used
  return placement.place_rows(b, _B.value, ctx.mesh)


if __name__ == '__main__':
  machine.run(main)
