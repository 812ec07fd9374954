"""A calculator environment and a 2-3 digit multiplication task (issue 44's worked example).

The same class and reward run under this project's GRPO and under TRL 1.16's
``GRPOTrainer(environment_factory=Calculator, reward_funcs=[correct])``:

  python examples/calculator.py /tmp/calc
  PYTHONPATH=.:examples python -m jaxrl_ga.main --config=configs/grpo_smollm2.py \\
      --workdir=/tmp/calc_run --config.data.train=/tmp/calc/train.jsonl \\
      --config.grpo.reward_funcs=calculator:correct \\
      --config.grpo.environment=calculator:Calculator --config.grpo.max_tool_calls=2 \\
      --config.grpo.sampling.max_completion_length=64 \\
      --config.grpo.sampling.max_prompt_length=320

``python examples/calculator.py OUT_DIR`` writes OUT_DIR/train.jsonl (GRPO rows: prompt, answer),
OUT_DIR/eval.jsonl (held-out rows, none of them in train.jsonl: prompt, completion, answer; the
completion lets an SFT run evaluate on them too) and OUT_DIR/sft.jsonl (tool-use conversations for an SFT warm start, ``stages=sft``: each a
system turn announcing the tools in the plain format, the question, the assistant's
``<tool_call>``, the tool's result and the final answer).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from typing import Optional

QUESTION = 'What is {a} * {b}? Use the calculator, then give the final answer as a number.'


class Calculator:
  """An environment (TRL's ``environment_factory`` contract): ``reset(**row)`` before each
  episode, its public methods the tools; ``get_reward`` is 1.0 when the episode called a tool
  whose result was the row's answer (a reward named "Calculator")."""

  def __init__(self):
    self.answer: Optional[str] = None
    self.results: list[int] = []

  def reset(self, **row) -> Optional[str]:
    self.answer, self.results = row.get('answer'), []
    return None  # nothing to add to the prompt

  def multiply(self, a: int, b: int) -> int:
    """Multiply two integers.

    Args:
      a: the first factor.
      b: the second factor.
    """
    self.results.append(int(a) * int(b))
    return self.results[-1]

  def add(self, a: int, b: int) -> int:
    """Add two integers.

    Args:
      a: the first term.
      b: the second term.
    """
    self.results.append(int(a) + int(b))
    return self.results[-1]

  def get_reward(self) -> float:
    return float(self.answer is not None and str(self.answer) in map(str, self.results))


def correct(prompts, completions, answer, **unused_columns):
  """1.0 iff the completion's final number is the row's answer (its last assistant turn's text;
  docs/your_data.md, "Tools and environments")."""
  del prompts, unused_columns
  out = []
  for text, want in zip(completions, answer):
    numbers = re.findall(r'-?\d+', str(text).replace(',', ''))
    out.append(float(bool(numbers) and numbers[-1] == str(want)))
  return out


correct.marks_correctness = True  # the run's accuracy is its share of 1.0


def rows(n: int, seed: int = 0) -> list[dict]:
  """n GRPO rows of 2- and 3-digit multiplications: prompt, answer."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    out.append({'prompt': QUESTION.format(a=a, b=b), 'answer': str(a * b)})
  return out


def sft_rows(n: int, seed: int = 1) -> list[dict]:
  """n tool-use conversations (``messages`` rows for stages=sft) in the plain format."""
  from jaxrl_ga import tools  # pylint: disable=import-outside-toplevel  # lazy: the example's class imports nothing of the package, as TRL runs it
  env = Calculator()
  block = tools.PLAIN_TOOLS_PROMPT.format(tools='\n'.join(
      json.dumps(tools.tool_schema(getattr(env, m))) for m in ('add', 'multiply')))
  out = []
  for row in rows(n, seed):
    a, b = [int(x) for x in row['prompt'].split('What is ')[1].split('?')[0].split(' * ')]
    call = json.dumps({'name': 'multiply', 'arguments': {'a': a, 'b': b}})
    out.append({'messages': [
        {'role': 'system', 'content': block},
        {'role': 'user', 'content': row['prompt']},
        {'role': 'assistant', 'content': f'<tool_call>\n{call}\n</tool_call>'},
        {'role': 'tool', 'content': str(a * b)},
        {'role': 'assistant', 'content': f'{a} * {b} = {a * b}. The answer is {a * b}.'}]})
  return out


def eval_rows(n: int, exclude: list[dict], seed: int = 2) -> list[dict]:
  """n held-out rows (prompt, completion, answer) whose question is not in ``exclude``."""
  seen = {r['prompt'] for r in exclude}
  out = [r for r in rows(2 * n + len(seen), seed) if r['prompt'] not in seen][:n]
  return [{**r, 'completion': f'The answer is {r["answer"]}.'} for r in out]


def main(out_dir: str, n_train: int = 512, n_sft: int = 64, n_eval: int = 48) -> None:
  os.makedirs(out_dir, exist_ok=True)
  train, sft = rows(n_train), sft_rows(n_sft)
  held = eval_rows(n_eval, train + [{'prompt': r['messages'][1]['content']} for r in sft])
  for name, data in (('train.jsonl', train), ('eval.jsonl', held), ('sft.jsonl', sft)):
    with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in data)
    print(f'wrote {len(data)} rows to {os.path.join(out_dir, name)}')


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/calculator')
