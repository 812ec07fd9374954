"""Text <-> token rows: prompts through the chat template, left-padded prompt batches for
generation, right-padded (and packed) rows for SFT and DPO, and completions decoded back."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from jaxrl_ga import placement
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import chat


def encode(tokenizer, text: str) -> list[int]:
  """``text``'s token ids, no special tokens added."""
  return list(tokenizer(text, add_special_tokens=False)['input_ids'])


def encode_ending(tokenizer, text: str, eos_id: int) -> list[int]:
  """``encode`` of a reply or document that ends the sequence, with ``eos_id`` after it unless
  it already ends with it (the text ends with the EOS token's text, which the tokenizer reads
  as that token): TRL 1.16 appends the EOS text only where it is missing (sft_trainer.py and
  dpo_trainer.py, ``add_eos``), so a row is never trained on EOS -> EOS."""
  ids = encode(tokenizer, text)
  return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def stop_tuple(stops: Union[int, Sequence[int]]) -> tuple[int, ...]:
  """``stops`` as a tuple: an int is the tokenizer's eos alone; a sequence is the tokenizer's eos
  first, then the generation config's other eos ids (``policy.stop_ids``)."""
  return (int(stops),) if isinstance(stops, (int, np.integer)) else tuple(int(s) for s in stops)


def encode_reply(tokenizer, prompt, completion: str, stops: Union[int, Sequence[int]]
                 ) -> list[int]:
  """A string completion's ids as the reply to ``prompt`` (SFT's and DPO's reference replies).

  Where the prompt goes through the chat template (``chat.templated``): the assistant turn the
  template writes after the prompt (``completion`` as one assistant message; the template may
  add around it, e.g. Qwen3's empty reasoning block) up to and including the first of ``stops``
  in it: the token the model ends its turn with, where sampling stops (Gemma 3's
  ``<end_of_turn>``, not the tokenizer's ``<eos>``; ChatML's ``<|im_end|>``, the eos). Otherwise
  (no template, a template that writes no stop id, or one that renders the prompt differently
  inside the conversation): :func:`encode_ending`, the completion and the eos (``stops[0]``)."""
  stops = stop_tuple(stops)
  if chat.templated(tokenizer, prompt):
    messages = ([{'role': 'user', 'content': prompt}] if isinstance(prompt, str)
                else [dict(m) for m in prompt])
    head = chat.prompt_text(tokenizer, prompt)
    whole = tokenizer.apply_chat_template(
        messages + [{'role': 'assistant', 'content': completion}], tokenize=False)
    if whole.startswith(head):
      ids = encode(tokenizer, whole[len(head):])
      end = next((i for i, t in enumerate(ids) if t in stops), None)
      if end is not None:
        return ids[:end + 1]
  return encode_ending(tokenizer, completion, stops[0])


def encode_prompt(tokenizer, text) -> list[int]:
  """A task prompt's ids: through the tokenizer's chat template when it has one (a user message
  plus the assistant generation prompt; ``jaxrl_ga.tasks.chat``), else the raw text. A list of
  chat messages goes through the template as it is (without one: ConfigError)."""
  return chat.prompt_ids(tokenizer, text)

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
  for p, c in zip(prompts, completions):
    if len(p) + len(c) > max_length:
      raise ConfigError(f'a sequence of {len(p) + len(c)} tokens (prompt + completion) exceeds '
                        f'{what}={max_length}; raise {what}.')
  return padded_rows([(list(p) + list(c), [0] * len(p) + [1] * len(c))
                      for p, c in zip(prompts, completions)], max_length, pad_id)


def padded_rows(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], length: int,
                pad_id: int) -> dict[str, np.ndarray]:
  """One (ids, loss mask) sequence per row, right-padded: tokens, attention_mask (0/1),
  loss_mask [N, length] int32."""
  return pack([[s] for s in sequences], length, pad_id)


def pack(rows: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], length: int,
         pad_id: int) -> dict[str, np.ndarray]:
  """Rows of (ids, loss mask) sequences placed one after another: tokens, attention_mask
  (segment ids 1, 2, ...; 0 padding) and loss_mask [len(rows), length] int32, each sequence's
  first token's loss mask 0 (nothing of its own predicts it; ``logprobs.sequence_logps``)."""
  n = len(rows)
  out = {k: np.zeros((n, length), np.int32) for k in ('tokens', 'attention_mask', 'loss_mask')}
  out['tokens'][:] = pad_id
  for r, row in enumerate(rows):
    at = 0
    for segment, (ids, mask) in enumerate(row, 1):
      end = at + len(ids)
      if end > length:
        raise ValueError(f'packed row {r}: {end} tokens exceed {length}.')
      out['tokens'][r, at:end] = ids
      out['attention_mask'][r, at:end] = segment
      out['loss_mask'][r, at:end] = mask
      out['loss_mask'][r, at] = 0  # predicted by nothing of its own
      at = end
  return out


def decode_completions(tokenizer, tokens, mask) -> list[str]:
  """Completion texts, without EOS and padding."""
  tokens, mask = placement.to_host(tokens), placement.to_host(mask)
  eos = tokenizer.eos_token_id
  out = []
  for row, m in zip(tokens, mask):
    ids = [int(t) for t, keep in zip(row, m) if keep and t != eos]
    out.append(tokenizer.decode(ids, skip_special_tokens=True))
  return out
