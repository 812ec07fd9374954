r"""SFT warm start, then DPO on (correct, incorrect) pairs sampled from the SFT policy.

  python -m jaxrl_ga.main --config=configs/dpo_arith.py --workdir=/tmp/dpo_arith

For each prompt the SFT policy samples 8 completions; a correct and an incorrect one make a pair.
Reference log-probs (the SFT policy) are computed once and cached in WORKDIR/dpo_pairs.npz.
Pair-weighted sigmoid loss plus RPO's NLL term on the chosen completion (rpo_alpha=1: TRL's 'sft'
term, the token mean of the chosen completions' NLL over the optimizer-step window), with exact
accumulation over K=2 micro-batches of 32 pairs.
Task, model, SFT and eval settings are grpo_arith.py's.
`--config=configs/dpo_arith.py:smoke` shrinks everything for a test run.
"""

import os

from jaxrl_ga.config import load_config_file, unknown_config_arg

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_arith.py')


def get_config(arg: str = ''):
  if arg not in ('', 'smoke'):  # this file's name in the error, not its base's
    raise unknown_config_arg(__file__, arg, ['', 'smoke'])
  c = load_config_file(_BASE, arg)
  c.stages = 'sft,dpo'
  c.dpo.update(num_steps=100, micro_batch_size=32, grad_accum_steps=2, num_prompts=1024,
               samples_per_prompt=8, max_length=12, log_every=10)
  c.dpo.sampling.update(max_prompt_length=8, max_completion_length=5, temperature=1.0)
  # Plain DPO lowers the chosen likelihood too and greedy accuracy collapses here (BENCHMARKS.md);
  # RPO's NLL term on the chosen completion (rpo_alpha) keeps it up.
  c.dpo.loss.update(loss_type='sigmoid', beta=0.1, aggregation='pair', rpo_alpha=1.0)
  c.dpo.optimizer.update(learning_rate=2e-5, max_grad_norm=1.0)
  if arg == 'smoke':
    c.dpo.update(num_steps=4, micro_batch_size=8, num_prompts=32, samples_per_prompt=4,
                 log_every=2, reference_as_chosen=True)
  return c
