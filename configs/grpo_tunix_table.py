r"""GRPO on GSM8K with 4 generations for the models and slices of Tunix's minimum-hardware table
(Qwen3-0.6B on v5e-1; Gemma2-2B and Llama3.2-1B on v5e-4; Gemma-7B, Llama3.1-8B and Qwen3-14B on
v5p-2), with the nearest Qwen3 / Gemma 3 / Llama 3.x sizes: one sub-config per row.

  python -m jaxrl_ga.plan --config=configs/grpo_tunix_table.py:qwen3-0.6b-v5e-1 --topology=v5e:1x1 --format=json

  arg                  model (hub id)                   mode   topology    mesh (data, fsdp)  B  S  K
  qwen3-0.6b-v5e-1     Qwen/Qwen3-0.6B                  full   v5e:1x1     (1, 1)             4  2  8
  gemma3-1b-v5e-4      google/gemma-3-1b-it             full   v5e:2x2     (1, 4)             16 2  4
  llama3.2-1b-v5e-4    meta-llama/Llama-3.2-1B-Instruct full   v5e:2x2     (1, 4)             16 2  4
  gemma3-4b-v5p-2      google/gemma-3-4b-it (text)      LoRA   v5p:1x1x1   (1, 1)             8  2  4
  llama3.1-8b-v5p-2    meta-llama/Llama-3.1-8B-Instruct LoRA   v5p:1x1x1   (1, 1)             8  2  4
  qwen3-14b-v5p-2      Qwen/Qwen3-14B                   LoRA   v5p:1x1x1   (1, 1)             8  2  4

(v5p-2: two TensorCores, one megacore chip, one jax device.) Gemma 3 1B stands for Tunix's
Gemma2-2B, Gemma 3 4B (its text layers, Gemma3ForCausalLM) for Gemma-7B. Everything else is
``configs/grpo_gsm8k_tpu.py``'s (prompts 320, completions 512, bfloat16 compute, float32 params
and AdamW for full fine-tuning, remat=full, log-prob chunks of 128); LoRA rows: rank 64 on every
projection over a frozen bfloat16 base, as its lora-* args. The plans' numbers are in
docs/models.md ("Tunix's hardware table").
"""

import os

from jaxrl_ga.config import load_config_file, unknown_config_arg

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'grpo_gsm8k_tpu.py')


def _gemma3_layers(n: int, pattern: int = 6) -> str:
  """Gemma 3's layer_types: every ``pattern``-th layer global, the others sliding."""
  return ','.join('full_attention' if (i + 1) % pattern == 0 else 'sliding_attention'
                  for i in range(n))


# HF config.json shapes in ModelSpec's names (plan reads no hub; training takes the checkpoint's).
MODELS = {
    'qwen3-0.6b': ('Qwen/Qwen3-0.6B', dict(
        architecture='qwen3', vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=True,
        max_position_embeddings=40960)),
    'qwen3-14b': ('Qwen/Qwen3-14B', dict(
        architecture='qwen3', vocab_size=151936, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False,
        max_position_embeddings=40960)),
    'gemma3-1b': ('google/gemma-3-1b-it', dict(
        architecture='gemma3', vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        rope_theta=1000000.0, rope_local_theta=10000.0, query_pre_attn_scalar=256.0,
        sliding_window=512, layer_types=_gemma3_layers(26), attention_bias=False,
        tie_word_embeddings=True, max_position_embeddings=32768)),
    'gemma3-4b': ('google/gemma-3-4b-it', dict(
        architecture='gemma3', vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        rope_theta=1000000.0, rope_local_theta=10000.0, query_pre_attn_scalar=256.0,
        sliding_window=1024, layer_types=_gemma3_layers(34), attention_bias=False,
        tie_word_embeddings=True, max_position_embeddings=131072)),
}

# arg -> (model, mesh fsdp, B, S, K, LoRA)
_ROWS = {
    'qwen3-0.6b-v5e-1': ('qwen3-0.6b', 1, 4, 2, 8, False),
    'gemma3-1b-v5e-4': ('gemma3-1b', 4, 16, 2, 4, False),
    'llama3.2-1b-v5e-4': ('llama3.2-1b', 4, 16, 2, 4, False),
    'gemma3-4b-v5p-2': ('gemma3-4b', 1, 8, 2, 4, True),
    'llama3.1-8b-v5p-2': ('llama3.1-8b', 1, 8, 2, 4, True),
    'qwen3-14b-v5p-2': ('qwen3-14b', 1, 8, 2, 4, True),
}


def get_config(arg: str = 'qwen3-0.6b-v5e-1'):
  arg = arg or 'qwen3-0.6b-v5e-1'
  if arg not in _ROWS:
    raise unknown_config_arg(__file__, arg, list(_ROWS))
  model, fsdp, b, s, k, lora = _ROWS[arg]
  c = load_config_file(_BASE, 'lora-llama1b-v5e-1' if lora else 'v5e-8')
  if model in MODELS:
    hf_path, shapes = MODELS[model]
  else:  # the base config's Llama entries
    base = load_config_file(_BASE, 'lora-llama1b-v5e-1' if model == 'llama3.2-1b'
                            else 'lora-llama8b-v5e-8').model
    hf_path = base.hf_path
    shapes = {k: base[k] for k in ('architecture', 'vocab_size', 'hidden_size',
                                   'intermediate_size', 'num_hidden_layers',
                                   'num_attention_heads', 'num_key_value_heads', 'head_dim',
                                   'rope_theta', 'attention_bias', 'tie_word_embeddings',
                                   'max_position_embeddings')}
  c.model.update(hf_path=hf_path, **shapes)
  c.mesh.update(data=1, fsdp=fsdp, tensor=1)
  c.grpo.schedule.update(micro_batch_size=b, num_generations=4, steps_per_generation=s,
                         grad_accum_steps=k)
  c.grpo.sampling.rollout_micro_batch_size = 0
  return c
