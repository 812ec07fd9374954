"""grpo.length_buckets: the learner computes each micro-batch's completions only up to a width
that holds its longest completion, and applies the update of the whole-width window loss.

Through GRPOTrainer.run on the tiny arithmetic model (untrained, so completion lengths are uneven
and EOS ends some early): the widths the learner's step receives are checked against the bucket
of each slice's longest completion, computed here from the rollout buffer's mask; and each
optimizer step's applied gradient (AdamW's first moment, b1 = 0) against the one-pass window loss
of the full-width rollout buffer (tests/learner_refs.py), so a cut that dropped a real token, or a
'constant' normalizer taken from the cut width instead of max_completion_length, fails.
"""

import jax
import numpy as np
import smoke_configs

from jaxrl_ga import api
from jaxrl_ga.trainers import grpo

from learner_refs import applied_grad, ref_grpo_window_loss, rel_err

L = 40  # max_completion_length; prompts are 8 wide and the model holds 64 positions
WIDTHS = (8, 16, 24, 32, 40)  # 5 buckets of 40, multiples of 8


def test_learner_width_follows_the_longest_completion_and_the_update_is_the_full_widths(tmp_path):
  # 'constant' (Dr. GRPO): its normalizer is max_completion_length, never the cut width.
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 3, 'grpo.length_buckets': len(WIDTHS),
      'grpo.sampling.max_completion_length': L, 'grpo.loss.aggregation': 'constant',
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

  trainer = grpo.GRPOTrainer(ctx, cfg.grpo, on_rollout=on_rollout)
  seen = []
  step = trainer.learner.step
  def recording_step(state, batch, frozen=None):
    seen.append(batch['completion_tokens'].shape)
    return step(state, batch, frozen)
  trainer.learner.step = recording_step
  trainer.run(params)

  # The widths: each slice's longest completion, from the buffer, up to the next bucket.
  want = []
  for e in events:
    longest = e['buffer'].completion_mask.sum(-1).max(-1)  # [S]
    widths = [min(w for w in WIDTHS if w >= n) for n in longest]
    assert e['width'] == np.mean(widths)
    want += widths
  assert [shape[1] for shape in seen] == want
  assert min(want) < L, 'the run must cut some micro-batch (completion lengths are too even)'

  # Window r's applied gradient is in the learner state that the next rollout sees.
  graphdef = ctx.graphdef
  loss_cfg = cfg.grpo.loss
  grad = jax.jit(jax.grad(lambda p, b: ref_grpo_window_loss(graphdef, p, b, loss_cfg)))
  for before, after in zip(events, events[1:]):
    buf = before['buffer']
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    window = dict(prompt_tokens=flat(buf.prompt_tokens), prompt_mask=flat(buf.prompt_mask),
                  completion_tokens=flat(buf.completion_tokens),
                  completion_mask=flat(buf.completion_mask), old_logps=flat(buf.old_logps),
                  has_old=flat(buf.has_old), advantages=before['advantages'].reshape(-1))
    assert window['completion_tokens'].shape[1] == L
    g = grad(before['params'], window)
    assert rel_err(after['applied'], g) <= 1e-5
