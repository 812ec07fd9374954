"""A model's completions of prompts, from any source: an HF directory or hub id, a .gguf file,
``pkg:<package>``, or a run's checkpoint (``load``), decoded by the library's jitted sampler
(``complete``). ``python -m jaxrl_ga.sample`` is its command line (which imports this module only
after host_memory's settings); ``sample.load`` and ``sample.complete`` are these functions.
"""

from __future__ import annotations

import os

import jax

from jaxrl_ga import checkpoint
from jaxrl_ga import export
from jaxrl_ga import sampling
from jaxrl_ga import sharding
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.tasks import chat as chat_lib
from jaxrl_ga.trainers import text


def _is_checkpoint(path: str) -> bool:
  if not os.path.isdir(path):
    return False
  path = path.rstrip('/')
  return (os.path.isdir(os.path.join(path, 'checkpoints')) or bool(checkpoint.all_steps(path))
          or (os.path.basename(path).isdigit()
              and bool(checkpoint.all_steps(os.path.dirname(path)))))


def load(model: str, param_dtype: str = 'float32'):
  """(graphdef, params, tokenizer, description) of any --model source."""
  if _is_checkpoint(model):
    cfg, params, tokenizer, src = export.load_checkpoint(model)
    if tokenizer is None:
      raise ValueError(f'--model={model}: no tokenizer beside the checkpoint (WORKDIR/tokenizer).')
    graphdef, _, _ = sharding.abstract_model(cfg)
    return graphdef, params, tokenizer, f'checkpoint {src}'
  hf.check_model_source(model, '--model')
  tokenizer = policy.load_tokenizer(model)
  _, graphdef, params = policy.load_model(model, param_dtype=param_dtype)
  return graphdef, params, tokenizer, model


def stop_ids(model: str, tokenizer) -> tuple[int, ...]:
  """The ids that end a completion of ``model`` (a ``load`` source): the tokenizer's eos, then
  the other eos ids of an HF model's generation config (``policy.stop_ids``; a run's checkpoint:
  the one the run kept beside its tokenizer, ``export.saved_generation_config``)."""
  if _is_checkpoint(model):
    return policy.stop_ids(tokenizer, export.saved_generation_config(tokenizer))
  return policy.stop_ids(tokenizer, policy.run_generation_config(model, tokenizer))


def complete(graphdef, params, tokenizer, prompts: list[str], *, chat: bool = False,
             max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             num_samples: int = 1, seed: int = 0,
             stop_ids: tuple[int, ...] = ()) -> list[list[str]]:
  """Completions [prompt][sample] (text without eos), decoded by the jitted sampler.
  ``stop_ids``: the ids that end a completion (``stop_ids(model, tokenizer)``); default: the
  tokenizer's eos."""
  if tokenizer.eos_token_id is None:
    raise ValueError('the tokenizer has no eos token; set eos_token in its tokenizer_config.json.')
  eos = int(tokenizer.eos_token_id)
  pad = eos if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
  ids = [chat_lib.prompt_ids(tokenizer, p, chat) for p in prompts]
  rows = [x for x in ids for _ in range(num_samples)]
  tokens, mask = text.left_pad(rows, max(len(x) for x in rows), pad, 'prompt length')
  sampler = sampling.Sampler(max_completion_length=max_new_tokens,
                             **sampling.eos_fields(tuple(stop_ids) or eos), pad_id=pad)
  generate = sampling.make_generate_fn(graphdef, sampler, greedy=temperature == 0)
  out = generate(params, tokens, mask, jax.random.PRNGKey(seed), max(temperature, 1e-6), top_p)
  texts = text.decode_completions(tokenizer, out.tokens, out.mask)
  return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
