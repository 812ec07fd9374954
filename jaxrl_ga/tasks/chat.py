"""Prompts for chat models: a task's prompt text -> token ids, through the chat template if any.

A tokenizer with a chat template (``tokenizer.chat_template``, e.g. an instruct model's ChatML)
gets the prompt as one user message with the generation prompt appended, as the model was
tuned on (``apply_chat_template(..., add_generation_prompt=True)``); the model then ends its turn
with the tokenizer's eos (``<|im_end|>`` for SmolLM2/Qwen instruct models), which is where the
sampler stops. A tokenizer without one (the synthetic tasks' character tokenizer, base models)
gets the raw text after the special tokens the tokenizer puts at the start of a text (a base
Llama's or Gemma's BOS; none for most), as TRL 1.16 tokenizes non-conversational prompts
(``processing_class(text=...)``): ``leading_special_ids``.

  ids = chat.prompt_ids(tokenizer, 'What is 3+4? Answer with the number only.')

A run's ``model.chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``) reach every rendering
through the tokenizer the run holds (:func:`with_template_kwargs`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Mapping, Optional

from jaxrl_ga.errors import ConfigError

__all__ = ['has_chat_template', 'leading_special_ids', 'prompt_ids', 'prompt_text', 'templated',
           'with_template_kwargs']


def has_chat_template(tokenizer) -> bool:
  return bool(getattr(tokenizer, 'chat_template', None))


def with_template_kwargs(tokenizer, kwargs: Mapping[str, Any],
                         setting: str = 'model.chat_template_kwargs'):
  """``tokenizer`` whose ``apply_chat_template`` passes ``kwargs`` to the template on every call
  (a keyword given to a call wins: a row's own ``chat_template_kwargs``): a shallow copy, the
  tokenizer given is left as it was. ``kwargs`` empty: ``tokenizer`` itself. A tokenizer without
  a chat template: ConfigError naming ``setting``."""
  if not kwargs:
    return tokenizer
  if not has_chat_template(tokenizer):
    raise ConfigError(f'{setting} is set but the tokenizer has no chat template to pass it to; '
                      f'leave it empty, or give a model whose tokenizer has one.')
  bound = copy.copy(tokenizer)
  bound.apply_chat_template = functools.partial(type(tokenizer).apply_chat_template, bound,
                                                **dict(kwargs))
  return bound


def prompt_text(tokenizer, text, chat: Optional[bool] = None) -> str:
  """The prompt as the model sees it (the template applied when ``chat``; default: when the
  tokenizer has one). ``text`` may also be a list of chat messages (``{'role', 'content'}``,
  TRL's conversational prompt), which needs a chat template (without one: ConfigError)."""
  messages = None if isinstance(text, str) else list(text)
  if not templated(tokenizer, text, chat):
    return text
  if not has_chat_template(tokenizer):
    raise ConfigError('a chat prompt (a list of messages, or chat=True) but the tokenizer has no '
                      'chat template; give a model whose tokenizer has one, or string prompts.')
  return tokenizer.apply_chat_template(messages or [{'role': 'user', 'content': text}],
                                       add_generation_prompt=True, tokenize=False)


def prompt_ids(tokenizer, text, chat: Optional[bool] = None) -> list[int]:
  """Token ids of ``prompt_text(tokenizer, text, chat)``: through the template, no special
  tokens beyond those it writes; raw text after ``leading_special_ids``."""
  ids = list(tokenizer(prompt_text(tokenizer, text, chat), add_special_tokens=False)['input_ids'])
  return ids if templated(tokenizer, text, chat) else leading_special_ids(tokenizer, text,
                                                                            ids) + ids


def templated(tokenizer, text, chat: Optional[bool] = None) -> bool:
  """Whether the prompt goes through the chat template (``chat``; default: when the tokenizer
  has one, or the prompt is a list of messages)."""
  return chat if chat is not None else (has_chat_template(tokenizer) or
                                        not isinstance(text, str))


def leading_special_ids(tokenizer, text: str, bare: Optional[list[int]] = None) -> list[int]:
  """The special tokens the tokenizer puts before ``text`` (``tokenizer(text)``'s ids up to the
  text's own, ``bare``, computed when not given: a base Llama's or Gemma's BOS; [] for most),
  without any it puts after (an eos)."""
  whole = list(tokenizer(text)['input_ids'])
  if bare is None:
    bare = list(tokenizer(text, add_special_tokens=False)['input_ids'])
  for start in range(len(whole) - len(bare) + 1):
    if whole[start:start + len(bare)] == bare:
      return whole[:start]
  return []
