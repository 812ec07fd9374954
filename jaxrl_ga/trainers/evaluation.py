"""Held-out evaluation with greedy decoding, each process scoring its own rows: exact-match
accuracy on a built-in task; on your data (``jaxrl_ga.data.DataTask``) each reward's mean, the
accuracy of the reward that marks correctness (``rewards.marks_correctness``; > 0 counts as
correct), and the means of ``eval.metric`` / the Python API's ``metric(prompts, completions,
**columns)``, which returns one float per completion or a dict of such lists.

With tools (a GRPO run with ``grpo.tools`` / ``grpo.environment``: ``runner`` and
``make_interaction`` given) each held-out row is a greedy episode, as in training: its prompt
with the tools announced (``tools.Episodes.padded_prompts``), the turns decoded by the greedy
``episodes.EpisodeRunner`` (the 'evaluation_episodes' program), the calls run by the host; the
rewards score the final assistant turn's text with the episode's columns
(``completions_messages``, ``environments``), and ``tools/calls_per_episode`` is the mean of tool
calls per held-out row. One process only (as multi-turn rollouts)."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from jaxrl_ga import checkpoint
from jaxrl_ga import episodes
from jaxrl_ga import placement
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga.tasks import base as task_base
from jaxrl_ga.trainers import text


class Evaluator:
  """Greedy held-out evaluation; one compile for the run (fixed batch shape)."""

  def __init__(self, ctx, program, examples=None, runner=None, make_interaction=None):
    """program: the stage's 'evaluation' entry of its programs' table
    (``programs.evaluation_program``: the greedy generation, its batch and prompt width);
    examples: default the task's held-out set (eval.num_examples of it). ``runner`` (greedy
    ``episodes.EpisodeRunner`` over the same batch, ``GRPOPrograms.eval_episodes``) and
    ``make_interaction`` (examples -> ``tools.Episodes``, ``tools.make_interaction``): both
    given, the rows are episodes with tools."""
    self.ctx = ctx
    ecfg = ctx.cfg.eval
    if examples is None:
      examples = ctx.task.eval_examples()
      examples = examples[:ecfg.num_examples] if ecfg.num_examples else examples
    self.examples = list(examples)
    self._generate = program.fn
    self._episodes = (runner, make_interaction) if (
        runner is not None and make_interaction is not None) else None
    self.batch_size, self.max_prompt_length = program.args[1].shape
    # Your data is scored by its rewards; a built-in task by its own exact match.
    self.rewards = (ctx.task.reward_functions() if getattr(ctx.task, 'name', '') == 'data'
                    else [])
    self.marked = next((r.name for r in self.rewards if r.marks_correctness), None)
    self.metric = ctx.eval_metric
    self._names: Optional[list[str]] = None  # the scores' names, fixed by the first chunk
    # The rewards' trainer_state keyword (TRL's): the stage sets it before each evaluation.
    self.trainer_state = rewards_lib.TrainerState()

  def accuracy(self, params) -> Optional[float]:
    return self.evaluate(params)['accuracy']

  def evaluate(self, params) -> dict[str, Any]:
    """{'accuracy': float (None when no reward marks correctness), 'reward/<name>': mean,
    'metric[/<name>]': mean}. Each process encodes, decodes and scores only its rows. With tools:
    the episodes' results, 'tools/calls_per_episode', and the same model's single-turn results
    (no tools announced, one greedy turn) under 'without_tools/<key>'."""
    if self._episodes is None:
      return self._evaluate(params, None)
    results = self._evaluate(params, self._episodes)
    results.update({f'without_tools/{k}': v for k, v in self._evaluate(params, None).items()})
    return results

  def _evaluate(self, params, with_episodes) -> dict[str, Any]:
    ctx, bs = self.ctx, self.batch_size
    rows = placement.batch_rows(bs, ctx.mesh)
    correct = np.zeros(bs, np.float32)
    sums: Optional[np.ndarray] = None  # [bs, F] sums and counts of the scores that applied
    counts: Optional[np.ndarray] = None
    error = None  # a reward or metric that failed here: the others must still reach the gathers
    calls = 0  # tool calls of the real rows (episodes)
    for start in range(0, len(self.examples), bs):
      if ctx.guard is not None and ctx.guard.should_stop:  # a long evaluation is interruptible
        raise checkpoint.Preempted('', -1, ctx.guard.signal_received)
      n = min(bs, len(self.examples) - start)
      chunk = [self.examples[start + (r if r < n else 0)] for r in rows]  # fixed shape
      valid = np.asarray(rows) < n
      # The rows scored: the real ones; on a process that holds none (several processes, few
      # held-out rows), its first padding row, scored and dropped, so that no reward or metric is
      # ever called with no completion (a one-process run never does that).
      pick = valid if valid.any() else np.arange(len(rows)) == 0
      extra = prompts = None  # the episodes' reward columns and prompts of the picked rows
      if with_episodes is not None:
        texts, extra, chunk_calls, prompts = self._run_episodes(with_episodes, params, chunk,
                                                                pick, valid)
        calls += chunk_calls
      else:
        tokens, mask = placement.place_rows(text.left_pad(
            [text.encode_prompt(ctx.tokenizer, e.prompt) for e in chunk], self.max_prompt_length,
            ctx.pad_id, 'max_prompt_length'), bs, ctx.mesh)
        out = self._generate(params, tokens, mask, jax.random.PRNGKey(0), np.float32(1.0),
                             np.float32(1.0))
        out_tokens, out_mask = (placement.local_part(x)[1] for x in (out.tokens, out.mask))
        texts = text.decode_completions(ctx.tokenizer, out_tokens, out_mask)
        extra = {'completion_ids': [out_tokens[r][out_mask[r] > 0] for r in np.flatnonzero(pick)]}
      if not self.rewards and self.metric is None:
        correct[rows] += [float(v and ctx.task.is_correct(e, t))
                          for v, e, t in zip(valid, chunk, texts)]
        continue
      if error is not None:
        continue  # generation is collective: this process keeps taking part, scoring nothing
      try:  # the picked rows are scored (a padding row's scores are dropped)
        real = self._scores([e for e, p in zip(chunk, pick) if p],
                            [t for t, p in zip(texts, pick) if p], extra, prompts)  # [n, F]
      except rewards_lib.RewardError as e:
        error = e
        continue
      scores = np.full((len(rows), real.shape[1]), np.nan)
      if valid.any():
        scores[valid] = real
      if sums is None:
        sums = np.zeros((bs, scores.shape[1]), np.float64)
        counts = np.zeros((bs, scores.shape[1]), np.float64)
      sums[rows] += np.nan_to_num(scores)
      counts[rows] += ~np.isnan(scores)
      if self.marked is not None:
        correct[rows] += valid & (np.nan_to_num(scores[:, self._names.index(
            f'reward/{self.marked}')]) > 0)
    # First the accuracy and whether scoring failed anywhere (every process reaches this gather,
    # and raises after it if any failed), then the score sums, whose width all then agree on.
    failed = np.full(bs, 0.0 if error is None else jax.process_index() + 1.0)
    first = placement.gather_rows(np.stack([correct, failed], 1)[rows], rows, bs, ctx.mesh)
    if error is not None:
      raise error
    hosts = sorted({int(p) - 1 for p in np.unique(first[:, 1]) if p})
    if hosts:
      raise rewards_lib.RewardError(
          f'a reward or metric failed in the held-out evaluation on process(es) {hosts} (their '
          f'log has the error); every process stops.')
    total = np.concatenate([first[:, :1]] + ([] if sums is None else [placement.gather_rows(
        np.concatenate([sums, counts], 1)[rows], rows, bs, ctx.mesh)]), 1).sum(0)
    size = max(len(self.examples), 1)
    results: dict[str, Any] = {'accuracy': float(total[0]) / size}
    if not self.examples or (getattr(ctx.task, 'name', '') == 'data' and self.marked is None):
      results['accuracy'] = None  # nothing asked, or no reward marks correctness: n/a, not 0
    if sums is not None:
      f = len(self._names)
      for i, name in enumerate(self._names):
        results[name] = float(total[1 + i] / total[1 + f + i]) if total[1 + f + i] else None
      if self.marked is None:
        results['accuracy'] = None
    if with_episodes is not None:
      results['tools/calls_per_episode'] = calls / size
    return results

  def _run_episodes(self, with_episodes, params, chunk, pick, valid
                    ) -> tuple[list[str], dict[str, list], int]:
    """The chunk's greedy episodes (one process). -> (each row's final assistant turn's text,
    the picked rows' episode columns of the rewards, the real (``valid``) rows' tool calls, the
    picked rows' prompts as the rewards get them: ``Episodes.reward_prompts``)."""
    ctx, bs = self.ctx, self.batch_size
    runner, make_interaction = with_episodes
    interaction = make_interaction(chunk)
    tokens, mask = placement.place_rows(
        interaction.padded_prompts(self.max_prompt_length, ctx.pad_id), bs, ctx.mesh)
    result = runner.run(params, tokens, mask, jax.random.PRNGKey(0), interaction)
    out_tokens = placement.local_part(result.completions.tokens)[1]
    model = placement.local_part(result.model_mask)[1]
    for r in range(len(chunk)):  # a turn cut at the length limit was never submitted
      interaction.finish(r, episodes.model_turns(out_tokens[r], model[r]))
    texts = [interaction.final_text(r) for r in range(len(chunk))]
    real = np.flatnonzero(pick)
    extra = {k: [v[r] for r in real] for k, v in interaction.reward_fields().items()}
    done = placement.local_part(result.completions.mask)[1]
    extra['completion_ids'] = [out_tokens[r][done[r] > 0] for r in real]
    calls = sum(m['role'] == 'tool' for r in np.flatnonzero(valid)
                for m in interaction.completion_messages(r))
    prompts = (interaction.reward_prompts() if hasattr(interaction, 'reward_prompts')
               else [e.prompt for e in chunk])
    return texts, extra, int(calls), [prompts[r] for r in real]

  def _scores(self, examples, texts, extra=None, prompts=None) -> np.ndarray:
    """[N, F] per-completion scores: each reward, then the metric's values. ``extra``: more
    columns (an episode's), one entry per completion; ``prompts``: the rewards' prompts where
    they are not the examples' (an episode's, with its environment's reset text)."""
    prompts = [e.prompt for e in examples] if prompts is None else prompts
    fields = task_base.reward_fields(examples)
    fields = {**fields, **(extra or {})}
    ids = fields.pop('completion_ids', [[] for _ in texts])
    keywords = rewards_lib.trl_keywords(ids, self.trainer_state)  # log_* go nowhere here
    names, columns = [], []
    if self.rewards:
      _, per_fn = rewards_lib.compute_rewards(self.rewards, prompts, texts, fields, keywords)
      for r in self.rewards:
        names.append(f'reward/{r.name}')
        columns.append(per_fn[r.name])
    if self.metric is not None:
      try:
        values = self.metric(list(prompts), list(texts), **fields)
      except Exception as e:  # pylint: disable=broad-except
        raise rewards_lib.RewardError(f'eval metric raised {type(e).__name__}: {e}') from e
      named = values.items() if isinstance(values, dict) else [('', values)]
      for key, vals in sorted(named):
        vals = [np.nan if v is None else float(v) for v in vals]
        if len(vals) != len(texts):
          raise rewards_lib.RewardError(f'eval metric returned {len(vals)} values for '
                                        f'{len(texts)} completions; return one per completion.')
        names.append(f'metric/{key}' if key else 'metric')
        columns.append(np.asarray(vals, np.float64))
    if self._names is None:
      self._names = names
    return np.stack(columns, 1).astype(np.float64)
