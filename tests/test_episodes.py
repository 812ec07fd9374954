"""Multi-turn rollouts (jaxrl_ga/episodes.py; docs/design.md, "Multi-turn rollouts") against
independent references:

* greedy episodes with a fake tool equal a reference that never uses a KV cache: a full forward
  pass over prompt + the whole history for every token, the tool's tokens appended at each turn
  end; with one slot per row and with a pool of 3 slots, the tool answering at once or from
  threads after delays (rows wait while the others decode): the same arrays;
* the learner trains only the policy's tokens: its accumulated gradient (K = 1 and 3) on a
  multi-turn batch equals the one-pass loss written with mask = model tokens, and differs from
  the one that also trains the inserted tokens;
* a GRPO run with multi-turn rollouts stopped mid-rollout and resumed is bitwise the
  uninterrupted run, and calls the tool for no row already in the checkpointed buffer;
* sampled episodes (temperature 1) are the same arrays with one slot per row and with a pool;
* the held-out evaluation with tools (trainers/evaluation.py) scores the greedy episodes' final
  turns (the reference's) and counts their calls; its single-turn pass scores the first turn.
"""

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import smoke_configs
from learner_refs import MODEL, OPT, TC, TP, applied_grad_err, make_mesh
from test_sampling import CFG, SHARPEN, _completion_logits, _forward, _prompts, _random_params

from jaxrl_ga import episodes
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import rollout as rollout_lib
from jaxrl_ga import sampling
from jaxrl_ga import schedule
from jaxrl_ga import sharding
from jaxrl_ga.config import GRPOLossConfig, MeshConfig, SamplingConfig, ScheduleConfig

N, L = 8, 24  # rows (tests/test_sampling.py's 8 prompts of up to 6 tokens), completion length
EOS = 36  # a token the tiny model's greedy continuations reach in most rows, at various steps
CALLS = 2  # tool calls per episode; then the episode ends


class FakeTool:
  """An Interaction: a row's k-th turn (k < CALLS) is answered with the first 1 + (row + k) % 4
  of TOOL_TOKENS, then None. ``delays``: answers from a thread pool after a few ms (varied per
  row and turn), else at once. Records every call (row, turn tokens)."""
  TOOL_TOKENS = (5, 9, 13, 7)

  def __init__(self, delays: bool = False, tokens=TOOL_TOKENS):
    self.calls = []
    self.withdrawn = []
    self.tokens = tokens
    self.pool = concurrent.futures.ThreadPoolExecutor(4) if delays else None

  def withdraw(self, row: int):
    self.withdrawn.append(int(row))

  def answer(self, row: int, k: int):
    return None if k >= CALLS else np.asarray(self.tokens[:1 + (row + k) % 4], np.int32)

  def submit(self, row, turn_tokens):
    row = int(row)
    k = sum(1 for r, _ in self.calls if r == row)
    self.calls.append((row, np.asarray(turn_tokens).tolist()))
    if self.pool is None:
      future = concurrent.futures.Future()
      future.set_result(self.answer(row, k))
      return future

    def later():
      time.sleep(0.002 * ((row * 7 + k) % 5))
      return self.answer(row, k)

    return self.pool.submit(later)


def _reprefill_reference(fwd, params, prompt_tokens, prompt_mask, tool: FakeTool):
  """Greedy episodes without a cache: every token is the argmax of a full forward over the
  prompt and the whole completion so far; a turn that ends at EOS gets the tool's tokens
  appended (or ends the episode), as docs/design.md says. -> (tokens, model mask, ended)."""
  tokens = np.zeros((N, L), np.int32)
  model = np.zeros((N, L), np.int32)
  length = np.zeros(N, int)
  ended = np.zeros(N, bool)
  over = np.zeros(N, bool)
  turn_start = np.zeros(N, int)
  while not over.all():
    mask = (np.arange(L)[None] < length[:, None]).astype(np.int32)
    logits = _completion_logits(fwd, params, prompt_tokens, prompt_mask, tokens, mask)
    for r in np.flatnonzero(~over):
      t = int(logits[r, length[r]].argmax())
      tokens[r, length[r]], model[r, length[r]] = t, 1
      length[r] += 1
      if t != EOS:
        over[r] = length[r] == L
        continue
      ended[r] = True
      if length[r] == L:
        over[r] = True
        continue
      answer = tool.submit(r, tokens[r, turn_start[r]:length[r]]).result()
      if answer is None or length[r] + len(answer) > L:  # TRL: a result that does not fit is
        over[r] = True  # dropped, the episode ends at the model's EOS
        if answer is not None:
          tool.withdraw(r)
        continue
      if length[r] + len(answer) == L:  # it fits, no model token can follow: truncated
        over[r], ended[r] = True, False
        continue
      tokens[r, length[r]:length[r] + len(answer)] = answer
      length[r] += len(answer)
      turn_start[r] = length[r]
      ended[r] = False
  return tokens, model, ended, length


@pytest.fixture(scope='module')
def tiny():
  graphdef, params, _ = _random_params(CFG, seed=0, lm_head_scale=SHARPEN)
  prompt_tokens, prompt_mask = _prompts(1, CFG.vocab_size)
  mesh = sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  tool = FakeTool()
  want = _reprefill_reference(_forward(graphdef), params, prompt_tokens, prompt_mask, tool)
  return dict(graphdef=graphdef, params=params, prompts=(prompt_tokens, prompt_mask), mesh=mesh,
              want=want, want_calls=sorted(map(str, tool.calls)), calls=list(tool.calls),
              want_withdrawn=sorted(tool.withdrawn))


class _LongAnswers(FakeTool):
  """Answers of 9 tokens: some do not fit in what is left of L = 24."""

  def answer(self, row: int, k: int):
    return None if k >= CALLS else np.asarray([5, 9, 13, 7, 5, 9, 13, 7, 5], np.int32)


def test_an_answer_that_does_not_fit_is_withdrawn_and_the_episode_ends_at_eos(tiny):
  """TRL 1.16 drops a tool result longer than the completion's room and the completion ends at
  the model's EOS (not truncated): the runner against the re-prefill reference with that rule."""
  tool = _LongAnswers()
  want = _reprefill_reference(_forward(tiny['graphdef']), tiny['params'], *tiny['prompts'], tool)
  assert tool.withdrawn  # the case happens
  sampler = sampling.Sampler(L, eos_id=EOS, pad_id=0, slots=3, decode_block=4)
  runner = episodes.EpisodeRunner(tiny['graphdef'], sampler, tiny['mesh'], greedy=True,
                                  segment_steps=5)
  got_tool = _LongAnswers()
  out = jax.device_get(runner.run(tiny['params'], *tiny['prompts'], jax.random.key(0),
                                  got_tool).completions)
  tokens, _, ended, length = want
  np.testing.assert_array_equal(out.tokens, tokens)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), length)
  np.testing.assert_array_equal(out.ended_with_eos, ended)
  assert sorted(got_tool.withdrawn) == sorted(tool.withdrawn)
  assert all(ended[r] for r in tool.withdrawn)  # finished, not truncated


@pytest.mark.parametrize('slots,delays', [(0, False), (3, True)], ids=['row-per-slot', 'pool'])
def test_greedy_episodes_equal_a_reference_that_reprefills_the_history(tiny, slots, delays):
  sampler = sampling.Sampler(L, eos_id=EOS, pad_id=0, slots=slots, decode_block=4)
  runner = episodes.EpisodeRunner(tiny['graphdef'], sampler, tiny['mesh'], greedy=True,
                                  segment_steps=5)
  tool = FakeTool(delays)
  out = runner.run(tiny['params'], *tiny['prompts'], jax.random.key(0), tool)
  tokens, model, ended, length = tiny['want']
  c = jax.device_get(out.completions)
  np.testing.assert_array_equal(np.asarray(c.mask).sum(1), length)
  np.testing.assert_array_equal(c.tokens, tokens)
  np.testing.assert_array_equal(out.model_mask, model * np.asarray(c.mask))
  np.testing.assert_array_equal(c.ended_with_eos, ended)
  assert (np.asarray(c.logps)[model == 0] == 0).all()  # host tokens: no sampler log-prob
  assert (np.asarray(c.logps)[model == 1] < 0).all()
  assert sorted(map(str, tool.calls)) == tiny['want_calls']  # the same turns, each once
  assert sorted(tool.withdrawn) == tiny['want_withdrawn']  # answers that did not fit
  # The case is not degenerate: tools answered in most rows, some episodes truncated.
  assert len(tool.calls) >= N and (model[:, 1:] < model[:, :-1]).any() and not ended.all()
  if slots:
    assert out.stats['rollout/segments'] > 1


def test_sampled_episodes_are_the_same_with_and_without_the_slot_pool(tiny):
  """Temperature 1: row i's position s draws with a key of (i, s) only (sampling.row_keys), so
  the pool (3 slots, tools answering late from threads) samples the same episodes as one slot per
  row with answers at once."""
  outs, calls = [], []
  for slots, delays in ((0, False), (3, True)):
    sampler = sampling.Sampler(L, eos_id=EOS, pad_id=0, slots=slots, decode_block=4)
    runner = episodes.EpisodeRunner(tiny['graphdef'], sampler, tiny['mesh'], greedy=False,
                                    segment_steps=5)
    tool = FakeTool(delays)
    outs.append(jax.device_get(runner.run(tiny['params'], *tiny['prompts'], jax.random.key(3),
                                          tool, temperature=1.0)))
    calls.append(sorted(map(str, tool.calls)))
  (a, ma), (b, mb) = [(o.completions, np.asarray(o.model_mask)) for o in outs]
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.mask, b.mask)
  np.testing.assert_array_equal(ma, mb)
  np.testing.assert_array_equal(a.ended_with_eos, b.ended_with_eos)
  np.testing.assert_allclose(a.logps, b.logps, atol=1e-5)
  assert calls[0] == calls[1]
  # Not degenerate: sampled, not the greedy episodes; tools answered; turns cut at EOS.
  assert (np.asarray(a.tokens) != tiny['want'][0]).any()
  assert (ma < np.asarray(a.mask)).any() and len(calls[0]) >= N // 2


class _ClosingTool(FakeTool):
  """FakeTool with the protocol's optional ``close``: records the turns cut at the limit."""

  def __init__(self, delays: bool = False):
    super().__init__(delays)
    self.closed = []

  def close(self, row, turn_tokens):
    self.closed.append((int(row), np.asarray(turn_tokens).tolist()))


def test_every_model_turn_reaches_the_host_the_cut_ones_by_close(tiny):
  """Each row's model turns (the reference's runs of model tokens) reach the host once, in
  order: by ``submit`` at EOS with room left, and the last one cut at the length limit by
  ``close`` (exactly the rows the reference ran to L); pool of 3, answers from threads."""
  sampler = sampling.Sampler(L, eos_id=EOS, pad_id=0, slots=3, decode_block=4)
  runner = episodes.EpisodeRunner(tiny['graphdef'], sampler, tiny['mesh'], greedy=True,
                                  segment_steps=5)
  tool = _ClosingTool(delays=True)
  runner.run(tiny['params'], *tiny['prompts'], jax.random.key(0), tool)
  tokens, model, _, length = tiny['want']
  assert sorted(r for r, _ in tool.closed) == np.flatnonzero(length == L).tolist()
  assert 0 < len(tool.closed) < N  # not degenerate: some rows cut, others ended by the host
  for r in range(N):
    runs, cur = [], []
    for s in range(int(length[r])):  # the reference's model turns: runs of model mask 1
      if model[r, s]:
        cur.append(int(tokens[r, s]))
      elif cur:
        runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    assert [t for row, t in tool.calls + tool.closed if row == r] == runs, r


def _turn_text(ids) -> str:
  """The fake tokenizer's text of token ids (EOS dropped, as decode's skip_special_tokens)."""
  return ' '.join(str(int(t)) for t in ids if int(t) != EOS)


class _EvalEpisodes(FakeTool):
  """The evaluator's interaction (``tools.Episodes``' methods it calls) over FakeTool: prompt
  row e.prompt of the tiny prompts; the final text is the last model turn's."""

  def __init__(self, chunk, prompts):
    super().__init__()
    self.chunk, self.prompts = chunk, prompts
    self.turns, self.answered = {}, {}

  def padded_prompts(self, length, pad_id):
    assert (length, pad_id) == (self.prompts[0].shape[1], 0)
    rows = [int(e.prompt) for e in self.chunk]
    return self.prompts[0][rows], self.prompts[1][rows]

  def answer(self, row, k):
    out = super().answer(row, k)
    self.answered[row] = self.answered.get(row, 0) + (out is not None)
    return out

  def finish(self, row, turns):
    self.turns[row] = list(turns)

  def final_text(self, row):
    return _turn_text(self.turns[row][-1]) if self.turns[row] else ''

  def completion_messages(self, row):
    return [{'role': 'tool', 'content': ''}] * self.answered.get(row, 0)

  def reward_fields(self):
    return {'completions_messages': [self.completion_messages(r) for r in range(len(self.chunk))]}


class _FakeTokenizer:
  """Prompt "i" -> the tiny prompts' row i (no chat template); ids -> their numbers."""
  chat_template, eos_token_id = None, EOS

  def __init__(self, prompts):
    self.prompts = prompts

  def __call__(self, prompt, add_special_tokens=False):
    tokens, mask = self.prompts
    return {'input_ids': tokens[int(prompt)][mask[int(prompt)] > 0].tolist()}

  def decode(self, ids, skip_special_tokens=True):
    return _turn_text(ids)


def test_evaluation_with_tools_scores_the_greedy_episodes(tiny):
  """The evaluator's episodes are the reference's greedy episodes (re-prefilled, no cache): a
  row is right iff its final text is the reference's last model turn, which only a row whose
  tool answered reaches after its first turn; its calls are the reference's answered calls. Its
  single-turn pass (no tools) scores the first turn: right only where no tool answered. 6 held-
  out rows in a batch of 8 (2 padding rows, not scored)."""
  import types  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import programs, rewards  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.tasks.base import Example  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import evaluation  # pylint: disable=g-import-not-at-top
  n = 6
  tokens, model, _, length = tiny['want']
  last, first, answered = [], [], []
  for r in range(n):  # the reference's model turns, written out: runs of model mask 1
    turns, cur = [], []
    for s in range(int(length[r])):
      if model[r, s]:
        cur.append(int(tokens[r, s]))
      elif cur:
        turns, cur = turns + [cur], []
    turns += [cur] if cur else []
    last.append(_turn_text(turns[-1]))
    first.append(_turn_text(turns[0]))
    answered.append(min(sum(1 for row, _ in tiny['calls'] if row == r), CALLS))
  right_single = sum(a == b for a, b in zip(first, last))
  assert sum(answered) and right_single < n  # tools change some rows' final turns

  def correct(prompts, completions, answer, completions_messages=None, **unused):
    assert len(completions) == n  # the padding rows are not scored
    if completions_messages is not None:  # the episodes' column, one entry per real row
      assert [sum(m['role'] == 'tool' for m in c) for c in completions_messages] == answered
    return [float(c == a) for c, a in zip(completions, answer)]

  correct.marks_correctness = True
  examples = [Example(str(r), None, {'answer': last[r]}) for r in range(n)]
  task = types.SimpleNamespace(name='data', eval_examples=lambda: examples,
                               reward_functions=lambda: [rewards.WeightedReward('correct',
                                                                                correct)])
  cfg = types.SimpleNamespace(eval=types.SimpleNamespace(num_examples=0, batch_size=8,
                                                         max_completion_length=L))
  mesh = tiny['mesh']
  params = jax.device_put(tiny['params'], sharding.replicated(mesh))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          params)
  kw = dict(eos_id=EOS, pad_id=0, max_prompt_length=tiny['prompts'][0].shape[1],
            attention='einsum')
  program = programs.evaluation_program(cfg, tiny['graphdef'], mesh,
                                        jax.tree.map(lambda x: x.sharding, params), abstract, **kw)
  runner, entry = programs.evaluation_episodes_program(cfg, tiny['graphdef'], mesh, abstract, **kw)
  assert entry.fn is runner.segment_fn
  ctx = types.SimpleNamespace(cfg=cfg, task=task, mesh=mesh, pad_id=0, guard=None,
                              eval_metric=None, tokenizer=_FakeTokenizer(tiny['prompts']))
  got = evaluation.Evaluator(
      ctx, program, runner=runner,
      make_interaction=lambda chunk: _EvalEpisodes(chunk, tiny['prompts'])).evaluate(params)
  assert got['accuracy'] == 1.0
  assert got['tools/calls_per_episode'] == pytest.approx(sum(answered) / n)
  assert got['without_tools/accuracy'] == pytest.approx(right_single / n)
  # Without tools the evaluator is the single-turn one, and its results the same.
  single = evaluation.Evaluator(ctx, program).evaluate(params)
  assert single == {k[len('without_tools/'):]: v for k, v in got.items()
                    if k.startswith('without_tools/')}


# -- the loss mask ------------------------------------------------------------------------------
def _multi_turn_rollout(rng, s, b):
  """A synthetic multi-turn rollout [S, B, ...]: completions with host-inserted runs
  (model_mask 0) between model turns, on-policy (no old log-probs)."""
  n = s * b
  comp_len = rng.integers(3, TC + 1, size=n)
  prompt_len = rng.integers(1, TP + 1, size=n)
  cm = (np.arange(TC)[None] < comp_len[:, None]).astype(np.int32)
  model = cm.copy()
  for i in range(n):  # one inserted run of 1-2 tokens after the first model token
    model[i, 1:1 + rng.integers(1, 3)] = 0
  model[:, 0] = 1
  model *= cm
  pm = (np.arange(TP)[None] >= TP - prompt_len[:, None]).astype(np.int32)
  r = lambda x: x.reshape(s, b, *x.shape[1:])
  zeros = np.zeros((n, TC), np.float32)
  buf = rollout_lib.RolloutBuffer(
      prompt_tokens=r(rng.integers(0, MODEL.vocab_size, (n, TP)).astype(np.int32) * pm),
      prompt_mask=r(pm),
      completion_tokens=r(rng.integers(0, MODEL.vocab_size, (n, TC)).astype(np.int32) * cm),
      completion_mask=r(cm), ended_with_eos=r(np.ones(n, bool)), sampler_logps=r(zeros),
      old_logps=r(zeros), has_old=r(np.zeros(n, bool)), ref_logps=None,
      policy_version=np.zeros((), np.int32), model_mask=r(model))
  return buf, r(rng.normal(size=n).astype(np.float32))


def _one_pass_loss(graphdef, params, full, mask):
  """The token-aggregated GRPO loss on-policy (ratio 1: -A per token) over the concatenated
  window, written out: the forward sees every completion token, ``mask`` weighs the loss."""
  from learner_refs import ref_completion_logps  # pylint: disable=g-import-not-at-top
  logp = ref_completion_logps(graphdef, params, full)
  ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
  m = mask.astype(jnp.float32)
  return jnp.sum(m * -ratio * full['advantages'][:, None]) / jnp.sum(m)


@pytest.mark.parametrize('k', [1, 3])
def test_learner_trains_only_the_model_tokens(k):
  mesh = make_mesh((1, 1, 1))
  graphdef, params, shardings = sharding.init_params(MODEL, seed=0, mesh=mesh)
  sched = ScheduleConfig(micro_batch_size=4, num_generations=2, steps_per_generation=k,
                         num_iterations=1, grad_accum_steps=k)
  loss_cfg = GRPOLossConfig(aggregation='token')
  engine = rollout_lib.RolloutEngine(
      graphdef, schedule.build_table(sched),
      SamplingConfig(max_prompt_length=TP, max_completion_length=TC), loss_cfg, mesh, shardings,
      eos_id=1, pad_id=0, multi_turn=True)
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(loss_cfg, TC), OPT, mesh,
                            shardings, optimizer_every=k)
  buf, adv = _multi_turn_rollout(np.random.default_rng(k), k, 4)
  buf = jax.device_put(buf, engine.buffer_shardings)
  adv = jax.device_put(adv, engine.advantage_sharding)
  state, window = None, []
  for j in range(k):
    mb = engine.micro_batch(buf, j, adv)
    assert 'loss_mask' in mb
    state = lrn.init(params, mb) if state is None else state
    state, out = lrn.step(state, mb)
    window.append(jax.device_get(mb))
  assert bool(out['stepped'])
  full = {key: np.concatenate([w[key] for w in window]) for key in window[0]}
  model_tokens = full['loss_mask']
  np.testing.assert_array_equal(
      model_tokens, np.asarray(buf.model_mask).reshape(-1, TC) * full['completion_mask'])
  assert (model_tokens < full['completion_mask']).any()  # inserted tokens are context only
  one_pass = jax.jit(jax.grad(lambda p, b, m: _one_pass_loss(graphdef, p, b, m)))
  grad = lambda mask: one_pass(params, full, mask)
  assert applied_grad_err(state, grad(model_tokens), OPT) <= 1e-5
  # Had the inserted tokens been trained (or counted in the normalizer), the gradient differs.
  assert applied_grad_err(state, grad(full['completion_mask']), OPT) > 1e-2


# -- GRPO: a resume mid-run ---------------------------------------------------------------------
@pytest.mark.slow
def test_multi_turn_grpo_resumes_bitwise_without_calling_the_tool_again(tmp_path):
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 2, 'checkpoint.every_steps': 0, 'grpo.completions_every': 0,
      'grpo.sampling.max_completion_length': 10})
  calls, rollouts = [], []

  def make_interaction(examples):
    assert len(examples) == cfg.grpo.schedule.completions_per_rollout
    tool = FakeTool(tokens=(3, 4, 5, 6))
    tool.calls = calls  # one count over the whole run
    return tool

  def make_trainer(workdir):
    ctx, params = api.build_context(cfg, str(workdir))
    trainer = grpo.GRPOLoop(ctx, cfg.grpo, make_interaction=make_interaction,
                            on_rollout=lambda e: rollouts.append(jax.device_get(e.buffer)))
    assert 'multi_turn' in trainer.programs.table
    if workdir.name == 'a':  # what plan lowers: the segment program at its abstract arguments
      trainer.programs.table['multi_turn'].lower()
    return trainer, params

  trainer, params = make_trainer(tmp_path / 'a')
  want, _ = trainer.run(params)
  want_calls, want_rollouts = list(calls), list(rollouts)
  assert len(want_rollouts) == 3 and want_calls
  assert all((b.model_mask < b.completion_mask).any() for b in want_rollouts)  # tools answered
  del calls[:], rollouts[:]
  got, _ = helpers.run_grpo_in_pieces(make_trainer, tmp_path / 'b', (3,), total_micro_steps=6)
  helpers.assert_trees_equal(got, want)
  helpers.assert_trees_equal(rollouts, want_rollouts)
  # Micro-step 3 is in rollout 1 (E = 2): the resumed run trains on the checkpointed buffer and
  # generates rollout 2 only; every tool call of the run happened once.
  assert sorted(map(str, calls)) == sorted(map(str, want_calls))


def test_multi_turn_on_several_processes_is_one_config_error(monkeypatch):
  """Multi-turn rollouts run on one process for now: a GRPOLoop with an interaction on more is
  refused with one ConfigError line, before any program is built."""
  import types  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  ctx = types.SimpleNamespace(with_chosen_lengths=lambda stage, cfg: cfg)
  with pytest.raises(ConfigError, match='one process') as e:
    grpo.GRPOLoop(ctx, smoke_configs.smoke('grpo_arith').grpo,
                  make_interaction=lambda examples: FakeTool())
  assert '\n' not in str(e.value)
