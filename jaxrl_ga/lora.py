"""LoRA: the adapters of a ``model.lora.rank`` > 0 model, apart from its frozen base weights.

The model (``models/transformer.py``) holds both: its params pure dict has, beside each targeted
``layers/<t>_proj`` [L, in, out], the float32 ``nnx.LoRAParam`` arrays ``layers/<t>_proj_lora_a``
[L, in, r] and ``layers/<t>_proj_lora_b`` [L, r, out]. ``split`` separates the two (params,
ShapeDtypeStructs, shardings or logical axes alike) and ``transformer.merge(graphdef, base,
adapters)`` rebuilds the model from both, copying nothing. The learner trains the adapters only
(``Learner(..., frozen_shardings=)``): its state, optimizer moments, MultiSteps accumulator and
checkpoints hold no base weight.

Export: ``merged`` folds the adapters into the base weights, W + (alpha / r) A @ B in float32 (an
HF directory of the plain architecture, ``jaxrl_ga.export``); ``save_peft`` writes the adapters
alone in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``; PEFT's
``LoraLayer``: delta W = scaling * lora_B.weight @ lora_A.weight with torch's [out, in] weights).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

from flax import nnx
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from jaxrl_ga.config import LoRAConfig
from jaxrl_ga.models import transformer as tfm

_SUFFIXES = ('_lora_a', '_lora_b')


def is_adapter(key: str) -> bool:
  return key.endswith(_SUFFIXES)


def split(tree: dict) -> tuple[dict, dict]:
  """(adapters, base) of a params-shaped nested dict: the ``*_lora_a`` / ``*_lora_b`` leaves and
  all the others (``transformer.combine`` / ``merge`` put them back together)."""
  adapters, base = {}, {}
  for key, value in tree.items():
    if isinstance(value, dict):
      a, b = split(value)
      if a:
        adapters[key] = a
      if b:
        base[key] = b
    else:
      (adapters if is_adapter(key) else base)[key] = value
  return adapters, base


def partition(tree: dict, cfg: tfm.ModelConfig) -> tuple[dict, Optional[dict]]:
  """(trained, frozen) parts of a params-shaped tree for the learner: (adapters, base) with LoRA,
  else (tree, None) (full fine-tuning)."""
  return split(tree) if cfg.lora.rank else (tree, None)


def base_config(cfg: tfm.ModelConfig) -> tfm.ModelConfig:
  """``cfg`` without adapters (the architecture an HF export of the merged weights has)."""
  return dataclasses.replace(cfg, lora=LoRAConfig())


def with_lora(cfg: tfm.ModelConfig, lora: LoRAConfig) -> tfm.ModelConfig:
  return dataclasses.replace(cfg, lora=lora)


def init_adapters(cfg: tfm.ModelConfig, seed: int, shardings=None) -> dict:
  """The adapters of a fresh ``cfg`` model (A random, B zero), born with ``shardings`` (the
  adapters' part of the model's, or None). The base weights' initialization is dead code in the
  jitted function: XLA computes and allocates none of it."""

  def init():
    return split(tfm.split(tfm.Transformer(cfg, rngs=nnx.Rngs(seed)))[1])[0]

  return jax.jit(init, out_shardings=shardings)()


def merged(params: dict, cfg: tfm.ModelConfig) -> tuple[dict, tfm.ModelConfig]:
  """(params with every adapter folded into its base weight, ``base_config(cfg)``):
  W' = W + (alpha / r) A @ B per layer, computed and kept in float32 (the other params keep
  their dtype). Stored in a bfloat16 W's dtype, an update under half a bfloat16 ulp of W would
  be lost (``bfloat16_loss``): the writer chooses the dtype. ``params``: base and adapters
  together (``transformer.combine``). Without adapters: (params, cfg)."""
  if not cfg.lora.rank:
    return params, cfg
  adapters, base = split(params)
  layers = dict(base['layers'])
  scale = cfg.lora.alpha / cfg.lora.rank
  fold = jax.jit(lambda w, a, b: tfm.fold_adapter(w, a, b, scale))
  for target in cfg.lora.targets:
    name = f'{target}_proj'
    layers[name] = fold(layers[name], adapters['layers'][f'{name}_lora_a'],
                        adapters['layers'][f'{name}_lora_b'])
  return dict(base, layers=layers), base_config(cfg)


def bfloat16_loss(params: dict, merged_params: dict, cfg: tfm.ModelConfig) -> float:
  """The part of the adapters' update that rounding ``merged(params, cfg)``'s folded weights to
  bfloat16 loses, as a fraction of the update's norm: ||round(W') - W - d|| / ||d||, d = W' - W,
  over every target (0 without adapters or with a zero update)."""
  if not cfg.lora.rank:
    return 0.0
  base = split(params)[1]['layers']

  @jax.jit
  def sums(w, folded):
    f32 = jnp.float32
    delta = folded - w.astype(f32)
    # bfloat16's rounding; not astype(bfloat16).astype(float32), a round trip XLA may drop
    # (xla_allow_excess_precision).
    rounded = jax.lax.reduce_precision(folded, exponent_bits=8, mantissa_bits=7)
    lost = rounded - w.astype(f32) - delta
    return jnp.sum(lost * lost), jnp.sum(delta * delta)

  lost = total = 0.0
  for target in cfg.lora.targets:
    name = f'{target}_proj'
    l, t = sums(base[name], merged_params['layers'][name])
    lost, total = lost + float(l), total + float(t)
  return math.sqrt(lost / total) if total else 0.0


# PEFT module names of our targets (transformers' Qwen2/Llama modules).
_PEFT_MODULES = {'q': 'self_attn.q_proj', 'k': 'self_attn.k_proj', 'v': 'self_attn.v_proj',
                 'o': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj',
                 'down': 'mlp.down_proj'}


def peft_tensors(adapters: dict, cfg: tfm.ModelConfig) -> dict[str, np.ndarray]:
  """The adapters as PEFT names them in adapter_model.safetensors, float32 host arrays:
  ``base_model.model.model.layers.{i}.<module>.lora_A.weight`` [r, in] (our A transposed) and
  ``...lora_B.weight`` [out, r] (B transposed)."""
  out = {}
  for target in cfg.lora.targets:
    a = np.asarray(_gather(adapters['layers'][f'{target}_proj_lora_a']), np.float32)
    b = np.asarray(_gather(adapters['layers'][f'{target}_proj_lora_b']), np.float32)
    for i in range(cfg.num_hidden_layers):
      prefix = f'base_model.model.model.layers.{i}.{_PEFT_MODULES[target]}'
      out[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a[i].T)
      out[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b[i].T)
  return out


def peft_config(cfg: tfm.ModelConfig, base_model: Optional[str] = None) -> dict[str, Any]:
  """PEFT's adapter_config.json for ``cfg.lora`` (a LoraConfig; keys as PEFT writes them)."""
  return {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_model,
      'r': cfg.lora.rank, 'lora_alpha': cfg.lora.alpha, 'lora_dropout': cfg.lora.dropout,
      'target_modules': sorted(f'{t}_proj' for t in cfg.lora.targets), 'bias': 'none',
      'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
      'init_lora_weights': True, 'inference_mode': True, 'modules_to_save': None,
  }


def save_peft(adapters: dict, cfg: tfm.ModelConfig, out_dir: str,
              base_model: Optional[str] = None) -> None:
  """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's file layout; load
  with ``peft.PeftModel.from_pretrained(base, out_dir)``). Only process 0 writes."""
  tensors = peft_tensors(adapters, cfg)
  if jax.process_index() != 0:
    return
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'adapter_config.json'), 'w') as f:
    json.dump(peft_config(cfg, base_model), f, indent=2)
  path = os.path.join(out_dir, 'adapter_model.safetensors')
  safetensors.numpy.save_file(tensors, path, metadata={'format': 'pt'})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)  # safetensors writes it owner-only


def _gather(x):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)
