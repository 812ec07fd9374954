"""Hugging Face interop for the decoder (Qwen2, Llama, Qwen3, Gemma 3 text, Mistral): config,
weights, tokenizer and export.

No torch: configs and tokenizers go through ``transformers`` (which does not need torch for them),
weights through ``safetensors``' numpy reader (bfloat16 comes back as an ``ml_dtypes`` array).
Only safetensors checkpoints load: ``model.safetensors``, or shards listed in
``model.safetensors.index.json``.

HF -> params layout (L layers stacked on axis 0; HF ``nn.Linear`` weights are [out, in], ours
[in, out]):

  model.embed_tokens.weight [V, D]                 -> embed [V, D]
  model.layers.{i}.input_layernorm.weight [D]      -> layers/attn_norm [L, D]
  model.layers.{i}.self_attn.q_proj.weight [Nq*H, D] -> layers/q_proj [L, D, Nq*H] (k, v alike)
  model.layers.{i}.self_attn.q_proj.bias [Nq*H]    -> layers/q_bias [L, Nq*H] (k, v alike; Qwen2)
  model.layers.{i}.self_attn.o_proj.weight [D, Nq*H] -> layers/o_proj [L, Nq*H, D]
  model.layers.{i}.post_attention_layernorm.weight -> layers/mlp_norm [L, D]
  model.layers.{i}.mlp.{gate,up}_proj.weight [F, D] -> layers/{gate,up}_proj [L, D, F]
  model.layers.{i}.mlp.down_proj.weight [D, F]     -> layers/down_proj [L, F, D]
  model.layers.{i}.self_attn.{q,k}_norm.weight [H] -> layers/{q,k}_norm [L, H] (Qwen3, Gemma 3)
  model.norm.weight [D]                            -> final_norm [D]
  lm_head.weight [V, D]                            -> lm_head [D, V] (absent when tied)

These are Llama's names (``families.HF_LAYER_TENSORS``); a family's spec has its own where they
differ (``Family.hf_layer_tensors``): Gemma 3's post_attention_layernorm is the norm after
attention (layers/post_attn_norm), pre_feedforward_layernorm the one before the MLP
(layers/mlp_norm), post_feedforward_layernorm the one after it (layers/post_mlp_norm). The family
(``models/families.py``) also says which HF config attributes it reads (``HF_SETTINGS``), refuses
and writes; nothing here branches on a family's name.

Typical use::

  cfg, graphdef, params = hf.load_model('Qwen/Qwen2.5-0.5B-Instruct')
  model = transformer.merge(graphdef, params)
  ...
  hf.export(params, cfg, '/tmp/out', tokenizer=hf.load_tokenizer('Qwen/Qwen2.5-0.5B-Instruct'))
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from typing import Any, Callable, Optional, Union

from absl import logging
from flax import nnx
from flax import traverse_util
import huggingface_hub
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' reader needs)
import numpy as np
import safetensors
import safetensors.numpy
import transformers

from jaxrl_ga import fileio
from jaxrl_ga import placement
from jaxrl_ga import sharding as shd
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import families
from jaxrl_ga.models import transformer

# HF architecture -> our ``ModelConfig.architecture`` (a family's ``hf_class``).
SUPPORTED_ARCHITECTURES = {f.hf_class: f.name for f in families.FAMILIES.values()}
_INDEX_FILE = 'model.safetensors.index.json'
_SINGLE_FILE = 'model.safetensors'
# What ``snapshot_download`` fetches for a hub id: configs, weights, tokenizer files.
_HUB_PATTERNS = ('*.json', '*.safetensors', '*.txt', '*.model', '*.jinja')


# -- config ----------------------------------------------------------------------------------------
def _rope_from_hf(hf: transformers.PretrainedConfig, layer_type: Optional[str] = None
                  ) -> tuple[float, Optional[transformer.RopeScaling]]:
  """(rope_theta, scaling or None) from whichever the config carries: ``rope_parameters``
  (transformers 5; those of ``layer_type`` when they are per layer type, as Gemma 3's) or the
  older top-level ``rope_theta`` and ``rope_scaling``."""
  params = getattr(hf, 'rope_parameters', None)
  if params and layer_type is not None and isinstance(params.get(layer_type), dict):
    params = params[layer_type]
  elif params and all(isinstance(v, dict) for v in params.values()):
    # Nested per layer type; fine as long as every layer type uses the same rotary embedding.
    distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
    if len(distinct) > 1:
      raise ValueError(f'Per-layer-type rope_parameters are not supported: {params}.')
    params = next(iter(params.values()))
  if not params:
    params = dict(getattr(hf, 'rope_scaling', None) or {})
  theta = params.get('rope_theta', getattr(hf, 'rope_theta', None) or 10000.0)
  rope_type = params.get('rope_type', params.get('type', 'default'))
  partial = params.get('partial_rotary_factor', getattr(hf, 'partial_rotary_factor', 1.0))
  if partial not in (None, 1.0):
    raise ValueError(f'partial_rotary_factor={partial} is not supported (only 1.0).')
  if rope_type == 'default':
    return float(theta), None
  if rope_type == 'linear':
    return float(theta), transformer.RopeScaling('linear', factor=float(params['factor']))
  if rope_type == 'llama3':
    return float(theta), transformer.RopeScaling(
        'llama3', factor=float(params['factor']),
        low_freq_factor=float(params['low_freq_factor']),
        high_freq_factor=float(params['high_freq_factor']),
        original_max_position_embeddings=int(params.get('original_max_position_embeddings')
                                              or hf.max_position_embeddings))
  raise ValueError(f'rope_type={rope_type!r} is not supported; supported: default, linear, llama3 '
                   f'(rope parameters: {params}).')


def _local_rope_theta(hf: transformers.PretrainedConfig) -> float:
  """The sliding layers' RoPE base (Gemma 3's ``rope_parameters['sliding_attention']``); their
  rope scaling is refused."""
  theta, scaling = _rope_from_hf(hf, 'sliding_attention')
  if scaling is not None:
    raise ValueError(f'{hf.model_type}: rope scaling of the sliding layers ({scaling}) is not '
                     'supported.')
  return theta


# A family's settings (``Family.settings``, ModelConfig fields) -> (its value read from an HF
# config, the HF config attributes export writes for it given the ModelConfig and the full
# layers' rope parameters).
HF_SETTINGS = {
    'sliding_window': (lambda hf: getattr(hf, 'sliding_window', None) or 0,
                       lambda cfg, rope: {'sliding_window': cfg.sliding_window or None}),
    'layer_types': (lambda hf: tuple(hf.layer_types),
                    lambda cfg, rope: {'layer_types': list(
                        cfg.layer_types or ['full_attention'] * cfg.num_hidden_layers)}),
    'rope_local_theta': (_local_rope_theta, lambda cfg, rope: {'rope_parameters': {
        'full_attention': rope, 'sliding_attention': {
            'rope_type': 'default', 'rope_theta': cfg.rope_local_theta or cfg.rope_theta}}}),
    'query_pre_attn_scalar': (
        lambda hf: float(hf.query_pre_attn_scalar),
        lambda cfg, rope: {'query_pre_attn_scalar': _number(cfg.query_pre_attn_scalar
                                                            or cfg.head_size)}),
    'final_logit_softcapping': (
        lambda hf: float(hf.final_logit_softcapping or 0.0),
        lambda cfg, rope: {'final_logit_softcapping': cfg.final_logit_softcapping or None}),
}


def _family(hf: transformers.PretrainedConfig) -> families.Family:
  """The family of an HF config: by its ``architectures``, else its ``model_type``."""
  names = list(getattr(hf, 'architectures', None) or [])
  by_type = {t: f.hf_class for f in families.FAMILIES.values() for t in f.model_types}
  if not names and hf.model_type in by_type:
    names = [by_type[hf.model_type]]
  if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f'Unsupported architecture {names or None} (model_type {hf.model_type!r}); supported: '
        f'{", ".join(SUPPORTED_ARCHITECTURES)}.')
  return families.FAMILIES[SUPPORTED_ARCHITECTURES[names[0]]]


def model_config_from_hf(hf_config_or_dir: Union[str, os.PathLike,
                                                 transformers.PretrainedConfig], *,
                         dtype: str = 'float32',
                         param_dtype: str = 'float32') -> transformer.ModelConfig:
  """ModelConfig from an HF config object, a local checkpoint dir or a hub id.

  Args:
    hf_config_or_dir: a ``transformers.PretrainedConfig``, or anything
      ``transformers.AutoConfig.from_pretrained`` takes (local dir, hub id).
    dtype: compute dtype, 'float32' or 'bfloat16'.
    param_dtype: params dtype, 'float32' or 'bfloat16'.

  Raises:
    ValueError: naming the offender, for an architecture not in SUPPORTED_ARCHITECTURES, an
      unsupported rope type, or a feature the model lacks (its family's ``hf_refused``: Qwen2/3
      sliding-window layers, biases other than Qwen2's q/k/v ones, Gemma 3's attention
      soft-capping or bidirectional attention; an activation other than the family's).
  """
  hf = hf_config_or_dir
  if not isinstance(hf, transformers.PretrainedConfig):
    path = os.fspath(hf)
    hf = transformers.AutoConfig.from_pretrained(
        _local_dir(path) if path.startswith(_REMOTE_SCHEMES) else path)
  family = _family(hf)
  arch = family.name
  act_name, act_want = family.hf_activation
  act = getattr(hf, act_name, act_want)
  if act != act_want:
    raise ValueError(f'{arch}: {act_name}={act!r} is not supported (only {act_want}).')
  for name in family.hf_refused:
    if getattr(hf, name, None):
      raise ValueError(f'{arch} with {name}={getattr(hf, name)} is not supported (the model '
                       'lacks that feature).')
  extra = {name: HF_SETTINGS[name][0](hf) for name in family.settings}
  if 'layer_types' in extra and 'sliding_attention' not in extra['layer_types']:
    for name, unset in (('sliding_window', 0), ('rope_local_theta', 0.0)):  # no layer slides
      if name in extra:
        extra[name] = unset
  per_type = 'rope_local_theta' in family.settings  # rope_parameters per layer type
  theta, scaling = _rope_from_hf(hf, 'full_attention' if per_type else None)
  default_head_dim = hf.hidden_size // hf.num_attention_heads
  head_dim = getattr(hf, 'head_dim', None) or default_head_dim
  return transformer.ModelConfig(
      vocab_size=hf.vocab_size,
      hidden_size=hf.hidden_size,
      intermediate_size=hf.intermediate_size,
      num_hidden_layers=hf.num_hidden_layers,
      num_attention_heads=hf.num_attention_heads,
      num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
      head_dim=None if head_dim == default_head_dim else head_dim,
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=hf.rms_norm_eps,
      attention_bias=family.attention_bias,  # HF Qwen2 always has q/k/v biases
      tie_word_embeddings=bool(getattr(hf, 'tie_word_embeddings', False)),
      max_position_embeddings=hf.max_position_embeddings,
      architecture=arch,
      param_dtype=param_dtype,
      dtype=dtype,
      **extra,
  )


# -- weights ---------------------------------------------------------------------------------------
_REMOTE_SCHEMES = ('gs://', 'gcs://')
# Where gs:// checkpoints are copied to (one copy per host, reused by later runs).
MODEL_CACHE_ENV = 'JAXRL_GA_MODEL_CACHE'


# (remote, local copy) pairs fetched by this process: the bucket is listed once, not by every
# loader (config, tokenizer, weights) that asks for the same checkpoint.
_REMOTE_COPIES: set[tuple[str, str]] = set()


def _remote_copy(remote: str) -> str:
  """The local copy of a gs:// checkpoint directory (configs, safetensors, tokenizer files), under
  $JAXRL_GA_MODEL_CACHE (default ~/.cache/jaxrl_ga/models)/<bucket>/<path>; files already copied
  with the same size are not fetched again, and a directory this process has fetched is not
  listed again. Each host copies to its own disk, streamed (no file is held in memory); the
  weights are then read one param at a time as from a local directory."""
  root = os.environ.get(MODEL_CACHE_ENV) or os.path.join(
      os.path.expanduser('~'), '.cache', 'jaxrl_ga', 'models')
  local = os.path.join(root, *remote.split('://', 1)[1].strip('/').split('/'))
  if (remote, local) in _REMOTE_COPIES and os.path.exists(os.path.join(local, 'config.json')):
    return local
  names = fileio.fetch_directory(remote, local, _HUB_PATTERNS)
  if 'config.json' not in names:
    raise FileNotFoundError(f'{remote} has no config.json: not an HF model directory.')
  _REMOTE_COPIES.add((remote, local))
  return local


def _local_dir(path_or_id: Union[str, os.PathLike]) -> str:
  """A local checkpoint dir as is; a gs:// one copied to the local cache (``_remote_copy``); a
  hub id through ``huggingface_hub.snapshot_download``."""
  path = os.fspath(path_or_id)
  if os.path.isdir(path):
    return path
  if path.startswith(_REMOTE_SCHEMES):
    return _remote_copy(path)
  if os.path.isabs(path) or path.startswith(('.', '~')) or os.path.exists(path):
    raise FileNotFoundError(f'{path!r} is not a checkpoint directory (a .gguf file loads with '
                            'jaxrl_ga.models.policy.load_model).')
  if ':' in path:  # no hub id has one: pkg:<package> (a GGUF) or an unknown scheme
    raise FileNotFoundError(f'{path!r} is not a checkpoint directory nor a hub id (pkg:<package> '
                            'loads with jaxrl_ga.models.policy.load_model).')
  return huggingface_hub.snapshot_download(path, allow_patterns=list(_HUB_PATTERNS))


local_dir = _local_dir  # public: jaxrl_ga.reward_model reads a checkpoint's files from it


def weight_file_paths(model_dir: str) -> list[str]:
  """The safetensors files of a local checkpoint dir, sorted."""
  return sorted(set(_weight_files(model_dir).values()))


def tensor_spans(file: str) -> tuple[str, list[tuple[int, int]], int]:
  """(file, [(start, end) byte offsets of each tensor's data, by name], the header's length in
  bytes) of a safetensors file, from its header alone (8 bytes of length, then JSON)."""
  with open(file, 'rb') as f:
    (n,) = struct.unpack('<Q', f.read(8))
    header = json.loads(f.read(n))
  spans = [(8 + n + header[k]['data_offsets'][0], 8 + n + header[k]['data_offsets'][1])
           for k in sorted(header) if k != '__metadata__']
  return file, spans, 8 + n


def tensor_shape(model_dir: str, name: str) -> tuple[int, ...]:
  """The shape of tensor ``name`` of a local checkpoint dir, its data unread (KeyError naming it
  when absent)."""
  files = _weight_files(model_dir)
  if name not in files:
    raise KeyError(f'{model_dir} has no tensor {name}')
  with _open_safetensors(files[name]) as f:
    return f.get_slice(name).shape


def read_tensor(model_dir: str, name: str) -> np.ndarray:
  """Tensor ``name`` of a local checkpoint dir, in HF's layout."""
  files = _weight_files(model_dir)
  with _open_safetensors(files[name]) as f:
    return f.get_tensor(name)


def _weight_files(model_dir: str) -> dict[str, str]:
  """HF tensor name -> safetensors file that holds it."""
  index = os.path.join(model_dir, _INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
    return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
  single = os.path.join(model_dir, _SINGLE_FILE)
  if os.path.exists(single):
    with _open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  raise FileNotFoundError(
      f'No {_SINGLE_FILE} or {_INDEX_FILE} in {model_dir} (found: '
      f'{sorted(os.listdir(model_dir))}); only safetensors checkpoints are supported.')


@contextlib.contextmanager
def _open_safetensors(file: str):
  """safetensors.safe_open, its errors naming the file (a truncated or foreign file)."""
  try:
    handle = safetensors.safe_open(file, framework='numpy')
  except Exception as e:  # pylint: disable=broad-except  (safetensors raises its own types)
    raise ValueError(f'{file}: not a readable safetensors file ({e}); re-export or re-download '
                     f'it.') from None
  with handle as f:
    yield _NamedTensors(f, file)


class _NamedTensors:
  """A safe_open handle whose get_tensor errors (data cut short) name the file."""

  def __init__(self, handle, file: str):
    self._handle, self._file = handle, file

  def keys(self):
    return self._handle.keys()

  def get_tensor(self, name: str) -> np.ndarray:
    try:
      return self._handle.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(name, e) from None

  def get_slice(self, name: str) -> '_NamedSlice':
    """A lazy view of tensor ``name``: ``.shape``, and ``[index]`` reads only that part."""
    try:
      return _NamedSlice(self._handle.get_slice(name), lambda e: self._damaged(name, e))
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(name, e) from None

  def _damaged(self, name: str, e: Exception) -> ValueError:
    return ValueError(f'{self._file}: tensor {name!r} cannot be read ({e}); the file is '
                      f'damaged: re-export or re-download it.')


class _NamedSlice:
  """safetensors' lazy slice, its read errors naming the file (see _NamedTensors)."""

  def __init__(self, handle, damaged: Callable[[Exception], ValueError]):
    self._handle, self._damaged = handle, damaged
    self.shape = tuple(handle.get_shape())

  def __getitem__(self, index) -> np.ndarray:
    try:
      return self._handle[index]
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(e) from None


def _hf_names(path: tuple[str, ...], num_layers: int,
              family: families.Family) -> tuple[list[str], bool]:
  """Param path (e.g. ('layers', 'q_proj')) -> its HF tensor names (one per layer) and whether
  HF stores them transposed, by the ``family``'s names."""
  if path[0] == 'layers':
    name, transposed = family.hf_layer_tensors[path[1]]
    return [f'model.layers.{i}.{name}' for i in range(num_layers)], transposed
  name, transposed = families.HF_TOP_TENSORS[path[0]]
  return [name], transposed


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def load_params(path_or_id: Union[str, os.PathLike], cfg: transformer.ModelConfig, *,
                shardings: Optional[dict] = None, ignore: tuple[str, ...] = ()) -> dict:
  """Reads a safetensors checkpoint into the params pure dict of ``Transformer(cfg)``.

  One param at a time: its per-layer tensors are read, transposed to [in, out], stacked, cast to
  ``cfg.param_dtype`` on the host and put straight onto its sharding, so host memory peaks at one
  stacked param. Tensors the model does not use (e.g. old ``rotary_emb.inv_freq`` buffers) are
  skipped with an absl warning that names them.

  Args:
    path_or_id: a local checkpoint dir or a hub id.
    cfg: the model config (usually ``model_config_from_hf`` of the same checkpoint).
    shardings: optional pytree of ``jax.sharding.Sharding`` with the params' structure; without
      it every array goes to the default device.
    ignore: HF tensor names the caller reads itself (a reward model's score head): not warned of.

  Returns:
    The params as a nested dict of jax arrays (``transformer.split``'s layout).

  Raises:
    ValueError: listing the missing HF tensors, or naming a tensor whose shape does not fit cfg.
    FileNotFoundError: when the dir holds no safetensors weights.
  """
  model_dir = _local_dir(path_or_id)
  files = _weight_files(model_dir)
  with contextlib.ExitStack() as stack:
    handles = {file: stack.enter_context(_open_safetensors(file))
               for file in sorted(set(files.values()))}
    return params_from_tensors(lambda name: handles[files[name]].get_tensor(name),
                               set(files) - set(ignore),
                               cfg, source=model_dir, shardings=shardings,
                               get_slice=lambda name: handles[files[name]].get_slice(name))


def _check_tied_head(get_tensor, get_slice, available, cfg: transformer.ModelConfig,
                     embed: str, source: str) -> None:
  """A config that ties the head to the embedding, with an ``lm_head.weight`` of other values in
  the checkpoint, is refused: transformers then unties them and uses the stored head, where this
  model would use the embedding (a head equal to the embedding is the tie, saved twice). Reads
  its first and last rows only."""
  if not cfg.tie_word_embeddings or 'lm_head.weight' not in available or embed not in available:
    return
  def rows(name):
    if get_slice is None:
      return np.asarray(get_tensor(name))[[0, 1, 2, 3, -4, -3, -2, -1]]
    view = get_slice(name)
    n = view.shape[0]
    return np.concatenate([view[0:4], view[n - 4:n]])

  if not np.array_equal(np.asarray(rows('lm_head.weight')), np.asarray(rows(embed))):
    raise ValueError(f'{source}: the config ties the output head to the embedding '
                     f'(tie_word_embeddings=true), but the checkpoint holds an lm_head.weight with '
                     f'other values, which transformers would use untied; set '
                     f'"tie_word_embeddings": false in its config.json (or drop lm_head.weight).')


def params_from_tensors(get_tensor: Callable[[str], np.ndarray], available, cfg:
                        transformer.ModelConfig, *, source: str,
                        shardings: Optional[dict] = None,
                        get_slice: Optional[Callable[[str], Any]] = None) -> dict:
  """The params pure dict of ``Transformer(cfg)`` from HF-named tensors in HF layout.

  ``get_tensor(hf_name)`` returns one tensor as numpy ([out, in] for linear weights); ``available``
  is the set of names it can return; ``source`` names them in errors. Shared by the safetensors
  reader above and ``jaxrl_ga.models.gguf`` (which dequantizes GGUF tensors into HF names).

  With ``shardings`` and ``get_slice`` (a lazy view per name: ``.shape``, and ``[index]`` reading
  only that part, as safetensors' ``get_slice``), each param is built by
  ``jax.make_array_from_callback``: every process reads only the parts of each tensor its own
  devices hold, so no host reads a whole model (docs/models.md).
  """
  expected = traverse_util.flatten_dict(shd.abstract_model(cfg)[1])
  flat_shardings = traverse_util.flatten_dict(shardings) if shardings is not None else {}
  names = {path: _hf_names(path, cfg.num_hidden_layers, cfg.family) for path in expected}

  wanted = {name for hf_names, _ in names.values() for name in hf_names}
  missing = sorted(wanted - set(available))
  if missing:
    raise ValueError(f'{len(missing)} tensors missing from {source}: {", ".join(missing)}.')
  _check_tied_head(get_tensor, get_slice, available, cfg, names[('embed',)][0][0], source)
  extra = sorted(set(available) - wanted)
  if extra:
    logging.warning('Ignoring %d tensors of %s that the model does not use: %s', len(extra),
                    source, ', '.join(extra))

  out = {}
  for path, spec in expected.items():
    hf_names, transposed = names[path]
    sharding = flat_shardings.get(path)
    if get_slice is not None and sharding is not None:
      out[path] = _read_sharded([get_slice(n) for n in hf_names], transposed, path, spec,
                                sharding, hf_names[0])
      continue
    layers = []
    for name in hf_names:
      x = get_tensor(name)
      layers.append(x.T if transposed else x)
    host = np.stack(layers) if path[0] == 'layers' else layers[0]
    if host.shape != spec.shape:
      raise ValueError(f'{"/".join(path)} (from {hf_names[0]}, ...): shape {host.shape} does not '
                       f'fit the config, which wants {spec.shape}.')
    host = np.ascontiguousarray(host.astype(spec.dtype, copy=False))
    out[path] = placement.put(host, sharding) if sharding is not None else jax.device_put(host)
    del host, layers
  return _unflatten(out)


def _read_sharded(views: list, transposed: bool, path: tuple[str, ...], spec, sharding,
                  first_name: str) -> jax.Array:
  """One param from its per-layer lazy views (one view for a param outside the layers): each
  device's shard read from the views' matching part, transposed and stacked on the host."""
  stacked = path[0] == 'layers'
  inner = views[0].shape[::-1] if transposed else views[0].shape
  shape = ((len(views),) if stacked else ()) + tuple(inner)
  if shape != tuple(spec.shape) or any(v.shape != views[0].shape for v in views):
    raise ValueError(f'{"/".join(path)} (from {first_name}, ...): shape {shape} does not fit the '
                     f'config, which wants {spec.shape}.')

  done: dict[tuple, np.ndarray] = {}  # a shard replicated on several local devices: read once

  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    key = tuple(i.indices(n) for i, n in zip(index, shape))
    if key not in done:
      done[key] = _read_part(index)
    return done[key]

  def _read_part(index: tuple[slice, ...]) -> np.ndarray:
    layers, part = (index[0], index[1:]) if stacked else (slice(0, 1), index)
    hf_part = part[::-1] if transposed else part
    pieces = [views[i][hf_part] for i in range(*layers.indices(len(views)))]
    pieces = [x.T for x in pieces] if transposed else pieces
    host = np.stack(pieces) if stacked else pieces[0]
    return np.ascontiguousarray(host.astype(spec.dtype, copy=False))

  return jax.make_array_from_callback(tuple(spec.shape), sharding, read)


def load_model(path_or_id: Union[str, os.PathLike], *, dtype: str = 'float32',
               param_dtype: str = 'float32',
               shardings_fn: Optional[Callable[[dict, dict], dict]] = None
               ) -> tuple[transformer.ModelConfig, nnx.GraphDef, dict]:
  """(cfg, graphdef, params) of an HF checkpoint, without materializing a random init.

  Args:
    path_or_id: a local checkpoint dir, or a hub id (downloaded: configs, safetensors, tokenizer),
      (a GGUF source, a .gguf file or pkg:<package>, loads with ``jaxrl_ga.models.gguf``;
      ``jaxrl_ga.models.policy.load_model`` takes either kind).
    dtype: compute dtype.
    param_dtype: params dtype.
    shardings_fn: optional; called as ``shardings_fn(abstract_params, logical_axes)``, i.e. the
      params dict of ShapeDtypeStructs and ``transformer.logical_axes`` (same structure, tuples
      such as ``('layers', 'embed', 'q_heads')``), it returns the pytree of shardings each param
      is placed on; e.g. ``functools.partial(sharding.param_shardings, mesh=mesh)``.

  Returns:
    cfg, the graphdef and the params dict; ``transformer.merge(graphdef, params)`` is the model.
  """
  model_dir = _local_dir(path_or_id)
  cfg = model_config_from_hf(model_dir, dtype=dtype, param_dtype=param_dtype)
  graphdef, shapes, axes = shd.abstract_model(cfg)
  shardings = shardings_fn(shapes, axes) if shardings_fn is not None else None
  return cfg, graphdef, load_params(model_dir, cfg, shardings=shardings)


def check_model_source(source: str, setting: str = 'model.hf_path') -> None:
  """``source`` names an HF model directory, a .gguf file, pkg:<package> or a hub id (org/name);
  anything else (a missing path, a URL scheme, a file of another kind) is a ConfigError naming
  ``setting`` at once, not a hub look-up or a loader's traceback."""
  if not source or source.startswith('pkg:'):
    return  # pkg: is resolved (with its pip command when missing) by models.gguf
  kinds = ('an HF model directory (local or gs://), a .gguf file, pkg:<package> or a hub id '
           '(org/name)')
  if source.startswith(_REMOTE_SCHEMES):
    try:
      fileio.check_endpoint(source)  # at once, not after gcsfs's retries
      found = fileio.exists(fileio.join(source, 'config.json'))
    except ImportError as e:
      raise ConfigError(f'{setting}={source}: reading gs:// needs gcsfs ({e}); pip install '
                        f'"jaxrl_ga[gcs]".') from None
    except Exception as e:  # pylint: disable=broad-except  (auth, network: the client's words)
      raise ConfigError(f'{setting}={source}: cannot read the bucket ({str(e)[:200]}).') from None
    if not found:
      raise ConfigError(f'{setting}={source}: no config.json there, so it is not an HF model '
                        f'directory; give {kinds}.')
    return
  scheme = re.match(r'^([a-zA-Z][\w+.-]*)://', source)
  if scheme:
    raise ConfigError(f'{setting}={source}: {scheme.group(1)}:// is not a supported model source '
                      f'(gs:// is); copy the model to a local directory and give its path, or '
                      f'give {kinds}.')
  path = os.path.expanduser(source)
  if os.path.isdir(path):
    if not os.path.exists(os.path.join(path, 'config.json')):
      raise ConfigError(f'{setting}={source}: the directory has no config.json, so it is not an '
                        f'HF model directory; give {kinds}.')
  elif os.path.exists(path):
    if not path.endswith('.gguf'):
      raise ConfigError(f'{setting}={source} is a file but not a .gguf file; give {kinds}.')
    if not os.access(path, os.R_OK):
      raise ConfigError(f'{setting}={source}: the file is not readable (permissions).')
  elif path.startswith(('/', '.', '~')) or not re.fullmatch(r'[\w.-]+/[\w.-]+', path):
    raise ConfigError(f'{setting}={source}: no such directory or file; give {kinds}.')
  else:  # a hub id: cached, or one quick look-up (not the minutes of retries of a download)
    if isinstance(huggingface_hub.try_to_load_from_cache(path, 'config.json'), str):
      return
    try:
      huggingface_hub.model_info(path, timeout=10)
    except Exception as e:  # pylint: disable=broad-except
      first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
      raise ConfigError(f'{setting}={source} is no local directory or file, is not in the '
                        f'Hugging Face cache, and the hub cannot serve it ({first}); give '
                        f'{kinds}.') from None


def load_tokenizer(path_or_id: Union[str, os.PathLike]) -> transformers.PreTrainedTokenizerBase:
  """The checkpoint's tokenizer via ``transformers.AutoTokenizer`` (local dir, gs:// or hub id;
  a GGUF source's: ``jaxrl_ga.models.gguf``, or ``jaxrl_ga.models.policy.load_tokenizer`` for
  either kind)."""
  path = os.fspath(path_or_id)
  return transformers.AutoTokenizer.from_pretrained(
      _local_dir(path) if path.startswith(_REMOTE_SCHEMES) else path)


def generation_config(path_or_id: Union[str, os.PathLike]) -> transformers.GenerationConfig:
  """The checkpoint's generation config: its ``generation_config.json``, else the one
  transformers derives from ``config.json`` (``GenerationConfig.from_model_config``, as
  ``model.generation_config`` is built). Its eos ids are what ``generate`` and TRL 1.16 stop a
  completion at besides the tokenizer's eos (Llama 3's ``<|eom_id|>``, Qwen's
  ``<|endoftext|>``, ...): :func:`eos_ids`."""
  path = os.fspath(path_or_id)
  where = _local_dir(path) if path.startswith(_REMOTE_SCHEMES) else path
  try:
    return transformers.GenerationConfig.from_pretrained(where)
  except OSError:  # no generation_config.json
    return transformers.GenerationConfig.from_model_config(
        transformers.AutoConfig.from_pretrained(where))


def eos_ids(generation: transformers.GenerationConfig) -> tuple[int, ...]:
  """A generation config's eos ids (its ``eos_token_id``: None, one id or a list)."""
  ids = generation.eos_token_id
  if ids is None:
    return ()
  return tuple(int(i) for i in ([ids] if isinstance(ids, int) else ids))


# -- export ----------------------------------------------------------------------------------------
def hf_config(cfg: transformer.ModelConfig, *, weights_dtype: Optional[str] = None,
              tokenizer: Optional[transformers.PreTrainedTokenizerBase] = None,
              generation: Optional[transformers.GenerationConfig] = None
              ) -> transformers.PretrainedConfig:
  """The HF config (its family's ``hf_config_class``: ``Qwen2Config``, ``LlamaConfig``, ...)
  describing cfg.

  ``weights_dtype`` (default cfg.param_dtype) becomes its ``dtype``; pad/bos/eos token ids come
  from the tokenizer when one is given, the eos ids from ``generation`` (``eos_ids``: the
  tokenizer's first) when it lists several, as the source's config.json does.
  """
  family, arch = cfg.family, cfg.architecture
  if cfg.attention_bias != family.attention_bias:
    raise ValueError(f'attention_bias={cfg.attention_bias} has no HF {arch} equivalent (Qwen2 '
                     'always has q/k/v biases, Llama has none here).')
  rope = {'rope_type': 'default', 'rope_theta': cfg.rope_theta}
  sc = cfg.rope_scaling
  if sc is not None and sc.rope_type == 'linear':
    rope.update(rope_type='linear', factor=sc.factor)
  elif sc is not None and sc.rope_type == 'llama3':
    rope.update(rope_type='llama3', factor=sc.factor, low_freq_factor=sc.low_freq_factor,
                high_freq_factor=sc.high_freq_factor,
                original_max_position_embeddings=sc.original_max_position_embeddings)
  kwargs = dict(
      architectures=[family.hf_class],
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_hidden_layers,
      num_attention_heads=cfg.num_attention_heads,
      num_key_value_heads=cfg.num_key_value_heads,
      max_position_embeddings=cfg.max_position_embeddings,
      rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_word_embeddings,
      rope_parameters=rope,
      dtype=weights_dtype or cfg.param_dtype,
  )
  # head_dim for every family but Qwen2, whose attention reads an optional one (when it differs).
  if family.hf_head_dim_always or cfg.head_size != cfg.hidden_size // cfg.num_attention_heads:
    kwargs.update(head_dim=cfg.head_size)
  kwargs.update(family.hf_export)
  kwargs[family.hf_activation[0]] = family.hf_activation[1]
  for name in family.settings:
    kwargs.update(HF_SETTINGS[name][1](cfg, rope))
  if tokenizer is not None:
    kwargs.update(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
  stops = eos_ids(generation) if generation is not None else ()
  if len(stops) > 1:
    kwargs.update(eos_token_id=list(stops))
  return getattr(transformers, family.hf_config_class)(**kwargs)


def _number(x: float):
  """x as an int when it is one (HF's strict configs type some such fields int)."""
  return int(x) if float(x).is_integer() else x


def export(params: dict, cfg: transformer.ModelConfig, out_dir: Union[str, os.PathLike], *,
           tokenizer: Optional[transformers.PreTrainedTokenizerBase] = None,
           weights_dtype: Optional[str] = None,
           generation: Optional[transformers.GenerationConfig] = None) -> None:
  """Writes an HF checkpoint (config.json, model.safetensors, optional tokenizer and
  generation_config.json) to out_dir.

  Tensor names and layouts are HF's (``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` load it; tied
  embeddings write no ``lm_head.weight``). With several processes every one must call this (the
  sharded params are gathered); only process 0 writes.

  Args:
    params: the params pure dict (``transformer.split``'s layout), possibly sharded.
    cfg: their config.
    out_dir: created if needed.
    tokenizer: saved alongside when given; its pad/bos/eos ids go into config.json.
    weights_dtype: 'float32' or 'bfloat16', the written tensors' dtype; default cfg.param_dtype.
    generation: written as generation_config.json when given (the run's, with every eos id the
      completions stopped at: ``policy.run_generation_config``).
  """
  weights_dtype = weights_dtype or cfg.param_dtype
  if weights_dtype not in ('float32', 'bfloat16'):
    raise ValueError(f'weights_dtype={weights_dtype!r}; choose float32 or bfloat16.')
  np_dtype = jnp.dtype(weights_dtype)  # a numpy dtype; bfloat16 is ml_dtypes'
  config = hf_config(cfg, weights_dtype=weights_dtype, tokenizer=tokenizer,
                     generation=generation)
  tensors = {}
  for path, value in traverse_util.flatten_dict(params).items():
    hf_names, transposed = _hf_names(path, cfg.num_hidden_layers, cfg.family)
    host = placement.to_host(value).astype(np_dtype, copy=False)
    per_name = list(host) if path[0] == 'layers' else [host]
    for name, x in zip(hf_names, per_name):
      tensors[name] = np.ascontiguousarray(x.T if transposed else x)
  if jax.process_index() != 0:
    return
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  config.save_pretrained(out_dir)
  # 'format': 'pt' is what transformers' loader checks for in the safetensors metadata.
  safetensors.numpy.save_file(tensors, os.path.join(out_dir, _SINGLE_FILE),
                              metadata={'format': 'pt'})
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)
  if generation is not None:
    generation.save_pretrained(out_dir)
