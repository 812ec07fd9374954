"""Short number questions in plain English, for pretrained chat models (offline, synthetic).

  'add':    'What is 3+4? Answer with the number only.'                          -> '7'
  'larger': 'Which number is larger, 27 or 72? Answer with the number only.'     -> '72'

Operands are drawn uniformly from [0, 10**num_digits). The prompt is plain text; the trainers send
it through the model's chat template (``jaxrl_ga.tasks.chat``), and the model's turn ends with the
tokenizer's eos. The held-out split is ``arithmetic``'s hash split on (op, a, b), so train and
eval never share a problem (with 1 digit there are only 100 problems: keep ``eval_fraction``
large enough for ``num_eval``).

Answer parsing (``extract_answer``), robust to how a chat model phrases a reply, in order:
  1. the reply is a number (``'7'``, ``'7.'``, ``'1,234'``)           -> that number;
  2. the reply has an ``=``                                          -> the first integer after the
     last ``=`` (``'3 + 4 = 7'`` -> 7);
  3. otherwise                                                       -> the first integer
     (``'The larger number is 72.'`` -> 72).
Thousands separators are dropped. 'correct' = 1 iff that number equals the answer; 'format' = 1
iff the reply is only the number (rule 1), what the prompt asks for.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

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
  """
  question: str = 'add'
  num_digits: int = 1
  num_eval: int = 64
  eval_fraction: float = 0.5

  def __post_init__(self):
    if self.question not in QUESTIONS:
      raise ValueError(f'question={self.question!r}; choose one of {", ".join(QUESTIONS)}.')


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

  def example_for(self, a: int, op: str, b: int) -> base.Example:
    del op  # the split hash keys on '+'; the question decides the answer
    a, b = int(a), int(b)
    answer = str(a + b if self.question == 'add' else max(a, b))
    return base.Example(prompt=QUESTIONS[self.question].format(a=a, b=b), answer=answer,
                        fields={'answer': answer})

  def sft_completion(self, example: base.Example) -> str:
    return example.answer

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
