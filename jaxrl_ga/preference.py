"""Preference datasets for DPO (``dpo.pairs='dataset'``): rows of prompt, chosen and rejected.

Rows come from ``data.train`` through the data layer (``jaxrl_ga.rows_lib.read_rows``: files,
``datasets`` or Python), in TRL's preference formats:

  explicit prompt   {"prompt": ..., "chosen": ..., "rejected": ...}, each a string or a list of
                    chat messages ({"role": ..., "content": ...}); chosen and rejected are the
                    replies (as messages: the assistant turn(s) after the prompt).
  implicit prompt   {"chosen": [...], "rejected": [...]}: whole conversations; the leading turns
                    they share are the prompt, the rest of each is its reply.

Other columns go to the held-out evaluation's rewards (``grpo.reward_funcs``) as with GRPO rows.
``data.columns`` renames columns first. With a chat template every part is a conversation (a
string prompt is one user message, a string reply one assistant message): the prompt is the
template with the generation prompt, a reply the text the template writes after it for the whole
conversation (TRL's DPO preprocessing), an eos added only when it holds no id sampling stops at
(``PreferenceTask.stops``: a template that ends turns with no token, such as a fresh model's plain
one; TRL adds none to conversational rows: Gemma 3's reply ends ``<end_of_turn>\n``, not
``<eos>``). Without a template the strings are used as they are (the prompt after the tokenizer's
leading special tokens, a base model's BOS, as TRL tokenizes text), each reply followed by the
eos unless it ends with one.

Lengths: a prompt longer than ``dpo.max_prompt_length`` (0: ``dpo.max_length - 1``) is an error
naming its row, dropped (counted) or truncated on ``dpo.truncation_side``
(``dpo.long_prompts``); a reply longer than what ``dpo.max_length`` leaves is cut at its end.

Bad input is a ConfigError naming the row (``file:line``): a missing column, a value that is
neither a string nor a message list, an empty reply, a reply conversation without an assistant
turn, chosen equal to rejected, conversations that share no leading turn (implicit prompt), a
template that raises on the row or renders the prompt differently inside the conversation.

The encoded pairs have a fingerprint (their tokens and masks, and ``dpo.ref_model``):
trainers/dpo.py caches them with their reference log-probs in ``WORKDIR/dpo_dataset_pairs.npz``
and api.build_context refuses a workdir whose cache was built from other rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga import rows as rows_lib
from jaxrl_ga import sft_data
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import chat
from jaxrl_ga.trainers import text

CACHE_FILE = 'dpo_dataset_pairs.npz'
Messages = list[dict[str, str]]


@dataclasses.dataclass
class Preference:
  """One row: its prompt and replies (all strings, or all message lists), its other columns."""
  prompt: Union[str, Messages]
  chosen: Union[str, Messages]
  rejected: Union[str, Messages]
  fields: dict[str, Any]
  where: str


# -- parsing ----------------------------------------------------------------------------------------
def _messages(value, where: str, column: str) -> Union[str, Messages]:
  if isinstance(value, str):
    return value
  # [] as well: parse then names what the row lacks (an assistant turn, a shared prompt).
  messages = [] if isinstance(value, (list, tuple)) and not value else rows_lib.as_messages(value)
  if messages is not None:
    return messages
  raise ConfigError(f'{where}: "{column}" is a {type(value).__name__} ({str(value)[:60]!r}); '
                    f'give a string or a list of chat messages {{"role": ..., "content": ...}}.')


def _as_messages(value, role: str) -> Messages:
  return [{'role': role, 'content': value}] if isinstance(value, str) else value


def parse(row: rows_lib.Row, columns: Mapping[str, str]) -> Preference:
  """A row (columns renamed by ``columns``) -> its Preference; bad rows: ConfigError."""
  where = row.where
  r = {columns.get(k, k): v for k, v in row.items()}
  for column in ('chosen', 'rejected'):
    if column not in r:
      hint = f'; rename a column with data.columns=<name>:{column}' if not columns else ''
      raise ConfigError(f'{where}: no "{column}" column (columns: '
                        f'{", ".join(map(str, r)) or "none"}); a preference row needs chosen and '
                        f'rejected{hint}.')
  chosen = _messages(r['chosen'], where, 'chosen')
  rejected = _messages(r['rejected'], where, 'rejected')
  if 'prompt' in r:
    prompt = rows_lib.check_prompt(r['prompt'], where)
  elif isinstance(chosen, list) and isinstance(rejected, list):  # TRL's implicit prompt
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
      n += 1
    if n == 0:
      raise ConfigError(f'{where}: no "prompt" column, and chosen and rejected share no leading '
                        f'turn to be the prompt; add a "prompt" column.')
    prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
  else:
    raise ConfigError(f'{where}: no "prompt" column; string replies need one (conversations in '
                      f'chosen and rejected may share their leading turns instead).')
  if any(isinstance(x, list) for x in (prompt, chosen, rejected)):  # one form for all three
    prompt = _as_messages(prompt, 'user')
    chosen, rejected = _as_messages(chosen, 'assistant'), _as_messages(rejected, 'assistant')
  for column, reply in (('chosen', chosen), ('rejected', rejected)):
    if isinstance(reply, list):
      turns = [m for m in reply if m['role'] == 'assistant']
      if not turns:
        roles = ', '.join(m['role'] for m in reply) or 'none'
        raise ConfigError(f'{where}: the {column} conversation has no assistant turn after the '
                          f'prompt (roles: {roles}); the reply must be an assistant message.')
      empty = not any(m['content'].strip() or m.get('tool_calls') for m in turns)
    else:
      empty = not reply.strip()
    if empty:
      raise ConfigError(f'{where}: an empty {column} reply; give a non-empty completion.')
  if chosen == rejected:
    raise ConfigError(f'{where}: chosen equals rejected; a pair needs two different replies.')
  fields = rows_lib.Row({k: v for k, v in r.items() if k not in ('prompt', 'chosen', 'rejected')})
  fields.where = where
  fields.update(sft_data.template_kwargs(fields))  # tools, chat_template_kwargs: checked
  return Preference(prompt, chosen, rejected, dict(fields), where)


def eval_row(pref: Preference) -> rows_lib.Row:
  """The row's prompt and other columns, as a held-out evaluation row (``rows_lib.DataTask``)."""
  row = rows_lib.Row(prompt=pref.prompt, **pref.fields)
  row.where = pref.where
  return row


def _train_row(pref: Preference) -> rows_lib.Row:
  row = eval_row(pref)
  row.update(chosen=pref.chosen, rejected=pref.rejected)
  return row


class PreferenceTask(rows_lib.DataTask):
  """The preference rows of a DPO run (``preferences``) and the held-out rows it evaluates on (a
  DataTask: its prompts, scored by the run's rewards when given; the training stream's examples
  are the preference rows' prompts)."""

  def __init__(self, preferences: Sequence[Preference], eval_rows, reward_funcs=(),
               shuffle: bool = True):
    # Training rows hold the replies too: a fresh model's tokenizer covers their characters.
    super().__init__([_train_row(p) for p in preferences], eval_rows, reward_funcs, shuffle)
    self.preferences = list(preferences)
    self.pairs: Optional[dict[str, np.ndarray]] = None  # encode() fills these
    self.fingerprint = ''
    self.dropped = self.truncated = 0
    self.cached: Optional[tuple[str, dict[str, np.ndarray]]] = None  # load_cache: (path, pairs)
    # The ids sampling stops at, the tokenizer's eos first (policy.stop_ids; api.build_context
    # sets them before the rows are measured or encoded); (): the tokenizer's eos alone.
    self.stops: tuple[int, ...] = ()

  def longest_pair(self, tokenizer, cfg) -> int:
    """Tokens of the longest pair, prompt (within ``cfg.max_prompt_length`` when > 0) plus its
    longer reply: what ``dpo.max_length=0`` becomes (api.validate_lengths)."""
    stops, cap = self.stops or int(tokenizer.eos_token_id), cfg.max_prompt_length or float('inf')
    return max(min(len(p), cap) + max(len(c), len(r))
               for p, c, r in (encode_row(tokenizer, pref, stops) for pref in self.preferences))

  def encode(self, tokenizer, cfg) -> None:
    """Tokenizes every row and checks it against ``cfg`` (DPOConfig): fills ``pairs`` (the
    right-padded chosen_*/rejected_* rows of ``text.right_padded_rows``), ``fingerprint``,
    ``dropped`` and ``truncated``. Bad rows: ConfigError naming the row."""
    stops = self.stops or int(tokenizer.eos_token_id)
    limit = min(cfg.max_prompt_length or cfg.max_length - 1, cfg.max_length - 1)
    setting = ('dpo.max_prompt_length' if 0 < cfg.max_prompt_length < cfg.max_length
               else 'dpo.max_length - 1')
    prompts, replies = [], {'chosen': [], 'rejected': []}
    self.dropped = self.truncated = 0
    for pref in self.preferences:
      prompt, chosen, rejected = encode_row(tokenizer, pref, stops)
      if len(prompt) > limit:
        if cfg.long_prompts == 'error':
          raise ConfigError(f'{pref.where}: a prompt of {len(prompt)} tokens, over {setting}='
                            f'{limit}; raise it, or set dpo.long_prompts=drop or truncate.')
        if cfg.long_prompts == 'drop':
          self.dropped += 1
          continue
        prompt = prompt[-limit:] if cfg.truncation_side == 'left' else prompt[:limit]
      room = cfg.max_length - len(prompt)
      self.truncated += (len(chosen) > room) + (len(rejected) > room)
      prompts.append(prompt)
      replies['chosen'].append(chosen[:room])
      replies['rejected'].append(rejected[:room])
    if not prompts:
      raise ConfigError(f'data.train: all {len(self.preferences)} preference rows have a prompt '
                        f'over {setting}={limit} (dpo.long_prompts=drop); raise it.')
    pairs = {}
    for side, comps in replies.items():
      rows = text.right_padded_rows(prompts, comps, cfg.max_length, int(tokenizer.pad_token_id),
                                    'dpo.max_length')
      pairs.update({f'{side}_{key}': value for key, value in rows.items()})
    self.pairs = pairs
    self.fingerprint = fingerprint(pairs, cfg.ref_model)
    self.cached = None  # a cache read for other pairs is read (and checked) again


def encode_row(tokenizer, pref: Preference, stops: Union[int, Sequence[int]]
               ) -> tuple[list[int], list[int], list[int]]:
  """(prompt, chosen, rejected) token ids of a row (see the module docstring). ``stops``: the
  tokenizer's eos, or the ids sampling stops at, eos first (``policy.stop_ids``)."""
  stops = text.stop_tuple(stops)
  eos_id = stops[0]
  if chat.has_chat_template(tokenizer):  # rendered as sft_data renders a conversation
    prompt = _as_messages(pref.prompt, 'user')
    kwargs = sft_data.render_kwargs(pref.fields)  # the row's tools and chat_template_kwargs
    prompt_text = sft_data.render(tokenizer, prompt, True, pref.where, **kwargs)
    replies = []
    for column in ('chosen', 'rejected'):
      full = sft_data.render(tokenizer, prompt + _as_messages(getattr(pref, column), 'assistant'),
                             False, pref.where, **kwargs)
      if not full.startswith(prompt_text):
        raise ConfigError(f'{pref.where}: the chat template renders the prompt differently at the '
                          f'start of the {column} conversation, so the reply cannot be split off; '
                          f'give the prompt in a "prompt" column, or string replies.')
      ids = text.encode(tokenizer, full[len(prompt_text):])
      replies.append(ids if set(ids) & set(stops) else ids + [eos_id])
    return text.encode(tokenizer, prompt_text), replies[0], replies[1]
  if not isinstance(pref.prompt, str):
    raise ConfigError(f'{pref.where}: chat messages, but the tokenizer has no chat template; give '
                      f'string prompt, chosen and rejected, or a model whose tokenizer has one.')
  return (text.encode_prompt(tokenizer, pref.prompt),  # the tokenizer's BOS, if it adds one
          text.encode_ending(tokenizer, pref.chosen, eos_id),
          text.encode_ending(tokenizer, pref.rejected, eos_id))


def fingerprint(pairs: Mapping[str, np.ndarray], ref_model: str = '') -> str:
  """sha256 of the encoded pairs (every array's name, shape, dtype and bytes, in name order) and
  of the reference model (``dpo.ref_model``; '' the starting policy)."""
  h = hashlib.sha256(f'ref_model={ref_model};'.encode())
  for key in sorted(pairs):
    value = np.ascontiguousarray(pairs[key])
    h.update(f'{key}:{value.shape}:{value.dtype};'.encode())
    h.update(value.tobytes())
  return h.hexdigest()


def cache_path(workdir: str) -> str:
  return fileio.join(workdir, CACHE_FILE)


def load_cache(workdir: str, task: PreferenceTask) -> Optional[dict[str, np.ndarray]]:
  """The pairs and reference log-probs cached in ``workdir`` (None: no cache), read once per task
  (api.build_context checks it before anything compiles, trainers/dpo.py then trains on it). A
  cache built from other rows or another ``dpo.ref_model`` is refused."""
  path = cache_path(workdir)
  if task.cached is not None and task.cached[0] == path:
    return task.cached[1]
  if not fileio.exists(path):
    return None
  pairs = fileio.load_npz(path)
  cached = str(pairs.pop('fingerprint', ''))
  if cached != task.fingerprint:
    raise ConfigError(f'data.train: {path} holds the pairs and reference log-probs of another '
                      f'dataset or dpo.ref_model (fingerprint {cached[:12] or "none"}, now {task.fingerprint[:12]}); '
                      f'use a fresh --workdir, or delete that file and the dpo checkpoints to '
                      f'start over.')
  task.cached = (path, pairs)
  return pairs


# -- the task ---------------------------------------------------------------------------------------
def build_task(cfg, train_source, eval_source, rewards) -> PreferenceTask:
  """The DPO run's preference rows (``train_source``) and held-out rows (``eval_source``: rows
  with a prompt; None: a seeded ``data.eval_fraction`` of the preference rows, as prompts)."""
  spec = cfg.data
  others = [s for s in cfg.stages if s != 'dpo']
  if others:
    raise ConfigError(f'stages={",".join(cfg.stages)}: with dpo.pairs=dataset, data.train holds '
                      f'preference rows, which only the dpo stage trains on; set stages=dpo '
                      f'(start it from a trained model with model.hf_path).')
  columns = rows_lib.parse_columns(spec.columns)
  rows = rows_lib.read_rows(train_source, spec.train_split, 'data.train')
  if not rows:
    raise ConfigError('data.train is empty; give at least one row.')
  preferences = [parse(r, columns) for r in rows]
  if eval_source is None:
    preferences, held = rows_lib.held_out_split(preferences, spec.eval_fraction, cfg.seed)
    eval_rows = [eval_row(p) for p in held]
  else:
    eval_rows = rows_lib.prepare(rows_lib.read_rows(eval_source, spec.eval_split, 'data.eval'),
                                 columns, 'data.eval')
  return PreferenceTask(preferences, eval_rows, rewards, shuffle=spec.shuffle)
