"""Text <-> token rows: prompts through the chat template, left-padded prompt batches for
generation, right-padded prompt+completion rows for SFT and DPO, and completions decoded back."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxrl_ga import placement
from jaxrl_ga.config import ConfigError
from jaxrl_ga.tasks import chat


def encode(tokenizer, text: str) -> list[int]:
  return tokenizer(text, add_special_tokens=False)['input_ids']

def encode_prompt(tokenizer, text) -> list[int]:
  """A task prompt's ids: through the tokenizer's chat template when it has one (a user message
  plus the assistant generation prompt; ``jaxrl_ga.tasks.chat``), else the raw text. A list of
  chat messages goes through the template as it is."""
  try:
    return chat.prompt_ids(tokenizer, text)
  except ValueError as e:  # a message list for a tokenizer without a chat template
    raise ConfigError(str(e)) from None

def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, what: str):
  """-> tokens, mask [N, length] int32, right-aligned. Too long: ConfigError naming ``what``."""
  out = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ConfigError(f'a prompt of {len(s)} tokens exceeds {what}={length}; raise {what}.')
    if not s:
      raise ConfigError('an empty prompt: every prompt needs at least one token.')
    out[i, length - len(s):] = s
    mask[i, length - len(s):] = 1
  return out, mask


def right_padded_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                      max_length: int, pad_id: int, what: str) -> dict[str, np.ndarray]:
  """prompt + completion rows, right-padded to ``max_length``: tokens, attention_mask and
  loss_mask (1 on the completion) [N, max_length] int32, the layout of SFT and DPO batches
  (``logprobs.sequence_logps``). Too long: ConfigError naming the setting ``what``."""
  n = len(prompts)
  tokens = np.full((n, max_length), pad_id, np.int32)
  attn = np.zeros((n, max_length), np.int32)
  loss = np.zeros((n, max_length), np.int32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    if len(p) + len(c) > max_length:
      raise ConfigError(f'a sequence of {len(p) + len(c)} tokens (prompt + completion) exceeds '
                        f'{what}={max_length}; raise {what}.')
    tokens[i, :len(p) + len(c)] = list(p) + list(c)
    attn[i, :len(p) + len(c)] = 1
    loss[i, len(p):len(p) + len(c)] = 1
  return {'tokens': tokens, 'attention_mask': attn, 'loss_mask': loss}


def decode_completions(tokenizer, tokens, mask) -> list[str]:
  """Completion texts, without EOS and padding."""
  tokens, mask = placement.to_host(tokens), placement.to_host(mask)
  eos = tokenizer.eos_token_id
  out = []
  for row, m in zip(tokens, mask):
    ids = [int(t) for t, keep in zip(row, m) if keep and t != eos]
    out.append(tokenizer.decode(ids, skip_special_tokens=True))
  return out
