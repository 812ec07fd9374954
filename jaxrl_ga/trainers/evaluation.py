"""Held-out evaluation: greedy exact-match accuracy, each process scoring its own rows."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import placement
from jaxrl_ga import sampling
from jaxrl_ga.trainers import text


class Evaluator:
  """Greedy held-out exact-match accuracy; one compile for the run (fixed batch shape)."""

  def __init__(self, ctx, max_prompt_length: int, examples=None):
    """examples: default the task's held-out set (eval.num_examples of it)."""
    self.ctx = ctx
    ecfg = ctx.cfg.eval
    if examples is None:
      examples = ctx.task.eval_examples()
      examples = examples[:ecfg.num_examples] if ecfg.num_examples else examples
    self.examples = list(examples)
    self.max_prompt_length = max_prompt_length
    sampler = sampling.Sampler(max_completion_length=ecfg.max_completion_length,
                               eos_id=ctx.eos_id, pad_id=ctx.pad_id)
    self._generate = sampling.make_generate_fn(ctx.graphdef, sampler, greedy=True, mesh=ctx.mesh,
                                               param_shardings=ctx.param_shardings)
    self.batch_size = placement.padded_batch_size(ecfg.batch_size, ctx.mesh)

  def accuracy(self, params) -> float:
    """Each process encodes, decodes and checks only the rows its devices hold."""
    ctx, bs = self.ctx, self.batch_size
    rows = placement.batch_rows(bs, ctx.mesh)
    correct = np.zeros(bs, np.float32)
    for start in range(0, len(self.examples), bs):
      if ctx.guard is not None and ctx.guard.should_stop:  # a long evaluation is interruptible
        raise checkpoint.Preempted('', -1, ctx.guard.signal_received)
      n = min(bs, len(self.examples) - start)
      chunk = [self.examples[start + (r if r < n else 0)] for r in rows]  # fixed shape
      tokens, mask = placement.shard_rows(lambda _: text.left_pad(
          [text.encode_prompt(ctx.tokenizer, e.prompt) for e in chunk], self.max_prompt_length,
          ctx.pad_id, 'max_prompt_length'), bs, ctx.mesh)
      out = self._generate(params, tokens, mask, jax.random.PRNGKey(0), 1.0, 1.0)
      texts = text.decode_completions(ctx.tokenizer, placement.local_part(out.tokens)[1],
                                 placement.local_part(out.mask)[1])
      correct[rows] += [float(r < n and ctx.task.is_correct(e, t))
                        for r, e, t in zip(rows, chunk, texts)]
    total = placement.gather_rows(correct[rows], rows, bs, ctx.mesh).sum()
    return float(total) / max(len(self.examples), 1)
