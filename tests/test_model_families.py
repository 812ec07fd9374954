"""Qwen3, Gemma 3 (text) and Mistral against transformers: logits, KV-cache decoding, greedy tokens.

The checkpoints and HF's float32 logits and greedy tokens come from
tests/fixtures/make_family_fixtures.py (torch, run once); nothing here imports torch. Errors are
max |ours - HF| over the real positions, relative to HF's largest |logit|.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import transformers

from jaxrl_ga import fileio
from jaxrl_ga import logprobs
from jaxrl_ga import lora
from jaxrl_ga import sharding
from jaxrl_ga.config import LoRAConfig
from jaxrl_ga.models import hf
from jaxrl_ga.models import transformer as tfm

import helpers

FAMILIES = ('qwen3_tiny', 'gemma3_tiny', 'mistral_tiny')
# float32 against float32: observed up to 1.2e-6 (forward and decode); without Gemma's (1 + w) or
# its sliding window the error is about 1 (docs/models.md).
RTOL = 1e-5


@functools.cache
def _loaded(name):
  return hf.load_model(helpers.fixture_dir(name))


def _relative_error(ours, ref, real):
  return float(np.abs(np.asarray(ours)[real] - ref[real]).max() / np.abs(ref[real]).max())


def test_configs_from_hf():
  qwen3, gemma3, mistral = (_loaded(n)[0] for n in FAMILIES)
  assert (qwen3.architecture, qwen3.qk_norm, qwen3.head_size, qwen3.attention_bias) == (
      'qwen3', True, 24, False)
  assert (gemma3.architecture, gemma3.gemma, gemma3.sliding_window, gemma3.head_size) == (
      'gemma3', True, 4, 16)
  assert gemma3.sliding_layers() == (True, False, True)
  assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling) == (
      1e5, 1e4, tfm.RopeScaling('linear', factor=2.0))
  assert (gemma3.query_pre_attn_scalar, gemma3.final_logit_softcapping) == (24.0, 1.0)
  assert gemma3.tie_word_embeddings and not mistral.tie_word_embeddings
  assert (mistral.architecture, mistral.sliding_window, mistral.sliding_layers()) == (
      'mistral', 5, (True, True))
  # Gemma's two RoPE bases reach the layers: the sliding layers' frequencies differ.
  inv = tfm.layer_constants(gemma3)['rope_inv_freq']
  assert np.array_equal(inv[0], inv[2]) and not np.allclose(inv[0], inv[1])


@pytest.mark.parametrize('name', FAMILIES)
def test_logits_match_hf(name):
  """The training forward (layers scanned) on a right- and a left-padded batch."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  forward = jax.jit(lambda p, t, m: tfm.merge(graphdef, p)(t, m))
  for side in ('right', 'left'):
    tokens, mask = ref[f'{side}_tokens'], ref[f'{side}_mask']
    error = _relative_error(forward(params, tokens, mask), ref[f'{side}_logits'],
                            mask.astype(bool))
    print(f'{name} {side}-padded forward: max abs logit error / max |logit| = {error:.1e}')
    assert error < RTOL, (side, error)


@pytest.mark.parametrize('block', [0, 4])
@pytest.mark.parametrize('name', FAMILIES)
def test_decode_and_greedy_match_hf(name, block):
  """KV-cache decoding as the sampler runs it (``sampling._generate_rows``: prefill the
  left-padded prompts, then per-layer arrays and cache): HF's greedy continuation decoded one
  token at a time, past the sliding window; the logits at every step against HF's one forward,
  and their argmax, the greedy tokens, equal to HF ``generate``'s (teacher forcing with HF's
  tokens: equal argmaxes at every step are an equal greedy run). ``block``: the decode
  attention over the whole cache (0), or looping over the filled blocks of 4 slots (the window
  mask and Gemma's query_pre_attn_scalar inside the loop)."""
  _, graphdef, params = _loaded(name)
  ref = helpers.reference_arrays(name)
  prompt, prompt_mask, greedy = ref['left_tokens'], ref['left_mask'], ref['greedy_tokens']
  tp, n = prompt.shape[1], greedy.shape[1]
  prefill = jax.jit(lambda p: tfm.merge(graphdef, p).prefill(prompt, prompt_mask, tp + n))
  decode = jax.jit(lambda p, t, c: tfm.merge(graphdef, p).decode(
      t, c, tfm.merge(graphdef, p).decode_layers(), block=block))
  logits, cache = prefill(params)
  cache = cache.per_layer()
  steps = [logits]
  for t in range(n - 1):
    logits, cache = decode(params, greedy[:, t], cache)
    steps.append(logits)
  steps = np.stack([np.asarray(x) for x in steps], axis=1)  # positions tp - 1 .. tp + n - 2
  want = ref['greedy_logits'][:, tp - 1:tp + n - 1]
  error = _relative_error(steps, want, np.ones(want.shape[:2], bool))
  print(f'{name} KV-cache decode (block {block}): max abs logit error / max |logit| = '
        f'{error:.1e}')
  assert error < RTOL, error
  np.testing.assert_array_equal(steps.argmax(-1), greedy)


@pytest.mark.parametrize('name', ['gemma3_tiny', 'mistral_tiny'])
def test_shared_prompt_chunked_unrolled_logps_match_hf(name):
  """The learner's log-probs with the training-forward options that change the forward program:
  the prompt's forward shared by two rows (``hidden_after_prefix``, the window cutting into the
  prompt), chunked log-probs, the layers unrolled (the per-layer window flag and RoPE
  frequencies as constants, not scanned), LoRA adapters on (B = 0 at init, so the model is the
  base one). Against log_softmax of HF's logits at the continuation. (Remat changes only the
  backward.) Qwen3 has no per-layer or windowed difference between these paths."""
  cfg, _, params = _loaded(name)
  cfg = dataclasses.replace(cfg, lora=LoRAConfig(rank=2))
  graphdef = sharding.abstract_model(cfg)[0]
  adapters = lora.init_adapters(cfg, seed=1)
  prompt, prompt_mask, greedy, want = helpers.shared_prompt_case(name)
  options = tfm.ForwardOptions(scan_layers=False, logprob_chunk_size=3,
                               share_prompts=2)
  logps, _ = jax.jit(lambda p, a: logprobs.completion_logps(
      tfm.merge(graphdef, p, a), prompt, prompt_mask, greedy, np.ones_like(greedy),
      options))(params, adapters)
  error = float(np.abs(np.asarray(logps) - want).max())
  print(f'{name} shared-prompt chunked log-probs: max abs error = {error:.1e}')
  assert error < 1e-5, error


@pytest.mark.parametrize('name', FAMILIES)
def test_export_round_trip_and_autoconfig(name, tmp_path):
  """Export writes what transformers reads as the same architecture (AutoConfig, no torch), and
  our loader reads back the same config and params."""
  cfg, _, params = _loaded(name)
  hf.export(params, cfg, tmp_path, tokenizer=hf.load_tokenizer(helpers.fixture_dir(name)))
  auto = transformers.AutoConfig.from_pretrained(tmp_path)
  original = transformers.AutoConfig.from_pretrained(helpers.fixture_dir(name))
  assert type(auto) is type(original) and auto.architectures == original.architectures
  keys = ('model_type', 'head_dim', 'sliding_window', 'layer_types', 'rope_parameters',
          'query_pre_attn_scalar', 'final_logit_softcapping', 'hidden_activation', 'hidden_act',
          'tie_word_embeddings', 'num_key_value_heads', 'attention_bias')
  for key in keys:
    assert getattr(auto, key, None) == getattr(original, key, None), key
  assert hf.model_config_from_hf(tmp_path) == cfg
  reloaded = hf.load_params(tmp_path, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               reloaded, params)
  with open(tmp_path / 'config.json') as f:
    assert json.load(f)['architectures'] == original.architectures


@pytest.mark.parametrize('name, extra', [('qwen3_tiny', ['--config.model.lora.rank=2']),
                                         ('gemma3_tiny', [])])
def test_grpo_cli_smoke(name, extra, tmp_path):
  """One GRPO step through the CLI on the tiny checkpoint (Qwen3 with LoRA, Gemma 3 full): the
  rollout's KV-cache sampling, the old log-probs, the learner's backward and a checkpoint; its
  architecture is the checkpoint's."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
         f'--workdir={tmp_path}', f'--config.model.hf_path={helpers.fixture_dir(name)}', '--config.stages=grpo',
         '--config.grpo.num_steps=1', '--config.eval.num_examples=4', '--config.eval.batch_size=4',
         '--config.grpo.schedule.grad_accum_steps=1', '--config.grpo.schedule.steps_per_generation=1',
         *extra]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=root)
  done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert '[grpo] 1/1 (100%)' in done.stdout + done.stderr
  lines = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert any(l['phase'] == 'grpo' and 'reward/mean' in l for l in lines)
  assert os.path.isdir(tmp_path / 'checkpoints' / 'grpo')


def test_checkpoint_from_a_bucket(fake_gcs, tmp_path, monkeypatch):
  """model.hf_path=gs://...: config, tokenizer and weights through a local copy (the fake bucket
  of tests/test_fileio.py stands in for Cloud Storage); a second load fetches nothing."""
  name = 'gemma3_tiny'
  del fake_gcs  # registered for gs://; written through fsspec as a client would
  for f in os.listdir(helpers.fixture_dir(name)):
    with open(os.path.join(helpers.fixture_dir(name), f), 'rb') as src:
      fileio.write_bytes(f'gs://bucket/models/{name}/{f}', src.read())
  monkeypatch.setenv(hf.MODEL_CACHE_ENV, str(tmp_path))
  remote = f'gs://bucket/models/{name}'
  hf.check_model_source(remote)  # no error
  cfg, _, params = hf.load_model(remote)
  want_cfg, _, want = _loaded(name)
  assert cfg == want_cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, want)
  text = 'Hi 12+3'
  assert hf.load_tokenizer(remote)(text)['input_ids'] == hf.load_tokenizer(helpers.fixture_dir(name))(text)[
      'input_ids']
  copied = tmp_path / 'bucket' / 'models' / name / 'model.safetensors'
  stamp = copied.stat().st_mtime_ns
  hf.load_model(remote)
  assert copied.stat().st_mtime_ns == stamp
  with pytest.raises(Exception, match='no config.json'):
    hf.check_model_source('gs://bucket/models')
