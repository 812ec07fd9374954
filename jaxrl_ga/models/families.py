"""Model families as specs: what each architecture changes in the Llama decoder layer, and its
Hugging Face (and GGUF) names.

The decoder (``models/transformer.py``) is Llama's: pre-norm layers of RMSNorm, grouped-query
attention with rotary embeddings and a SwiGLU MLP. A :class:`Family` says what one architecture
does differently (norms, q/k norms, activation, embedding scale, biases, which settings it
reads) and how Hugging Face names it (classes, ``model_type``s, tensor names, config
attributes). The model, the HF reader and writer (``models/hf.py``), the GGUF reader
(``models/gguf.py``), the FLOP model (``flops.py``) and the checkpoint fingerprint
(``trainers/context.py``) read the spec (``ModelConfig.family``), never the architecture's name.

The numbers a family needs beyond Llama's (a sliding window, a second RoPE base, a soft-cap) are
``ModelConfig`` fields with HF's names, listed in ``Family.settings``; a family that does not
list one must leave it unset. The window pattern is one of them: ``sliding_window`` alone makes
every layer slide (Mistral), with ``layer_types`` each layer says (Gemma 3).

Adding a family (docs/models.md, "Adding a family"): one ``Family`` in ``FAMILIES`` with its HF
names, and a fixture test against transformers; a feature no family has yet (a new norm, a new
setting) also needs its code in ``models/transformer.py`` and, for a setting, its HF attribute
in ``models/hf.py``'s ``HF_SETTINGS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# The MLP's gate activation (``Family.activation``; models/transformer.py computes them).
ACTIVATIONS = ('silu', 'gelu_tanh')

# Our param name (outside the layers) -> (HF tensor name, whether HF stores it transposed: HF's
# ``nn.Linear`` weights are [out, in], ours [in, out]).
HF_TOP_TENSORS = {
    'embed': ('model.embed_tokens.weight', False),
    'final_norm': ('model.norm.weight', False),
    'lm_head': ('lm_head.weight', True),
}
# A sequence classifier's score head [num_labels, D] (``Family.hf_score_class``; read by
# ``jaxrl_ga.reward_model``, row 0 is the reward).
HF_SCORE_TENSOR = 'score.weight'
# Llama's names: our name under ``layers`` -> (HF name after ``model.layers.{i}.``, transposed).
HF_LAYER_TENSORS = {
    'attn_norm': ('input_layernorm.weight', False),
    'q_proj': ('self_attn.q_proj.weight', True),
    'q_bias': ('self_attn.q_proj.bias', False),
    'k_proj': ('self_attn.k_proj.weight', True),
    'k_bias': ('self_attn.k_proj.bias', False),
    'v_proj': ('self_attn.v_proj.weight', True),
    'v_bias': ('self_attn.v_proj.bias', False),
    'o_proj': ('self_attn.o_proj.weight', True),
    'mlp_norm': ('post_attention_layernorm.weight', False),
    'gate_proj': ('mlp.gate_proj.weight', True),
    'up_proj': ('mlp.up_proj.weight', True),
    'down_proj': ('mlp.down_proj.weight', True),
    'q_norm': ('self_attn.q_norm.weight', False),
    'k_norm': ('self_attn.k_norm.weight', False),
}
# llama.cpp's names in a GGUF file: tensor name (after ``blk.{i}.``) -> HF name (after
# ``model.layers.{i}.``), and those outside the layers; ``models/gguf.py`` renames to HF's.
GGUF_LAYER_NAMES = {
    'attn_norm.weight': 'input_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}
GGUF_TOP_NAMES = {'token_embd.weight': 'model.embed_tokens.weight',
                  'output_norm.weight': 'model.norm.weight',
                  'output.weight': 'lm_head.weight',
                  'cls.output.weight': HF_SCORE_TENSOR}  # llama.cpp's classifier head


@dataclasses.dataclass(frozen=True)
class Family:
  """One architecture: how its layer differs from Llama's, and its HF names.

  Attributes:
    name: ``ModelConfig.architecture`` (``model.architecture``).
    hf_class: the HF model class: config.json's ``architectures`` entry, what export writes.
    hf_config_class: the ``transformers`` config class export builds.
    model_types: HF ``model_type``s that name the family when a config lists no architectures.
    attention_bias: q/k/v projection biases, as the HF class always has them (Qwen2); export
      refuses a config that differs.
    qk_norm: q and k RMSNormed per head (over the head dim) before RoPE (Qwen3, Gemma 3).
    norm_plus_one: the RMSNorms scale by (1 + w) in float32, then cast (Gemma); else Llama's
      w * normed in the input's dtype. Fresh norm weights start at 0 instead of 1.
    post_norms: norms after attention and after the MLP too, before each residual add (Gemma 3:
      ``post_attn_norm``, ``post_mlp_norm``).
    scale_embeddings: the embeddings times sqrt(hidden_size), rounded to the table's dtype
      (Gemma).
    activation: the MLP's gate activation, one of ACTIVATIONS: 'silu' (SwiGLU) or 'gelu_tanh'
      (Gemma's GELU, tanh approximation).
    settings: the ``ModelConfig`` fields beyond Llama's that the family reads (FAMILY_SETTINGS);
      the window pattern is among them (the module docstring).
    hf_activation: (HF config attribute, value) of that activation: checked on load, written on
      export.
    hf_layer_tensors: our name under ``layers`` -> (HF name after ``model.layers.{i}.``,
      transposed): HF_LAYER_TENSORS with the family's own names.
    hf_refused: HF config attributes of features the model lacks: a checkpoint that sets one is
      refused, naming it.
    hf_export: HF config attributes export writes as they are (the class's switches for those
      features, off).
    hf_head_dim_always: export writes ``head_dim`` even when it is hidden_size / heads (Qwen2's
      config reads one only when it differs).
    gguf_architecture: the GGUF ``general.architecture`` read as this family ('' none;
      ``models/gguf.py``, llama.cpp's names GGUF_LAYER_NAMES).
    hf_score_class: the HF sequence-classification class on this decoder (a reward model,
      ``jaxrl_ga.reward_model``: the decoder's tensors plus HF_SCORE_TENSOR); '' none.
  """
  name: str
  hf_class: str
  hf_config_class: str
  model_types: tuple[str, ...]
  attention_bias: bool = False
  qk_norm: bool = False
  norm_plus_one: bool = False
  post_norms: bool = False
  scale_embeddings: bool = False
  activation: str = 'silu'
  settings: tuple[str, ...] = ()
  hf_activation: tuple[str, str] = ('hidden_act', 'silu')
  hf_layer_tensors: Mapping[str, tuple[str, bool]] = dataclasses.field(
      default_factory=lambda: HF_LAYER_TENSORS)
  hf_refused: tuple[str, ...] = ()
  hf_export: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  hf_head_dim_always: bool = True
  gguf_architecture: str = ''
  hf_score_class: str = ''

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'{self.name}: activation={self.activation!r}; one of {ACTIVATIONS}.')


# Every family, by ``ModelConfig.architecture`` (the order error messages list them in).
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family('qwen2', 'Qwen2ForCausalLM', 'Qwen2Config', ('qwen2',), attention_bias=True,
           hf_refused=('use_sliding_window',), hf_head_dim_always=False,
           hf_score_class='Qwen2ForSequenceClassification'),
    Family('llama', 'LlamaForCausalLM', 'LlamaConfig', ('llama',),
           hf_refused=('attention_bias', 'mlp_bias'),
           hf_export={'attention_bias': False, 'mlp_bias': False}, gguf_architecture='llama',
           hf_score_class='LlamaForSequenceClassification'),
    Family('qwen3', 'Qwen3ForCausalLM', 'Qwen3Config', ('qwen3',), qk_norm=True,
           hf_refused=('use_sliding_window', 'attention_bias', 'mlp_bias'),
           hf_export={'attention_bias': False, 'use_sliding_window': False},
           hf_score_class='Qwen3ForSequenceClassification'),
    # ('gemma3' is the multimodal Gemma3Config, which this text model does not read.)
    Family('gemma3', 'Gemma3ForCausalLM', 'Gemma3TextConfig', ('gemma3_text',),
           qk_norm=True, norm_plus_one=True, post_norms=True, scale_embeddings=True,
           activation='gelu_tanh',
           settings=('sliding_window', 'layer_types', 'rope_local_theta',
                     'query_pre_attn_scalar', 'final_logit_softcapping'),
           hf_activation=('hidden_activation', 'gelu_pytorch_tanh'),
           hf_layer_tensors={
               **HF_LAYER_TENSORS,
               'mlp_norm': ('pre_feedforward_layernorm.weight', False),
               'post_attn_norm': ('post_attention_layernorm.weight', False),
               'post_mlp_norm': ('post_feedforward_layernorm.weight', False)},
           hf_refused=('attention_bias', 'mlp_bias', 'attn_logit_softcapping',
                       'use_bidirectional_attention'),
           hf_export={'attention_bias': False, 'attn_logit_softcapping': None},
           hf_score_class='Gemma3TextForSequenceClassification'),
    Family('mistral', 'MistralForCausalLM', 'MistralConfig', ('mistral',),
           settings=('sliding_window',), hf_refused=('attention_bias', 'mlp_bias'),
           hf_score_class='MistralForSequenceClassification'),
)}

# The ModelConfig fields only some families read (each family's ``settings``).
FAMILY_SETTINGS = tuple(dict.fromkeys(s for f in FAMILIES.values() for s in f.settings))
