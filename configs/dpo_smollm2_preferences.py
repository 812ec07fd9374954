r"""DPO from your preference file: SmolLM2-135M-Instruct on a correct and a wrong reply to
"What is a+b?", offline, on a CPU.

  python studies/your_data/make_preference_jsonl.py --out=/tmp/preferences
  PYTHONPATH=/tmp/preferences python -m jaxrl_ga.main \
      --config=configs/dpo_smollm2_preferences.py:/tmp/preferences --workdir=/tmp/smollm2_dpo

The argument is the directory the script wrote (preferences.jsonl, eval.jsonl,
addition_rewards.py); ``:DIR,smoke`` shrinks the run for a quick check. The same as setting, on
any config, ``--config.stages=dpo --config.dpo.pairs=dataset
--config.data.train=DIR/preferences.jsonl --config.data.eval=DIR/eval.jsonl
--config.grpo.reward_funcs=addition_rewards:correct`` with DIR on PYTHONPATH (the reward scores
the held-out evaluation only; DPO trains on the pairs).

Model, mesh and evaluation are configs/grpo_smollm2.py's (48 held-out problems, greedy). The
preference rows are chat conversations sharing their user turn (TRL's implicit prompt); through
SmolLM2's template a prompt is 43 tokens, a reply at most 11 ("3 + 4 = 7<|im_end|>\n"), so
max_length 56. Reference log-probs: the starting policy's, computed once and cached in
WORKDIR/dpo_dataset_pairs.npz. Sigmoid loss, beta 0.1, RPO's NLL term on the chosen reply
(rpo_alpha=1, as configs/dpo_arith.py), K = 2 micro-batches of 4 pairs per optimizer step.
"""

import os

from jaxrl_ga.config import ConfigError, load_config_file, unknown_config_arg

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_smollm2.py')


def get_config(arg: str = ''):
  directory, _, variant = (arg or '').partition(',')
  if not directory:
    raise ConfigError('configs/dpo_smollm2_preferences.py needs the data directory: '
                      '--config=configs/dpo_smollm2_preferences.py:/tmp/preferences (written by '
                      'studies/your_data/make_preference_jsonl.py --out=/tmp/preferences).')
  c = load_config_file(_BASE, variant)
  c.stages = 'dpo'
  c.data.update(train=os.path.join(directory, 'preferences.jsonl'),
                eval=os.path.join(directory, 'eval.jsonl'))
  c.grpo.reward_funcs = 'addition_rewards:correct'  # scores the held-out evaluation
  c.dpo.update(pairs='dataset', num_steps=20, micro_batch_size=4, grad_accum_steps=2,
               max_length=56, max_prompt_length=48, log_every=2)
  c.dpo.sampling.update(max_prompt_length=0, max_completion_length=10)  # 0: the data's longest
  c.dpo.loss.update(loss_type='sigmoid', beta=0.1, aggregation='pair', rpo_alpha=1.0)
  c.dpo.optimizer.update(learning_rate=5e-6, max_grad_norm=1.0)
  if variant == 'smoke':
    c.dpo.update(num_steps=2, micro_batch_size=2, grad_accum_steps=2, log_every=1)
  elif variant:
    raise unknown_config_arg(__file__, variant, ['', 'smoke'])
  return c
