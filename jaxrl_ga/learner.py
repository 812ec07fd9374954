"""The train state and the one jitted learner step (exact accumulation with optax.MultiSteps).

Exactness. Every task loss returns, for its micro-batch, the *un-normalized* numerator of the
window loss and its contribution to the window normalizer (``losses.LossTerms``). The step
differentiates the numerator only; ``optax.MultiSteps(use_grad_mean=False)`` sums those gradients
in float32 while the state sums the normalizers; at the optimizer step the inner optimizer first
divides the summed gradient by the summed normalizer (passed as the extra argument
``denominator``), then clips by global norm, then applies AdamW. A window that spans two rollouts,
or micro-batches of different token counts, or several data-parallel shards and hosts (the sums are
over global arrays), therefore gets exactly the gradient of its one-pass loss.

Non-finite windows are skipped by ``optax.apply_if_finite``: params and the AdamW state are left
unchanged and ``total_notfinite`` counts them. Metrics are accumulated in the state the same way
(sums and weights, mins, maxes) and finalized into exact window means when a step fires.

``optax.MultiSteps`` runs its inner optimizer at every micro-step and discards the result unless it
is the last; with ``lazy_inner=True`` (default) a ``lax.cond`` runs it, and the param update, only
when an optimizer step fires, keeping MultiSteps' state and semantics bit for bit (measured in
benchmarks/multisteps_overhead.py).

LoRA (``frozen_shardings``): the state's params are the trainable ones only (the adapters,
``jaxrl_ga.lora.split``); the frozen rest (the base weights) is an argument of every step, never
donated nor part of the state (so never in a checkpoint), and the model is
``transformer.merge(graphdef, params, frozen)``. Gradients, the accumulator and AdamW's moments
exist for the trainable params only; the accumulation is exact in the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import optax

from jaxrl_ga import logprobs
from jaxrl_ga import losses
from jaxrl_ga import sharding
from jaxrl_ga.config import DPOLossConfig, GRPOLossConfig, OptimizerConfig, ScheduleConfig
from jaxrl_ga.models import transformer as tfm

TaskLoss = Callable[[tfm.Transformer, dict], losses.LossTerms]


@dataclasses.dataclass(frozen=True)
class ForwardLoss:
  """A task loss over the model's forward, what ``sft_task_loss``, ``grpo_task_loss`` and
  ``dpo_task_loss`` return: ``loss(model, batch, options)`` with the forward's ``options``. The
  Learner runs ``on(its mesh)``: the same loss with the activations' sharding constraints on
  that mesh (``ForwardOptions.activation_mesh``). A plain ``(model, batch)`` function is a
  TaskLoss too; its forward is constrained where its own options say."""
  loss: Callable[[tfm.Transformer, dict, tfm.ForwardOptions], losses.LossTerms]
  options: tfm.ForwardOptions

  def __call__(self, model, batch):
    return self.loss(model, batch, self.options)

  def on(self, mesh) -> 'ForwardLoss':
    return dataclasses.replace(self, options=dataclasses.replace(
        self.options, activation_mesh=sharding.KernelMesh(mesh)))


# -- task losses --------------------------------------------------------------------------------
def completion_logps(model: tfm.Transformer, prompt_tokens, prompt_mask, completion_tokens,
                     completion_mask, with_entropy: bool = False, temperature=1.0, **options):
  """``logprobs.completion_logps`` with the forward's options given as ``ForwardOptions``
  keywords (scan_layers, remat, logprob_chunk_size, share_prompts, adapters): the form the
  exactness tests call. The library passes a ``ForwardOptions``."""
  return logprobs.completion_logps(model, prompt_tokens, prompt_mask, completion_tokens,
                                   completion_mask, tfm.ForwardOptions(**options),
                                   with_entropy=with_entropy, temperature=temperature)


def _options(options: Optional[tfm.ForwardOptions], fields: dict) -> tfm.ForwardOptions:
  """``options``, or one built from ForwardOptions keywords (not both)."""
  if options is not None and fields:
    raise TypeError(f'pass options or its fields {sorted(fields)}, not both.')
  return tfm.ForwardOptions(**fields) if options is None else options


def sft_task_loss(options: Optional[tfm.ForwardOptions] = None, **fields) -> TaskLoss:
  """Batch: tokens, attention_mask, loss_mask [B, T] (loss_mask marks the target tokens).
  ``options``: the forward's (``ForwardOptions``, or its fields as keywords)."""
  options = _options(options, fields)

  def task_loss(model, batch, options):
    logps = logprobs.token_logps_of(model, batch['tokens'], batch['attention_mask'], options)
    return losses.sft_loss(logps, batch['loss_mask'][:, 1:].astype(jnp.float32))

  return ForwardLoss(task_loss, options)


def grpo_task_loss(cfg: GRPOLossConfig, max_completion_length: int,
                   temperature: float = 1.0, options: Optional[tfm.ForwardOptions] = None,
                   **fields) -> TaskLoss:
  """Batch: prompt_tokens/prompt_mask [B, Tp], completion_tokens/completion_mask [B, Tc],
  advantages [B], old_logps [B, Tc] with has_old [B] (rows without old log-probs are on-policy:
  their "old" is stop_gradient(current), ratio 1), ref_logps [B, Tc] when beta > 0, and
  sampler_logps [B, Tc] with loss.sampler_is_correction or loss.off_policy_mask_threshold.
  Multi-turn rows also hold loss_mask [B, Tc], the tokens the policy sampled: completion_mask is
  then the forward's attention mask only and loss_mask the loss's (and its normalizers').
  ``options``: the forward's (``ForwardOptions``, or its fields as keywords); with
  ``share_prompts`` = R, rows ``i*R .. i*R+R-1`` of every micro-batch share their prompt."""
  options = _options(options, fields)

  def task_loss(model, batch, options):
    logps, entropy = logprobs.completion_logps(
        model, batch['prompt_tokens'], batch['prompt_mask'], batch['completion_tokens'],
        batch['completion_mask'], options, with_entropy=True, temperature=temperature)
    if cfg.entropy_coef == 0:
      entropy = jax.lax.stop_gradient(entropy)
    old = jnp.where(batch['has_old'][:, None], batch['old_logps'], jax.lax.stop_gradient(logps))
    return losses.grpo_loss(
        logps, old, batch['advantages'], loss_mask(batch).astype(jnp.float32), cfg,
        max_completion_length, ref_logps=batch.get('ref_logps'), entropy=entropy,
        sampler_logps=batch.get('sampler_logps'))

  return ForwardLoss(task_loss, options)


def loss_mask(batch: dict) -> jax.Array:
  """A GRPO micro-batch's loss mask: its loss_mask (multi-turn rows), else completion_mask."""
  return batch.get('loss_mask', batch['completion_mask'])


def dpo_task_loss(cfg: DPOLossConfig, options: Optional[tfm.ForwardOptions] = None,
                  **fields) -> TaskLoss:
  """Batch: {chosen,rejected}_{tokens,attention_mask,loss_mask} [P, T] and
  ref_{chosen,rejected}_logps [P] (summed over the response, cached once); with rpo_alpha > 0,
  rpo_scale [P], the window's denominator / chosen tokens (losses.dpo_window_normalizers);
  optionally ref_is_policy [P] bool: these weights are the reference's (trainers/dpo.py sets it
  in the stage's first optimizer window without ``dpo.ref_model``).

  Where ref_is_policy, the reference log-probs are this forward's own (stop-gradient), so
  policy - reference is exactly 0, as in TRL, whose one forward computes both at step 1. The
  cached ones come from another program (the reference pass) and differ by float noise
  (+-1e-7 on CPU) that rewards/accuracies' strict ``>`` counts as wins (0.25 to 0.5 at step 1
  instead of TRL's 0). A margin would not do: the noise grows with a sequence's log-prob and
  with the dtype (bfloat16's is ~1e4 times float32's), so no fixed margin tells it from a true
  difference. The gradient is the same either way (the reference is a constant).
  ``options``: the forward's (``ForwardOptions``, or its fields as keywords)."""
  options = _options(options, fields)

  def task_loss(model, batch, options):
    n = batch['chosen_tokens'].shape[0]
    cat = lambda k: jnp.concatenate([batch[f'chosen_{k}'], batch[f'rejected_{k}']], axis=0)
    logps, counts = logprobs.sequence_logps(model, cat('tokens'), cat('attention_mask'),
                                            cat('loss_mask'), options)
    lengths = jnp.sum(cat('attention_mask').astype(jnp.float32), axis=-1)  # open-instruct's
    ref = jnp.concatenate([batch['ref_chosen_logps'], batch['ref_rejected_logps']])  # [2P]
    if 'ref_is_policy' in batch:
      own = jnp.concatenate([batch['ref_is_policy']] * 2)  # [2P]
      ref = jnp.where(own, jax.lax.stop_gradient(logps), ref)
    return losses.dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], counts[:n], counts[n:], cfg,
                           chosen_lengths=lengths[:n], rejected_lengths=lengths[n:],
                           rpo_scale=batch.get('rpo_scale'))

  return ForwardLoss(task_loss, options)


# -- optimizer ----------------------------------------------------------------------------------
def normalize_by_denominator() -> optax.GradientTransformationExtraArgs:
  """Divides the accumulated gradient by the accumulated window normalizer (extra arg)."""

  def update(updates, state, params=None, *, denominator, **_):
    del params
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return jax.tree.map(lambda g: jnp.where(denominator > 0, g / safe, 0.0), updates), state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update)


def sequential_lr_scale(cfg: OptimizerConfig, sched: ScheduleConfig) -> float:
  """GRPO's peak learning-rate factor: 1, or under update_mode='sequential' (an optimizer step
  per micro-step instead of one per K) optimizer.sequential_lr_scale, default 1/sqrt(K)
  (docs/design, "Implicit bias")."""
  if sched.update_mode != 'sequential':
    return 1.0
  scale = cfg.sequential_lr_scale
  return (1.0 / math.sqrt(sched.grad_accum_steps)) if scale is None else scale


def learning_rate_schedule(cfg: OptimizerConfig, lr_scale: float = 1.0) -> optax.Schedule:
  """Warmup, then constant, cosine or linear decay to 0 over optimizer.total_steps; the peak is
  optimizer.learning_rate * lr_scale."""
  peak = cfg.learning_rate * lr_scale
  if cfg.lr_schedule == 'constant':
    decay = optax.constant_schedule(peak)
  elif cfg.lr_schedule == 'cosine':
    decay = optax.cosine_decay_schedule(peak, cfg.total_steps - cfg.warmup_steps)
  else:
    decay = optax.linear_schedule(peak, 0.0, cfg.total_steps - cfg.warmup_steps)
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decays(params):
  """Which params AdamW's weight decay applies to (a bool per leaf): all but the norms' scales
  and the biases, as transformers' ``Trainer.get_decay_parameter_names`` decides for TRL's
  trainers (its name patterns 'bias' and '*norm' match exactly these leaves: ``attn_norm``,
  ``mlp_norm``, ``q_norm``/``k_norm``, ``post_attn_norm``/``post_mlp_norm``, ``final_norm``,
  ``q_bias``/``k_bias``/``v_bias``). The embedding, the head, the projections and the LoRA
  adapters decay."""
  def rule(path, _):
    name = str(getattr(path[-1], 'key', path[-1]))
    return not (name.endswith('norm') or name.endswith('bias'))
  return jax.tree_util.tree_map_with_path(rule, params)


def add_decayed_weights(weight_decay: float) -> optax.GradientTransformation:
  """optax.add_decayed_weights (u + weight_decay * w) on the leaves ``decays`` selects; its state
  is optax's (empty), unmasked."""
  def update(updates, state, params):
    return jax.tree.map(lambda u, w, on: u + weight_decay * w if on else u,
                        updates, params, decays(params)), state
  return optax.GradientTransformation(lambda _: optax.AddDecayedWeightsState(), update)


def make_optimizer(cfg: OptimizerConfig, optimizer_every: int,
                   lr_scale: float = 1.0) -> optax.MultiSteps:
  """MultiSteps over ``optimizer_every`` micro-steps of: divide the summed gradient by the
  window's denominator, clip, AdamW; a non-finite window is skipped and counted."""
  inner = [normalize_by_denominator()]
  if cfg.max_grad_norm > 0:
    inner.append(optax.clip_by_global_norm(cfg.max_grad_norm))
  # optax.adamw's chain, with the decay on ``decays`` only. Not adamw(mask=): its masked() state
  # would change the optimizer state's tree, and checkpoints of earlier versions would not load.
  inner.append(optax.chain(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
                           add_decayed_weights(cfg.weight_decay),
                           optax.scale_by_learning_rate(learning_rate_schedule(cfg, lr_scale))))
  # Skip (and count) a window whose gradient is not finite; never give up silently: the trainer
  # stops the run after optimizer.max_consecutive_nonfinite skipped windows in a row.
  robust = optax.apply_if_finite(optax.chain(*inner), max_consecutive_errors=2**30)
  return optax.MultiSteps(robust, every_k_schedule=optimizer_every, use_grad_mean=False,
                          accumulator_dtype=jnp.float32)


def float32_like(params):
  """``params`` as float32 arrays, to initialize the optimizer state from: MultiSteps' accumulator
  and AdamW's moments are float32 whatever ``model.param_dtype``. With bfloat16 params (full
  fine-tuning) each micro-batch's gradient is bfloat16 (the params' dtype, as in PyTorch), summed
  in float32; the inner optimizer computes in float32 and ``optax.apply_updates`` rounds the
  update into the bfloat16 params (no float32 master copy: an update under half a bfloat16 ulp
  of its weight is lost, as with PyTorch's bfloat16 params). Moments in the params' dtype would
  also turn float32 on the first firing step (the summed gradient is float32), and the firing
  and accumulating branches of the step's ``lax.cond`` would disagree on their types. Under jit
  only the shapes are used: nothing is copied."""
  return jax.tree.map(lambda p: p.astype(jnp.float32), params)


def _schedule_count(opt_state) -> jax.Array:
  """The step count of AdamW's learning-rate schedule (optax.ScaleByScheduleState.count): the
  optimizer steps really applied, skipped non-finite windows not counted."""
  is_state = lambda x: isinstance(x, optax.ScaleByScheduleState)
  (node,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  return node.count


def _multisteps_apply(ms: optax.MultiSteps, k: int, grads, state: optax.MultiStepsState, params,
                      *, lazy: bool, **extra):
  """One micro-step of MultiSteps, updates applied: -> (params, state). Two mends of
  MultiSteps.update that keep its state and semantics:

  * lazy: the inner optimizer runs only when this micro-step fires a step (MultiSteps runs it at
    every micro-step and discards the result), and without MultiSteps' selects; see _lazy_apply.
  * MultiSteps clears its accumulator by multiplying it by 0, which leaves a NaN in place; a
    skipped non-finite window would then poison every later window. Clear it with a select.
  """
  if lazy:
    return _lazy_apply(ms, k, grads, state, params, **extra)
  emit = state.mini_step == k - 1
  updates, new_state = ms.update(grads, state, params, **extra)
  acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), new_state.acc_grads)
  return optax.apply_updates(params, updates), new_state._replace(acc_grads=acc)


def _fire(ms: optax.MultiSteps, acc, rest: optax.MultiStepsState, params, **extra):
  """MultiSteps.update on a micro-step known to fire, with the summed gradient `acc`.

  What MultiSteps.update computes when its emit flag is true (and no should_skip_update_fn is
  set, as in make_optimizer): the inner optimizer on the sum, mini_step back to 0, gradient_step
  + 1 (the caller clears the accumulator). MultiSteps itself, with emit traced, also keeps the
  old inner state, accumulator and a zero update alive to select between them (2 params-sizes of
  temporary memory; see BENCHMARKS.md, memory.py). tests/test_learner_tasks.py checks the two
  bit for bit.
  """
  updates, inner = ms.inner_opt.update(acc, rest.inner_opt_state, params, **extra)
  new_state = rest._replace(mini_step=jnp.zeros_like(rest.mini_step),
                            gradient_step=optax.safe_increment(rest.gradient_step),
                            inner_opt_state=inner)
  return optax.apply_updates(params, updates), new_state


def _lazy_apply(ms: optax.MultiSteps, k: int, grads, state: optax.MultiStepsState, params,
                **extra):
  """MultiSteps.update, the inner optimizer and the param update, only on a firing micro-step.

  The gradient is added to the accumulator outside the cond, in the donated buffer and fused
  with the gradient computation. One cond runs _fire on the sum when this micro-step fires
  (the inner optimizer, the counters, the param update; non-final micro-steps write no zero
  updates) and only advances mini_step otherwise; a second cond clears the accumulator after a
  step or keeps the sum. Returning the accumulator from the first cond, whose firing branch
  still reads it, cost one params-size more temporary memory. With k = 1 every micro-step
  fires, and the conds stay: they make XLA run the optimizer after the backward's buffers are
  freed (without them, K=1 with 64 sequences of 32 tokens on a 60M-param model needed one
  params-size more temporary memory).
  """
  acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc_grads, grads)
  rest = state._replace(acc_grads=None)
  fire = lambda acc, rest, params: _fire(ms, acc, rest, params, **extra)

  def accumulate(acc, rest, params):
    return params, rest._replace(mini_step=rest.mini_step + 1)

  emit = state.mini_step == k - 1
  params, new_state = jax.lax.cond(emit, fire, accumulate, acc, rest, params)
  acc = jax.lax.cond(emit, lambda a: jax.tree.map(jnp.zeros_like, a), lambda a: a, acc)
  return params, new_state._replace(acc_grads=acc)


# -- state and step -----------------------------------------------------------------------------
@flax.struct.dataclass
class TrainState:
  """The learner's device state. Its counters are MultiSteps' (``opt_state.mini_step``: the
  micro-step within the window, ``gradient_step``: the optimizer steps); the host's micro-step
  and the rest: docs/design.md, "Step counters"."""
  params: Any
  opt_state: optax.MultiStepsState
  window: losses.LossTerms  # accumulated numerator/denominator/metrics of the open window
  align: Any  # (g_pos, g_neg) accumulated gradients for the alignment diagnostic, or None

  @property
  def optimizer_step(self) -> jax.Array:
    return self.opt_state.gradient_step

  @property
  def nonfinite_skipped(self) -> jax.Array:
    return self.opt_state.inner_opt_state.total_notfinite


class Learner:
  """Owns the optimizer, the state's shardings and the jitted micro-step.

  Usage:
    learner = Learner(graphdef, task_loss, opt_cfg, mesh, param_shardings, optimizer_every=k)
    state = learner.init(params, example_batch)
    state, out = learner.step(state, batch)   # one micro-batch; out['stepped'] tells if it fired

  LoRA: ``param_shardings`` are the adapters', ``frozen_shardings`` the base weights'; ``init``,
  ``abstract_init`` and ``step`` then take the base params as a third argument ``frozen``.
  """

  def __init__(self, graphdef: nnx.GraphDef, task_loss: TaskLoss, opt_cfg: OptimizerConfig,
               mesh, param_shardings, *, optimizer_every: int, lr_scale: float = 1.0,
               align_diagnostic: bool = False, lazy_inner: bool = True,
               frozen_shardings: Any = None):
    self.graphdef = graphdef
    self.frozen_shardings = frozen_shardings
    # A ForwardLoss's activations constrained on this mesh, where the step is jitted.
    self.task_loss = task_loss.on(mesh) if isinstance(task_loss, ForwardLoss) and (
        mesh is not None) else task_loss
    self.mesh = mesh
    self.param_shardings = param_shardings
    self.align_diagnostic = align_diagnostic
    self.lazy_inner = lazy_inner
    self.k = optimizer_every  # K: micro-steps per optimizer step
    self.optimizer = make_optimizer(opt_cfg, optimizer_every, lr_scale)
    self.lr_schedule = learning_rate_schedule(opt_cfg, lr_scale)
    self._state_shardings = None
    self._step = None

  # The loss of one micro-batch at `params` (with the frozen params, if any), and (optionally)
  # its split by advantage sign. Gradients are taken with respect to `params` only.
  def _terms(self, params, batch, frozen=None):
    return self.task_loss(tfm.merge(self.graphdef, params, frozen), batch)

  def _grads(self, params, batch, frozen=None):
    def numerator(p, b):
      terms = self._terms(p, b, frozen)
      return terms.numerator, terms
    return jax.value_and_grad(numerator, has_aux=True)(params, batch)

  def _check_frozen(self, frozen) -> None:
    if (frozen is None) != (self.frozen_shardings is None):
      raise ValueError('pass the frozen params exactly when the Learner was built with '
                       'frozen_shardings (LoRA: the base weights).')

  def init(self, params, example_batch, frozen=None) -> TrainState:
    init_fn = self._setup(params, example_batch, frozen)
    return jax.jit(init_fn, out_shardings=self._state_shardings)(params)

  def abstract_init(self, params, example_batch, frozen=None) -> TrainState:
    """As ``init`` without computing anything: ``params`` may be ShapeDtypeStructs. -> the state
    as ShapeDtypeStructs with their shardings (for ``step_fn.lower``; see jaxrl_ga.plan)."""
    init_fn = self._setup(params, example_batch, frozen)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(init_fn, params), self._state_shardings)

  def _setup(self, params, example_batch, frozen=None):
    """The state's shardings and the jitted micro-step; -> the state's init function."""
    self._check_frozen(frozen)
    terms_shape = jax.eval_shape(self._terms, params, example_batch, frozen)

    def init_fn(params):
      f32 = lambda p: jnp.zeros(p.shape, jnp.float32)
      align = (jax.tree.map(f32, params), jax.tree.map(f32, params)) \
          if self.align_diagnostic else None
      return TrainState(params=params, opt_state=self.optimizer.init(float32_like(params)),
                        window=losses.neutral_like(terms_shape), align=align)

    abstract = jax.eval_shape(init_fn, params)
    rep = sharding.replicated(self.mesh)
    opt_shardings = optax.tree_map_params(
        self.optimizer, lambda _, s: s, abstract.opt_state, self.param_shardings,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    self._state_shardings = TrainState(
        params=self.param_shardings, opt_state=opt_shardings,
        window=jax.tree.map(lambda _: rep, abstract.window),
        align=None if abstract.align is None else (self.param_shardings, self.param_shardings))
    frozen_in = () if self.frozen_shardings is None else (self.frozen_shardings,)
    if self._step is None:  # one jitted step: what abstract_init's lowering compiled, step runs
      self._step = jax.jit(self._micro_step,
                           in_shardings=(self._state_shardings, None, *frozen_in),
                           out_shardings=(self._state_shardings, None), donate_argnums=(0,))
    return init_fn

  def step(self, state: TrainState, batch: dict, frozen=None) -> tuple[TrainState, dict]:
    """Consumes one micro-batch (global arrays, batch-sharded). Returns (state, outputs):
    outputs['stepped'] is True when an optimizer step fired after this micro-step; then the other
    entries are the exact window metrics of that step (device scalars; fetch when stepped).
    ``frozen``: the frozen params (LoRA's base weights), read, never donated."""
    self._check_frozen(frozen)
    return self._step(state, batch) if frozen is None else self._step(state, batch, frozen)

  def compile_for(self, state: TrainState, batches: Sequence[dict], frozen=None) -> None:
    """Compiles the micro-step now for each of ``batches`` (micro-batch shapes: ShapeDtypeStructs
    with their shardings, e.g. one per learner width), so that no later ``step`` stops to compile:
    ``lower(...).compile()`` fills jax's compilation cache, which ``step``'s jit call then hits
    (tests/test_learn_width.py counts the compiles of a run). ``state``: the live state or its
    abstract one (nothing is donated here). One compile after another: on CPU, under
    ``jaxrl_ga.host_memory``'s single malloc arena, compiles in threads ran slower than in turn."""
    self._check_frozen(frozen)
    frozen_in = () if frozen is None else (frozen,)
    for batch in batches:
      self._step.lower(state, batch, *frozen_in).compile()

  @property
  def step_fn(self):
    """The jitted micro-step (for compile counting and AOT inspection)."""
    return self._step

  @property
  def traced_step(self):
    """The micro-step before ``jax.jit`` (what ``step_fn`` compiles), for a caller that traces
    it itself: e.g. FLOP counts with the layer scan unrolled (benchmarks/learner.py)."""
    return self._micro_step

  def _micro_step(self, state: TrainState, batch: dict, frozen=None):
    (_, terms), grads = self._grads(state.params, batch, frozen)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    window = losses.combine(state.window, terms)
    emit = state.opt_state.mini_step == self.k - 1
    extra = {'denominator': window.denominator}
    params, opt_state = _multisteps_apply(self.optimizer, self.k, grads, state.opt_state,
                                          state.params, lazy=self.lazy_inner, **extra)

    loss, out = losses.finalize(window)
    out['loss'] = loss
    denom = jnp.where(window.denominator > 0, window.denominator, 1.0)
    summed = jax.tree.map(lambda a, g: a + g, state.opt_state.acc_grads, grads)
    out['grad_norm'] = optax.tree.norm(summed) / denom  # before clipping
    # AdamW's own step count: skipped non-finite windows do not advance its schedule.
    out['learning_rate'] = self.lr_schedule(_schedule_count(state.opt_state))
    out['nonfinite_skipped'] = opt_state.inner_opt_state.total_notfinite
    out['nonfinite_consecutive'] = opt_state.inner_opt_state.notfinite_count
    out['stepped'] = emit

    align = state.align
    if self.align_diagnostic:
      align, align_out = self._alignment(state, batch, denom, emit, frozen)
      out.update(align_out)

    reset = lambda x, zero: jnp.where(emit, zero, x)
    window = jax.tree.map(reset, window, losses.neutral_like(window))
    new_state = TrainState(params=params, opt_state=opt_state, window=window, align=align)
    return new_state, out

  def _alignment(self, state: TrainState, batch: dict, denom, emit, frozen=None):
    """Gradients of the positive- and negative-advantage samples, accumulated over the window;
    at the optimizer step their dot product and cosine (the diagnostic of the blog post "The
    Implicit Bias of Gradient Accumulation in RLHF"; docs/design, "Implicit bias"). A window with
    samples of only one sign has no alignment: its cosine is NaN (logged as null), not 0."""
    adv = batch['advantages']
    parts = []
    for keep in (adv > 0, adv < 0):
      sub = dict(batch, completion_mask=batch['completion_mask'] * keep[:, None])
      if 'loss_mask' in batch:
        sub['loss_mask'] = batch['loss_mask'] * keep[:, None]
      (_, _), g = self._grads(state.params, sub, frozen)
      parts.append(g)
    g_pos = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), state.align[0], parts[0])
    g_neg = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), state.align[1], parts[1])
    dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g_pos), jax.tree.leaves(g_neg)))
    n_pos, n_neg = optax.tree.norm(g_pos), optax.tree.norm(g_neg)
    out = {'align/dot': dot / (denom * denom),
           'align/cosine': jnp.where(n_pos * n_neg > 0, dot / jnp.maximum(n_pos * n_neg, 1e-30),
                                     jnp.nan)}
    zero = lambda t: jax.tree.map(lambda x: jnp.where(emit, jnp.zeros_like(x), x), t)
    return (zero(g_pos), zero(g_neg)), out
