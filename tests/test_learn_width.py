"""grpo.length_buckets: the learner computes each micro-batch's completions only up to a width
that holds every position its rows train on, and applies the update of the whole-width window
loss.

Through GRPOLoop.run on the tiny arithmetic model (untrained, so completion lengths are uneven
and EOS ends some early), stopped in the middle of a rollout and of a window and resumed: the
widths the learner's step receives are checked against the bucket of each slice's last trained
position, computed here from the rollout buffer's masks; and each optimizer step's applied
gradient (AdamW's first moment, b1 = 0) against the one-pass window loss of the full-width rollout
buffer (tests/learner_refs.py). The run uses 'constant' (Dr. GRPO: its normalizer is
max_completion_length, never the cut width), a KL term (reference log-probs cut with the rest) and
mask_truncated_completions (completions cut at max length train nothing and do not widen a
micro-batch). Every width's learner step is compiled before the loop: the test counts the
compiles each learner step finds already done. tests/mutants.py lists three bugs this test
catches.
"""

import jax
import numpy as np
import smoke_configs

from jaxrl_ga import api
from jaxrl_ga.trainers import grpo

from learner_refs import applied_grad, ref_grpo_window_loss, rel_err

L = 40  # max_completion_length; prompts are 8 wide and the model holds 64 positions
WIDTHS = (8, 16, 24, 32, 40)  # 5 buckets of 40, multiples of 8


def test_learner_width_follows_the_longest_completion_and_the_update_is_the_full_widths(
    tmp_path, compile_log):
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 3, 'grpo.length_buckets': len(WIDTHS),
      'grpo.sampling.max_completion_length': L, 'grpo.loss.aggregation': 'constant',
      'grpo.loss.beta': 0.05, 'grpo.advantage.mask_truncated_completions': True,
      'grpo.schedule.grad_accum_steps': 2, 'grpo.schedule.steps_per_generation': 2,
      'grpo.schedule.micro_batch_size': 8, 'grpo.schedule.num_generations': 4,
      # Rewarded by length, so that the untrained model's groups have non-zero advantages.
      'grpo.reward_funcs': 'length_penalty', 'eval.num_examples': 0,
      'grpo.optimizer.b1': 0.0, 'grpo.optimizer.max_grad_norm': 0.0,
      'grpo.optimizer.learning_rate': 1e-2, 'checkpoint.every_steps': 0})
  ctx, params = api.build_context(cfg, str(tmp_path))
  events = []

  def on_rollout(e):  # K = S = 2: each rollout is one optimizer step's window
    host = lambda t: jax.tree.map(np.asarray, t)
    events.append(dict(params=host(e.learner.params), applied=host(applied_grad(e.learner)),
                       buffer=host(e.buffer), advantages=np.asarray(e.advantages),
                       width=e.host_stats['rollout/learn_width']))

  trainer = grpo.GRPOLoop(ctx, cfg.grpo, on_rollout=on_rollout)
  seen, compiled, _ = _record_steps(trainer, compile_log)
  # Stopped after micro-step 2 (rollout 1's first slice, window 1's first micro-step), resumed:
  # the resumed run takes the widths of the restored buffer.
  _, summary = trainer.run(params, stop_at_micro_step=3)
  assert summary['stopped_at_micro_step'] == 3
  # Every width was compiled before the first learner step, and none after it.
  assert compiled == [len(WIDTHS)] * 3 and compile_log.count('_micro_step') == len(WIDTHS)
  _, summary = trainer.run(params)
  assert summary['grpo/resumed_from_micro_step'] == 3 and len(events) == 3
  resumed = compiled[3:]
  assert resumed == [resumed[0]] * len(resumed) == [compile_log.count('_micro_step')] * 3

  # The widths: each slice's last trained position (rows that ended with EOS), up to a bucket.
  want = []
  for e in events:
    buf = e['buffer']
    trained = buf.completion_mask * buf.ended_with_eos[..., None]  # [S, B, L]
    last = np.where(trained > 0, np.arange(1, L + 1), 0).max(axis=(1, 2))  # [S]
    widths = [min(w for w in WIDTHS if w >= n) for n in last]
    assert e['width'] == np.mean(widths)
    want += widths
  assert [shape[1] for shape in seen] == want
  assert min(want) < L, 'the run must cut some micro-batch (completion lengths are too even)'

  # Window r's applied gradient is in the learner state that the next rollout sees; window 1
  # spans the stop and the resume.
  graphdef = ctx.graphdef
  loss_cfg = cfg.grpo.loss
  grad = jax.jit(jax.grad(lambda p, b: ref_grpo_window_loss(graphdef, p, b, loss_cfg)))
  for before, after in zip(events, events[1:]):
    buf = before['buffer']
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    window = dict(prompt_tokens=flat(buf.prompt_tokens), prompt_mask=flat(buf.prompt_mask),
                  completion_tokens=flat(buf.completion_tokens),
                  completion_mask=flat(buf.completion_mask * buf.ended_with_eos[..., None]),
                  old_logps=flat(buf.old_logps), has_old=flat(buf.has_old),
                  ref_logps=flat(buf.ref_logps), advantages=before['advantages'].reshape(-1))
    assert window['completion_tokens'].shape[1] == L
    g = grad(before['params'], window)
    assert rel_err(after['applied'], g) <= 1e-5


def test_lora_learner_compiles_every_width_before_the_loop(tmp_path, compile_log):
  """Under LoRA the learner step takes the frozen base weights as a third argument; the widths'
  compiles before the loop must be the ones the steps then use (no compile after the first)."""
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 2, 'grpo.length_buckets': 3, 'grpo.sampling.max_completion_length': 24,
      'model.lora.rank': 4, 'eval.num_examples': 0, 'checkpoint.every_steps': 0})
  ctx, params = api.build_context(cfg, str(tmp_path))
  trainer = grpo.GRPOLoop(ctx, cfg.grpo)
  assert trainer.widths == (8, 16, 24)
  _, compiled, with_frozen = _record_steps(trainer, compile_log)
  trainer.run(params)
  assert all(with_frozen)  # the base weights, as LoRA passes them
  assert compiled and compiled == [3] * len(compiled) == [compile_log.count('_micro_step')] * len(
      compiled)


def _record_steps(trainer, compile_log):
  """Wraps the trainer's learner step. -> lists filled at each step: its micro-batch's
  completion shape, the learner-step compiles done so far, and whether it got frozen params."""
  seen, compiled, with_frozen = [], [], []
  step = trainer.learner.step
  def recording_step(state, batch, frozen=None):
    seen.append(batch['completion_tokens'].shape)
    compiled.append(compile_log.count('_micro_step'))
    with_frozen.append(frozen is not None)
    return step(state, batch, frozen)
  trainer.learner.step = recording_step
  return seen, compiled, with_frozen
