r"""Writes a user's own DPO preference data: a correct and a wrong reply to "What is a+b?".

  python studies/your_data/make_preference_jsonl.py --out=/tmp/preferences
  PYTHONPATH=/tmp/preferences python -m jaxrl_ga.main \
      --config=configs/dpo_smollm2_preferences.py:/tmp/preferences --workdir=/tmp/smollm2_dpo

The files are what a user brings (TRL's preference format, implicit prompt):

  preferences.jsonl   one row per training problem, two chat conversations sharing their user
                      turn: {"chosen": [{"role": "user", "content": "What is 3+4? Answer with the
                      number only."}, {"role": "assistant", "content": "3 + 4 = 7"}],
                      "rejected": [..., {"role": "assistant", "content": "3 + 4 = 8"}]}; the
                      wrong sum is off by 1 or 2 (seeded), half the wrong replies in the other
                      form the model writes, "The answer is 8.".
  eval.jsonl          the held-out problems as rows {"prompt": ..., "answer": "7"}, scored by
  addition_rewards.py  make_addition_jsonl.py's reward ``correct`` (it marks correctness).

The 100 pairs (a, b) in [0, 10)^2 are shuffled with --seed; the first --num_eval are held out
(the same split as make_addition_jsonl.py's at the same seed). Only the standard library.
"""

import argparse
import json
import os
import random

from make_addition_jsonl import QUESTION, REWARDS  # this directory's script (sys.path[0])


def preference_row(a: int, b: int, rng: random.Random) -> dict:
  wrong = a + b + rng.choice([-2, -1, 1, 2] if a + b >= 2 else [1, 2])
  bad = f'{a} + {b} = {wrong}' if rng.random() < 0.5 else f'The answer is {wrong}.'
  user = {'role': 'user', 'content': QUESTION.format(a=a, b=b)}
  return {'chosen': [user, {'role': 'assistant', 'content': f'{a} + {b} = {a + b}'}],
          'rejected': [user, {'role': 'assistant', 'content': bad}]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='directory to write the three files to')
  parser.add_argument('--num_eval', type=int, default=48, help='problems held out')
  parser.add_argument('--seed', type=int, default=0, help='shuffles the problems, picks wrong sums')
  args = parser.parse_args()
  problems = [(a, b) for a in range(10) for b in range(10)]
  random.Random(args.seed).shuffle(problems)
  held, train = problems[:args.num_eval], problems[args.num_eval:]
  rng = random.Random(args.seed + 1)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'preferences.jsonl'), 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(preference_row(a, b, rng)) + '\n' for a, b in train)
  with open(os.path.join(args.out, 'eval.jsonl'), 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'prompt': QUESTION.format(a=a, b=b), 'answer': str(a + b)}) + '\n'
                 for a, b in held)
  with open(os.path.join(args.out, 'addition_rewards.py'), 'w', encoding='utf-8') as f:
    f.write(REWARDS)
  print(f'wrote {len(train)} preference pairs, {len(held)} held-out problems and '
        f'addition_rewards.py to {args.out}')


if __name__ == '__main__':
  main()
