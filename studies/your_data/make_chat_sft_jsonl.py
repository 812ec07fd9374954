r"""Writes a small chat SFT set: "What is a+b?" conversations answered right, as JSONL.

  python studies/your_data/make_chat_sft_jsonl.py --out=/tmp/chat_sft
  python -m jaxrl_ga.main --config=configs/sft_smollm2_chat.py:/tmp/chat_sft \
      --workdir=/tmp/smollm2_chat_sft

The files are what a user brings for SFT (TRL's conversational format):

  train.jsonl, eval.jsonl   one conversation per row: {"messages": [{"role": "user", "content":
                            "What is 37+45?"}, {"role": "assistant", "content": "37 + 45 = 82"}],
                            "answer": "82"}; every --two_turn_every-th training row has two
                            exchanges (an earlier question and its answer first), so that the
                            loss covers both assistant turns and none of the user turns.
                            Operands in [0, 100) (two-digit sums: SmolLM2-135M-Instruct gets
                            some wrong), the pairs shuffled with --seed, the first --num_eval
                            held out (never trained on, as the second question or the first).

The ``answer`` column is what the run's held-out accuracy compares (``final_answer``: the reply's
final number equals it). Only the standard library: it runs before jaxrl_ga is installed.
"""

import argparse
import json
import os
import random


def exchange(a, b):
  return [{'role': 'user', 'content': f'What is {a}+{b}?'},
          {'role': 'assistant', 'content': f'{a} + {b} = {a + b}'}]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='directory to write the two files to')
  parser.add_argument('--num_train', type=int, default=1000, help='training conversations')
  parser.add_argument('--num_eval', type=int, default=48, help='problems held out')
  parser.add_argument('--two_turn_every', type=int, default=4,
                      help='every n-th training row has two exchanges (0: none)')
  parser.add_argument('--seed', type=int, default=0, help='shuffles the problems')
  args = parser.parse_args()
  rng = random.Random(args.seed)
  pairs = [(a, b) for a in range(100) for b in range(100)]
  rng.shuffle(pairs)
  held, rest = pairs[:args.num_eval], pairs[args.num_eval:args.num_eval + args.num_train]
  train = []
  for i, (a, b) in enumerate(rest):
    messages = exchange(a, b)
    if args.two_turn_every and i % args.two_turn_every == 0:
      messages = exchange(*rest[(i + 1) % len(rest)]) + messages
    train.append({'messages': messages, 'answer': str(a + b)})
  held_out = [{'messages': exchange(a, b), 'answer': str(a + b)} for a, b in held]
  os.makedirs(args.out, exist_ok=True)
  for name, rows in (('train.jsonl', train), ('eval.jsonl', held_out)):
    with open(os.path.join(args.out, name), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in rows)
  print(f'wrote {len(train)} training and {len(held_out)} held-out conversations to {args.out}')


if __name__ == '__main__':
  main()
