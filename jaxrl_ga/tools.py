"""Tools and environments for multi-turn GRPO rollouts, on the host (TRL 1.16's interface).

A rollout row is an episode: the model writes an assistant turn; when the turn (ended at eos, as
in TRL) holds tool calls, the host runs them and the tool turn(s), rendered by the chat template
with the next assistant header, are appended as context tokens; the model goes on. This module
is the host side: which tools exist, the prompt they are announced in, parsing a finished turn,
running the calls and rendering their results. The decoding (and the loss mask over the model's
own tokens) is the engine's (``jaxrl_ga.episodes``), which calls :meth:`Episodes.submit` at
each turn end (:meth:`Episodes.close` for a last turn cut at the length limit).

What TRL's ``GRPOTrainer(tools=..., environment_factory=...)`` takes, this takes:

  tools             plain functions (sync or ``async def``) with type hints and a docstring
                    (``transformers.utils.get_json_schema`` must describe them; a function it
                    cannot is a ConfigError naming it). CLI: ``grpo.tools='module:fn,module:fn2'``.
  environment       a class (or any factory) whose instances have ``reset(**row) -> str | None``
                    and whose public methods are the tools; optional ``get_reward() -> float``.
                    One instance per rollout row (pooled across rollouts, reset every time, as
                    TRL does). The text ``reset`` returns is appended to the prompt's last
                    message. ``get_reward`` is an extra reward named after the class, weight 1
                    (None for rows of another environment). A dict ``{name: factory}`` selects
                    each row's environment by its ``environment`` column (which ``reset`` does
                    not receive). CLI: ``grpo.environment='module:Class'`` or
                    ``'name=module:Class,name2=module:Class2'``.
  grpo.max_tool_calls   TRL's ``max_tool_calling_iterations``: assistant turns with tool calls
                    whose calls are run, per episode (0: no limit but the completion length).
                    A turn with calls past it ends the episode, its calls not run.
  grpo.tool_timeout_s   a call running longer is a failure whose message is its tool turn.

Tool-call formats. A tokenizer with a response parser (``tokenizer.response_template`` or
``response_schema``, transformers' ``parse_response``) has its turns parsed by it; any other
(SmolLM2's ChatML) by the plain format, Qwen2.5's::

  <tool_call>
  {"name": "multiply", "arguments": {"a": 12, "b": 34}}
  </tool_call>

one block per call, or, where the template writes calls as one bare JSON object with
``"parameters"`` (Llama 3.1/3.2), that object as the whole turn (:func:`call_parser` picks the
one that reads back the template's own call; neither: ConfigError), in the turn's content only:
a thinking model's ``<think>...</think>`` (opened by the model or by the generation prompt) is
its reasoning, where a call is not run (TRL 1.16's Qwen3 parser), and the assistant message
holds it as ``reasoning_content``. Prompts: a chat template that renders tools (TRL's check,
:func:`template_renders_tools`) gets them through ``apply_chat_template(tools=...)``; any other
gets a system block announcing them and the plain format (:data:`PLAIN_TOOLS_PROMPT`, Qwen2.5's
words). Tool turns: ``{'role': 'tool', 'name': ..., 'content': str(result)}`` rendered by the
template and cut after the model's eos (TRL's ``_get_tool_suffix_ids``); for SmolLM2 that is
``\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``.

Failures never crash a run: a tool that raises, times out, a name the model invents, a call that
is not JSON or whose arguments are not an object: the tool turn is ``str({'error': message})``
(TRL's) and the call counts in ``tools/failures``. (TRL drops a turn its parser cannot read to
plain text, ending the episode; so does a response-template tokenizer here. The plain format's
unreadable blocks are failed calls instead: the model reads why.)

Concurrency: the calls of one turn run one after another, in the turn's order, each once the one
before it is answered (as TRL 1.16 runs them: a stateful environment sees its tools in the order
the model wrote them); the turns of different rows run at once, a sync tool on a daemon thread of
its own, an async one on one event loop thread, and the engine keeps decoding the other rows
meanwhile. A call past its timeout is answered with the timeout's tool turn and the turn's next
call starts; an async one is cancelled, a sync one's thread runs on unheard. (TRL has no
timeout.) An environment whose sync call runs on is held (:meth:`ToolSetup.hold`): it takes no
other call (a failed call), leaves the pool, and its ``get_reward`` waits for the call at most
another timeout (else None), so that no late call changes the state another call, a reward or a
later rollout's episode sees.

Rewards of an episode (docs/your_data.md, "Tools and environments"): ``prompts`` holds each
row's prompt, with ``reset``'s text appended where it returned some (TRL's); ``completions`` each
row's final assistant turn's text as the model wrote it (reasoning included); the column
``completions_messages`` its whole completion as messages (assistant and tool turns, TRL's
conversational ``completions``: the reasoning in ``reasoning_content``, out of ``content``) and
``environments`` its environment instance (TRL's ``environments`` keyword).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import numpy as np
from transformers.utils import get_json_schema

from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.trainers import text

__all__ = ['ToolSetup', 'Episodes', 'build', 'make_interaction', 'add_rewards', 'tool_schema',
           'parse_plain_tool_calls', 'parse_json_tool_call', 'split_reasoning', 'call_parser',
           'template_renders_tools', 'PLAIN_TOOLS_PROMPT']

# Qwen2.5's chat template's words for the tools it is given (the plain format's system block).
PLAIN_TOOLS_PROMPT = (
    '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
    'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
    '{tools}\n</tools>\n\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

_TOOL_CALL = re.compile(r'<tool_call>(.*?)(</tool_call>|$)', re.DOTALL)
_RESERVED = ('reset', 'get_reward')


# -- specs ----------------------------------------------------------------------------------------
def tool_schema(fn: Callable[..., Any], what: str = 'grpo.tools') -> dict:
  """The JSON schema the chat template announces ``fn`` with (transformers' get_json_schema:
  type hints and a Google-style docstring with an ``Args:`` entry per parameter). Without them:
  ConfigError naming ``fn``."""
  try:
    return get_json_schema(fn)
  except Exception as e:  # pylint: disable=broad-except  (TypeHint/DocstringParsingException)
    name = getattr(fn, '__qualname__', None) or getattr(fn, '__name__', repr(fn))
    raise ConfigError(f'{what}: tool {name!r} cannot be described to the model ({e}); give it '
                      f'type hints and a docstring with an Args: line per parameter.') from None


def _resolve_tools(tools, what: str) -> list[Callable[..., Any]]:
  if isinstance(tools, str):
    tools = [s.strip() for s in tools.split(',') if s.strip()]
  out = []
  for t in tools or ():
    fn = rewards_lib.import_callable(t, what) if isinstance(t, str) else t
    if not callable(fn):
      raise ConfigError(f'{what}: {t!r} is neither a callable nor an import string '
                        f'"module:function".')
    tool_schema(fn, what)
    out.append(fn)
  rewards_lib.refuse_repeated([f.__name__ for f in out], f'{what}: tool',
                              'each tool needs its own name.')
  return out


def _resolve_environments(environment, what: str) -> Optional[dict[Optional[str], Callable]]:
  """{name: factory}; None: no environment; {None: factory}: one for every row."""
  if environment is None or environment == '':
    return None
  if isinstance(environment, Mapping):
    return {str(k): _factory(v, what) for k, v in environment.items()}
  if isinstance(environment, str):
    parts = [p.strip() for p in environment.split(',') if p.strip()]
    named = [p.partition('=') for p in parts]
    if len(parts) == 1 and not named[0][1]:
      return {None: _factory(parts[0], what)}
    if not all(sep and name.strip() for name, sep, _ in named):
      raise ConfigError(f'{what}={environment!r}: give one "module:Class", or several as '
                        f'"name=module:Class,name2=module:Class2" (chosen by the environment '
                        f'column).')
    return {name.strip(): _factory(target, what) for name, _, target in named}
  return {None: _factory(environment, what)}


def _factory(target, what: str) -> Callable[[], Any]:
  fn = rewards_lib.import_callable(target, what) if isinstance(target, str) else target
  if not callable(fn):
    raise ConfigError(f'{what}: {target!r} is not a class or factory.')
  return fn


def _environment_methods(instance) -> list[str]:
  """The tool method names of an environment: public functions of its class, but reset and
  get_reward (TRL lists them on the class, so that properties are not evaluated)."""
  return [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
          if n not in _RESERVED and not n.startswith('_')]


class ToolSetup:
  """A run's tools and environments, checked (every ConfigError before anything compiles).

  ``tools``: callables or import strings; ``environment``: a factory, an import string, or a
  dict of them (see the module docstring); ``max_tool_calls``, ``timeout_s``: grpo's settings.
  """

  def __init__(self, tools=(), environment=None, max_tool_calls: int = 0,
               timeout_s: float = 30.0, what_tools: str = 'grpo.tools',
               what_environment: str = 'grpo.environment'):
    self.standalone = _resolve_tools(tools, what_tools)
    self.factories = _resolve_environments(environment, what_environment)
    self.multi = self.factories is not None and None not in self.factories
    self.max_tool_calls, self.timeout_s = int(max_tool_calls), float(timeout_s)
    self._pool_of: dict[Optional[str], list[Any]] = {}  # reusable instances per environment
    self._env_tools: dict[Optional[str], list[str]] = {}
    self._reward_types: list[type] = []
    for name, factory in (self.factories or {}).items():
      what = what_environment + ('' if name is None else f' ({name})')
      try:
        instance = factory()
      except Exception as e:  # pylint: disable=broad-except
        raise ConfigError(f'{what}: creating an instance raised {type(e).__name__}: {e}.') from None
      members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
      if 'reset' not in members:
        raise ConfigError(f'{what}: {type(instance).__name__} has no reset method; an '
                          f'environment needs reset(self, **row) -> str | None (TRL\'s).')
      methods = _environment_methods(instance)
      for m in methods:
        tool_schema(getattr(instance, m), what)
      clash = sorted(set(methods) & {f.__name__ for f in self.standalone})
      if clash:
        raise ConfigError(f'{what}: method(s) {", ".join(clash)} have the name of a tool of '
                          f'{what_tools}; rename one.')
      self._env_tools[name] = methods
      self._pool_of[name] = [instance]
      if 'get_reward' in members and type(instance) not in self._reward_types:
        self._reward_types.append(type(instance))
    if not self.standalone and not self._env_tools:
      raise ConfigError(f'{what_tools} and {what_environment} are both empty; give tools or an '
                        f'environment.')
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._loop_lock = threading.Lock()
    # Environment instances whose sync call timed out and runs on (its thread cannot be
    # stopped): id -> (instance, the call's Future). Such an instance takes no other call, leaves
    # the pool, and its get_reward waits for the call (see hold()).
    self._held: dict[int, tuple[Any, concurrent.futures.Future]] = {}
    self._held_lock = threading.Lock()

  @classmethod
  def from_config(cls, grpo, tools=None, environment_factory=None) -> Optional['ToolSetup']:
    """The run's setup from ``grpo`` (GRPOConfig) and the Python API's arguments (which take
    precedence); None when neither gives tools nor an environment (the default: nothing
    changes)."""
    tools = grpo.tools if tools is None else tools
    environment = grpo.environment if environment_factory is None else environment_factory
    if not tools and not environment:
      return None
    return cls(tools or (), environment or None, grpo.max_tool_calls, grpo.tool_timeout_s)

  # -- what rows see ------------------------------------------------------------------------------
  def environment_name(self, fields: Mapping[str, Any]) -> Optional[str]:
    """The environment a row selects (its ``environment`` column with a dict of them)."""
    if not self.multi:
      return None
    name = fields.get('environment')
    if name not in self.factories:
      raise ConfigError(f'a row has environment={name!r}, not among the environments of '
                        f'grpo.environment: {sorted(self.factories)}; give each row an '
                        f'environment column naming one.')
    return name

  def check_tokenizer(self, tokenizer) -> Optional[Callable[[str], list[dict]]]:
    """Episodes need a chat template (to render prompts with tools and tool turns), and the
    model's calls must be readable (``call_parser``): a template that writes calls in a format
    no parser here reads, without a response parser, would have every call go unread, every
    episode silently single-turn. -> the calls' parser (None: transformers' parse_response)."""
    if not getattr(tokenizer, 'chat_template', None):
      raise ConfigError('grpo.tools / grpo.environment need a tokenizer with a chat template '
                        '(an instruct model, model.hf_path); this one has none.')
    if has_response_parser(tokenizer):
      return None
    parser = call_parser(tokenizer)
    if parser is not None:
      return parser
    raise ConfigError(
        f'grpo.tools / grpo.environment: the chat template writes tool calls as '
        f'{_rendered_call(tokenizer).strip()[:120]!r}, which neither the <tool_call> parser nor '
        f'the bare-JSON one can read, and the tokenizer has no response parser; set '
        f'tokenizer.response_schema (transformers\' parse_response) for this format, or use a '
        f'template that writes <tool_call> blocks (Qwen2.5\'s).')

  def reset_kwargs(self, example) -> dict[str, Any]:
    """``reset``'s keywords for a row, as TRL passes them: ``prompt`` (as in the data) and the
    other columns, but ``environment`` with a dict of environments."""
    kwargs = {'prompt': example.prompt, **example.fields}
    if self.multi:
      kwargs.pop('environment', None)
    return kwargs

  def reward_functions(self) -> list[rewards_lib.WeightedReward]:
    """One reward per environment class with get_reward, named after the class, weight 1: the
    row's ``get_reward()`` when its environment is exactly that class, else None (TRL's)."""
    return [rewards_lib.WeightedReward(cls.__name__, _env_reward(cls, self)) for cls in
            self._reward_types]

  def dry_call_fields(self, examples: Sequence[Any], completions: Sequence[str]
                      ) -> dict[str, list]:
    """The episode columns of the reward functions' dry call (GRPOStage.check_inputs; each
    example once per completion, in a row): ``completions_messages`` (each placeholder completion
    as one assistant turn) and ``environments`` (an instance per row, reset with it)."""
    fields = {'completions_messages': [[{'role': 'assistant', 'content': c}]
                                       for _ in examples for c in completions]}
    if self.factories is not None:
      names = [self.environment_name(ex.fields) for ex in examples]
      instances = self._instances([n for n in names for _ in completions])
      rows = [ex for ex in examples for _ in completions]
      for ex, env in zip(rows, instances):
        env.reset(**self.reset_kwargs(ex))
      fields['environments'] = instances
    return fields

  def prompt_ids(self, tokenizer, example) -> list[int]:
    """The token ids of ``example``'s episode prompt (:meth:`Episodes.prompt_ids`: the tools
    announced, its environment reset with it and the reset text appended): what
    api.validate_lengths measures the prompt width with."""
    return self.episodes(tokenizer, [example]).prompt_ids(0)

  def episodes(self, tokenizer, examples: Sequence[Any],
               stop_ids: Sequence[int] = ()) -> 'Episodes':
    """The interaction of one rollout whose rows have ``examples`` (jaxrl_ga.tasks.base.Example,
    row j*B+i at index j*B+i): an environment per row, reset with the row's columns.
    ``stop_ids``: the ids that end a turn (``RunContext.generation_stops``; default: the
    tokenizer's eos)."""
    return Episodes(self, tokenizer, examples, stop_ids)

  # -- environments and the pool ------------------------------------------------------------------
  def _instances(self, names: Sequence[Optional[str]]) -> list[Any]:
    """One instance per row: the pool's, more created when a rollout needs more (TRL's
    "construct once, reset often")."""
    cursor: dict[Optional[str], int] = {}
    out = []
    for name in names:
      pool = self._pool_of[name]
      i = cursor.get(name, 0)
      if i == len(pool):
        pool.append(self.factories[name]())
      elif self.running(pool[i]):  # a timed-out call still changes it: a new one takes its place
        logging.warning('tools: an instance of %s is still running a call that timed out '
                        '(grpo.tool_timeout_s); a new instance replaces it in the pool.',
                        type(pool[i]).__name__)
        pool[i] = self.factories[name]()
      cursor[name] = i + 1
      out.append(pool[i])
    return out

  def hold(self, environment, future: concurrent.futures.Future) -> None:
    """Marks ``environment`` as still running ``future``, a sync call that timed out: until
    it returns, the instance takes no other call (:meth:`running`), is not handed to a later
    rollout, and its ``get_reward`` waits for it (a thread cannot be stopped; run on, it would
    change the state the next call, the reward or another row's episode sees)."""
    with self._held_lock:
      self._held[id(environment)] = (environment, future)

  def running(self, environment) -> Optional[concurrent.futures.Future]:
    """The timed-out call ``environment`` still runs (:meth:`hold`), or None."""
    with self._held_lock:
      held = self._held.get(id(environment))
      if held is None or held[0] is not environment:
        return None
      if held[1].done():
        del self._held[id(environment)]
        return None
      return held[1]

  def _event_loop(self) -> asyncio.AbstractEventLoop:
    """A daemon thread's event loop that async tools are awaited on (made at first use)."""
    with self._loop_lock:
      if self._loop is None:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name='jaxrl_ga-tool-loop', daemon=True).start()
        self._loop = loop
      return self._loop

  def call(self, fn: Callable[..., Any], arguments: dict) -> concurrent.futures.Future:
    """``fn(**arguments)`` on a daemon thread of its own (a coroutine function: awaited on the
    event loop), so that the rows' calls run at once and a hung tool holds neither the
    others nor the process's exit (a ThreadPoolExecutor's workers are joined at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if inspect.iscoroutinefunction(fn):
      try:
        coro = fn(**arguments)
      except Exception as e:  # pylint: disable=broad-except  (bad arguments)
        future.set_exception(e)
        return future
      return asyncio.run_coroutine_threadsafe(coro, self._event_loop())

    def run() -> None:
      if not future.set_running_or_notify_cancel():  # running: cancel() leaves it be
        return  # timed out before it started
      try:
        result = fn(**arguments)
      except BaseException as e:  # pylint: disable=broad-except  (the call's failure)
        future.set_exception(e)
      else:
        future.set_result(result)

    threading.Thread(target=run, name=f'jaxrl_ga-tool-{fn.__name__}', daemon=True).start()
    return future


def _env_reward(cls: type, setup: ToolSetup) -> Callable[..., list]:
  def reward(prompts, completions, environments=None, **unused_columns):
    del prompts, unused_columns
    if environments is None:  # a dry call before the run (no episode yet): does not apply
      return [None] * len(completions)
    out = []
    deadline = time.monotonic() + setup.timeout_s
    for e in environments:
      if type(e) is not cls:  # pylint: disable=unidiomatic-typecheck  (TRL: exact type)
        out.append(None)
        continue
      call = setup.running(e)
      if call is not None:  # a timed-out call still runs: its state is not the episode's yet
        concurrent.futures.wait([call], timeout=max(deadline - time.monotonic(), 0.0))
        if not call.done():
          logging.warning('tools: %s.get_reward not called: a call that timed out is still '
                          'running on the instance after another grpo.tool_timeout_s; the '
                          'row is unscored by it (None).', cls.__name__)
          out.append(None)
          continue
      value = e.get_reward()
      out.append(asyncio.run(value) if inspect.isawaitable(value) else value)
    return out
  reward.__name__ = cls.__name__
  return reward


def build(grpo, tools=None, environment_factory=None) -> Optional[ToolSetup]:
  """:meth:`ToolSetup.from_config` (the name api.build_context calls)."""
  return ToolSetup.from_config(grpo, tools, environment_factory)


# -- parsing --------------------------------------------------------------------------------------
def parse_plain_tool_calls(text: str) -> list[dict]:
  """The calls of an assistant turn in the plain format. -> [{'name', 'arguments'} or {'name',
  'error'}] in order; a block that is not JSON, not an object with a string name, or whose
  arguments are not an object (or a JSON string of one) is an 'error' entry (a failed call)."""
  calls = []
  for body, closing in _TOOL_CALL.findall(text):
    name_match = re.search(r'"name"\s*:\s*"([^"]*)"', body)
    name = name_match.group(1) if name_match else 'unknown'
    if not closing:
      calls.append({'name': name, 'error': 'the tool call has no closing </tool_call> tag'})
      continue
    try:
      call = json.loads(body.strip())
    except json.JSONDecodeError as e:
      calls.append({'name': name, 'error': f'the tool call is not valid JSON ({e})'})
      continue
    calls.append(_checked_call(call))
  return calls


_THINK = re.compile(r'<think>(.*?)(?:</think>\s*|$)', re.DOTALL)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
  """A turn's ``(content, reasoning)``: the text inside ``<think>...</think>`` (an unclosed one
  to the end), as TRL 1.16's response templates for thinking models (Qwen3's) read it; tool
  calls are read in the content only, so a call the model only thinks about is not run.
  ``opened``: the generation prompt opened the reasoning (the turn starts inside it)."""
  if opened:
    text = '<think>' + text
  if '<think>' not in text:
    return text, ''
  reasoning = '\n'.join(m.group(1).strip() for m in _THINK.finditer(text))
  return _THINK.sub('', text), reasoning


def parse_json_tool_call(text: str) -> list[dict]:
  """The call of an assistant turn that is one bare JSON object ``{"name": ..., "parameters":
  {...}}`` (Llama 3.1's and 3.2's format, as TRL 1.16's schema for them reads it: the whole turn
  is the call, at most one per turn; ``"arguments"`` is taken too). -> [{'name', 'arguments'}]
  or [{'name', 'error'}], or [] where the turn is not such an object (plain content)."""
  body = text.strip()
  if not body.startswith('{'):
    return []
  try:
    call, end = json.JSONDecoder().raw_decode(body)
  except json.JSONDecodeError:
    return []
  if body[end:].strip() or not isinstance(call, dict) or not isinstance(call.get('name'), str):
    return []
  if 'parameters' not in call and 'arguments' not in call:
    return []
  return [_checked_call({'name': call['name'],
                         'arguments': call.get('parameters', call.get('arguments'))})]


def call_parser(tokenizer) -> Optional[Callable[[str], list[dict]]]:
  """The parser of the model's calls without a response parser: ``parse_plain_tool_calls``
  where the template does not render tools (the plain format is asked for in a system block)
  or writes <tool_call> blocks; ``parse_json_tool_call`` where it writes one bare JSON object
  (Llama 3.1/3.2); None where neither reads back the call the template writes."""
  if not template_renders_tools(tokenizer):
    return parse_plain_tool_calls
  written = _rendered_call(tokenizer)
  # As a model turn reaches the parser: tokenized, decoded without special tokens.
  written = tokenizer.decode(tokenizer(written, add_special_tokens=False)['input_ids'],
                             skip_special_tokens=True)
  want = {'name': _CALL_PROBE[0], 'arguments': {_CALL_PROBE[1]: _CALL_PROBE[2]}}
  for parser in (parse_plain_tool_calls, parse_json_tool_call):
    if parser(written) == [want]:
      return parser
  return None


def _checked_call(call) -> dict:
  if isinstance(call, dict) and call.get('type') == 'function' and 'function' in call:
    call = call['function']  # transformers' parse_response form
  if not isinstance(call, dict) or not isinstance(call.get('name'), str):
    return {'name': 'unknown', 'error': 'a tool call must be a JSON object with a "name" string '
                                        'and an "arguments" object'}
  arguments = call.get('arguments', {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError as e:
      return {'name': call['name'], 'error': f'the arguments are not valid JSON ({e})'}
  if not isinstance(arguments, dict):
    return {'name': call['name'], 'error': 'the arguments must be a JSON object'}
  return {'name': call['name'], 'arguments': arguments}


def has_response_parser(tokenizer) -> bool:
  """Whether transformers' ``tokenizer.parse_response`` can parse this tokenizer's turns."""
  return (getattr(tokenizer, 'response_template', None) is not None
          or getattr(tokenizer, 'response_schema', None) is not None)


_CALL_PROBE = ('tool_name_a8f3e2b1', 'tool_arg_key_b9d4f5c2', 'tool_arg_val_d6e7a9f3')


def _rendered_call(tokenizer) -> str:
  """The text the chat template writes for one assistant turn with one tool call (the part
  after the rendering without that turn)."""
  name, key, value = _CALL_PROBE
  head = [{'role': 'user', 'content': 'hi'}]
  turn = {'role': 'assistant', 'content': '', 'tool_calls': [
      {'type': 'function', 'function': {'name': name, 'arguments': {key: value}}}]}
  before = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=False)
  after = tokenizer.apply_chat_template(head + [turn], tokenize=False)
  return after[len(before):] if after.startswith(before) else after


def template_renders_tools(tokenizer) -> bool:
  """TRL's ``supports_tool_calling``: the chat template renders a whole tool-calling exchange
  (the call's name, its argument and the tool message all appear)."""
  sentinels = (*_CALL_PROBE, 'tool_content_c4f9a8e2')
  name, key, value, content = sentinels
  messages = [{'role': 'user', 'content': 'hi'},
              {'role': 'assistant', 'content': '', 'tool_calls': [
                  {'type': 'function', 'function': {'name': name, 'arguments': {key: value}}}]},
              {'role': 'tool', 'name': name, 'content': content}]
  try:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
  except Exception:  # pylint: disable=broad-except  (a template refusing the roles)
    return False
  return all(s in rendered for s in sentinels)


# -- one rollout ----------------------------------------------------------------------------------
class Episodes:
  """The ``Interaction`` of one rollout (``jaxrl_ga.episodes``): its rows' environments, prompts,
  conversations and tool metrics. ``submit(row, turn_tokens)`` -> a Future of the tokens to
  append (tool turns + the next assistant header) or None (the episode ends); never raises."""

  def __init__(self, setup: ToolSetup, tokenizer, examples: Sequence[Any],
               stop_ids: Sequence[int] = ()):
    parser = setup.check_tokenizer(tokenizer)
    self.setup, self.tokenizer = setup, tokenizer
    self.stop_ids = frozenset(int(i) for i in stop_ids) or {int(tokenizer.eos_token_id)}
    self.examples = list(examples)
    self.parse_with_template = parser is None
    self._parse_calls = parser
    self.template_tools = template_renders_tools(tokenizer)
    names = [setup.environment_name(ex.fields) for ex in self.examples]
    self.environments = (setup._instances(names)  # pylint: disable=protected-access
                         if setup.factories is not None else [None] * len(self.examples))
    self._tools: list[dict[str, Callable]] = []
    self._schemas: list[list[dict]] = []
    self._prompts: list[list[dict]] = []
    self._observed: list[bool] = []  # reset returned text: the rewards' prompt is the messages
    for ex, name, env in zip(self.examples, names, self.environments):
      fns = list(setup.standalone)
      if env is not None:
        fns += [getattr(env, m) for m in setup._env_tools[name]]  # pylint: disable=protected-access
      self._tools.append({f.__name__: f for f in fns})
      self._schemas.append([tool_schema(f) for f in fns])
      self._prompts.append(self._reset(ex, env))
    self._lock = threading.Lock()
    # The tokenizer from one thread at a time (a fast tokenizer's state is not for concurrent
    # use); never held while taking _lock.
    self._tok_lock = threading.RLock()
    self._completion: list[list[dict]] = [[] for _ in self.examples]
    self._last_text = [''] * len(self.examples)  # each row's last assistant turn, as decoded
    # Each row's tokens so far (prompt, turns, tool turns): the prefix parse_response reads.
    self._history: list[Optional[list[int]]] = [None] * len(self.examples)
    self._tool_turns = np.zeros(len(self.examples), np.int64)  # assistant turns with calls run
    self._calls = np.zeros(len(self.examples), np.int64)
    self._failures = np.zeros(len(self.examples), np.int64)
    self._calls_of: dict[str, int] = {}
    self._answer: dict[int, tuple[int, int]] = {}  # row: its last answer's (messages, tokens)

  def _reset(self, example, env) -> list[dict]:
    """The row's prompt messages: its prompt (a string: one user message) with ``reset``'s text
    appended to the last message's content (TRL's); reset's keywords are the row's, as TRL
    passes them: ``prompt`` (as in the data, before the text is appended) and the other columns
    (but ``environment`` with a dict of environments)."""
    prompt = example.prompt
    messages = ([{'role': 'user', 'content': prompt}] if isinstance(prompt, str)
                else [dict(m) for m in prompt])
    if env is None:
      self._observed.append(False)
      return messages
    observation = env.reset(**self.setup.reset_kwargs(example))
    self._observed.append(observation is not None)
    if observation is not None:
      messages[-1] = {**messages[-1], 'content': messages[-1]['content'] + observation}
    return messages

  # -- prompts ------------------------------------------------------------------------------------
  def prompt_messages(self, row: int) -> list[dict]:
    """The row's prompt as chat messages, reset text appended, the plain format's tools system
    block included where the template does not render tools."""
    messages = [dict(m) for m in self._prompts[row]]
    if self.template_tools or not self._schemas[row]:
      return messages
    block = PLAIN_TOOLS_PROMPT.format(tools='\n'.join(json.dumps(s) for s in self._schemas[row]))
    if messages and messages[0]['role'] == 'system':
      messages[0] = {**messages[0], 'content': messages[0]['content'] + '\n\n' + block}
      return messages
    return [{'role': 'system', 'content': block}] + messages

  def prompt_text(self, row: int) -> str:
    """The row's prompt as the model sees it (the generation prompt appended)."""
    return self.tokenizer.apply_chat_template(
        self.prompt_messages(row), tools=(self._schemas[row] or None) if self.template_tools
        else None, add_generation_prompt=True, tokenize=False)

  def prompt_ids(self, row: int) -> list[int]:
    """Token ids of :meth:`prompt_text` (no special tokens added beyond the template's): what
    replaces ``text.encode_prompt`` for the row."""
    with self._tok_lock:
      return list(self.tokenizer(self.prompt_text(row), add_special_tokens=False)['input_ids'])

  def padded_prompts(self, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row's :meth:`prompt_ids`, left-padded: tokens, mask [N, length] int32 (what
    GRPOLoop._prompt_rows makes of the rows' prompts without tools; too long: ConfigError
    naming grpo.sampling.max_prompt_length)."""
    return text.left_pad([self.prompt_ids(r) for r in range(len(self.examples))], length, pad_id,
                         'grpo.sampling.max_prompt_length')

  # -- turns --------------------------------------------------------------------------------------
  def submit(self, row: int, turn_tokens) -> concurrent.futures.Future:
    """The Interaction protocol: the row's finished turn -> a Future of the int32 tokens to
    append, or of None (the episode ends: no call in the turn, the turn did not end at eos,
    grpo.max_tool_calls turns with calls already run). Never raises."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      self._submit(row, np.asarray(turn_tokens).reshape(-1).tolist(), out)
    except Exception as e:  # pylint: disable=broad-except  (never raises: the episode ends)
      logging.exception('tools: row %d: the turn could not be handled (%s); its episode ends.',
                        row, e)
      if not out.done():
        out.set_result(None)
    return out

  def _submit(self, row: int, ids: list[int], out: concurrent.futures.Future) -> None:
    tok = self.tokenizer
    ended = bool(ids) and ids[-1] in self.stop_ids
    with self._tok_lock:
      text = tok.decode(ids, skip_special_tokens=True)
    calls, message = self._parse(row, ids, text) if ended else ([], self._message(row, text))
    if calls:
      message['tool_calls'] = [{'type': 'function', 'function': {
          'name': c['name'], 'arguments': c.get('arguments', {})}} for c in calls]
    with self._lock:
      self._completion[row].append(message)
      self._last_text[row] = text
    limit = self.setup.max_tool_calls
    if not calls or (limit and self._tool_turns[row] >= limit):
      out.set_result(None)
      return
    with self._lock:
      self._tool_turns[row] += 1
    results: list[Optional[dict]] = [None] * len(calls)
    remaining = [len(calls)]
    finish_lock = threading.Lock()

    def finish(i: int, content: str, failed: bool) -> None:
      with finish_lock:
        if results[i] is not None:
          return  # the timeout came first, or the call after its timeout
        results[i] = {'role': 'tool', 'name': calls[i]['name'], 'content': content}
        remaining[0] -= 1
        last = remaining[0] == 0
      with self._lock:
        self._calls[row] += 1
        self._failures[row] += int(failed)
        if calls[i]['name'] in self._tools[row]:  # an invented name gets no metric of its own
          self._calls_of[calls[i]['name']] = self._calls_of.get(calls[i]['name'], 0) + 1
      if not last:  # the turn's next call, once this one is answered (TRL's order)
        self._start(row, i + 1, calls[i + 1], finish)
        return
      try:
        ids = self._tool_turn_ids(results)
        with self._lock:
          self._completion[row].extend(results)
          self._history[row].extend(ids)
          self._answer[row] = (len(results), len(ids))
        out.set_result(np.asarray(ids, np.int32))
      except Exception as e:  # pylint: disable=broad-except
        logging.exception('tools: row %d: rendering the tool turn failed (%s); its episode '
                          'ends.', row, e)
        out.set_result(None)

    self._start(row, 0, calls[0], finish)

  def _start(self, row: int, i: int, call: dict, finish) -> None:
    """Runs one call; ``finish(i, content, failed)`` when it returns, raises or times out."""
    error = lambda message: str({'error': message})  # TRL's tool turn of a failed call
    if 'error' in call:
      finish(i, error(call['error']), True)
      return
    fn = self._tools[row].get(call['name'])
    if fn is None:
      finish(i, error(f'Tool {call["name"]} not found.'), True)  # TRL's message
      return
    timeout = self.setup.timeout_s
    env = self.environments[row]
    env = env if getattr(fn, '__self__', None) is env and env is not None else None
    if env is not None and self.setup.running(env) is not None:
      finish(i, error(f'Tool {call["name"]} not run: an earlier call to this environment timed '
                      'out and is still running (grpo.tool_timeout_s).'), True)
      return
    running: list[concurrent.futures.Future] = []

    def timed_out() -> None:
      for f in running:
        # An async tool's task is cancelled; a thread that started runs on, unheard: its
        # environment is held until it returns (ToolSetup.hold).
        if not f.cancel() and not f.done() and env is not None:
          self.setup.hold(env, f)
      finish(i, error(f'Tool {call["name"]} timed out after {timeout:g} s '
                      '(grpo.tool_timeout_s).'), True)

    timer = threading.Timer(timeout, timed_out)
    timer.daemon = True

    def done(future: concurrent.futures.Future) -> None:
      timer.cancel()
      if future.cancelled():
        return  # timed out: its turn is already the timeout's
      e = future.exception()
      if e is not None:
        finish(i, error(str(e)), True)
      else:
        result = future.result()
        finish(i, result if isinstance(result, str) else str(result), False)

    timer.start()
    try:
      future = self.setup.call(fn, call['arguments'])
    except Exception as e:  # pylint: disable=broad-except
      timer.cancel()
      finish(i, error(str(e)), True)
      return
    running.append(future)
    future.add_done_callback(done)

  def _parse(self, row: int, ids: list[int], text: str) -> tuple[list[dict], dict]:
    """The turn's calls and its assistant message: transformers' parse_response where the
    tokenizer has a parser (a turn it cannot parse has no call and its text as content, as in
    TRL's parse_response), else the plain format read outside the reasoning
    (:func:`split_reasoning`). A ``response_template`` parser reads the row's tokens before the
    turn (``prefix``) and the row's tools (TRL's call)."""
    prompt = self.prompt_ids(row) if self._history[row] is None else None
    with self._lock:
      if self._history[row] is None:
        self._history[row] = prompt
      prefix = list(self._history[row])
      self._history[row].extend(ids)
    if not self.parse_with_template:
      message = self._message(row, text, prefix)
      return self._parse_calls(message['content']), message
    tok = self.tokenizer
    try:
      with self._tok_lock:
        if getattr(tok, 'response_template', None) is not None:
          parsed = tok.parse_response(ids, prefix=prefix, tools=self._schemas[row] or None)
        else:  # a legacy response_schema: no prefix
          parsed = tok.parse_response(ids)
      if parsed is None:
        raise ValueError('parse_response returned None')
    except (ValueError, TypeError):
      return [], {'role': 'assistant', 'content': text}
    message = {'role': 'assistant', 'content': parsed.get('content') or ''}
    if parsed.get('reasoning_content'):
      message['reasoning_content'] = parsed['reasoning_content']
    return [_checked_call(c) for c in parsed.get('tool_calls') or []], message

  def _message(self, row: int, text: str, prefix: Optional[list[int]] = None) -> dict:
    """The assistant message of a turn ``text`` (the plain formats): the reasoning, if the
    model wrote any, in ``reasoning_content`` and out of ``content`` (TRL's parsed messages).
    ``prefix``: the row's tokens before the turn (default: as they stand), whose generation
    prompt may have opened the reasoning (a thinking template's ``<think>``)."""
    if prefix is None:
      with self._lock:
        prefix = list(self._history[row]) if self._history[row] is not None else None
      if prefix is None:
        prefix = self.prompt_ids(row)
    with self._tok_lock:
      tail = self.tokenizer.decode(prefix[-64:], skip_special_tokens=False)
    eos = self.tokenizer.eos_token
    tail = tail[tail.rindex(eos) + len(eos):] if eos and eos in tail else tail
    content, reasoning = split_reasoning(text, opened=tail.rfind('<think>') > tail.rfind(
        '</think>'))
    message = {'role': 'assistant', 'content': content}
    if reasoning:
      message['reasoning_content'] = reasoning
    return message

  def _tool_turn_ids(self, tool_messages: list[dict]) -> list[int]:
    """The tool turns plus the next assistant header as the template renders them after the
    model's eos (TRL's ``_get_tool_suffix_ids``, in text)."""
    with self._tok_lock:
      return self._tool_turn_ids_locked(tool_messages)

  def _tool_turn_ids_locked(self, tool_messages: list[dict]) -> list[int]:
    tok = self.tokenizer
    dummy = [{'role': 'user', 'content': 'dummy'},
             {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': {
                 'name': tool_messages[0]['name'], 'arguments': {}}}]}]
    prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=False)
    full = tok.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                   tokenize=False)
    bare = tok.apply_chat_template(dummy, add_generation_prompt=True, tokenize=False)
    eos = tok.eos_token
    if eos and eos in prefix:
      prefix = prefix[:prefix.rindex(eos) + len(eos)]
    # The template's own text for the turns, however it writes their content (Llama 3.1's
    # ``| tojson`` escapes quotes and newlines), as TRL takes it.
    suffix = full[len(prefix):] if full.startswith(prefix) else None
    if suffix is None and eos and eos in prefix and full != bare:
      # A template that rewrites the earlier assistant turn once a turn follows it (Qwen3 drops
      # its empty reasoning block): the tool turns start after as many eos as the prefix holds,
      # the text TRL 1.16 takes from its prefix-preserving training template.
      at = -len(eos)
      for _ in range(prefix.count(eos)):
        at = full.find(eos, at + len(eos))
        if at < 0:
          break
      if at >= 0:
        suffix = full[at + len(eos):]
    if suffix is None or full == bare:
      # The template drops tool turns: ChatML's, as Qwen2.5's tokens write a tool turn.
      suffix = '\n' + ''.join(f'<|im_start|>tool\n{m["content"]}<|im_end|>\n'
                              for m in tool_messages) + '<|im_start|>assistant\n'
    return list(tok(suffix, add_special_tokens=False)['input_ids'])

  def close(self, row: int, turn_tokens) -> None:
    """The Interaction protocol's optional end: the row's last turn, cut at the length limit
    (the engine calls it instead of :meth:`submit`: no answer can follow). It is recorded as the
    row's last assistant turn, its calls (if any) not run. (TRL 1.16 parses a cut turn too, runs
    its calls and drops their results, which no token can follow either: the same tokens and
    messages, but an environment's state, and so its ``get_reward``, can differ.)"""
    ids = np.asarray(turn_tokens).reshape(-1).tolist()
    with self._tok_lock:
      text = self.tokenizer.decode(ids, skip_special_tokens=True)
    message = self._message(row, text)
    with self._lock:
      self._completion[row].append(message)
      self._last_text[row] = text

  def withdraw(self, row: int) -> None:
    """The Interaction protocol's optional take-back: the row's last answer did not fit in the
    completion, so its tool turns leave the row's messages (the rewards' ``completions_messages``
    holds what the model saw) and its context; the calls stay counted (TRL 1.16's rollback)."""
    with self._lock:
      messages, tokens = self._answer.pop(row, (0, 0))
      if messages:
        del self._completion[row][-messages:]
      if tokens:
        del self._history[row][-tokens:]

  # -- after the rollout --------------------------------------------------------------------------
  def finish(self, row: int, turns: Sequence[np.ndarray]) -> None:
    """Records the row's turns that were never submitted nor closed (``turns``: every assistant
    turn of the episode, as the buffer holds them; the held-out evaluation's call). The engine
    hands every turn to :meth:`submit` or :meth:`close`, so this adds nothing to its episodes."""
    with self._lock:
      seen = sum(m['role'] == 'assistant' for m in self._completion[row])
    for ids in turns[seen:]:
      self.close(row, ids)

  def messages(self, row: int) -> list[dict]:
    """The row's whole conversation, each turn with its role (prompt, assistant and tool turns):
    what completions.jsonl logs."""
    return self.prompt_messages(row) + self.completion_messages(row)

  def completion_messages(self, row: int) -> list[dict]:
    """The row's completion as messages: its assistant turns (``tool_calls`` on those that
    called) and tool turns; the ``completions_messages`` column of the rewards."""
    with self._lock:
      return [dict(m) for m in self._completion[row]]

  def final_text(self, row: int) -> str:
    """The text of the row's last assistant turn as the model wrote it (its reasoning included,
    as a run without tools gives it): its ``completions`` entry for the rewards."""
    with self._lock:
      return self._last_text[row]

  def reward_prompts(self) -> list[Any]:
    """The ``prompts`` the rewards get, one per row (TRL 1.16's): the row's prompt as in the
    data, or, where its environment's ``reset`` returned text, the prompt messages with that text
    appended (what the model was asked)."""
    return [[dict(m) for m in self._prompts[r]] if self._observed[r] else ex.prompt
            for r, ex in enumerate(self.examples)]

  def reward_fields(self) -> dict[str, list]:
    """The columns episodes add to the rewards' (one entry per row): ``completions_messages``,
    and ``environments`` with an environment."""
    fields = {'completions_messages': [self.completion_messages(r)
                                       for r in range(len(self.examples))]}
    if self.setup.factories is not None:
      fields['environments'] = list(self.environments)
    return fields

  def metrics(self) -> dict[str, float]:
    """tools/calls_per_episode, tools/calling_turns_per_episode (assistant turns whose calls ran), tools/failures
    (failed calls, summed), tools/<name>/calls, and TRL's tools/call_frequency (calls per
    completion) and tools/failure_frequency (failures per call)."""
    with self._lock:
      calls, failures = int(self._calls.sum()), int(self._failures.sum())
      n = max(len(self.examples), 1)
      out = {'tools/calls_per_episode': calls / n,
             'tools/calling_turns_per_episode': float(self._tool_turns.sum()) / n,
             'tools/failures': float(failures),
             'tools/call_frequency': calls / n,
             'tools/failure_frequency': failures / calls if calls else 0.0}
      out.update({f'tools/{k}/calls': float(v) for k, v in sorted(self._calls_of.items())})
    return out


def add_rewards(task, setup: ToolSetup) -> None:
  """Appends ``setup``'s environment rewards (:meth:`ToolSetup.reward_functions`) to
  ``task.reward_functions()`` and gives the reward functions' dry call the episode columns
  (``task.dry_call_fields``, :meth:`ToolSetup.dry_call_fields`), on this instance only. A name
  clash with the task's rewards is a ConfigError."""
  task.dry_call_fields = setup.dry_call_fields
  extra = setup.reward_functions()
  if not extra:
    return
  own = task.reward_functions
  clash = sorted({r.name for r in own()} & {r.name for r in extra})
  if clash:
    raise ConfigError(f'grpo.environment: the reward of environment {", ".join(clash)} has the '
                      f'name of a reward of grpo.reward_funcs; rename the class or the function.')
  task.reward_functions = lambda *args, **kwargs: list(own(*args, **kwargs)) + list(extra)


def make_interaction(ctx) -> Optional[Callable[[Sequence[Any]], Episodes]]:
  """GRPOLoop's ``make_interaction`` hook of a run (``ctx``: trainers.context.RunContext):
  ``examples`` (the rollout's rows, [S*B] slice-major) -> their :class:`Episodes`; None when the
  run has no tools (``ctx.tool_setup`` is None: single-turn rollouts, as before)."""
  setup = getattr(ctx, 'tool_setup', None)
  if setup is None:
    return None
  return lambda examples: setup.episodes(ctx.tokenizer, examples, ctx.generation_stops)
