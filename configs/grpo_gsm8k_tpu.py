r"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct on a TPU VM: `:v5e-8` (one host) or `:v4-32` (4 hosts)

  python launch/tpu.py run -- python -m jaxrl_ga.main \
      --config=configs/grpo_gsm8k_tpu.py:v5e-8 --workdir=$HOME/runs/gsm8k
  python -m jaxrl_ga.explain --config=configs/grpo_gsm8k_tpu.py:v5e-8 --num_devices=8

The policy and its tokenizer come from the hub (`Qwen/Qwen2.5-0.5B-Instruct`, or a local HF
directory via --config.model.hf_path), GSM8K from the hub (`openai/gsm8k`, needs the [data]
extra) or a local JSONL file (--config.task.options.source=/path/train.jsonl). Stage: GRPO only
(the instruct model needs no SFT warm start). Rewards: 'correct' (the number after `####`) and
'format'. Held-out accuracy: greedy, on the whole GSM8K test split (1319 problems), before,
every 100 steps, and after.

Schedule (global counts; see README): G = 8 completions per prompt, and K/S = 3/2 as in TRL
issue #5770, so every optimizer-step window of K micro-steps spans two rollouts, and only the
slices that a newer policy trains pay for old log-probs (the slice rule):

  arg     chips  mesh (data, fsdp)  B   S  K   per micro-step  per rollout        per opt step
  v5e-8   8      (2, 4)             16  8  12  2 seqs/chip     128 = 16 prompts   192 = 24 prompts
  v4-32   16     (4, 4)             64  4  6   4 seqs/chip     256 = 32 prompts   384 = 48 prompts

(v4-32: 32 TensorCores = 16 chips; each megacore chip is one jax device, so 16 devices on 4
hosts.) `num_steps` covers about one epoch of GSM8K's 7473 training problems. Params are sharded
over fsdp within a group of 4 chips and replicated over data: for a 0.5B model a larger fsdp
would save little memory and make every decode step all-gather over more chips.

Precision: params (and so AdamW's moments, which take the params' dtype) are float32 master
weights; compute is bfloat16 (`model.dtype`), logits and log-softmax float32. bfloat16 params are
not used on purpose: bfloat16 spaces weights of magnitude 0.02 by 2**-13 ~ 1.2e-4, so an AdamW
update of ~learning_rate = 1e-6 rounds to zero and the policy never moves (set
--config.model.param_dtype=bfloat16 only together with a much larger learning rate).

Memory per chip, estimated (P = 494M params; L = 24 layers, D = 896, F = 4864, 14 query / 2 KV
heads of 64, V = 151936; T = Tp + Tc = 320 + 512 = 832; b = sequences per chip per micro-step):

  item                                              formula                  v5e-8     v4-32
  params f32 + AdamW mu, nu f32 + f32 accumulator   16 B * P / fsdp          1.98 GB   1.98 GB
  gradient of one micro-step (f32)                  4 B * P / fsdp           0.49 GB   0.49 GB
  all-gathered bf16 embedding (= tied lm head)      2 B * V * D              0.27 GB   0.27 GB
  rollout KV cache, all S*B/dp = 16 rows at once    L*2*2*64*2 B * T = 10.2 MB/row
                                                                             0.16 GB   0.16 GB
  learner activations kept for backward, no remat   ~94 MB/seq/layer * L * b  4.5 GB    9.1 GB
    (per seq and layer: f32 attention logits + bf16 probs 14*T*T*6 B = 58 MB, MLP gate/up/
    product 3*F*T*2 B = 24 MB, ~8 D-wide bf16 tensors 12 MB)
  same with per-layer remat (h saved per layer,     (L*D*T*2 B + 94 MB) * b   0.26 GB   0.52 GB
    one layer recomputed; not implemented yet)
  completion logits: forward, log-softmax, grad     3 * Tc*V*4 B * b          1.9 GB    3.7 GB
  total (no remat)                                                           ~9 GB     ~16 GB
  HBM per chip                                                               16 GiB    32 GiB

Transients of the rollout step are smaller (prefill attention logits of 16 rows: 0.24 GB per
layer; one decode step's logits: 10 MB). B = 32 on v5e-8 (b = 4) would need ~15.5 GB of the
16 GiB: too close without remat. If memory runs out, halve B and double K and S: each optimizer
step then sees the same completions and, accumulation being exact, applies the same update. A
0.5B policy could also run without fsdp (data = all chips): ~10 GB of replicated state per chip,
which fits on v4 (32 GiB) but leaves v5e too little for the activations.

Prompts: max_prompt_length = 320 tokens holds the prompt template plus a GSM8K question (they
are short: typically well under 200 tokens); a longer one stops the run with an error naming
grpo.sampling.max_prompt_length. Completions: up to 512 tokens.

Multi-host (v4-32): every host runs the same command (`launch/tpu.py run`, --worker=all); the
checkpoint directory must be one that all hosts share (gs://...), see the README, "Scaling out".
`--config=configs/grpo_gsm8k_tpu.py:v5e-8` is the default when no argument is given.
"""

from jaxrl_ga.config import default_config_dict

# Qwen/Qwen2.5-0.5B-Instruct's config.json, in ModelSpec's names.
QWEN25_05B = dict(architecture='qwen2', vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=True,
                  max_position_embeddings=32768)

# arg -> (mesh data, mesh fsdp, B, S, K, num_steps)
_SHAPES = {
    'v5e-8': (2, 4, 16, 8, 12, 300),
    'v4-32': (4, 4, 64, 4, 6, 150),
}


def get_config(arg: str = 'v5e-8'):
  arg = arg or 'v5e-8'
  if arg not in _SHAPES:
    raise ValueError(f'unknown config argument {arg!r}; use one of {", ".join(_SHAPES)} '
                     f'(e.g. --config=configs/grpo_gsm8k_tpu.py:v4-32).')
  data, fsdp, b, s, k, num_steps = _SHAPES[arg]
  c = default_config_dict()
  c.seed = 0
  c.stages = 'grpo'
  c.task.name = 'gsm8k'  # options: jaxrl_ga.tasks.GSM8KConfig (defaults: openai/gsm8k, main)
  c.model.update(hf_path='Qwen/Qwen2.5-0.5B-Instruct', dtype='bfloat16', param_dtype='float32')
  # The checkpoint's shapes (its config.json), for python -m jaxrl_ga.plan, which reads no hub;
  # training takes them from the checkpoint itself.
  c.model.update(QWEN25_05B)
  c.mesh.update(data=data, fsdp=fsdp, tensor=1)
  c.grpo.update(num_steps=num_steps, log_every=1, eval_every=100)
  c.grpo.schedule.update(micro_batch_size=b, num_generations=8, steps_per_generation=s,
                         num_iterations=1, grad_accum_steps=k)
  c.grpo.sampling.update(max_prompt_length=320, max_completion_length=512, temperature=1.0,
                         top_k=0, top_p=1.0, rollout_micro_batch_size=0,
                         old_logprob_source='recompute')
  c.grpo.loss.update(aggregation='token', beta=0.0, epsilon_low=0.2, epsilon_high=0.28)
  c.grpo.advantage.update(scale_rewards='group', mask_truncated_completions=False)
  c.grpo.optimizer.update(learning_rate=1e-6, lr_schedule='constant', warmup_steps=0,
                          weight_decay=0.0, max_grad_norm=1.0)
  c.eval.update(num_examples=0, batch_size=128, max_completion_length=512)
  c.checkpoint.update(every_steps=25, max_to_keep=2)
  return c
