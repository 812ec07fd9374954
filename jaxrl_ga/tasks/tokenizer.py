"""A character-level tokenizer for synthetic tasks, built as a byte-level BPE with no merges.

Every character of the alphabet is one token (a non-ASCII character is one token per UTF-8 byte),
so text over the alphabet round-trips exactly, spaces and newlines included. Ids are fixed by the
alphabet's order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, then one id per byte symbol in order
of first appearance. Encoding adds no special tokens; the trainer places bos/eos itself. Characters
outside the alphabet are dropped (there is no unk token, as in Qwen2).

Why byte-level: transformers 5 loads the tokenizer of a checkpoint whose config.json says
``model_type: qwen2`` as ``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` says, and that class
rebuilds a byte-level pipeline (regex split, ByteLevel, NFC) around the saved vocab. A vocab of
byte-level symbols (``' '`` -> ``'Ġ'``, ``'\\n'`` -> ``'Ċ'``) gives the same ids under that
pipeline as under the plain ``tokenizers`` one; a raw character vocab would lose whitespace.
``Qwen2Tokenizer`` also adds ``<|endoftext|>`` as a new unk token unless the saved config names
the unk token explicitly, so we save ``unk_token: null``: the vocab size stays the same.

Reload: ``save_pretrained(d)`` writes tokenizer.json and tokenizer_config.json (``tokenizer_class:
TokenizersBackend``); ``AutoTokenizer.from_pretrained(d)`` and
``PreTrainedTokenizerFast.from_pretrained(d)`` both give the same ids, with no config.json in ``d``
or beside a qwen2 or llama config.json (as ``jaxrl_ga.models.hf.export`` writes).
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers
import transformers

PAD, BOS, EOS = '<pad>', '<bos>', '<eos>'
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2


def byte_symbols(alphabet: str) -> list[str]:
  """The byte-level symbols of ``alphabet``'s characters, deduplicated, in order."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  symbols: list[str] = []
  for ch in alphabet:
    for symbol in byte_level.pre_tokenize_str(ch)[0][0]:  # ' ' -> 'Ġ'; 'é' -> 'Ã', '©'
      if symbol not in symbols:
        symbols.append(symbol)
  return symbols


def build_char_tokenizer(alphabet: str) -> transformers.PreTrainedTokenizerFast:
  """A one-token-per-character tokenizer over ``alphabet`` with <pad>/<bos>/<eos> = 0/1/2.

  Args:
    alphabet: the characters to cover; order fixes the ids, repeats are ignored.

  Returns:
    A fresh ``PreTrainedTokenizerFast`` (padding side right); see the module docstring for
    reloading after ``save_pretrained``.
  """
  if not alphabet:
    raise ValueError('alphabet is empty; pass the characters the task writes.')
  vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS) + byte_symbols(alphabet))}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  # Without merges the split pattern cannot change the tokens, so no regex split is needed.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
      unk_token=None)  # saved as null, so that Qwen2Tokenizer adds no '<|endoftext|>'.
