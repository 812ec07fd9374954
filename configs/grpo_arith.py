r"""The CPU default: SFT warm start, then GRPO, on 2-digit addition with a tiny Qwen2 model.

  python -m jaxrl_ga.main --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith

A tiny Qwen2-architecture model is trained from scratch on a character tokenizer (saved to
WORKDIR/tokenizer). SFT stops once greedy accuracy on a probe set of training problems reaches
40% (sft.target_accuracy), held-out accuracy still in the middle; GRPO with
exact-match and format rewards then raises it. The schedule is deliberately non-aligned
(K=3, S=2: a window spans two rollouts), so the static table matters:
  python -m jaxrl_ga.explain --config=configs/grpo_arith.py

Every field of jaxrl_ga.config.RunConfig exists here (the file starts from its defaults) and can
be overridden, e.g. --config.grpo.schedule.grad_accum_steps=4.
`--config=configs/grpo_arith.py:smoke` shrinks everything for a test run.
"""

from jaxrl_ga.config import default_config_dict, set_task, unknown_config_arg


def get_config(arg: str = ''):
  c = default_config_dict()
  c.seed = 0
  c.stages = 'sft,grpo'
  set_task(c, 'arithmetic', num_digits=2, operations='+', reverse_answer=True, num_eval=500)
  c.model.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
  # Two layers: unrolled, the learner's forward + backward is ~13% faster on CPU than scanned.
  c.model.scan_layers = False
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  # SFT stops once greedy accuracy on 200 training problems reaches 40% (checked every 25
  # steps), so GRPO starts in the middle whatever the seed; at most 800 steps.
  c.sft.update(num_steps=800, micro_batch_size=64, grad_accum_steps=2, max_length=12,
               log_every=50, target_accuracy=0.4, probe_every=25)
  c.sft.optimizer.update(learning_rate=1e-3, max_grad_norm=1.0)
  c.grpo.update(num_steps=200, log_every=10, eval_every=50)
  c.grpo.schedule.update(micro_batch_size=64, num_generations=8, steps_per_generation=2,
                         num_iterations=1, grad_accum_steps=3)
  c.grpo.sampling.update(max_prompt_length=8, max_completion_length=5, temperature=1.0)
  c.grpo.loss.update(aggregation='token', beta=0.0, epsilon_low=0.2, epsilon_high=0.28)
  c.grpo.advantage.update(scale_rewards='group')
  c.grpo.optimizer.update(learning_rate=1e-4, max_grad_norm=1.0)
  c.eval.update(num_examples=500, batch_size=100, max_completion_length=5)
  c.checkpoint.update(every_steps=50, max_to_keep=2)
  if arg == 'smoke':
    c.model.update(hidden_size=32, intermediate_size=64)
    c.sft.update(num_steps=4, micro_batch_size=16, grad_accum_steps=1, log_every=2,
                 target_accuracy=0.0)
    c.grpo.update(num_steps=4, log_every=2, eval_every=0)
    c.grpo.schedule.update(micro_batch_size=8, num_generations=4)
    c.eval.update(num_examples=16, batch_size=16)
    c.checkpoint.update(every_steps=2)
  elif arg:
    raise unknown_config_arg(__file__, arg, ['', 'smoke'])
  return c
