r"""SFT on your chat data: SmolLM2-135M-Instruct on "What is a+b?" conversations, offline, on a CPU.

  python studies/your_data/make_chat_sft_jsonl.py --out=/tmp/chat_sft
  python -m jaxrl_ga.main --config=configs/sft_smollm2_chat.py:/tmp/chat_sft \
      --workdir=/tmp/smollm2_chat_sft

The argument is the directory the script wrote (train.jsonl, eval.jsonl); ``:DIR,smoke`` shrinks
the run for a quick check. Rows are ``{"messages": [...], "answer": ...}``: the loss covers the
assistant turns only (SmolLM2's ChatML template has no generation markers, so its turns are found
prefix by prefix, ``jaxrl_ga.sft_data``); ``sft.packing`` puts several conversations in each row of
``sft.max_length`` tokens. Held-out accuracy, before and after: the share of the 48 held-out
problems whose greedy reply's final number is the ``answer`` column (the built-in reward
``final_answer``, which the evaluation of your data uses when it is among ``grpo.reward_funcs``).
The model, mesh and layer settings are configs/grpo_smollm2.py's.

One run (seed 0, data --seed=0, a shared and loaded 2-core CPU VM, 2026-11-25, 749 s): held-out
accuracy 0.125 before SFT, 0.667 after 20 optimizer steps (loss 0.153 at step 5, 0.053 at 20).
"""

import os

from jaxrl_ga.config import ConfigError, load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_smollm2.py')


def get_config(arg: str = ''):
  directory, _, variant = (arg or '').partition(',')
  if not directory:
    raise ConfigError('configs/sft_smollm2_chat.py needs the data directory: '
                      '--config=configs/sft_smollm2_chat.py:/tmp/chat_sft (written by '
                      'studies/your_data/make_chat_sft_jsonl.py --out=/tmp/chat_sft).')
  c = load_config_file(_BASE, variant)
  c.stages = 'sft'
  c.data.update(train=os.path.join(directory, 'train.jsonl'),
                eval=os.path.join(directory, 'eval.jsonl'))
  c.grpo.reward_funcs = 'final_answer'  # scores the held-out replies
  # A two-exchange conversation through the template (default system prompt included) is ~75
  # tokens, a one-exchange one ~45: rows of 128 hold two or three of them packed.
  c.sft.update(num_steps=20, micro_batch_size=8, grad_accum_steps=1, max_length=128,
               packing=True, too_long='error', log_every=5, eval_before=True)
  c.sft.optimizer.update(learning_rate=2e-5, max_grad_norm=1.0, warmup_steps=0)
  c.eval.update(num_examples=48, batch_size=48, max_completion_length=16)
  c.checkpoint.update(every_steps=0, max_to_keep=1)
  if variant == 'smoke':
    c.sft.update(num_steps=2, micro_batch_size=4, grad_accum_steps=1, log_every=1)
    c.eval.update(num_examples=8, batch_size=8)
  return c
