r"""SFT only, on 2-digit addition with a tiny Qwen2 model trained from scratch.

  python -m jaxrl_ga.main --config=configs/sft_arith.py --workdir=/tmp/sft_arith

Token cross-entropy with exact accumulation: K=2 micro-batches of 64 give the update of one batch
of 128, whatever the answer lengths. Task, model and eval settings are grpo_arith.py's.
`--config=configs/sft_arith.py:smoke` shrinks everything for a test run.
"""

import os

from jaxrl_ga.config import load_config_file, unknown_config_arg

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_arith.py')


def get_config(arg: str = ''):
  if arg not in ('', 'smoke'):  # this file's name in the error, not its base's
    raise unknown_config_arg(__file__, arg, ['', 'smoke'])
  c = load_config_file(_BASE, arg)
  c.stages = 'sft'
  c.sft.update(micro_batch_size=64, grad_accum_steps=2)
  if arg == 'smoke':
    c.sft.update(micro_batch_size=8)
  return c
