"""The policy a run trains: its architecture (``model_config``) and its sharded params
(``build_model``), in one place for the trainers, ``jaxrl_ga.plan`` and ``jaxrl_ga.export``.

Architectures come from ``model.hf_path`` (an HF checkpoint directory or hub id: ``hf``; a llama
GGUF file or ``pkg:`` package: ``gguf``; this module alone chooses between the two:
``load_model``, ``load_tokenizer``) or from the ``model.*`` fields; the LoRA adapters'
settings (``model.lora``) are always the run's. ``planned_model_config`` reads no weights and no
hub (``jaxrl_ga.plan``); ``model_config_from_dict`` rebuilds a checkpoint's from its fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Callable, Optional, Union

import transformers

from jaxrl_ga import lora
from jaxrl_ga import sharding
from jaxrl_ga.config import LoRAConfig, RunConfig
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import gguf
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm


def load_model(source: Union[str, os.PathLike], *, dtype: str = 'float32',
               param_dtype: str = 'float32', shardings_fn: Optional[Callable] = None):
  """(cfg, graphdef, params) of ``source``: a GGUF source (a .gguf file or pkg:<package>) through
  ``gguf.load_model``, else an HF checkpoint (local dir, gs:// or hub id) through
  ``hf.load_model`` (the arguments are theirs)."""
  loader = gguf.load_model if gguf.is_gguf_source(source) else hf.load_model
  return loader(source, dtype=dtype, param_dtype=param_dtype, shardings_fn=shardings_fn)


# A LoRA checkpoint's base (its ``base_digest``, ``weights_digest``) is not the one at its source.
BASE_CHANGED = ('the base weights at {source} differ from those the LoRA adapters of {where} '
                'were trained on (another revision, or files replaced in place): the adapters '
                'would be {use} on other weights. Restore that model, or start a fresh '
                '--workdir.')


def weights_digest(source: Union[str, os.PathLike]) -> str:
  """A digest of ``source``'s weights that reads a few MB whatever their size: each weight
  file's size and header (tensor names, dtypes, shapes, offsets), and 4 KB at the start, middle
  and end of every tensor's bytes. A LoRA run re-reads its frozen base from ``source`` at every
  resume and export: a base changed since (a hub id's new revision, files replaced in place)
  shows here. Not a checksum of every byte: a change to a few bytes deep inside one tensor can
  pass."""
  if gguf.is_gguf_source(source):
    path = gguf.resolve(source)
    spans = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
             for t in gguf.tensors(path)]
    files = [(path, spans, min((s for s, _ in spans), default=os.path.getsize(path)))]
  else:
    files = [hf.tensor_spans(file) for file in hf.weight_file_paths(hf.local_dir(source))]
  h = hashlib.sha256()
  for path, spans, header in files:
    with open(path, 'rb') as f:
      h.update(f'{os.path.getsize(path)};'.encode())
      h.update(f.read(header))
      for start, end in spans:
        for at in sorted({start, max(start, (start + end) // 2 - 2048), max(start, end - 4096)}):
          f.seek(at)
          h.update(f.read(min(4096, end - at)))
  return h.hexdigest()


def load_tokenizer(source: Union[str, os.PathLike]) -> transformers.PreTrainedTokenizerBase:
  """The tokenizer of ``source``: a GGUF source's (``gguf.load_tokenizer``), else the HF
  checkpoint's (``hf.load_tokenizer``)."""
  return (gguf.load_tokenizer if gguf.is_gguf_source(source) else hf.load_tokenizer)(source)


def run_generation_config(hf_path: str, tokenizer) -> Optional[transformers.GenerationConfig]:
  """The generation config of a run's model: an HF checkpoint's (``hf.generation_config``) with
  the tokenizer's eos first among its eos ids, as TRL 1.16 builds its ``eos_token_ids``; None
  for a GGUF file or a model built from the ``model.*`` fields (the tokenizer's eos alone: a
  GGUF's is the file's eos, the one id transformers' GGUF loading gives the model's config). The
  run keeps it beside its tokenizer (WORKDIR/tokenizer/generation_config.json), where
  ``jaxrl_ga.export`` and ``jaxrl_ga.sample`` read it back."""
  if not hf_path or gguf.is_gguf_source(hf_path):
    return None
  try:
    generation = hf.generation_config(hf_path)
  except (OSError, ValueError) as e:
    raise ConfigError(f'model.hf_path={hf_path}: its generation config cannot be read '
                      f'({_first_line(e)}); fix or remove its generation_config.json.') from None
  generation.eos_token_id = list(stop_ids(tokenizer, generation))
  return generation


def stop_ids(tokenizer, generation: Optional[transformers.GenerationConfig] = None
             ) -> tuple[int, ...]:
  """The ids that end a generated completion: the tokenizer's eos, then the other eos ids of
  ``generation`` (``run_generation_config``), as TRL 1.16 stops (its ``eos_token_ids``) and
  transformers' ``generate``."""
  eos = int(tokenizer.eos_token_id)
  more = hf.eos_ids(generation) if generation is not None else ()
  return (eos, *dict.fromkeys(i for i in more if i != eos))


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def model_config(cfg: RunConfig, vocab_size: int) -> tfm.ModelConfig:
  """The policy's architecture, read from ``model.hf_path``'s config (no weights) or built from
  the ``model.*`` fields with the tokenizer's ``vocab_size``; with ``model.lora``'s adapters."""
  spec = cfg.model
  if not spec.hf_path:
    return dataclasses.replace(spec.architecture_config(vocab_size), lora=spec.lora)
  if gguf.is_gguf_source(spec.hf_path):
    m = gguf.model_config(gguf.resolve(spec.hf_path), dtype=spec.dtype,
                          param_dtype=spec.param_dtype)
  else:
    try:
      m = hf.model_config_from_hf(spec.hf_path, dtype=spec.dtype, param_dtype=spec.param_dtype)
    except (OSError, ValueError, KeyError) as e:  # unknown model_type, unsupported feature
      raise ConfigError(f'model.hf_path={spec.hf_path}: {_first_line(e)} (supported: '
                        f'{", ".join(hf.SUPPORTED_ARCHITECTURES)} checkpoints, or a llama GGUF '
                        'file)') from None
  return dataclasses.replace(m, lora=spec.lora)


def planned_model_config(cfg: RunConfig, hf_config: Optional[str] = None) -> tfm.ModelConfig:
  """``model_config`` without weights, tokenizer or the hub (``jaxrl_ga.plan``): from
  ``hf_config`` (an HF config.json or checkpoint directory), else a local ``model.hf_path``
  (directory, .gguf file, pkg:), else the ``model.*`` fields with ``model.vocab_size``."""
  spec = cfg.model
  if hf_config:
    try:
      m = hf.model_config_from_hf(transformers.AutoConfig.from_pretrained(hf_config),
                                  dtype=spec.dtype, param_dtype=spec.param_dtype)
    except (OSError, ValueError, KeyError) as e:
      raise ConfigError(f'--hf_config={hf_config}: cannot read an HF config from it '
                        f'({_first_line(e)}).') from None
    return dataclasses.replace(m, lora=spec.lora)
  if spec.hf_path and (os.path.exists(spec.hf_path) or spec.hf_path.startswith('pkg:')):
    return model_config(cfg, 0)
  if not spec.vocab_size:
    raise ConfigError(f'model.hf_path={spec.hf_path!r} is not a local checkpoint and '
                      'model.vocab_size is 0: write the model\'s shapes into model.* (with '
                      'model.vocab_size) or pass --hf_config=<config.json or checkpoint dir>.')
  return dataclasses.replace(spec.architecture_config(), lora=spec.lora)


def model_config_from_dict(d: dict) -> tfm.ModelConfig:
  """A ``ModelConfig`` from its ``dataclasses.asdict`` (a checkpoint's fingerprint['model'])."""
  d = dict(d)
  if d.get('rope_scaling'):
    d['rope_scaling'] = tfm.RopeScaling(**d['rope_scaling'])
  if d.get('lora'):
    d['lora'] = LoRAConfig(**d['lora'])
  fields = {f.name for f in dataclasses.fields(tfm.ModelConfig)}
  return tfm.ModelConfig(**{k: v for k, v in d.items() if k in fields})


def build_model(cfg: RunConfig, model_cfg: tfm.ModelConfig, mesh):
  """(graphdef, params, shardings) of ``model_cfg``: from HF weights or freshly initialised
  (``sharding.init_params``). With LoRA the params hold the base weights and fresh adapters
  (``jaxrl_ga.lora``); the same base on every call (a resumed run rebuilds it so)."""
  shardings_fn = functools.partial(sharding.param_shardings, mesh=mesh)
  if cfg.model.hf_path:
    _, _, params = load_model(cfg.model.hf_path, dtype=cfg.model.dtype,
                              param_dtype=cfg.model.param_dtype, shardings_fn=shardings_fn)
    graphdef, shapes, axes = sharding.abstract_model(model_cfg)
    shardings = shardings_fn(shapes, axes)
    if model_cfg.lora.rank:
      params = tfm.combine(params, lora.init_adapters(model_cfg, cfg.seed,
                                                      lora.split(shardings)[0]))
    return graphdef, params, shardings
  return sharding.init_params(model_cfg, cfg.seed, mesh)
