r"""GRPO on your own data: SmolLM2-135M-Instruct on a JSONL of one-digit additions with your own
reward module (not the built-in task), offline, on a CPU.

  python studies/your_data/make_addition_jsonl.py --out=/tmp/addition
  PYTHONPATH=/tmp/addition python -m jaxrl_ga.main \
      --config=configs/grpo_smollm2_addition.py:/tmp/addition --workdir=/tmp/smollm2_addition

The argument is the directory the script wrote (train.jsonl, eval.jsonl, addition_rewards.py);
``:DIR,smoke`` shrinks the run for a quick check. The same as setting, on any config,
``--config.data.train=DIR/train.jsonl --config.data.eval=DIR/eval.jsonl
--config.grpo.reward_funcs=addition_rewards:correct`` with DIR on PYTHONPATH. Everything else is
configs/grpo_smollm2.py (model, schedule, lengths, learning rate): the rows ask what the built-in
``number_questions`` task asks, so the two runs can be compared. Held-out accuracy: the share of
the 48 held-out problems that the reward ``correct`` (it marks correctness) scores 1 on, greedy.
"""

import os

from jaxrl_ga.config import ConfigError, load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_smollm2.py')


def get_config(arg: str = ''):
  directory, _, variant = (arg or '').partition(',')
  if not directory:
    raise ConfigError('configs/grpo_smollm2_addition.py needs the data directory: '
                      '--config=configs/grpo_smollm2_addition.py:/tmp/addition (written by '
                      'studies/your_data/make_addition_jsonl.py --out=/tmp/addition).')
  c = load_config_file(_BASE, variant)
  c.data.update(train=os.path.join(directory, 'train.jsonl'),
                eval=os.path.join(directory, 'eval.jsonl'))
  c.grpo.reward_funcs = 'addition_rewards:correct'
  return c
