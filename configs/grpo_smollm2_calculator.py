r"""Issue 44's worked example: SmolLM2-135M-Instruct learns to use a calculator for 2- and 3-digit
multiplication. An SFT warm start on tool-use conversations, then GRPO with the tool.

  bash examples/run_calculator.sh /tmp/calc     # all of it, timed, then the accuracy table

runs these (and the untrained model's evaluation, ``:DIR,base``):

  python examples/calculator.py /tmp/calc       # train.jsonl, eval.jsonl (48), sft.jsonl (64)
  export PYTHONPATH=.:examples                  # calculator:Calculator, calculator:correct
  python -m jaxrl_ga.main --config=configs/grpo_smollm2_calculator.py:/tmp/calc,sft \
      --workdir=/tmp/calc_sft
  python -m jaxrl_ga.export --checkpoint=/tmp/calc_sft/checkpoints/sft --out=/tmp/calc_sft_hf
  python -m jaxrl_ga.main --config=configs/grpo_smollm2_calculator.py:/tmp/calc,grpo \
      --workdir=/tmp/calc_grpo --config.model.hf_path=/tmp/calc_sft_hf

Two runs, because a run's ``data.train`` is one file for every stage: the SFT stage trains on
sft.jsonl's conversations (each a system turn announcing the tools in the plain
``<tool_call>`` format, the question, the call, the tool's result, the final answer;
``examples/calculator.py``), the GRPO stage on train.jsonl's questions with
``grpo.environment=calculator:Calculator`` (one ``multiply``/``add`` calculator per row, at most
2 calling turns) and the reward ``calculator:correct`` (the final assistant turn's last number is
the product). The GRPO run evaluates the 48 held-out questions (eval.jsonl, none in the training
files), greedy, scored by ``correct``, as episodes with the tool (before and after GRPO;
``eval/tools/calls_per_episode``) and single-turn (``eval/without_tools/accuracy``); the SFT
run's own evaluation is single-turn, 16 of them.

Variants: ``:DIR,sft`` and ``:DIR,grpo`` as above; ``:DIR,base`` is the GRPO run on the
untrained model with a learning rate of 1e-30 and one step (its evaluation before is the untrained
model's accuracy with the tool). The model, mesh and layer settings are configs/grpo_smollm2.py's,
the layers scanned (a shorter compile).

Measured (docs/your_data.md, "Tools and environments"; 2026-11-27, examples/run_calculator.sh
in one go on a quiet 2-core CPU VM): held-out accuracy with the tool / without: untrained 0.000 /
0.000 (0 calls per episode); after 2 SFT steps 0.396 / 0.000 (1.42 calls); after GRPO's 4 steps
on it 0.792 / 0.000 (1.02 calls): +39.6 points from GRPO, +79.2 in all (one seed). 819 s wall in
all (untrained evaluation 207 s, SFT 114 s, export 7 s, GRPO with its two evaluations 488 s),
1421 s CPU. 12 SFT steps (an earlier setting) alone reach 0.979 with the tool.
"""

import os

from jaxrl_ga.config import ConfigError, load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_smollm2.py')
_VARIANTS = ('sft', 'grpo', 'base')


def get_config(arg: str = ''):
  directory, _, variant = (arg or '').partition(',')
  if not directory or variant not in _VARIANTS:
    raise ConfigError(f'configs/grpo_smollm2_calculator.py needs the data directory and a '
                      f'variant of {_VARIANTS}: --config=configs/grpo_smollm2_calculator.py:'
                      f'/tmp/calc,sft (the directory written by examples/calculator.py).')
  c = load_config_file(_BASE)
  c.model.scan_layers = True
  c.data.update(eval=os.path.join(directory, 'eval.jsonl'))
  c.grpo.reward_funcs = 'calculator:correct'
  # "What is 988 * 893?": the call (~30 tokens), the tool turn (~12) and the SFT rows' answer
  # "988 * 893 = 882284. The answer is 882284." (~30) need 96 tokens; at 64 the final turn is
  # cut before its number (0.042 instead of 0.979 with the tool after SFT).
  # Batches of 16: the prefill of 48 prompts of ~400 tokens held GBs of logits on the CPU.
  c.eval.update(num_examples=48, batch_size=16, max_completion_length=96)
  c.checkpoint.update(every_steps=0, max_to_keep=1)
  if variant == 'sft':
    c.stages = 'sft'
    c.data.train = os.path.join(directory, 'sft.jsonl')
    # A conversation with the tools' system block is ~330-420 tokens: one per row, unpacked;
    # 8 rows per optimizer step in micro-batches of 2 (8 at once took 13 GB on the CPU; 2 peaked
    # at 8.7 GB resident, micro-batches of 1 at 10.3 GB: not the activations).
    # Two steps only: the untrained model never calls the tool (0.000 with it); a short SFT
    # leaves GRPO room to add (docs/your_data.md, "Tools and environments").
    c.sft.update(num_steps=2, micro_batch_size=2, grad_accum_steps=4, max_length=0,
                 packing=False, too_long='error', log_every=1)
    c.sft.optimizer.update(learning_rate=5e-5, max_grad_norm=1.0, warmup_steps=0)
    # Its own evaluation is single-turn (no tools announced): 16 questions, a side number; the
    # GRPO run's evaluation before is the SFT model's, with the tool and without, on all 48.
    c.eval.num_examples = 16
    return c
  c.stages = 'grpo'
  c.data.train = os.path.join(directory, 'train.jsonl')
  c.grpo.update(environment='calculator:Calculator', max_tool_calls=2, num_steps=4,
                log_every=1, eval_every=0)
  # 2 questions x 4 completions per optimizer step, one micro-batch.
  c.grpo.schedule.update(micro_batch_size=8, num_generations=4, steps_per_generation=1,
                         grad_accum_steps=1)
  # The tools' system block makes every prompt ~300 tokens.
  c.grpo.sampling.update(max_prompt_length=384, max_completion_length=96, temperature=1.0)
  c.grpo.optimizer.update(learning_rate=2e-5, max_grad_norm=1.0)
  if variant == 'base':  # examples/run_calculator.sh stops it after its first evaluation
    c.grpo.num_steps = 1
    c.grpo.optimizer.learning_rate = 1e-30  # (> 0 is required): the params do not move
  return c
