"""GSM8K-style grade-school word problems with a final ``#### <number>`` line.

Data comes from the Hugging Face hub (default ``openai/gsm8k``, config ``main``, through the
optional ``datasets`` package) or from a local JSONL file of ``{"question": ..., "answer": ...}``
records (read with ``datasets`` when installed, else with the json module, so offline use needs
nothing extra). A reference ``answer`` is the worked solution ending in ``#### <number>``, with
``<<48/2=24>>`` calculator annotations that the SFT target drops by default.

Rewards (see ``base.Task.reward_functions``): 'correct' = 1.0 iff the number after the last
``####`` of the completion equals the reference numerically (``1,234`` = ``1234``, ``2.50`` =
``2.5``); 'format' = 1.0 iff the completion has ``#### <number>`` at all.

Held-out set: the hub's ``eval_split`` (default 'test'), or ``eval_source``; for a local file with
no ``eval_source``, the questions whose hash falls below ``eval_fraction``. Training examples whose
question also appears in the eval set are dropped either way.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Any, Optional

import numpy as np

from jaxrl_ga.answers import extract_final_number, numbers_equal  # gsm8k.<name> for users
from jaxrl_ga.tasks import base

DEFAULT_SOURCE = 'openai/gsm8k'
DEFAULT_PROMPT_TEMPLATE = (
    'Solve the math problem. Reason step by step, then write the final answer on its own last '
    'line as "#### <number>".\n\nQuestion: {question}\nAnswer:\n')
_LOCAL_SUFFIXES = ('.jsonl', '.json')
_CALCULATOR = re.compile(r'<<[^<>]*>>')


def _is_local(source: str) -> bool:
  return source.endswith(_LOCAL_SUFFIXES) or os.path.isfile(source)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  rows = []
  with open(path, encoding='utf-8') as f:
    for line_number, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f'{path}:{line_number}: not a JSON record: {e}') from e
  return rows


def _import_datasets():
  try:
    # lazy: optional dependency (datasets)
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('loading GSM8K from the Hugging Face hub needs the `datasets` package: '
                      '`pip install datasets` (or the extra: `pip install -e .[data]`). Or pass '
                      'a local .jsonl file with "question" and "answer" fields, which needs '
                      'nothing extra.') from e
  return datasets


def load_gsm8k(source: str = DEFAULT_SOURCE, split: str = 'train',
               config_name: str = 'main') -> list[dict[str, str]]:
  """GSM8K records as ``[{'question': str, 'answer': str}, ...]``, in dataset order.

  Args:
    source: a hub dataset id, or a local ``.jsonl`` file (one JSON record per line).
    split: the hub split; for a local file, only the name under which ``datasets`` loads it.
    config_name: the hub dataset config ('main' or 'socratic' for openai/gsm8k).
  """
  if _is_local(source):
    if not os.path.isfile(source):
      raise FileNotFoundError(f'GSM8K file {source!r} does not exist.')
    rows = _read_jsonl(source)  # a malformed line is named (file:line), whatever reads it next
    try:
      datasets = _import_datasets()
    except ImportError:
      pass
    else:
      rows = list(datasets.load_dataset('json', data_files={split: source}, split=split))
  else:
    rows = list(_import_datasets().load_dataset(source, config_name, split=split))
  for i, row in enumerate(rows):
    if not isinstance(row.get('question'), str) or not isinstance(row.get('answer'), str):
      raise ValueError(f'{source} ({split}) record {i} lacks string "question" and "answer" '
                       f'fields: {sorted(row)}.')
  return [{'question': row['question'], 'answer': row['answer']} for row in rows]


@dataclasses.dataclass(frozen=True)
class GSM8KConfig:
  """Where the problems come from and how they are asked.

  Attributes:
    source: hub dataset id or local .jsonl path (training data, and eval data by default).
    config_name: hub dataset config.
    train_split: hub split for training.
    eval_split: hub split for the held-out set.
    eval_source: another hub id or .jsonl file for the held-out set; None: see the module doc.
    eval_fraction: share of a local file's questions held out when ``eval_source`` is None.
    num_eval: keep the first ``num_eval`` held-out problems; None keeps all.
    prompt_template: ``str.format`` template with a ``{question}`` field.
    strip_calculator_annotations: drop ``<<...>>`` from the SFT targets.
  """
  source: str = DEFAULT_SOURCE
  config_name: str = 'main'
  train_split: str = 'train'
  eval_split: str = 'test'
  eval_source: Optional[str] = None
  eval_fraction: float = 0.2
  num_eval: Optional[int] = None
  prompt_template: str = DEFAULT_PROMPT_TEMPLATE
  strip_calculator_annotations: bool = True

  def __post_init__(self):
    if '{question}' not in self.prompt_template:
      raise ValueError('prompt_template needs a {question} field.')
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f'eval_fraction={self.eval_fraction}; choose a value in (0, 1).')
    if self.num_eval is not None and self.num_eval < 1:
      raise ValueError(f'num_eval={self.num_eval}; need at least 1 (or None for all).')


def _question_key(question: str) -> str:
  return ' '.join(question.split()).lower()


def _hash_unit(text: str) -> float:
  digest = hashlib.blake2b(text.encode('utf-8'), digest_size=8).digest()
  return int.from_bytes(digest, 'big') / 2.0**64


class GSM8KTask(base.Task):
  """Word problems answered with a final '#### <number>'. Data loads on first use."""

  name = 'gsm8k'

  def __init__(self, config: GSM8KConfig = GSM8KConfig()):
    self.config = config
    self._order_key: Optional[tuple[int, int]] = None
    self._order = np.zeros(0, np.int64)

  # -- data -------------------------------------------------------------------------------------
  @functools.cached_property
  def _splits(self) -> tuple[list[base.Example], list[base.Example]]:
    cfg = self.config
    rows = load_gsm8k(cfg.source, cfg.train_split, cfg.config_name)
    if cfg.eval_source is None and _is_local(cfg.source):
      held_out = [_hash_unit(_question_key(r['question'])) < cfg.eval_fraction for r in rows]
      eval_rows = [r for r, h in zip(rows, held_out) if h]
    else:
      eval_rows = load_gsm8k(cfg.eval_source or cfg.source, cfg.eval_split, cfg.config_name)
    eval_rows = eval_rows[:cfg.num_eval]
    eval_questions = {_question_key(r['question']) for r in eval_rows}
    train_rows = [r for r in rows if _question_key(r['question']) not in eval_questions]
    if not train_rows or not eval_rows:
      raise ValueError(f'GSM8K split of {cfg.source!r} left {len(train_rows)} training and '
                       f'{len(eval_rows)} eval problems; both must be non-empty (eval_source='
                       f'{cfg.eval_source!r}, eval_fraction={cfg.eval_fraction}).')
    return [self._example(r) for r in train_rows], [self._example(r) for r in eval_rows]

  def _example(self, row: dict[str, str]) -> base.Example:
    answer = extract_final_number(row['answer'])
    if answer is None:
      raise ValueError(f'GSM8K reference answer has no "#### <number>": {row["answer"]!r}')
    return base.Example(
        prompt=self.config.prompt_template.format(question=row['question']), answer=answer,
        fields={'answer': answer, 'question': row['question'], 'solution': row['answer']})

  def _epoch_order(self, seed: int, epoch: int) -> np.ndarray:
    """The visiting order of epoch ``epoch``; the last one is cached (reads are sequential)."""
    if self._order_key != (seed, epoch):
      self._order = np.random.default_rng([seed, epoch]).permutation(len(self._splits[0]))
      self._order_key = (seed, epoch)
    return self._order

  def train_example(self, index: int, seed: int) -> base.Example:
    """Epoch ``index // N`` of the stream ``seed`` visits the N problems in a seeded order."""
    if index < 0 or seed < 0:
      raise ValueError(f'index={index}, seed={seed}; both must be >= 0.')
    train = self._splits[0]
    epoch, position = divmod(index, len(train))
    return train[int(self._epoch_order(seed, epoch)[position])]

  def eval_examples(self) -> list[base.Example]:
    return list(self._splits[1])

  def num_train(self) -> int:
    return len(self._splits[0])

  def sft_completion(self, example: base.Example) -> str:
    solution = example.fields['solution']
    if self.config.strip_calculator_annotations:
      solution = _CALCULATOR.sub('', solution)
    return solution

  # -- checking ---------------------------------------------------------------------------------
  def extract_answer(self, completion: str) -> Optional[str]:
    return extract_final_number(completion)

  def answers_equal(self, predicted: str, reference: str) -> bool:
    return numbers_equal(predicted, reference)
