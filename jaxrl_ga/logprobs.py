"""Per-token log-probs (and entropies) of completion tokens from final hidden states, optionally
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


def completion_token_stats(model, h: jax.Array, targets: jax.Array, *, temperature=1.0,
                           chunk_size: int = 0, with_entropy: bool = False
                           ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Log-probs of ``targets`` under softmax(model.logits(h) / temperature), and entropies.

  Args:
    model: a ``transformer.Transformer`` (its ``logits`` projects [..., D] -> [..., V] float32).
    h: [B, T, D] hidden states of the positions that predict ``targets``.
    targets: [B, T] int token ids.
    temperature: the policy's softmax temperature.
    chunk_size: positions per chunk; 0 (or >= T) projects all T positions at once.
    with_entropy: also return the entropy of each position's distribution.

  Returns:
    (logps [B, T] float32, entropy [B, T] float32 or None).
  """
  def stats(hc, tc):
    # On [B*c] rows: with [B, c, V] logits XLA:CPU wrote the logits' gradient transposed for the
    # output projection's weight gradient (issue 15, BENCHMARKS.md); the reshapes are free.
    logits = model.logits(hc.reshape(tc.size, -1)) / temperature  # [B*c, V] float32
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
