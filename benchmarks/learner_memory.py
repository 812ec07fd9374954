r"""The GRPO learner micro-step's memory, from the compiler: XLA's ``memory_analysis()`` of the
step compiled for the CPU at a given shape (nothing runs, nothing is allocated), per setting of
``model.attention``, ``model.logprob_chunk_size`` and ``model.remat`` (issue 47, item 2).

  python benchmarks/learner_memory.py --out=benchmarks/results/learner_memory.json
  python benchmarks/learner_memory.py --settings=einsum/0/none,flash/128/none

The step is the trainer's own, built as ``python -m jaxrl_ga.plan`` builds it
(``plan.lower_grpo``: ``programs.build_grpo_programs``, abstract params, the config's shapes)
on one CPU device, and compiled by XLA:CPU (``plan.compile_step``); with --topology by libtpu's
compiler for that TPU topology, as ``plan`` does. Default shape: the
Qwen2-architecture model of issue 47 (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864,
attention bias, vocabulary 49,152, tied embeddings: 0.40B params), ``model.dtype=bfloat16``,
``param_dtype=float32``, layers scanned, B = 64 rows per micro-step (8 prompts x G = 8), 64
prompt + 512 completion tokens, K = S = mu = 1. The learner state (params, AdamW moments, the
accumulator) is the step's argument; ``temp`` is what the step allocates besides (activations
kept for the backward, the gradient); ``total`` = argument + output - alias + temp, the bytes
the step holds at once (``plan.compile_step``'s peak). XLA:GPU's buffer assignment differs
from XLA:CPU's, so the figure is the same program's, not a GPU measurement. TRL's peak on an
H200 at this shape (torch, sdpa, bf16 autocast, no checkpointing) was 62.3 GiB (issue 47).
"""

import os
import sys
import time

from absl import app
from absl import flags

import machine  # benchmarks/machine.py

_SETTINGS = flags.DEFINE_list(
    'settings', ['einsum/0/none', 'einsum/128/none', 'xla/128/none', 'flash/0/none',
                 'flash/128/none', 'einsum/128/save_dots', 'flash/128/save_dots',
                 'einsum/128/full'],
    'attention/logprob_chunk_size/remat triples to compile (an attention this checkout does not '
    'know is skipped with a note).')
_B = flags.DEFINE_integer('micro_batch_size', 64, 'Rows per micro-step (8 prompts x G = 8).')
_TP = flags.DEFINE_integer('prompt_length', 64, 'Prompt tokens.')
_TC = flags.DEFINE_integer('completion_length', 512, 'Completion tokens.')
_HIDDEN = flags.DEFINE_integer('hidden_size', 896, 'Model: hidden size.')
_LAYERS = flags.DEFINE_integer('layers', 24, 'Model: decoder layers.')
_HEADS = flags.DEFINE_integer('heads', 14, 'Model: query heads.')
_KV_HEADS = flags.DEFINE_integer('kv_heads', 2, 'Model: key/value heads.')
_MLP = flags.DEFINE_integer('intermediate_size', 4864, 'Model: MLP width.')
_VOCAB = flags.DEFINE_integer('vocab_size', 49152, 'Model: vocabulary.')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'model.dtype (compute).')
_TOPOLOGY = flags.DEFINE_string(
    'topology', None, 'Compile for this TPU topology instead (e.g. v5p:1x1; libtpu\'s compiler, '
    'as python -m jaxrl_ga.plan does; no TPU needed).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/learner_memory.json', 'JSON output.')

_GIB = 2**30


def run_config(attention: str, chunk: int, remat: str):
  """The RunConfig of the measured run (configs/grpo_gsm8k_tpu.py's recipe, this shape)."""
  from jaxrl_ga.config import RunConfig, default_config_dict, from_mapping, set_task  # pylint: disable=g-import-not-at-top
  c = default_config_dict()
  c.stages = 'grpo'
  set_task(c, 'arithmetic')
  c.model.update(architecture='qwen2', vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value,
                 intermediate_size=_MLP.value, num_hidden_layers=_LAYERS.value,
                 num_attention_heads=_HEADS.value, num_key_value_heads=_KV_HEADS.value,
                 attention_bias=True, tie_word_embeddings=True, rope_theta=1000000.0,
                 max_position_embeddings=32768, dtype=_DTYPE.value, param_dtype='float32',
                 scan_layers=True, remat=remat, logprob_chunk_size=chunk, attention=attention)
  c.mesh.update(data=1, fsdp=1, tensor=1)
  c.grpo.schedule.update(micro_batch_size=_B.value, num_generations=8, steps_per_generation=1,
                         num_iterations=1, grad_accum_steps=1)
  c.grpo.sampling.update(max_prompt_length=_TP.value, max_completion_length=_TC.value)
  c.grpo.loss.update(beta=0.0)
  return from_mapping(RunConfig, c.to_dict())


def measure(attention: str, chunk: int, remat: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import plan  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import policy  # pylint: disable=g-import-not-at-top
  cfg = run_config(attention, chunk, remat)
  t0 = time.perf_counter()
  devices = (plan.topology_devices(_TOPOLOGY.value) if _TOPOLOGY.value
             else jax.devices('cpu')[:1])
  lowered = plan.lower_grpo(cfg, policy.planned_model_config(cfg), devices,
                            steps=('learner',)).learner
  step = plan.compile_step(lowered)
  seconds = time.perf_counter() - t0
  keys = ('argument_bytes', 'output_bytes', 'temp_bytes', 'alias_bytes', 'peak_bytes')
  return {'attention': attention, 'logprob_chunk_size': chunk, 'remat': remat,
          **{k: step[k] for k in keys}, 'lower_compile_seconds': seconds}


def main(argv):
  del argv
  from jaxrl_ga.models import attention as attn_lib  # pylint: disable=g-import-not-at-top
  rows, skipped = [], []
  for s in _SETTINGS.value:  # every one checked before the first compile
    parts = s.split('/')
    if len(parts) != 3 or not parts[1].lstrip('-').isdigit():
      raise machine.BadInput(f'--settings: {s!r} is not attention/chunk/remat, e.g. '
                             f'flash/0/none.')
  for s in _SETTINGS.value:
    attention, chunk, remat = s.split('/')
    if attention not in attn_lib.ATTENTION_IMPLS:
      skipped.append(s)
      print(f'skipped {s}: this checkout has no model.attention={attention}', flush=True)
      continue
    r = measure(attention, int(chunk), remat)
    rows.append(r)
    print(f'{s}: total {r["peak_bytes"] / _GIB:.2f} GiB (temp {r["temp_bytes"] / _GIB:.2f}); '
          f'{r["lower_compile_seconds"]:.0f} s to lower and compile', flush=True)
  compiler = f'TPU {_TOPOLOGY.value}' if _TOPOLOGY.value else 'XLA:CPU'
  print(f'\nGRPO learner micro-step, B={_B.value}, T={_TP.value}+{_TC.value}, '
        f'dtype={_DTYPE.value}, {compiler} memory_analysis() (GiB)\n')
  print('| attention | logprob_chunk_size | remat | argument | output | temp | alias | total |')
  print('|---|---|---|---|---|---|---|---|')
  for r in rows:
    g = lambda k: f'{r[k] / _GIB:.2f}'
    print(f'| {r["attention"]} | {r["logprob_chunk_size"]} | {r["remat"]} | {g("argument_bytes")} '
          f'| {g("output_bytes")} | {g("temp_bytes")} | {g("alias_bytes")} | '
          f'**{g("peak_bytes")}** |')
  shape = dict(micro_batch_size=_B.value, prompt_length=_TP.value,
               completion_length=_TC.value, hidden_size=_HIDDEN.value, layers=_LAYERS.value,
               heads=_HEADS.value, kv_heads=_KV_HEADS.value,
               intermediate_size=_MLP.value, vocab_size=_VOCAB.value, dtype=_DTYPE.value,
               param_dtype='float32')
  machine.write_json(_OUT.value, {'machine': machine.machine_info(shape=shape),
                                  'compiler': compiler, 'results': rows, 'skipped': skipped,
                                  'trl_peak_gib_h200': 62.3})


if __name__ == '__main__':
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  machine.run(main)
