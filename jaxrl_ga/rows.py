"""Dataset rows: reading them (files, ``datasets``, Python lists), renaming columns, the seeded
held-out split, and ``DataTask`` (rows as a task), below ``jaxrl_ga.data`` (which builds the run's
task from them), ``jaxrl_ga.sft_data`` and ``jaxrl_ga.preference`` (their row kinds). The formats,
the order and the errors are described in ``jaxrl_ga.data``'s docstring.
"""

from __future__ import annotations

import collections.abc
import csv
import hashlib
import io
import json
import os
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from jaxrl_ga import fileio
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import base
from jaxrl_ga.tasks import tokenizer as tokenizer_lib

FILE_SUFFIXES = ('.jsonl', '.json', '.csv', '.parquet')
# The split of data.train when data.eval is not given: its own stream of the run's seed.
HELD_OUT_STREAM = 4099
# A fresh model's tokenizer: its characters besides the data's, and its chat template.
BASE_ALPHABET = ''.join(chr(c) for c in range(32, 127)) + '\n'
PLAIN_CHAT_TEMPLATE = ('{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}'
                       '{% if add_generation_prompt %}assistant: {% endif %}')


class Row(dict):
  """A dataset row (a plain dict) that remembers where it came from (``file:line`` or ``row
  i``), for error messages."""
  where: str = ''


class FileRows(collections.abc.Sequence):
  """The rows of a .jsonl or .parquet file, each parsed into a Row when it is read (again on
  each read: nothing is kept), so that a process parses only the rows it asks for.

  ``read(i)`` parses row i of the file; ``take(indices)`` and ``mapped(fn)`` are views (a
  subset, a per-row function applied on read) that parse nothing; ``characters()`` the file's
  characters (a fresh model's tokenizer; see DataTask.tokenizer).
  """

  def __init__(self, read: Callable[[int], Row], count: int, characters: Callable[[], str],
               index: Optional[np.ndarray] = None, fn: Callable[[Row], Row] = lambda r: r):
    self._read, self._count, self.characters = read, count, characters
    self._index, self._fn = index, fn

  def __len__(self) -> int:
    return self._count if self._index is None else len(self._index)

  def __getitem__(self, i):
    if isinstance(i, slice):  # a view, as take
      return self.take(np.arange(len(self))[i])
    if not -len(self) <= i < len(self):
      raise IndexError(i)
    i %= len(self)
    return self._fn(self._read(i if self._index is None else int(self._index[i])))

  def take(self, indices: Sequence[int]) -> FileRows:
    index = np.asarray(indices, np.int64)
    index = index if self._index is None else self._index[index]
    return FileRows(self._read, self._count, self.characters, index, self._fn)

  def mapped(self, fn: Callable[[Row], Row]) -> FileRows:
    return FileRows(self._read, self._count, self.characters, self._index,
                    lambda r, inner=self._fn: fn(inner(r)))


# -- reading ------------------------------------------------------------------------------------
def read_rows(source, split: str = 'train', what: str = 'data.train') -> list[Row]:
  """The rows of ``source`` (see the module docstring), each a dict with its location."""
  return list(open_rows(source, split, what))


def open_rows(source, split: str = 'train', what: str = 'data.train') -> Sequence[Row]:
  """As ``read_rows``, but a .jsonl or .parquet file's rows are a FileRows, parsed when read."""
  if isinstance(source, (list, tuple)):
    return [_row(r, f'{what} row {i}', what) for i, r in enumerate(source)]
  if not isinstance(source, str):
    return _from_datasets_object(source, split, what)
  name = f'{what}={source}'
  path = os.path.expanduser(source)
  if path.endswith(FILE_SUFFIXES):
    if not fileio.exists(path):
      raise ConfigError(f'{name}: no such file; give an existing .jsonl, .json, .csv or '
                        f'.parquet file.')
    data = fileio.path(path).read_bytes()
    if data.startswith(_BOM):  # Excel's "CSV UTF-8", Notepad's: not part of the first column
      data = data[len(_BOM):]
    if path.endswith('.parquet'):
      return _parquet_rows(data, source, what)
    text = _utf8(data, source, what)
    if path.endswith('.jsonl'):
      return _jsonl_rows(data, source, what)
    if path.endswith('.json'):
      return _json_rows(text, source, what)
    return _csv_rows(text, source, what)
  if os.path.isdir(path):
    try:
      loaded = _datasets().load_from_disk(path)
    except ImportError:
      raise ConfigError(f'{name}: reading a directory needs the datasets package (pip install '
                        f'datasets).') from None
    except (FileNotFoundError, ValueError) as e:
      raise ConfigError(f'{name}: not a directory written by datasets.Dataset.save_to_disk '
                        f'({_first_line(e)}); give such a directory or a data file.') from None
    return _from_datasets_object(loaded, split, what, name=source)
  if path.startswith(('/', '.', '~')) or fileio.is_remote(path) or not re.fullmatch(
      r'[\w.-]+(/[\w.-]+)?', path):
    raise ConfigError(f'{name}: no such file or directory; give a .jsonl, .json, .csv or '
                      f'.parquet file, a datasets.save_to_disk directory or a hub dataset id.')
  try:
    datasets = _datasets()
  except ImportError:
    raise ConfigError(f'{name}: a hub dataset needs the datasets package (pip install '
                      f'datasets), or give a local file.') from None
  try:
    loaded = datasets.load_dataset(path, split=split)
  except Exception as e:  # pylint: disable=broad-except  (offline, unknown id, unknown split)
    raise ConfigError(f'{name}: the hub dataset (split {split!r}) cannot be loaded '
                      f'({_first_line(e)}); check the id and split, or give a local file.'
                      ) from None
  return _from_datasets_object(loaded, split, what, name=source)


_BOM = '\ufeff'.encode('utf-8')


def split_ignored(train_source, eval_source, split: str, eval_split: str) -> bool:
  """Whether data.eval names data.train's own ``save_to_disk`` directory of one dataset with
  another split than data.train's: the directory has no splits, so both would read the same
  rows (the same file, or the same split, named twice is the user's explicit choice)."""
  if not (isinstance(train_source, str) and isinstance(eval_source, str)) or split == eval_split:
    return False
  path = os.path.expanduser(train_source)
  return (path == os.path.expanduser(eval_source) and os.path.isdir(path)
          and not os.path.exists(os.path.join(path, 'dataset_dict.json')))


def source_digest(source, split: str = 'train') -> Optional[str]:
  """A digest of what ``open_rows(source, split)`` reads, to tell a resumed run that its rows
  changed: sha256 of a file's bytes or of a list's JSON; of a saved directory or a hub id,
  ``datasets``' own fingerprint of the files it loads (memory-mapped, or from its cache). None
  for a ``datasets`` object given in Python (a transform's fingerprint may be random: a resume
  would be refused for nothing) and where none is known."""
  if isinstance(source, (list, tuple)):
    text = json.dumps(list(source), sort_keys=True, default=str)
    return hashlib.sha256(text.encode('utf-8')).hexdigest()
  if not isinstance(source, str):
    return None
  path = os.path.expanduser(source)
  if path.endswith(FILE_SUFFIXES):
    return hashlib.sha256(fileio.path(path).read_bytes()).hexdigest()
  try:  # open_rows has read the source with datasets already
    datasets = _datasets()
    loaded = (datasets.load_from_disk(path) if os.path.isdir(path)
              else datasets.load_dataset(path, split=split))
  except Exception:  # pylint: disable=broad-except  (open_rows said why, if it could not)
    return None
  if isinstance(loaded, Mapping):
    loaded = loaded.get(split)
  return getattr(loaded, '_fingerprint', None)


def _datasets():
  """The datasets package (ImportError when it is not installed)."""
  # lazy: optional dependency (datasets)
  import datasets  # pylint: disable=g-import-not-at-top
  return datasets


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def _row(value, where: str, what: str) -> Row:
  if not isinstance(value, Mapping):
    raise ConfigError(f'{where}: a {type(value).__name__}, not a record; each row of {what} must '
                      f'be an object with a "prompt" field.')
  row = Row(value)
  row.where = where
  return row


def _utf8(data: bytes, source: str, what: str) -> str:
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    raise ConfigError(f'{what}={source}:{line}: bytes that are not UTF-8 ({data[e.start:e.end]!r} '
                      f'at byte {e.start}); save the file as UTF-8.') from None


def _jsonl_rows(data: bytes, source: str, what: str) -> FileRows:
  """One pass over the bytes finds the lines that are not blank (no JSON is parsed); row i is
  parsed from its line when read."""
  buf = np.frombuffer(data, np.uint8)
  newlines = np.flatnonzero(buf == ord('\n'))
  starts = np.concatenate([[0], newlines + 1])
  ends = np.concatenate([newlines, [len(buf)]])
  solid = np.concatenate([[0], np.cumsum(~np.isin(buf, list(b' \t\r\n\v\f')))])
  lines = np.flatnonzero(solid[ends] > solid[starts])  # 0-based numbers of the rows' lines
  read = lambda i: _jsonl_line(data[starts[lines[i]]:ends[lines[i]]].decode('utf-8'),
                               int(lines[i]) + 1, source, what)
  return FileRows(read, len(lines), lambda: _json_characters(data.decode('utf-8')))


def _jsonl_line(line: str, n: int, source: str, what: str) -> Row:
  """Line ``n`` (1-based) of a .jsonl file as a Row."""
  try:
    value = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f'{what}={source}:{n}: invalid JSON ({e.msg}: column {e.colno}); '
                      f'each line must be one JSON object.') from None
  return _row(value, f'{what}={source}:{n}', what)


def _json_characters(text: str) -> str:
  """The characters of a JSON text's strings, without parsing it: its own characters, then
  those its escapes (``\\u00e9``, ``\\t``) stand for (a superset: keys and syntax too)."""
  escaped = re.findall(r'\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4}|u[0-9a-fA-F]{4}|'
                       r'[bfnrt])', text)
  decoded = ''.join(c for c in dict.fromkeys(json.loads(f'"{e}"') for e in escaped)
                    if not '\ud800' <= c <= '\udfff')  # a lone surrogate is no character
  return ''.join(dict.fromkeys(text + decoded))


def _json_rows(text: str, source: str, what: str) -> list[Row]:
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f'{what}={source}:{e.lineno}: invalid JSON ({e.msg}: column {e.colno}).'
                      ) from None
  if isinstance(value, Mapping) and value and all(isinstance(v, list) for v in value.values()):
    lengths = {len(v) for v in value.values()}  # columns: {"prompt": [...], "answer": [...]}
    if len(lengths) != 1:
      raise ConfigError(f'{what}={source}: columns of different lengths {sorted(lengths)}.')
    value = [dict(zip(value, vals)) for vals in zip(*value.values())]
  if not isinstance(value, list):
    raise ConfigError(f'{what}={source}: a JSON file must hold a list of records or an object of '
                      f'equal-length columns; use .jsonl for one record per line.')
  return [_row(r, f'{what}={source} record {i}', what) for i, r in enumerate(value)]


def _csv_rows(text: str, source: str, what: str) -> list[Row]:
  """The rows of a CSV text with a header line; every cell a string (no type is guessed). A
  header with an empty or repeated name, or a row with more or fewer cells than the header, is a
  ConfigError naming the line (pandas, so datasets, refuses such a file too)."""
  reader = csv.DictReader(io.StringIO(text, newline=''))
  names = reader.fieldnames or []
  repeated = sorted({n for n in names if names.count(n) > 1})
  if any(not n.strip() for n in names) or repeated:
    raise ConfigError(f'{what}={source}:1: the header has '
                      + (f'a repeated column name {repeated[0]!r}' if repeated
                         else 'an empty column name') + '; give each column its own name.')
  rows = []
  for r in reader:
    if None in r or None in r.values():  # DictReader's restkey / restval: a ragged row
      cells = sum(v is not None for k, v in r.items() if k is not None) + len(r.get(None, ()))
      raise ConfigError(f'{what}={source}:{reader.line_num}: {cells} cell(s), the header has '
                        f'{len(names)}; give every row one cell per column.')
    rows.append(_row(r, f'{what}={source}:{reader.line_num}', what))
  return rows


def _parquet_rows(data: bytes, source: str, what: str) -> FileRows:
  """The columns are decoded whole (in C, by every process that reads the file); row i becomes
  Python values only when read."""
  # lazy: optional dependency (pyarrow, with datasets)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    table = pq.read_table(io.BytesIO(data))
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'{what}={source}: not a readable parquet file ({_first_line(e)}).'
                      ) from None
  read = lambda i: _row(table.slice(i, 1).to_pylist()[0], f'{what}={source} row {i}', what)
  return FileRows(read, table.num_rows, lambda: _text_of(table.to_pylist()))


def _from_datasets_object(obj, split: str, what: str, name: str = '') -> list[Row]:
  if isinstance(obj, Mapping):  # a datasets.DatasetDict: {split: Dataset}
    if split not in obj:
      raise ConfigError(f'{what}={name or "the dataset"} has splits {", ".join(obj)}, not '
                        f'{split!r}; set {what}_split.')
    obj = obj[split]
  if not hasattr(obj, '__len__') or not hasattr(obj, '__getitem__'):
    raise ConfigError(f'{what}: a {type(obj).__name__}; give a path, a hub id, a list of dicts or '
                      f'a datasets.Dataset.')
  return [_row(obj[i], f'{what}={name or "dataset"} row {i}', what) for i in range(len(obj))]


# -- checking and shaping ------------------------------------------------------------------------
def parse_columns(columns) -> dict[str, str]:
  """``'question:prompt,solution:answer'`` (or a mapping) -> {'question': 'prompt', ...}."""
  if isinstance(columns, Mapping):
    out = dict(columns)
  else:
    out = {}
    for item in filter(None, (p.strip() for p in (columns or '').split(','))):
      src, colon, dst = item.partition(':')
      if not colon or not src.strip() or not dst.strip():
        raise ConfigError(f'data.columns: {item!r} is not "source:target" (e.g. '
                          f'data.columns=question:prompt).')
      out[src.strip()] = dst.strip()
  targets = list(out.values())
  twice = sorted({t for t in targets if targets.count(t) > 1})
  if twice:  # one would silently win, by the file's column order (datasets refuses it too)
    sources = [s for s, t in out.items() if t == twice[0]]
    raise ConfigError(f'data.columns: {" and ".join(map(repr, sources))} are both renamed to '
                      f'{twice[0]!r}; rename one column to each name.')
  return out


def prepare(rows: Sequence[Row], columns: Mapping[str, str], what: str) -> Sequence[Row]:
  """Columns renamed; each row's prompt checked (a string, or a list of {role, content}); of a
  FileRows, each row when it is read."""
  if not len(rows):
    raise ConfigError(f'{what} is empty; give at least one row.')
  if isinstance(rows, FileRows):
    return rows.mapped(lambda row: _prepared(row, columns))
  return [_prepared(row, columns) for row in rows]


def _prepared(row: Row, columns: Mapping[str, str]) -> Row:
  renamed = renamed_row(row, columns)
  if 'prompt' not in renamed:
    hint = '; rename a column with data.columns=<name>:prompt' if not columns else ''
    raise ConfigError(f'{row.where}: no "prompt" column (columns: '
                      f'{", ".join(map(str, renamed)) or "none"}){hint}.')
  renamed['prompt'] = check_prompt(renamed['prompt'], row.where)
  return renamed


def check_prompt(prompt, where: str):
  """A prompt string, or a list of chat messages as plain dicts; anything else: ConfigError."""
  if isinstance(prompt, str):
    if not prompt:
      raise ConfigError(f'{where}: an empty prompt.')
    return prompt
  messages = as_messages(prompt)
  if messages is not None:
    return messages
  raise ConfigError(f'{where}: the prompt is a {type(prompt).__name__} ({str(prompt)[:60]!r}); '
                    f'give a string or a list of chat messages {{"role": ..., "content": ...}}.')


def as_messages(value) -> Optional[list[dict[str, Any]]]:
  """A non-empty list of chat messages as plain dicts, every key kept (``tool_calls``, ``name``,
  ``tool_call_id``, ``reasoning_content``: the chat template renders them, as TRL's rows give
  them to it); else None. Each has a string ``role`` and a string ``content``, which an
  assistant turn of tool calls alone may lack or hold as None (it becomes '')."""
  if not (isinstance(value, (list, tuple)) and value):
    return None
  out = []
  for m in value:
    if not (isinstance(m, Mapping) and isinstance(m.get('role'), str)):
      return None
    m = dict(m)
    if m.get('content') is None and m.get('tool_calls'):
      m['content'] = ''
    if not isinstance(m['content'] if 'content' in m else None, str):
      return None
    out.append(m)
  return out


def held_out_split(rows: Sequence[Row], fraction: float, seed: int
                   ) -> tuple[Sequence[Row], list[Row]]:
  """(train, eval): a seeded ``fraction`` of the rows (at least one) held out; of a FileRows,
  only the held-out rows are parsed (train stays a FileRows)."""
  n = len(rows)
  order = np.random.default_rng([seed, HELD_OUT_STREAM]).permutation(n)
  k = max(1, int(round(fraction * n)))
  if k >= n:
    raise ConfigError(f'data.train has {n} row(s): holding out data.eval_fraction={fraction} '
                      f'leaves none to train on; give data.eval or more rows.')
  held = np.zeros(n, bool)
  held[order[:k]] = True
  take = lambda index: (rows.take(index) if isinstance(rows, FileRows)
                        else [rows[i] for i in index])
  return take(np.flatnonzero(~held)), list(take(np.flatnonzero(held)))


# -- the task -------------------------------------------------------------------------------------
class DataTask(base.Task):
  """Rows as a task: prompts, reward columns and the given reward functions (GRPO).

  ``reward_functions()`` are the run's (``grpo.reward_funcs`` or the Python API's); accuracy is
  the correctness reward's (``rewards.marks_correctness``), none when no reward marks it.
  ``train`` may be a FileRows: a row is parsed when its example is built. ``owns(position)``:
  whether this process trains on data position ``position`` (GRPO's; default all).
  """

  name = 'data'

  def __init__(self, train: Sequence[Row], eval_rows: Sequence[Row],
               reward_funcs: Sequence[rewards_lib.WeightedReward] = (), shuffle: bool = True,
               owns: Callable[[int], bool] = lambda position: True):
    self.train = train if isinstance(train, FileRows) else list(train)
    self.owns = owns
    self.eval_rows = list(eval_rows)
    self.rewards = list(reward_funcs)
    self.shuffle = shuffle
    self._order_key, self._order = None, None
    # The columns of each split's rows parsed so far (data.build_task parses this process's first
    # epoch up front): a row without one of them gets None, as a row of TRL's `datasets` does
    # (a column is every row's), so that reward functions and an environment's reset take the
    # same keywords for every row. Before, a keyword only some rows had was missing from a batch
    # of rows without it: a TypeError mid-run where the function required it.
    self._columns: dict[str, dict[str, None]] = {'train': {}, 'eval': {}}

  def example(self, row: Mapping[str, Any], split: str = 'train') -> base.Example:
    """``row`` as an Example: its prompt, and as fields every column of the split's rows seen so
    far (None where the row has none)."""
    columns = self._columns[split]
    columns.update((k, None) for k in row if k != 'prompt' and k not in columns)
    return base.Example(prompt=row['prompt'], answer=None,
                        fields={k: row.get(k) for k in columns})

  def train_example(self, index: int, seed: int) -> base.Example:
    return self.example(self.train[self.row_index(index, seed)])

  def row_index(self, index: int, seed: int) -> int:
    """The index in ``self.train`` of the row at data position ``index`` of seed ``seed``."""
    if index < 0 or seed < 0:
      raise ValueError(f'index={index}, seed={seed}; both must be >= 0.')
    epoch, position = divmod(index, len(self.train))
    if self.shuffle:
      if self._order_key != (seed, epoch):  # the last epoch's order is cached
        self._order = np.random.default_rng([seed, epoch]).permutation(len(self.train))
        self._order_key = (seed, epoch)
      position = int(self._order[position])
    return position

  def first_epoch(self, seed: int, limit: Optional[int] = None) -> list[base.Example]:
    """The examples at this process's data positions (``owns``; of the first ``limit``) of the
    first epoch of seed ``seed``: the rows it trains on in that epoch, parsed (and checked)."""
    positions = range(min(len(self.train), len(self.train) if limit is None else limit))
    return [self.example(self.train[self.row_index(p, seed)]) for p in positions
            if self.owns(p)]

  def eval_examples(self) -> list[base.Example]:
    for r in self.eval_rows:  # every held-out row's columns first: the set is small and known
      self._columns['eval'].update((k, None) for k in r if k != 'prompt')
    return [self.example(r, 'eval') for r in self.eval_rows]

  def num_train(self) -> int:
    return len(self.train)

  def sft_completion(self, example: base.Example) -> str:
    raise ConfigError('data.train rows train GRPO only for now (SFT and DPO use the built-in '
                      'tasks); set stages=grpo.')

  def reward_functions(self, *unused_args, **unused_kwargs):
    return list(self.rewards)

  def correctness_reward(self) -> Optional[rewards_lib.WeightedReward]:
    return next((r for r in self.rewards if r.marks_correctness), None)

  def is_correct(self, example: base.Example, completion: str) -> bool:
    reward = self.correctness_reward()
    if reward is None:
      return False
    _, per_fn = rewards_lib.compute_rewards(
        [reward], [example.prompt], [completion], base.reward_fields([example]))
    return bool(per_fn[reward.name][0] > 0)

  def extract_answer(self, completion: str) -> Optional[str]:
    return None

  def tokenizer(self):
    """A fresh model's: one token per character of the data (BASE_ALPHABET besides), with a
    plain chat template. Of a FileRows, the file's characters (FileRows.characters: a .jsonl
    file's are read without parsing it)."""
    chars = dict.fromkeys(BASE_ALPHABET)
    if isinstance(self.train, FileRows):
      chars.update(dict.fromkeys(self.train.characters()))
    for row in ([] if isinstance(self.train, FileRows) else self.train) + self.eval_rows:
      for value in row.values():
        chars.update(dict.fromkeys(_text_of(value)))
    tok = tokenizer_lib.build_char_tokenizer(''.join(chars))
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    return tok


def _text_of(value) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping):
    return ''.join(_text_of(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return ''.join(_text_of(v) for v in value)
  return ''


def renamed_row(row: Row, columns: Mapping[str, str]) -> Row:
  out = Row({columns.get(k, k): v for k, v in row.items()})
  out.where = row.where
  return out
