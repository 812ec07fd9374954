r"""GRPO on GSM8K on a TPU VM: Qwen2.5-0.5B-Instruct on `:v5e-8` (one host) or `:v4-32` (4 hosts),
Qwen2.5-1.5B-Instruct on `:qwen1.5b-v5e-8`, Llama-3.1-8B-Instruct on `:llama8b-v5p-8`

  python launch/tpu.py run -- python -m jaxrl_ga.main \
      --config=configs/grpo_gsm8k_tpu.py:v5e-8 --workdir=$HOME/runs/gsm8k
  python -m jaxrl_ga.explain --config=configs/grpo_gsm8k_tpu.py:v5e-8 --num_devices=8
  python -m jaxrl_ga.plan --config=configs/grpo_gsm8k_tpu.py:v5e-8 --topology=v5e:2x4

The policy and its tokenizer come from the hub (`Qwen/Qwen2.5-0.5B-Instruct`, or a local HF
directory via --config.model.hf_path), GSM8K from the hub (`openai/gsm8k`, needs the [data]
extra) or a local JSONL file (--config.task.options.source=/path/train.jsonl). Stage: GRPO only
(the instruct model needs no SFT warm start). Rewards: 'correct' (the number after `####`) and
'format'. Held-out accuracy: greedy, on the whole GSM8K test split (1319 problems), before,
every 100 steps, and after. Other math rows instead of GSM8K: --config.data.train=/path/rows.jsonl
(a `prompt` column, a string or chat messages, and an `answer` column holding the number or a
solution ending in `#### <number>`; --config.data.columns=question:prompt renames) with
--config.grpo.reward_funcs=final_answer,answer_format=0.1 (jaxrl_ga/data.py, jaxrl_ga/rewards.py).

Schedule (global counts; docs/schedule.md): G = 8 completions per prompt, and K/S = 3/2 as in TRL
issue #5770, so every optimizer-step window of K micro-steps spans two rollouts, and only the
slices that a newer policy trains pay for old log-probs (the slice rule):

  arg             chips  mesh (data, fsdp)  B   S  K   per micro-step  per rollout   per opt step
  v5e-8           8      (2, 4)             32  4  6   4 seqs/chip     128 = 16 pr.  192 = 24 pr.
  v4-32           16     (4, 4)             64  4  6   4 seqs/chip     256 = 32 pr.  384 = 48 pr.
  qwen1.5b-v5e-8  8      (1, 8)             16  8  12  2 seqs/chip     128 = 16 pr.  192 = 24 pr.
  llama8b-v5p-8   4      (1, 4)             16  8  12  4 seqs/chip     128 = 16 pr.  192 = 24 pr.
  lora-llama8b-v5e-8   8 (1, 1, tensor 8) 16  8  12  16 seqs, tp     128 = 16 pr.  192 = 24 pr.
  lora-llama1b-v5e-1   1 (1, 1)           8   8  12  8 seqs/chip     64 = 8 pr.    96 = 12 pr.

(v4-32: 32 TensorCores = 16 chips; each megacore chip is one jax device, so 16 devices on 4
hosts.) `num_steps` covers about one epoch of GSM8K's 7473 training problems. Params are sharded
over fsdp within a group of 4 chips and replicated over data: for a 0.5B model a larger fsdp
would save little memory and make every decode step all-gather over more chips.

Precision: params (and so AdamW's moments, which take the params' dtype) are float32 master
weights; compute is bfloat16 (`model.dtype`), logits and log-softmax float32. bfloat16 params are
not used on purpose: bfloat16 spaces weights of magnitude 0.02 by 2**-13 ~ 1.2e-4, so an AdamW
update of ~learning_rate = 1e-6 rounds to zero and the policy never moves (set
--config.model.param_dtype=bfloat16 only together with a much larger learning rate).

Memory per chip, from the TPU compiler (python -m jaxrl_ga.plan, which compiles the rollout and
learner steps for the topology without a TPU; docs/scaling.md, "Will it fit?"): peak GiB per chip.

  arg             topology   learner (B)        rollout     HBM
  v5e-8           v5e:2x4    4.19 (32)          2.32        16 GiB
  qwen1.5b-v5e-8  v5e:2x4    5.92 (16)          5.41        16 GiB
  llama8b-v5p-8   v5p:2x2x1  45.10 (16)         19.76       95 GiB
  lora-llama8b-v5e-8  v5e:2x4  8.84 (16)     4.94        16 GiB
  lora-llama1b-v5e-1  v5e:1x1  5.51 (8)      8.02        16 GiB

The lora-* args train LoRA adapters (model.lora: rank 64, alpha 64, every projection; float32
adapters and AdamW state) on a frozen bfloat16 base (model.param_dtype=bfloat16), lr 1e-5:
Llama-3.1-8B-Instruct on a v5e-8 with tensor parallelism (mesh.tensor=8; with
--config.mesh.fsdp=8 --config.mesh.tensor=1 the rollout fits too since the decode step gathers one
layer's weights at a time: 7.78 GiB per chip per plan, 15.65 GiB before), Llama-3.2-1B-Instruct
on one v5e chip.

All use model.remat=full and model.logprob_chunk_size=128. Without them the v5e-8 learner at
B = 32 needs 16.49 GiB (temporaries 14.64 GiB: every layer's activations kept for the backward,
and the float32 [b, 512, 151936] logits); with remat=full alone 4.35 GiB, with the chunking alone
15.95 GiB. Activations are sharded over data x fsdp (the model's activation constraints); before
that, the compiler rejected even B = 16 (17.16 GB of temporaries). If memory runs out, halve B
and double K and S: each optimizer step then sees the same completions and, accumulation being
exact, applies the same update.

Prompts: max_prompt_length = 320 tokens holds the prompt template plus a GSM8K question (they
are short: typically well under 200 tokens); a longer one stops the run with an error naming
grpo.sampling.max_prompt_length. Completions: up to 512 tokens.

Multi-host (v4-32): every host runs the same command (`launch/tpu.py run`, --worker=all); the
checkpoint directory must be one that all hosts share (gs://...), see docs/scaling.md.
`--config=configs/grpo_gsm8k_tpu.py:v5e-8` is the default when no argument is given.
"""

from jaxrl_ga.config import default_config_dict, set_task, unknown_config_arg

# model -> (hub id, its config.json in ModelSpec's names). The shapes are for
# python -m jaxrl_ga.plan, which reads no hub; training takes them from the checkpoint itself.
MODELS = {
    'qwen2.5-0.5b': ('Qwen/Qwen2.5-0.5B-Instruct', dict(
        architecture='qwen2', vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=True,
        max_position_embeddings=32768)),
    'qwen2.5-1.5b': ('Qwen/Qwen2.5-1.5B-Instruct', dict(
        architecture='qwen2', vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=True,
        max_position_embeddings=32768)),
    # rope_scaling (llama3, factor 8) changes no shape; the checkpoint's config carries it.
    'llama3.1-8b': ('meta-llama/Llama-3.1-8B-Instruct', dict(
        architecture='llama', vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False,
        max_position_embeddings=131072)),
    'llama3.2-1b': ('meta-llama/Llama-3.2-1B-Instruct', dict(
        architecture='llama', vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=True,
        max_position_embeddings=131072)),
}

# arg -> (model, mesh data, mesh fsdp, B, S, K, num_steps, remat, logprob_chunk_size)
_SHAPES = {
    'v5e-8': ('qwen2.5-0.5b', 2, 4, 32, 4, 6, 300, 'full', 128),
    'v4-32': ('qwen2.5-0.5b', 4, 4, 64, 4, 6, 150, 'full', 128),
    'qwen1.5b-v5e-8': ('qwen2.5-1.5b', 1, 8, 16, 8, 12, 300, 'full', 128),
    'llama8b-v5p-8': ('llama3.1-8b', 1, 4, 16, 8, 12, 300, 'full', 128),
    # LoRA (model.lora): the base weights frozen in bfloat16, rank-64 adapters on every
    # projection trained in float32 (docs/lora.md).
    'lora-llama8b-v5e-8': ('llama3.1-8b', 1, 1, 16, 8, 12, 300, 'full', 128),  # tensor=8
    'lora-llama1b-v5e-1': ('llama3.2-1b', 1, 1, 8, 8, 12, 300, 'full', 128),
}
LORA = dict(rank=64, alpha=64.0, targets='q,k,v,o,gate,up,down')


def get_config(arg: str = 'v5e-8'):
  arg = arg or 'v5e-8'
  if arg not in _SHAPES:
    raise unknown_config_arg(__file__, arg, list(_SHAPES))
  model, data, fsdp, b, s, k, num_steps, remat, chunk = _SHAPES[arg]
  hf_path, shapes = MODELS[model]
  c = default_config_dict()
  c.seed = 0
  c.stages = 'grpo'
  set_task(c, 'gsm8k')  # options: jaxrl_ga.tasks.GSM8KConfig (defaults: openai/gsm8k, main)
  c.model.update(hf_path=hf_path, dtype='bfloat16', param_dtype='float32', remat=remat,
                 logprob_chunk_size=chunk, **shapes)
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
  if arg.startswith('lora-'):
    c.model.lora.update(**LORA)
    c.model.param_dtype = 'bfloat16'  # the frozen base; adapters and AdamW stay float32
    c.grpo.optimizer.learning_rate = 1e-5
    c.eval.batch_size = 64
    if model == 'llama3.1-8b':
      # Tensor parallelism (mesh.fsdp=8 fits too: the decode step gathers one layer's weights
      # at a time, transformer._gather_layer).
      c.mesh.update(fsdp=1, tensor=8)
      c.grpo.sampling.rollout_micro_batch_size = 32
  c.checkpoint.update(every_steps=25, max_to_keep=2)
  return c
