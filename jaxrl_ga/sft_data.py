"""SFT from your data: rows -> token ids and a loss mask, and packing several rows into one.

Rows come through the one data layer (``jaxrl_ga.data``: read_rows, columns, held-out split,
order); each holds one of TRL's SFT formats:

  {"messages": [{"role": ..., "content": ...}, ...]}   loss on the assistant turns only
  {"prompt": ..., "completion": ...}                   loss on the completion only
  {"text": "..."}                                      loss on every token

(sft.assistant_only_loss=False and sft.completion_only_loss=False, TRL's options of those names:
the loss on every token of the first two kinds too.)

``prompt`` and ``completion`` may each be a string or a list of chat messages (TRL's
conversational prompt-completion). Messages keep every key (an assistant turn's ``tool_calls``, a
tool turn's ``name``), and a conversation's ``tools`` column (tool schemas, or their JSON text) and
``chat_template_kwargs`` column (e.g. ``{"enable_thinking": false}``) go to the chat template,
as TRL's SFTTrainer passes them. Strings follow the library's rule for prompts
(``trainers.text.encode_prompt``): a string prompt is one user message through the chat template
when the tokenizer has one (else the raw text after the tokenizer's leading special tokens, a
base model's BOS: ``chat.leading_special_ids``). A string completion after a templated prompt is
the assistant turn the template writes, up to the token that ends it where sampling stops (Gemma
3's ``<end_of_turn>``, ChatML's ``<|im_end|>``; ``trainers.text.encode_reply``); after a raw
prompt, or through a template that ends turns with no such token, it and ``text`` (which starts
with those tokens too) are followed by the tokenizer's eos (unless they end with it, as TRL), as
the built-in tasks' SFT targets are. Conversations end as the template renders them.

What is assistant text is the chat template's decision:
  - a template with generation markers (``{% generation %} ... {% endgeneration %}``): the tokens
    ``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)`` marks;
  - a template without them: each assistant turn ``i`` is the text that rendering
    ``messages[:i+1]`` adds to rendering ``messages[:i]`` with the generation prompt. Every such
    render must be a prefix of the next and of the whole conversation's (true of ChatML-style
    templates); a template that rewrites earlier turns (e.g. drops earlier reasoning) is refused
    for that row with one line asking for a template with generation markers.
The text between the marked spans is tokenized piece by piece (no token straddles a boundary).

Lengths (``sft.max_length``, ``sft.too_long``): a row longer than max_length is an error naming it
('error'), left out with a count ('drop'), or cut to its first max_length tokens ('truncate', TRL's
rule; a row with no loss token left is then left out and counted).

Packing (``sft.packing``, ``pack``): rows placed one after another into packed rows of max_length
tokens, the attention mask holding their segment ids 1, 2, ... so that positions and attention
never cross a row's boundary (``models.transformer.causal_mask``/``positions_from_mask``). The loss
is the per-token cross-entropy normalized over the optimizer-step window (docs/design.md), which
sums over tokens whichever rows hold them: the same examples give the same gradient packed or not.

Bad input is a ConfigError naming the row (``file:line``): no known column, a message list that
is not ``{role, content}`` dicts, an empty completion or text, a conversation without an assistant
turn (or with only empty ones).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional, Sequence, Union

from jaxrl_ga import rows as rows_lib
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import base
from jaxrl_ga.tasks import chat
from jaxrl_ga.trainers import text

TOO_LONG = ('error', 'drop', 'truncate')
_GENERATION_MARKER = re.compile(r'\{%-?\s*generation\s*-?%\}')


# -- checking rows (no tokenizer needed) -----------------------------------------------------------
def check_row(row: rows_lib.Row) -> rows_lib.Row:
  """The row with its SFT columns checked and normalized (message lists as plain dicts)."""
  where = row.where
  out = rows_lib.Row(row)
  out.where = where
  for column, value in template_kwargs(row).items():
    out[column] = value
  if 'messages' in row:
    messages = _messages(row['messages'], where, 'messages')
    if not any(m['role'] == 'assistant' and (m['content'] or m.get('tool_calls'))
               for m in messages):
      raise ConfigError(f'{where}: the conversation has no assistant turn with content; SFT '
                        f'trains on the assistant turns (add one or drop the row).')
    out['messages'] = messages
  elif 'prompt' in row or 'completion' in row:
    for column in ('prompt', 'completion'):
      if column not in row:
        raise ConfigError(f'{where}: a "{"prompt" if column == "completion" else "completion"}" '
                          f'column but no "{column}" column; SFT rows need both (or "messages",'
                          f' or "text").')
    out['prompt'] = rows_lib.check_prompt(row['prompt'], where)
    completion = row['completion']
    if isinstance(completion, str):
      if not completion:
        raise ConfigError(f'{where}: an empty completion; SFT needs a target to train on.')
    else:
      completion = _messages(completion, where, 'completion')
      if not any(m['content'] for m in completion):
        raise ConfigError(f'{where}: an empty completion; SFT needs a target to train on.')
    out['completion'] = completion
  elif 'text' in row:
    if not isinstance(row['text'], str) or not row['text']:
      raise ConfigError(f'{where}: "text" must be a non-empty string, got '
                        f'{str(row["text"])[:60]!r}.')
  else:
    raise ConfigError(f'{where}: no SFT column (columns: {", ".join(map(str, row)) or "none"}); '
                      f'give "messages", "prompt" and "completion", or "text" (rename with '
                      f'data.columns=<name>:messages).')
  return out


def template_kwargs(row: rows_lib.Row) -> dict[str, Any]:
  """The row's own chat-template arguments, checked: ``tools`` (a list of tool schemas; JSON
  text of one is parsed) and ``chat_template_kwargs`` (a dict, passed as keyword arguments).
  Absent or None: none."""
  out = {}
  tools = row.get('tools')
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except ValueError:
      tools = 'not JSON'
  if tools is not None:
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
      raise ConfigError(f'{row.where}: "tools" must be a list of tool schemas (or its JSON '
                        f'text), got {str(row["tools"])[:60]!r}.')
    out['tools'] = [dict(t) for t in tools]
  kwargs = row.get('chat_template_kwargs')
  if kwargs is not None:
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
      raise ConfigError(f'{row.where}: "chat_template_kwargs" must be a dict of keyword '
                        f'arguments, got {str(kwargs)[:60]!r}.')
    out['chat_template_kwargs'] = dict(kwargs)
  return out


def render_kwargs(row: Mapping[str, Any]) -> dict[str, Any]:
  """A checked row's arguments to apply_chat_template (tools=, and the row's own)."""
  out = dict(row.get('chat_template_kwargs') or {})
  if row.get('tools') is not None:
    out['tools'] = row['tools']
  return out


def _messages(value, where: str, column: str) -> list[dict[str, Any]]:
  messages = rows_lib.as_messages(value)
  if messages is not None:
    return messages
  raise ConfigError(f'{where}: "{column}" is a {type(value).__name__} ({str(value)[:60]!r}); '
                    f'give a non-empty list of chat messages {{"role": ..., "content": ...}}.')


def row_format(row: Mapping[str, Any]) -> str:
  """'messages', 'prompt_completion' or 'text' (of a checked row)."""
  return 'messages' if 'messages' in row else ('text' if 'prompt' not in row
                                                else 'prompt_completion')


# -- tokens and loss masks ---------------------------------------------------------------------------
def has_generation_markers(tokenizer) -> bool:
  template = getattr(tokenizer, 'chat_template', None)
  return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def encode_row(tokenizer, row: rows_lib.Row, stops: Union[int, Sequence[int]], *,
               assistant_only: bool = True, completion_only: bool = True
               ) -> tuple[list[int], list[int]]:
  """A checked row -> (token ids, loss mask), the mask 1 on the tokens SFT trains on. The first
  token's mask is 0 (nothing predicts it), so that packed and unpacked rows count alike.
  ``stops``: the tokenizer's eos, or the ids sampling stops at, eos first (``policy.stop_ids``;
  ``text.encode_reply``).
  ``assistant_only`` (sft.assistant_only_loss) False: a ``messages`` row trains on every token
  of the whole conversation's render, as TRL tokenizes it (no assistant text to find: a
  template that rewrites earlier turns, Qwen3's, is fine then); ``completion_only``
  (sft.completion_only_loss) False: a prompt-completion row trains on every token too."""
  kind = row_format(row)
  if kind == 'messages' and not assistant_only:
    _need_template(tokenizer, row.where)
    ids = text.encode(tokenizer, render(tokenizer, row['messages'], False, row.where,
                                        **render_kwargs(row)))
    return ids, [0] + [1] * (len(ids) - 1)
  ids, mask = _encode_row(tokenizer, row, text.stop_tuple(stops))
  if kind == 'prompt_completion' and not completion_only:
    mask = [0] + [1] * (len(ids) - 1)
  return ids, mask


def _encode_row(tokenizer, row: rows_lib.Row, stops: tuple[int, ...]
                ) -> tuple[list[int], list[int]]:
  kind = row_format(row)
  if kind == 'text':
    ids = (chat.leading_special_ids(tokenizer, row['text'])
           + text.encode_ending(tokenizer, row['text'], stops[0]))
    return ids, [0] + [1] * (len(ids) - 1)
  kwargs = render_kwargs(row)
  if kind == 'prompt_completion' and isinstance(row['completion'], str) and isinstance(
      row['prompt'], str):  # the built-in tasks' rule (trainers.sft), with the row's own columns
    if kwargs and chat.has_chat_template(tokenizer):
      tokenizer = chat.with_template_kwargs(tokenizer, kwargs)
    return prompt_completion_ids(tokenizer, row['prompt'], row['completion'], stops)
  _need_template(tokenizer, row.where)
  if kind == 'prompt_completion':
    prompt = row['prompt']
    prompt = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else prompt
    completion = row['completion']
    completion = ([{'role': 'assistant', 'content': completion}]
                  if isinstance(completion, str) else completion)
    head = render(tokenizer, prompt, True, row.where, **kwargs)
    whole = render(tokenizer, prompt + completion, False, row.where, **kwargs)
    _check_prefix(head, whole, row.where)
    pieces = [(head, 0), (whole[len(head):], 1)]
  elif has_generation_markers(tokenizer):
    out = tokenizer.apply_chat_template(row['messages'], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **kwargs)
    ids, mask = list(out['input_ids']), list(out['assistant_masks'])
    return _checked(ids, [0] + mask[1:], row.where)
  else:
    pieces = assistant_pieces(tokenizer, row['messages'], row.where, **kwargs)
  ids, mask = [], []
  for piece, trained in pieces:
    piece_ids = text.encode(tokenizer, piece) if piece else []
    ids += piece_ids
    mask += [trained] * len(piece_ids)
  return _checked(ids, [0] + mask[1:], row.where)


def prompt_completion_ids(tokenizer, prompt, completion: str, stops: Union[int, Sequence[int]]
                          ) -> tuple[list[int], list[int]]:
  """prompt (through ``encode_prompt``) + the completion as its reply (``text.encode_reply``:
  through the chat template, the assistant turn up to the token it ends with; else the
  completion and the eos, none added after a completion that ends with it), the loss on the
  reply: the SFT sequence of a built-in task's example and of a string prompt-completion row."""
  head = text.encode_prompt(tokenizer, prompt)
  tail = text.encode_reply(tokenizer, prompt, completion, stops)
  return head + tail, [0] * len(head) + [1] * len(tail)


def assistant_pieces(tokenizer, messages: Sequence[Mapping[str, Any]], where: str, **kwargs
                     ) -> list[tuple[str, int]]:
  """The rendered conversation as (text, 1 if assistant text else 0) pieces, prefix by prefix
  (for a template without generation markers; see the module docstring). ``kwargs``: the
  template's (``tools=``)."""
  whole = render(tokenizer, messages, False, where, **kwargs)
  pieces, done = [], ''
  for i, m in enumerate(messages):
    if m['role'] != 'assistant':
      continue
    head = render(tokenizer, messages[:i], True, where, **kwargs) if i else ''
    upto = render(tokenizer, messages[:i + 1], False, where, **kwargs)
    _check_prefix(done, head, where)
    _check_prefix(head, upto, where)
    _check_prefix(upto, whole, where)
    pieces += [(head[len(done):], 0), (upto[len(head):], 1)]
    done = upto
  pieces.append((whole[len(done):], 0))
  return pieces


def render(tokenizer, messages, add_generation_prompt: bool, where: str, **kwargs) -> str:
  """``messages`` through the chat template as text (``kwargs``: its own, e.g. ``tools=``); a
  template that raises (its own ``raise_exception``, a bad template): one ConfigError line
  naming the row ``where``."""
  try:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  (a template's own raise_exception)
    raise ConfigError(f'{where}: the chat template cannot render this conversation '
                      f'({rows_lib._first_line(e)}).') from None  # pylint: disable=protected-access


def _check_prefix(head: str, whole: str, where: str) -> None:
  if not whole.startswith(head):
    raise ConfigError(f'{where}: the chat template renders an earlier part of this conversation '
                      f'differently from the whole, so its assistant text cannot be found; give a '
                      f'template with {{% generation %}} markers.')


def _need_template(tokenizer, where: str) -> None:
  if not chat.has_chat_template(tokenizer):
    raise ConfigError(f'{where}: a conversation, but the tokenizer has no chat template; give a '
                      f'model whose tokenizer has one, or "text" / string prompt-completion rows.')


def _checked(ids, mask, where: str):
  if not any(mask):
    raise ConfigError(f'{where}: the chat template marks no assistant token in this row; check '
                      f'its {{% generation %}} markers, or that the row has assistant text.')
  return ids, mask


def fit_length(ids, mask, max_length: int, too_long: str, where: str):
  """(ids, mask) within ``max_length`` by the ``too_long`` rule; None: left out."""
  if len(ids) <= max_length:
    return ids, mask
  if too_long == 'error':
    raise ConfigError(f'{where}: {len(ids)} tokens exceeds sft.max_length={max_length}; raise '
                      f'sft.max_length, or set sft.too_long=drop or truncate.')
  if too_long == 'truncate' and any(mask[:max_length]):
    return ids[:max_length], mask[:max_length]
  return None


# -- batches -------------------------------------------------------------------------------------------
# One sequence per row (``padded_rows``) or several (``pack``): the row layout of
# ``trainers.text``, the one for SFT and DPO.
padded_rows, pack = text.padded_rows, text.pack


def greedy_rows(lengths: Sequence[int], num_rows: int, length: int) -> list[list[int]]:
  """Sequences in stream order filled into ``num_rows`` rows of ``length`` tokens: the next one
  goes into the current row if it fits, else starts the next row; it stops at the first sequence
  that fits in no row left. -> the indices per row (their total: the sequences consumed)."""
  rows, at, i = [[]], 0, 0
  for i, n in enumerate(lengths):
    if n > length:
      raise ValueError(f'sequence {i}: {n} tokens exceed the packed length {length}.')
    if at + n > length:
      if len(rows) == num_rows:
        break
      rows.append([])
      at = 0
    rows[-1].append(i)
    at += n
  return rows + [[] for _ in range(num_rows - len(rows))]


# -- the task --------------------------------------------------------------------------------------------
class SFTDataTask(rows_lib.DataTask):
  """SFT rows as a task: ``train_sequence(index, seed)`` gives the (ids, loss mask) of the row at
  a data position (the order of ``rows_lib.DataTask``), after ``encode(tokenizer, ...)`` has
  tokenized every row (and left out those too long, by sft.too_long). Held-out rows are evaluated
  on their prompt: a conversation up to its last assistant turn (or the prompt column), scored by
  the run's reward functions with the reference reply as the ``answer`` column (unless the row
  has its own); ``text`` rows are not evaluated."""

  def __init__(self, train, eval_rows, reward_funcs=(), shuffle: bool = True):
    super().__init__(train, eval_rows, reward_funcs, shuffle)
    self.sequences: Optional[list[tuple[list[int], list[int]]]] = None
    self.dropped = 0
    self.held_out_note: Optional[str] = None  # how many rows data.train held out, and why

  def encode(self, tokenizer, stops: Union[int, Sequence[int]], max_length: int, too_long: str,
             assistant_only: bool = True, completion_only: bool = True) -> None:
    kept, sequences = [], []
    for row in self.train:
      ids, mask = encode_row(tokenizer, row, stops, assistant_only=assistant_only,
                             completion_only=completion_only)
      fitted = fit_length(ids, mask, max_length, too_long, row.where)
      if fitted is not None:
        kept.append(row)
        sequences.append(fitted)
    self.dropped = len(self.train) - len(kept)
    if not kept:
      raise ConfigError(f'data.train: all {len(self.train)} rows exceed sft.max_length='
                        f'{max_length}; raise it.')
    self.train, self.sequences = kept, sequences
    self._order_key = None

  def train_sequence(self, index: int, seed: int) -> tuple[list[int], list[int]]:
    if self.sequences is None:
      raise RuntimeError('SFTDataTask.encode(tokenizer, ...) first.')
    return self.sequences[self.row_index(index, seed)]

  @staticmethod
  def example(row: Mapping[str, Any]) -> base.Example:
    kind = row_format(row)
    fields = {k: v for k, v in row.items() if k not in ('messages', 'prompt', 'completion', 'text')}
    if kind == 'text':
      return base.Example(prompt=row['text'], answer=None, fields=fields)
    if kind == 'messages':
      messages = row['messages']
      last = max(i for i, m in enumerate(messages)
                 if m['role'] == 'assistant' and (m['content'] or m.get('tool_calls')))
      prompt, reply = messages[:last], messages[last]['content']
    else:
      prompt, completion = row['prompt'], row['completion']
      reply = completion if isinstance(completion, str) else completion[-1]['content']
    fields.setdefault('answer', reply)
    return base.Example(prompt=prompt, answer=None, fields=fields)

  def eval_examples(self) -> list[base.Example]:
    return [self.example(r) for r in self.eval_rows if row_format(r) != 'text']

  def sft_completion(self, example: base.Example) -> str:
    raise RuntimeError('SFT rows train through train_sequence (trainers.sft).')

  def longest(self) -> int:
    return max(len(ids) for ids, _ in self.sequences)


def build_task(rows: Sequence[rows_lib.Row], eval_rows: Sequence[rows_lib.Row], rewards,
               shuffle: bool) -> SFTDataTask:
  """The SFT task of (already read and renamed) rows: each checked (``check_row``)."""
  train = [check_row(r) for r in rows]
  if not train:
    raise ConfigError('data.train is empty; give at least one row.')
  held = [check_row(r) for r in eval_rows]
  return SFTDataTask(train, held, rewards, shuffle=shuffle)
