r"""Writes a user's own GRPO data and reward module: one-digit additions as JSONL.

  python studies/your_data/make_addition_jsonl.py --out=/tmp/addition
  PYTHONPATH=/tmp/addition python -m jaxrl_ga.main \
      --config=configs/grpo_smollm2_addition.py:/tmp/addition --workdir=/tmp/smollm2_addition

The files are what a user brings, not the built-in ``number_questions`` task:

  train.jsonl, eval.jsonl   one row per problem: {"prompt": "What is 3+4? Answer with the number
                            only.", "answer": "7", "a": 3, "b": 4}; the 100 pairs (a, b) in
                            [0, 10)^2 shuffled with --seed, the first --num_eval held out.
  addition_rewards.py       correct(prompts, completions, answer, **columns): 1.0 iff the number
                            the reply states equals the answer (a bare number, else the first
                            number after the last '=', else the first number), marked as the
                            correctness reward so the run reports held-out accuracy.

Only the standard library: it runs before jaxrl_ga is installed.
"""

import argparse
import json
import os
import random

QUESTION = 'What is {a}+{b}? Answer with the number only.'

REWARDS = r'''"""Rewards for the one-digit additions of make_addition_jsonl.py (a user's module)."""
import re

_NUMBER_ONLY = re.compile(r'\s*(-?\d+)\s*\.?\s*')
_INTEGER = re.compile(r'-?\d+')


def stated_number(reply):
  """The integer a reply states: a bare number, else the first after the last '=', else the
  first; None if none."""
  m = _NUMBER_ONLY.fullmatch(reply)
  if m:
    return int(m.group(1))
  tail = reply.rsplit('=', 1)[1] if '=' in reply else reply
  m = _INTEGER.search(tail)
  return int(m.group(0)) if m else None


def correct(prompts, completions, answer, **columns):
  """1.0 iff the reply states the answer, else 0.0."""
  return [float(stated_number(c) == int(a)) for c, a in zip(completions, answer)]


correct.marks_correctness = True  # the run reports its held-out accuracy
'''


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='directory to write the three files to')
  parser.add_argument('--num_eval', type=int, default=48, help='problems held out')
  parser.add_argument('--seed', type=int, default=0, help='shuffles the 100 problems')
  args = parser.parse_args()
  rows = [{'prompt': QUESTION.format(a=a, b=b), 'answer': str(a + b), 'a': a, 'b': b}
          for a in range(10) for b in range(10)]
  random.Random(args.seed).shuffle(rows)
  os.makedirs(args.out, exist_ok=True)
  for name, part in (('eval.jsonl', rows[:args.num_eval]), ('train.jsonl', rows[args.num_eval:])):
    with open(os.path.join(args.out, name), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in part)
  with open(os.path.join(args.out, 'addition_rewards.py'), 'w', encoding='utf-8') as f:
    f.write(REWARDS)
  print(f'wrote {len(rows) - args.num_eval} training and {args.num_eval} held-out problems and '
        f'addition_rewards.py to {args.out}')


if __name__ == '__main__':
  main()
