"""Every log-prob the library computes from the model: the completion tokens' (GRPO's learner,
old and reference log-probs: ``completion_logps``), a sequence's (SFT, DPO: ``token_logps_of``,
``sequence_logps``), all of them from one forward whose options are a ``ForwardOptions``.

Per-token log-probs (and entropies) of completion tokens from final hidden states, optionally
chunked over the sequence so that the float32 ``[b, Tc, V]`` logits are never alive at once.

With ``chunk_size = c > 0`` the completion positions are processed ``c`` at a time in a
``lax.map``; each chunk's projection, log-softmax and entropy run under ``jax.checkpoint``, so
the backward pass recomputes one chunk's logits from its hidden states instead of keeping every
chunk's: the live logits are ``[b, c, V]`` (forward and backward) instead of ``[b, Tc, V]``
(about 3 copies of those in the learner without chunking: logits, softmax and the gradient).
The values are those of the unchunked computation (the same per-position arithmetic); the
output-projection gradient is summed over chunks in float32 (the projection's cast to the
compute dtype happens inside each chunk). Liger-Kernel's fused linear cross-entropy and
MaxText's vocabulary tiling do the same for pretraining.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_ga import losses
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.models.transformer import ForwardOptions


def completion_logps(model: tfm.Transformer, prompt_tokens, prompt_mask, completion_tokens,
                     completion_mask, options: ForwardOptions = ForwardOptions(), *,
                     with_entropy: bool = False, temperature=1.0
                     ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Per-token log-probs (and entropies) of the completion tokens. -> ([B, Tc] float32, entropy
  [B, Tc] or None).

  prompt_*: [B, Tp] left-padded; completion_*: [B, Tc] right-padded. Logits are projected only at
  the Tc positions that predict completion tokens, ``options.logprob_chunk_size`` positions at a
  time (``completion_token_stats``). The policy is softmax(logits / temperature), the
  distribution the sampler draws from (as in TRL), so ratios compare like with like.

  ``options.share_prompts`` = R > 1: rows ``i*R .. i*R+R-1`` hold the same prompt (R completions
  of one prompt; the caller guarantees it, ``rollout.prompt_share``), so the prompt's forward runs
  once for them (``Transformer.hidden_after_prefix``): the same values, with the prompt
  positions' work divided by R (model.share_prompt_prefix).
  """
  tp, r = prompt_tokens.shape[1], options.share_prompts
  if r > 1:
    # [B, Tp] -> [P, R, Tp] -> the first of each R rows (a local reshape under batch sharding)
    first = lambda x: x.reshape(-1, r, tp)[:, 0]
    prompt_h, h = model.hidden_after_prefix(first(prompt_tokens), first(prompt_mask),
                                            completion_tokens, completion_mask, options)
    # The prompt's last position predicts completion token 0 of each of its R rows.
    last = jnp.repeat(prompt_h[:, -1:], r, axis=0)  # [B, 1, D]
    h = jnp.concatenate([last, h[:, :-1]], axis=1)  # [B, Tc, D]
  else:
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    h = model.hidden(tokens, mask, options)[:, tp - 1:-1]  # [B, Tc, D]
  return completion_token_stats(model, h, completion_tokens, temperature=temperature,
                                chunk_size=options.logprob_chunk_size, with_entropy=with_entropy,
                                options=options)


def token_logps_of(model: tfm.Transformer, tokens, attention_mask,
                   options: ForwardOptions = ForwardOptions()) -> jax.Array:
  """[B, T] tokens -> [B, T-1] log-probs of tokens[:, 1:] under the full forward."""
  logits = model(tokens, attention_mask, options)[:, :-1]
  return losses.token_logps(logits, tokens[:, 1:])


def sequence_logps(model: tfm.Transformer, tokens, attention_mask, loss_mask,
                   options: ForwardOptions = ForwardOptions()) -> tuple[jax.Array, jax.Array]:
  """Summed log-probs of the tokens where loss_mask is 1 ([B, T] inputs). -> ([B], token counts)."""
  m = loss_mask[:, 1:].astype(jnp.float32)
  return jnp.sum(token_logps_of(model, tokens, attention_mask, options) * m, axis=-1), \
      jnp.sum(m, axis=-1)


def completion_token_stats(model, h: jax.Array, targets: jax.Array, *, temperature=1.0,
                           chunk_size: int = 0, with_entropy: bool = False,
                           options: ForwardOptions = ForwardOptions()
                           ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Log-probs of ``targets`` under softmax(model.logits(h) / temperature), and entropies.

  Args:
    model: a ``transformer.Transformer`` (its ``logits`` projects [..., D] -> [..., V] float32).
    h: [B, T, D] hidden states of the positions that predict ``targets``.
    targets: [B, T] int token ids.
    temperature: the policy's softmax temperature.
    chunk_size: positions per chunk; 0 (or >= T) projects all T positions at once.
    with_entropy: also return the entropy of each position's distribution.
    options: the forward's (``model.logits`` takes its activation_mesh).

  Returns:
    (logps [B, T] float32, entropy [B, T] float32 or None).
  """
  def stats(hc, tc):
    # On [B*c] rows: with [B, c, V] logits XLA:CPU wrote the logits' gradient transposed for the
    # output projection's weight gradient (issue 15, BENCHMARKS.md); the reshapes are free.
    logits = model.logits(hc.reshape(tc.size, -1), options) / temperature  # [B*c, V] float32
    lp = losses.token_logps(logits, tc.reshape(-1)).reshape(tc.shape)
    return lp, (losses.token_entropy(logits).reshape(tc.shape) if with_entropy else None)

  b, t = targets.shape
  if chunk_size <= 0 or chunk_size >= t:
    return stats(h, targets)
  n = math.ceil(t / chunk_size)
  pad = n * chunk_size - t
  if pad:  # the padded positions' values are computed and dropped
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  to_chunks = lambda x: jnp.swapaxes(x.reshape(b, n, chunk_size, *x.shape[2:]), 0, 1)
  body = jax.checkpoint(lambda xs: stats(*xs), prevent_cse=False)
  lp, ent = jax.lax.map(body, (to_chunks(h), to_chunks(targets)))  # [n, B, c]
  from_chunks = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, n * chunk_size)[:, :t]
  return from_chunks(lp), (from_chunks(ent) if with_entropy else None)
