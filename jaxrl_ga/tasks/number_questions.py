"""Short number questions in plain English, for pretrained chat models (offline, synthetic).

  'add':    'What is 3+4? Answer with the number only.'                          -> '7'
  'larger': 'Which number is larger, 27 or 72? Answer with the number only.'     -> '72'

Operands are drawn uniformly from [0, 10**num_digits). The prompt is plain text; the trainers send
it through the model's chat template (``jaxrl_ga.tasks.chat``), and the model's turn ends with the
tokenizer's eos. The held-out split is ``arithmetic``'s hash split on (op, a, b), so train and
eval never share a problem (with 1 digit there are only 100 problems: keep ``eval_fraction``
large enough for ``num_eval``).

'larger' is position-balanced, so that no answer rule that ignores the values beats chance
(a model trained on it once learned "say the first number", right on the ~47% of problems where
the first is the larger): the two numbers always differ, the split hashes the unordered pair
{a, b} (so 'a or b' and 'b or a' are both held out or both trained on), and the held-out set lists
each held-out pair in both orders, (larger, smaller) then (smaller, larger). "Always the first"
and "always the second" score exactly 50% on it, and a model that compares gets both orders right.

Answer parsing (``extract_answer``), robust to how a chat model phrases a reply, in order:
  1. the reply is a number (``'7'``, ``'7.'``, ``'1,234'``)           -> that number;
  2. the reply has an ``=``                                          -> the first integer after the
     last ``=`` (``'3 + 4 = 7'`` -> 7);
  3. otherwise                                                       -> the first integer
     (``'The larger number is 72.'`` -> 72).
Thousands separators are dropped. 'correct' = 1 iff that number equals the answer; 'format' = 1
iff the reply is only the number (rule 1), what the prompt asks for; 'wrong' = 1 iff the reply
states a number that is not the answer, weighted by ``wrong_weight`` (0: a metric only). With
``wrong_weight=-1`` a wrong guess costs what a right answer earns, so on 'larger' any rule that
picks a position ("say the first number") earns 0 in expectation, the same as not answering.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from jaxrl_ga.tasks import arithmetic
from jaxrl_ga.tasks import base

QUESTIONS = {
    'add': 'What is {a}+{b}? Answer with the number only.',
    'larger': 'Which number is larger, {a} or {b}? Answer with the number only.',
}
_NUMBER_ONLY = re.compile(r'\s*(-?\d+)\s*\.?\s*')
_INTEGER = re.compile(r'-?\d+')
_THOUSANDS = re.compile(r'(?<=\d),(?=\d{3}\b)')


@dataclasses.dataclass(frozen=True)
class NumberQuestionsConfig:
  """Attributes:
    question: 'add' or 'larger' (see the module docstring).
    num_digits: operands are drawn from [0, 10**num_digits).
    num_eval: size of the fixed held-out set.
    eval_fraction: share of all problems held out from training (hash split).
    wrong_weight: weight of the 'wrong' reward (a number stated, not the answer); <= 0.
    format_weight: weight of the 'format' reward (the reply is the number alone).
  """
  question: str = 'add'
  num_digits: int = 1
  num_eval: int = 64
  eval_fraction: float = 0.5
  wrong_weight: float = 0.0
  format_weight: float = base.FORMAT_WEIGHT

  def __post_init__(self):
    if self.question not in QUESTIONS:
      raise ValueError(f'question={self.question!r}; choose one of {", ".join(QUESTIONS)}.')
    if self.wrong_weight > 0:
      raise ValueError(f'wrong_weight={self.wrong_weight} rewards wrong answers; use a value <= 0 '
                       f'(e.g. -1).')


def parse_number(reply: str) -> Optional[str]:
  """The integer a reply states (rules in the module docstring), canonical, or None."""
  text = _THOUSANDS.sub('', reply).strip()
  m = _NUMBER_ONLY.fullmatch(text)
  if m:
    found = m.group(1)
  else:
    tail = text.rsplit('=', 1)[1] if '=' in text else text
    m = _INTEGER.search(tail)
    if m is None:
      return None
    found = m.group(0)
  return str(int(found))


class NumberQuestionsTask(arithmetic.ArithmeticTask):
  """English number questions with exact-integer rewards; see the module docstring."""

  name = 'number_questions'

  def __init__(self, config: NumberQuestionsConfig = NumberQuestionsConfig()):
    self.question = config.question
    super().__init__(arithmetic.ArithmeticConfig(
        num_digits=config.num_digits, operations='+', reverse_answer=False,
        num_eval=config.num_eval, eval_fraction=config.eval_fraction))
    self.number_config = config  # self.config: the arithmetic split it reuses

  # -- 'larger': distinct operands, split on the unordered pair, eval in both orders -----------
  def _pair_held_out(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    return arithmetic.held_out_mask(np.full(lo.shape, arithmetic.OPERATIONS.index('+')), lo, hi,
                                    self.config.eval_fraction)

  def is_held_out(self, a: int, op: str, b: int) -> bool:
    if self.question != 'larger':
      return super().is_held_out(a, op, b)
    return bool(self._pair_held_out(np.array([a]), np.array([b]))[0])

  def train_example(self, index: int, seed: int) -> base.Example:
    if self.question != 'larger':
      return super().train_example(index, seed)
    if index < 0 or seed < 0:
      raise ValueError(f'index={index}, seed={seed}; both must be >= 0.')
    rng = np.random.default_rng([seed, index])
    while True:
      a, b = rng.integers(0, 10**self.config.num_digits, size=2, dtype=np.int64)
      if a != b and not self._pair_held_out(np.array([a]), np.array([b]))[0]:
        return self.example_for(a, '+', b)

  def _draw_eval_examples(self) -> list[base.Example]:
    if self.question != 'larger':
      return super()._draw_eval_examples()
    rng = np.random.default_rng(arithmetic._EVAL_SEED)
    pairs: dict[tuple[int, int], None] = {}  # (larger, smaller), in order of first draw
    for _ in range(arithmetic._EVAL_MAX_BATCHES):
      a, b = rng.integers(0, 10**self.config.num_digits, size=(2, arithmetic._EVAL_BATCH),
                          dtype=np.int64)
      keep = (a != b) & self._pair_held_out(a, b)
      pairs.update(dict.fromkeys(zip(np.maximum(a, b)[keep].tolist(),
                                     np.minimum(a, b)[keep].tolist())))
      if 2 * len(pairs) >= self.config.num_eval:
        both = [(x, y) for hi, lo in pairs for x, y in ((hi, lo), (lo, hi))]
        return [self.example_for(x, '+', y) for x, y in both[:self.config.num_eval]]
    raise ValueError(
        f'only {2 * len(pairs)} held-out ordered pairs exist for num_digits='
        f'{self.config.num_digits}, eval_fraction={self.config.eval_fraction}; lower '
        f'num_eval={self.config.num_eval}, or raise eval_fraction or num_digits.')

  def example_for(self, a: int, op: str, b: int) -> base.Example:
    del op  # the split hash keys on '+'; the question decides the answer
    a, b = int(a), int(b)
    answer = str(a + b if self.question == 'add' else max(a, b))
    return base.Example(prompt=QUESTIONS[self.question].format(a=a, b=b), answer=answer,
                        fields={'answer': answer})

  def sft_completion(self, example: base.Example) -> str:
    return example.answer

  def reward_functions(self, correct_weight: float = base.CORRECT_WEIGHT,
                       format_weight: Optional[float] = None) -> list[base.WeightedReward]:
    """'correct' and 'format' (``base.Task``; format weighted by the config's ``format_weight``
    unless given), then 'wrong' weighted by ``wrong_weight``."""
    if format_weight is None:
      format_weight = self.number_config.format_weight

    def wrong(prompts, completions, answer, **unused_fields):
      del prompts, unused_fields
      return [float(parse_number(c) not in (None, ref)) for c, ref in
              zip(completions, answer, strict=True)]

    return super().reward_functions(correct_weight, format_weight) + [
        base.WeightedReward('wrong', wrong, self.number_config.wrong_weight)]

  def extract_answer(self, completion: str) -> Optional[str]:
    return parse_number(completion)

  def is_well_formed(self, completion: str) -> bool:
    return _NUMBER_ONLY.fullmatch(_THOUSANDS.sub('', completion)) is not None

  def tokenizer(self):
    return None  # the pretrained model's own

  @property
  def max_prompt_length(self) -> int:
    raise NotImplementedError('prompt lengths depend on the model tokenizer and chat template; '
                              'set grpo.sampling.max_prompt_length.')

  @property
  def max_completion_length(self) -> int:
    raise NotImplementedError('set grpo.sampling.max_completion_length.')
