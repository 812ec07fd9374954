"""Reading a stated final answer out of a text: the leaf that the built-in rewards
(``jaxrl_ga.rewards``: ``final_answer``) and the GSM8K task (``jaxrl_ga.tasks.gsm8k``) share.
Standard library only; it imports nothing of the package.
"""

from __future__ import annotations

import decimal
import re
from typing import Optional

# After '####': optional '$' (either side of a minus sign), then 1,234.5 / 5 / .5 (commas allowed).
_FINAL_NUMBER = re.compile(r'\s*(-?)\s*\$?\s*(-?)((?:[0-9][0-9,]*)?(?:\.[0-9]+)?)')


def extract_final_number(text: str) -> Optional[str]:
  """The number after the last '####' without commas, '$' or a trailing '.'; None if none.

  '#### 1,234' -> '1234'; '#### $5.' -> '5'; '#### -3' -> '-3'; '#### .5' -> '.5'.
  """
  marker = text.rfind('####')
  if marker < 0:
    return None
  match = _FINAL_NUMBER.match(text, marker + 4)
  sign_before, sign_after, number = match.groups()
  number = number.replace(',', '')
  if not any(ch.isdigit() for ch in number) or (sign_before and sign_after):
    return None
  return ('-' if sign_before or sign_after else '') + number


def numbers_equal(predicted: str, reference: str) -> bool:
  """Numeric equality of two extracted numbers ('2.50' == '2.5'); False if either is malformed."""
  try:
    return decimal.Decimal(predicted) == decimal.Decimal(reference)
  except decimal.InvalidOperation:
    return False


_BOXED = re.compile(r'\\boxed\{([^{}]*)\}')
_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?|-?\.\d+')


def final_number(text: str) -> Optional[str]:
  """The final answer a text states: the last ``\\boxed{...}``'s number, else the number after the
  last ``####``, else the last number; commas dropped. None if it states no number.
  ``'so \\boxed{1,234}'`` -> ``'1234'``; ``'... #### 42'`` -> ``'42'``; ``'it is 7.'`` -> ``'7'``."""
  text = str(text)
  boxed = _BOXED.findall(text)
  if boxed:
    numbers = _NUMBER.findall(boxed[-1])
    return numbers[-1].replace(',', '') if numbers else None
  if '####' in text:
    return extract_final_number(text)
  numbers = _NUMBER.findall(text)
  return numbers[-1].replace(',', '') if numbers else None
