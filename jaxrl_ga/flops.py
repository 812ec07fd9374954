"""The FLOP model of a decoder (Qwen2 / Llama layout): one count for ``jaxrl_ga.plan`` and the
benchmarks (``benchmarks/machine.py``), of what the programs built by ``jaxrl_ga.programs`` run.

Matmuls only (projections, attention products over the full masked matrix, the output projection,
the LoRA adapters); elementwise work (softmax, norms, activations) is not counted. Every function
takes a ``transformer.ModelConfig`` ``m`` (its ``lora`` included) and, for the training forward, the
run's ``ForwardOptions``: the rows that share a prompt's forward (``share_prompts``), the layers'
remat and the log-prob chunk, as the programs run them. tests/test_plan.py checks the counts
against the TPU compiler's on a compile with the layers unrolled.
"""

from __future__ import annotations

import dataclasses

from jaxrl_ga.models.transformer import ForwardOptions


def layer_matmul_params(m) -> int:
  """Weights of one layer's seven projections (q, k, v, o, gate, up, down)."""
  dq, dkv = m.num_attention_heads * m.head_size, m.num_key_value_heads * m.head_size
  return m.hidden_size * (dq + 2 * dkv) + dq * m.hidden_size + 3 * m.hidden_size * \
      m.intermediate_size


def decode_matmul_params(m) -> int:
  """Weights a decode step multiplies by: every layer's projections and the output projection
  (norms and the one embedding row gathered per token are negligible)."""
  return m.num_hidden_layers * layer_matmul_params(m) + m.hidden_size * m.vocab_size


def param_count(m) -> int:
  """The base model's params (adapters not included)."""
  d, v = m.hidden_size, m.vocab_size
  q_dim, kv_dim = m.num_attention_heads * m.head_size, m.num_key_value_heads * m.head_size
  layer = layer_matmul_params(m) + 2 * d + (q_dim + 2 * kv_dim if m.attention_bias else 0)
  family = m.family  # its extra norms: q/k per head, after attention and MLP
  layer += (2 * m.head_size if family.qk_norm else 0) + (2 * d if family.post_norms else 0)
  return m.num_hidden_layers * layer + v * d * (1 if m.tie_word_embeddings else 2) + d


def lora_params_per_layer(m) -> int:
  """The LoRA adapters' params of one layer (0 without adapters)."""
  r = m.lora.rank
  if not r:
    return 0
  d, f = m.hidden_size, m.intermediate_size
  q_dim, kv_dim = m.num_attention_heads * m.head_size, m.num_key_value_heads * m.head_size
  sizes = {'q': d + q_dim, 'k': d + kv_dim, 'v': d + kv_dim, 'o': q_dim + d, 'gate': d + f,
           'up': d + f, 'down': f + d}
  return sum(r * sizes[t] for t in m.lora.targets)


def forward_flops(m, rows: int, length: int, logit_positions: int, context: int = 0) -> dict:
  """Matmul FLOPs of one forward over ``rows`` sequences of ``length`` tokens, the output
  projection at ``logit_positions`` positions per row: the projections 2 x params x tokens, the
  output projection 2 x d x V x rows x logit_positions, attention 4 x L x rows x length x
  (context + length) x (heads * head_dim) (the score and value products over the full, masked
  matrix; ``context``: keys of a prefix computed elsewhere, a shared prompt's or a KV cache's,
  that every position also attends to), the adapters 2 x their params x tokens."""
  tokens = rows * length
  dq = m.num_attention_heads * m.head_size
  out = {'projections': 2 * m.num_hidden_layers * layer_matmul_params(m) * tokens,
         'lm_head': 2 * m.hidden_size * m.vocab_size * rows * logit_positions,
         'attention': 4 * m.num_hidden_layers * tokens * (context + length) * dq,
         'lora': 2 * m.num_hidden_layers * lora_params_per_layer(m) * tokens}
  out['total'] = sum(out.values())
  return out


def _add(*parts: dict) -> dict:
  return {k: sum(p[k] for p in parts) for k in parts[0]}


def prompt_completion_forward_flops(m, rows: int, prompt_length: int, completion_length: int,
                                    share: int = 1) -> dict:
  """``forward_flops`` of ``rows`` prompt + completion sequences, logits at the completion
  positions (``logprobs.completion_logps``). ``share`` = R > 1: every R rows share their prompt,
  whose forward runs once for them (model.share_prompt_prefix): rows / R prompts, then the
  completions attending to their prompt and themselves."""
  if share == 1:
    return forward_flops(m, rows, prompt_length + completion_length, completion_length)
  return _add(forward_flops(m, rows // share, prompt_length, 0),
              forward_flops(m, rows, completion_length, completion_length, prompt_length))


def learner_flops(m, rows: int, prompt_length: int, completion_length: int,
                  options: ForwardOptions = ForwardOptions()) -> dict:
  """One GRPO learner micro-step over ``rows`` sequences as ``options`` run it. -> {'model': the
  forward and a backward of twice its matmuls (the input and the weight gradient of every
  product); with LoRA the frozen weights get no weight gradient: their matmuls once more for the
  input gradients, the weightless attention products and the adapters still twice, 'executed':
  'model' plus what remat and log-prob chunking recompute, 'forward': the forward alone,
  'forward_parts': its ``forward_flops`` parts}."""
  f = prompt_completion_forward_flops(m, rows, prompt_length, completion_length,
                                      options.share_prompts)
  if m.lora.rank:
    model = 2 * f['total'] + f['attention'] + f['lora']
  else:
    model = 3 * f['total']
  extra = 0
  if options.remat == 'full':
    extra += f['total'] - f['lm_head']  # every layer's forward again
  elif options.remat == 'save_dots':
    extra += f['attention']  # the batched attention products are not saved
  if 0 < options.logprob_chunk_size < completion_length:
    extra += f['lm_head']  # each chunk's logits again in the backward
  return {'model': model, 'executed': model + extra, 'forward': f['total'], 'forward_parts': f}


def generation_flops(m, rows: int, prompt_length: int, completion_length: int,
                     share: int = 1) -> float:
  """Sampling ``rows`` completions: the prefill of rows / ``share`` prompts (each prompt once for
  its ``share`` rows), then ``completion_length - 1`` decode steps over a cache of
  prompt + completion - 1 slots (the full masked cache)."""
  cache = prompt_length + completion_length - 1
  prefill = forward_flops(m, rows // share, prompt_length, 1, cache - prompt_length)
  step = forward_flops(m, rows, 1, 1, cache - 1)
  return prefill['total'] + (completion_length - 1) * step['total']


def rollout_flops(m, rows: int, prompt_length: int, completion_length: int, *,
                  generation_share: int = 1, old_logp_rows: int = 0, old_logp_share: int = 1,
                  ref_rows: int = 0, ref_share: int = 1) -> float:
  """A GRPO rollout (and its deferred old log-probs, if any): generation of ``rows``
  completions, the old-log-prob forward of ``old_logp_rows`` of them and the reference forward of
  ``ref_rows``, each with its rows sharing prompts as the engine runs them
  (``RolloutEngine.gen_share``, ``micro_batch_share``, ``share_prompts``)."""
  fwd = lambda m, n, r: prompt_completion_forward_flops(m, n, prompt_length, completion_length,
                                                        r)['total'] if n else 0.0
  base = dataclasses.replace(m, lora=type(m.lora)())  # the reference: adapters off
  return (generation_flops(m, rows, prompt_length, completion_length, generation_share)
          + fwd(m, old_logp_rows, old_logp_share) + fwd(base, ref_rows, ref_share))
