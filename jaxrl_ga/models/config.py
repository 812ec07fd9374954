"""The architecture of a decoder: ``ModelConfig`` (with its RoPE scaling and LoRA adapters).

What ``models/transformer.py`` builds, ``models/hf.py`` and ``models/gguf.py`` read from a
checkpoint, and a checkpoint's fingerprint records (``dataclasses.asdict``). Its family
(``architecture``) is a spec in ``models/families.py``. The run's ``model.*`` settings
(``jaxrl_ga.config.ModelSpec``) hold one; ``jaxrl_ga.config`` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import families

MODEL_DTYPES = ('float32', 'bfloat16')
ROPE_TYPES = ('default', 'linear', 'llama3')
# ModelConfig.architecture: a family of models/families.py (what export writes, docs/models.md).
ARCHITECTURES = tuple(families.FAMILIES)
LAYER_TYPES = ('full_attention', 'sliding_attention')  # HF's layer_types values


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rotary-embedding frequency scaling (HF ``rope_scaling``); ``rope_type`` in ROPE_TYPES."""
  rope_type: str = 'default'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f'rope_scaling.rope_type={self.rope_type!r} is not supported; '
                       f'supported: {", ".join(ROPE_TYPES)}.')


LORA_TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the decoder layers' weight
  matrices: ``model.lora.*``. With ``rank`` > 0 only the adapters train; the base weights are
  frozen (``jaxrl_ga.lora``). Adapters and their optimizer state are float32 whatever
  ``model.param_dtype`` (which then sets the frozen base weights' storage: 'bfloat16' halves it).

  Attributes:
    rank: r, the adapters' rank; 0 disables LoRA (full fine-tuning).
    alpha: the adapters' output is scaled by alpha / rank (PEFT's ``lora_alpha``).
    targets: comma-separated projections to adapt, among q, k, v, o (attention) and gate, up,
      down (MLP): PEFT's ``target_modules`` q_proj, ..., down_proj.
    dropout: 0 only (PEFT's ``lora_dropout``; the learner step draws no dropout randomness).
  """
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = LORA_TARGETS
  dropout: float = 0.0

  def __post_init__(self):
    p = 'model.lora.'
    targets = self.targets.split(',') if isinstance(self.targets, str) else self.targets
    object.__setattr__(self, 'targets', tuple(t.strip() for t in targets if t.strip()))
    if not (isinstance(self.rank, numbers.Integral) and not isinstance(self.rank, bool)
            and self.rank >= 0):
      raise ConfigError(f'{p}rank={self.rank!r} must be an integer >= 0 (0: no LoRA, full '
                        'fine-tuning).')
    object.__setattr__(self, 'rank', int(self.rank))
    if not (isinstance(self.alpha, numbers.Real) and math.isfinite(self.alpha)
            and self.alpha > 0):
      raise ConfigError(f'{p}alpha={self.alpha!r} must be a finite number > 0.')
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if not self.targets or bad or len(set(self.targets)) != len(self.targets):
      raise ConfigError(f'{p}targets={",".join(self.targets)!r}: give distinct names among '
                        f'{",".join(LORA_TARGETS)} (e.g. {p}targets=q,v).')
    if self.dropout != 0:
      raise ConfigError(f'{p}dropout={self.dropout!r} is not supported (the learner step draws '
                        f'no dropout randomness); set {p}dropout=0.')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder of one of the families of ``models/families.py`` (Qwen2, Llama,
  Qwen3, Gemma 3, Mistral; ``models.transformer``). Field names follow the HF config. The run's
  ``model.*`` settings (``jaxrl_ga.config.ModelSpec``) hold one, besides where the weights come
  from.

  Attributes:
    vocab_size: token embeddings (and logits) rows.
    hidden_size: d_model, the residual stream's width.
    intermediate_size: the MLP's hidden width (SwiGLU).
    num_hidden_layers: decoder layers.
    num_attention_heads: query heads.
    num_key_value_heads: key/value heads (grouped-query attention; divides the query heads).
    head_dim: per-head width; None: hidden_size // num_attention_heads.
    rope_theta: RoPE base frequency.
    rope_scaling: RoPE scaling (Llama 3 or linear), None for none.
    rms_norm_eps: epsilon of the RMSNorms.
    attention_bias: q/k/v projection biases (Qwen2: True; Llama: False).
    tie_word_embeddings: the output head reuses the token embedding matrix.
    max_position_embeddings: the longest sequence (prompt + completion) the model takes.
    architecture: one of ARCHITECTURES, the family (``models/families.py``): which HF class
      export writes, and the layer's structure (norms, q/k norms, activation, embedding scale).
    sliding_window: W > 0: a sliding layer's query at position p sees the keys at positions
      > p - W (HF's sliding_window_overlay); 0: none. Gemma 3 and Mistral.
    layer_types: per layer 'full_attention' or 'sliding_attention' (HF's layer_types); empty:
      every layer sliding when sliding_window > 0 (Mistral), else full. Gemma 3.
    rope_local_theta: the RoPE base of the sliding layers, which use no rope scaling (Gemma 3's
      rope_local_base_freq); 0: they use rope_theta and rope_scaling as the full layers do.
    query_pre_attn_scalar: attention scores are scaled by its -1/2 power (Gemma); 0: head size.
    final_logit_softcapping: c > 0: logits = c * tanh(logits / c) (Gemma); 0: none.
    param_dtype: 'float32' or 'bfloat16': the dtype params are stored in. The optimizer state
      (accumulator, AdamW's moments) is float32 either way (learner.float32_like).
    dtype: 'float32' or 'bfloat16': the compute dtype; logits and softmax are always float32.
    lora: low-rank adapters on the layers' projections (rank 0: none); part of the architecture.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  rms_norm_eps: float = 1e-6
  attention_bias: bool = False  # q/k/v biases (Qwen2: True)
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 2048
  architecture: str = 'qwen2'  # ARCHITECTURES: the family (models/families.py)
  param_dtype: str = 'float32'
  dtype: str = 'float32'  # compute dtype; logits and softmax are always float32
  sliding_window: int = 0
  layer_types: tuple[str, ...] = ()
  rope_local_theta: float = 0.0
  query_pre_attn_scalar: float = 0.0
  final_logit_softcapping: float = 0.0
  # Low-rank adapters on the layers' projections (rank 0: none). Part of the architecture: the
  # module's params include them (jaxrl_ga.lora). HF configs carry none (PEFT's are separate).
  lora: LoRAConfig = LoRAConfig()

  def __post_init__(self):
    if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f'num_attention_heads={self.num_attention_heads} must be a multiple of '
          f'num_key_value_heads={self.num_key_value_heads} (grouped-query attention).')
    for name in ('param_dtype', 'dtype'):
      if getattr(self, name) not in MODEL_DTYPES:
        raise ValueError(f'{name}={getattr(self, name)!r}; choose one of '
                         f'{", ".join(MODEL_DTYPES)}.')
    if self.architecture not in ARCHITECTURES:
      raise ValueError(f'architecture={self.architecture!r}; choose one of '
                       f'{", ".join(ARCHITECTURES)}.')
    types = self.layer_types
    types = tuple(t.strip() for t in (types.split(',') if isinstance(types, str) else types)
                  if t.strip())
    object.__setattr__(self, 'layer_types', types)
    if types and (len(types) != self.num_hidden_layers or set(types) - set(LAYER_TYPES)):
      raise ValueError(f'layer_types={",".join(types)!r}: give {self.num_hidden_layers} entries '
                       f'(one per layer) among {", ".join(LAYER_TYPES)}, or none.')
    if self.sliding_window < 0 or ('sliding_attention' in types and not self.sliding_window):
      raise ValueError(f'sliding_window={self.sliding_window}: sliding layers need a window > 0.')
    foreign = [n for n in families.FAMILY_SETTINGS
               if getattr(self, n) and n not in self.family.settings]
    if foreign:
      having = '; '.join(
          f'{n}: {", ".join(f.name for f in families.FAMILIES.values() if n in f.settings)}'
          for n in foreign)
      raise ValueError(f'{", ".join(foreign)}: architecture={self.architecture!r} has no such '
                       f'setting (the architectures that have it: {having}); set architecture '
                       'to one of those or leave them unset.')

  @property
  def family(self) -> families.Family:
    """The spec of ``architecture`` (``models/families.py``): what the layer does and its HF
    names."""
    return families.FAMILIES[self.architecture]

  @property
  def head_size(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @property
  def qk_norm(self) -> bool:
    """q and k RMSNormed per head before RoPE (Qwen3, Gemma 3): ``family.qk_norm``."""
    return self.family.qk_norm

  @property
  def gemma(self) -> bool:
    """Gemma's layer ((1 + w) norms: ``family.norm_plus_one``, with its other traits in the
    family spec); for callers, the model reads the spec."""
    return self.family.norm_plus_one

  def sliding_layers(self) -> tuple[bool, ...]:
    """Per layer: does it attend through the sliding window."""
    if self.layer_types:
      return tuple(t == 'sliding_attention' for t in self.layer_types)
    return (self.sliding_window > 0,) * self.num_hidden_layers
