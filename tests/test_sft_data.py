"""SFT from your data (jaxrl_ga.sft_data): which tokens a row trains on, against transformers'
assistant-token mask and hand-written spans; packing, against the same examples unpacked and one
at a time; bad rows, one line naming the row before anything compiles (through the CLI too)."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_ga import api
from jaxrl_ga import data
from jaxrl_ga import learner as learner_lib
from jaxrl_ga import sft_data
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, SFTConfig
from jaxrl_ga.models import attention as attn_lib
from jaxrl_ga.models import transformer as tfm
from jaxrl_ga.tasks import tokenizer as tokenizer_lib
from jaxrl_ga.trainers import sft as sft_trainer

from learner_refs import OPT, applied_grad, make_mesh, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A ChatML-like template with generation markers around each assistant reply and its end, and
# the same template without them.
MARKED = ("{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}"
          "{% generation %}{{ m.content }}<|end|>\n{% endgeneration %}{% else %}{{ m.content }}"
          "<|end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN = MARKED.replace('{% generation %}', '').replace('{% endgeneration %}', '')
EOS = tokenizer_lib.SPECIAL_TOKENS.index(tokenizer_lib.EOS)
CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is 2+3?'}, {'role': 'assistant', 'content': '5'}],
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+3?'},
     {'role': 'assistant', 'content': '5'}, {'role': 'user', 'content': 'and 4+4?'},
     {'role': 'assistant', 'content': '8, since 4+4=8'}],
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': ''},
     {'role': 'user', 'content': 'sum 1 1'}, {'role': 'assistant', 'content': '2'},
     {'role': 'user', 'content': 'thanks'}],
]


def _tokenizer(template=PLAIN):
  tok = tokenizer_lib.build_char_tokenizer(data.BASE_ALPHABET)
  tok.chat_template = template
  return tok


def _row(where='d.jsonl:1', **columns):
  row = data.Row(columns)
  row.where = where
  return sft_data.check_row(row)


def _trained_text(tok, ids, mask):
  return ''.join(tok.decode([i]) for i, m in zip(ids, mask) if m)


def test_assistant_tokens_match_transformers_mask_and_hand_spans():
  for messages in CONVERSATIONS:
    marked, plain = _tokenizer(MARKED), _tokenizer(PLAIN)
    ref = marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    for tok in (plain, marked):  # prefix-by-prefix renders; the markers through transformers
      ids, mask = sft_data.encode_row(tok, _row(messages=messages), EOS)
      assert ids == list(ref['input_ids'])
      assert mask == [0] + list(ref['assistant_masks'])[1:]
    expected = ''.join(f'{m["content"]}<|end|>\n' for m in messages if m['role'] == 'assistant')
    assert _trained_text(plain, ids, mask) == expected


def test_prompt_completion_and_text_rows_train_on_their_targets():
  tok = _tokenizer()
  prompt = [{'role': 'user', 'content': 'What is 2+3?'}]
  ids, mask = sft_data.encode_row(
      tok, _row(prompt=prompt, completion=[{'role': 'assistant', 'content': '5'}]), EOS)
  assert tok.decode(ids) == '<|user|>\nWhat is 2+3?<|end|>\n<|assistant|>\n5<|end|>\n'
  assert _trained_text(tok, ids, mask) == '5<|end|>\n'
  ids, mask = sft_data.encode_row(tok, _row(prompt='What is 2+3?', completion='5'), EOS)
  assert _trained_text(tok, ids, mask) == '5<eos>' and ids[-1] == EOS  # string: + eos
  assert tok.decode(ids[:-2]) == '<|user|>\nWhat is 2+3?<|end|>\n<|assistant|>\n'
  ids, mask = sft_data.encode_row(tok, _row(text='abc'), EOS)
  assert tok.decode(ids) == 'abc<eos>' and mask == [0, 1, 1, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row():
  # Renders an assistant reply only when it is the last message (as templates that drop earlier
  # reasoning do): the render of the first turn is not a prefix of the whole.
  template = PLAIN.replace("{% if m.role == 'assistant' %}",
                           "{% if m.role == 'assistant' and not loop.last %}<|end|>\n"
                           "{% elif m.role == 'assistant' %}")
  with pytest.raises(ConfigError) as e:
    sft_data.encode_row(_tokenizer(template), _row(messages=CONVERSATIONS[1]), EOS)
  assert str(e.value) == (
      'd.jsonl:1: the chat template renders an earlier part of this conversation differently '
      'from the whole, so its assistant text cannot be found; give a template with '
      '{% generation %} markers.')


def test_greedy_rows_fill_in_stream_order():
  assert sft_data.greedy_rows([3, 4, 2, 5, 1, 6], 2, 8) == [[0, 1], [2, 3, 4]]
  assert sft_data.greedy_rows([8, 8, 8], 3, 8) == [[0], [1], [2]]
  assert sft_data.greedy_rows([2], 3, 8) == [[0], [], []]


def test_masks_of_plain_rows_are_unchanged_by_segment_support():
  """On 0/1 masks (left or right padding, holes) positions and the causal mask are the plain
  rules: the count of real tokens before, and every real position <= t."""
  rng = np.random.default_rng(0)
  mask = (rng.random((16, 12)) < 0.7).astype(np.int32)
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  causal = np.tril(np.ones((12, 12), bool))[None] & mask.astype(bool)[:, None, :]
  np.testing.assert_array_equal(attn_lib.positions_from_mask(jnp.asarray(mask)), pos)
  np.testing.assert_array_equal(attn_lib.causal_mask(jnp.asarray(mask)), causal)


# -- packing: the same examples give the same logits and the same accumulated gradient ------------
L = 128  # packed (and padded) row length


def _chat_sequences(n, seed=0):
  """n chat rows of spread lengths (one turn, or two for 30%, of 1-12 character contents through the
  plain template: 21 to 86 tokens), encoded."""
  rng = np.random.default_rng(seed)
  tok = _tokenizer(data.PLAIN_CHAT_TEMPLATE)
  word = lambda: ''.join(rng.choice(list('abcdefgh +=0123456789'), rng.integers(1, 13)))
  out = []
  for _ in range(n):
    messages = []
    for _ in range(1 + (rng.random() < 0.3)):
      messages += [{'role': 'user', 'content': word()}, {'role': 'assistant', 'content': word()}]
    out.append(sft_data.encode_row(tok, _row(messages=messages), EOS))
  return out, len(tok)


@pytest.fixture(scope='module')
def tiny():
  sequences, vocab = _chat_sequences(16)
  model_cfg = tfm.ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
  mesh = make_mesh((1, 1, 1))
  graphdef, params, shardings = sharding.init_params(model_cfg, seed=0, mesh=mesh)
  return types.SimpleNamespace(sequences=sequences, graphdef=graphdef, params=params,
                               shardings=shardings, mesh=mesh)


def _logits_fn(tiny):
  if not hasattr(tiny, 'logits'):
    tiny.logits = jax.jit(lambda p, t, m: tfm.merge(tiny.graphdef, p)(t, m))
  return lambda b: np.asarray(tiny.logits(tiny.params, b['tokens'], b['attention_mask']))


def test_a_packed_forward_equals_each_example_alone(tiny):
  """No attention across an example's boundary, positions restarting at each: each segment's
  logits are those of its example in a row of its own (right-padded, a 0/1 mask)."""
  seqs = tiny.sequences[:8]
  rows = [r for r in sft_data.greedy_rows([len(s[0]) for s in seqs], 8, L) if r]
  assert max(len(r) for r in rows) >= 2  # rows hold several examples
  logits = _logits_fn(tiny)
  packed = logits(sft_data.pack([[seqs[j] for j in r] for r in rows] + [[]] * (8 - len(rows)),
                                L, 0))
  alone = logits(sft_data.padded_rows(seqs, L, 0))
  for r, row in enumerate(rows):
    at = 0
    for j in row:
      n = len(seqs[j][0])
      np.testing.assert_allclose(packed[r, at:at + n], alone[j, :n], atol=2e-5)
      at += n


def _learner_grads(tiny, k, *windows):
  """The gradient one learner (optimizer step every k micro-batches) applies at the first
  optimizer step of each window, from the same params. -> one per window."""
  lrn = learner_lib.Learner(tiny.graphdef, learner_lib.sft_task_loss(), OPT, tiny.mesh,
                            tiny.shardings, optimizer_every=k)
  put = lambda b: {kk: jax.device_put(v, sharding.batch_sharding(tiny.mesh, v.ndim))
                   for kk, v in b.items()}
  grads = []
  for micro_batches in windows:
    state = lrn.init(tiny.params, put(micro_batches[0]))
    for b in micro_batches:
      state, out = lrn.step(state, put(b))
    assert bool(out['stepped'])
    grads.append(jax.device_get(applied_grad(state)))  # AdamW's first moment, b1 = 0
  return grads


def _one_pass_grad(tiny, seqs):
  """The window loss in one pass over the window's examples, one right-padded row each: the sum
  of the trained tokens' -log p over the window's trained tokens."""
  batch = sft_data.padded_rows(seqs, L, 0)
  def loss(params):
    logits = tfm.merge(tiny.graphdef, params)(batch['tokens'], batch['attention_mask'])
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), batch['tokens'][:, 1:, None],
                             -1)[..., 0]
    m = batch['loss_mask'][:, 1:].astype(jnp.float32)
    return -jnp.sum(lp * m) / jnp.sum(m)
  return jax.jit(jax.grad(loss))(tiny.params)


def test_packing_gives_the_unpacked_accumulated_gradient(tiny, k=2):
  """One window of 4K examples: K micro-batches of 4 rows one example each, or the same examples
  packed into fewer rows (spread over K micro-batches of 4 rows, the rest empty). K = 2: each
  micro-batch is packed (what K = 1 checks) and the window's token count spans both (the learner's
  K = 1 path is tests/test_learner.py's)."""
  seqs = tiny.sequences[:4 * k]
  unpacked = [sft_data.padded_rows(seqs[i * 4:(i + 1) * 4], L, 0) for i in range(k)]
  rows = [r for r in sft_data.greedy_rows([len(s[0]) for s in seqs], 4 * k, L) if r]
  per = -(-len(rows) // k)
  assert per < 4  # packing saves rows
  packed = [sft_data.pack([[seqs[j] for j in r] for r in rows[i * per:(i + 1) * per]]
                          + [[]] * (4 - len(rows[i * per:(i + 1) * per])), L, 0)
            for i in range(k)]
  g_unpacked, g_packed = _learner_grads(tiny, k, unpacked, packed)
  reference = _one_pass_grad(tiny, seqs)
  assert rel_err(g_packed, g_unpacked) <= 1e-5
  assert rel_err(g_packed, reference) <= 1e-5
  assert rel_err(g_unpacked, reference) <= 1e-5


def test_the_trainer_packs_the_stream_in_order_and_counts_what_it_used():
  tok = _tokenizer(data.PLAIN_CHAT_TEMPLATE)
  rows = [_row(f'd.jsonl:{i + 1}', messages=[{'role': 'user', 'content': 'q' * (i % 5)},
                                              {'role': 'assistant', 'content': str(i)}])
          for i in range(12)]
  task = sft_data.SFTDataTask(rows, [], shuffle=False)
  task.encode(tok, EOS, 64, 'error')
  ctx = types.SimpleNamespace(task=task, tokenizer=tok, eos_id=EOS, pad_id=0)
  cfg = SFTConfig(micro_batch_size=2, max_length=64, packing=True)
  batch, used = sft_trainer.micro_batch(ctx, cfg, 3, 0, np.arange(2))
  lengths = [len(task.sequences[i][0]) for i in range(3, 12)]
  expected = sft_data.greedy_rows(lengths, 2, 64)
  assert used == sum(map(len, expected)) > 2
  for r, row in enumerate(expected):
    assert max(batch['attention_mask'][r]) == len(row)
    got = batch['tokens'][r][batch['attention_mask'][r] > 0].tolist()
    assert got == sum((task.sequences[3 + j][0] for j in row), [])
  unpacked, used = sft_trainer.micro_batch(ctx, dataclasses.replace(cfg, packing=False), 3, 0,
                                           np.arange(2))
  assert used == 2 and unpacked['attention_mask'].max() == 1


def test_held_out_rows_are_asked_up_to_their_last_assistant_turn():
  conversation = CONVERSATIONS[1]
  held = [_row(messages=conversation), _row(messages=conversation, answer='8'),
          _row(prompt='What is 2+3?', completion='5'), _row(text='abc')]
  task = sft_data.build_task([_row(text='x')], held, [], shuffle=False)
  examples = task.eval_examples()
  assert len(examples) == 3  # text rows are not evaluated
  assert examples[0].prompt == conversation[:4]
  assert [e.fields['answer'] for e in examples] == ['8, since 4+4=8', '8', '5']


# -- bad input ------------------------------------------------------------------------------------
def _sft_cfg(path, **overrides):
  return api.make_config(os.path.join(ROOT, 'configs', 'sft_arith.py') + ':smoke',
                         **{'data.train': str(path), 'sft.max_length': 48, **overrides})


GOOD = {'messages': [{'role': 'user', 'content': 'What is 1+1?'},
                     {'role': 'assistant', 'content': '2'}]}


@pytest.mark.parametrize('bad,message', [
    ({'question': 'x'}, 'no SFT column (columns: question); give "messages", "prompt" and '
                        '"completion", or "text" (rename with data.columns=<name>:messages).'),
    ({'prompt': 'What is 1+1?'}, 'a "prompt" column but no "completion" column; SFT rows need '
                                 'both (or "messages", or "text").'),
    ({'prompt': 'What is 1+1?', 'completion': ''},
     'an empty completion; SFT needs a target to train on.'),
    ({'messages': [{'role': 'user', 'content': 'What is 1+1?'}]},
     'the conversation has no assistant turn with content; SFT trains on the assistant turns '
     '(add one or drop the row).'),
    ({'messages': 'hello'}, '"messages" is a str (\'hello\'); give a non-empty list of chat '
                            'messages {"role": ..., "content": ...}.'),
    ({'text': 'x' * 60}, '61 tokens exceeds sft.max_length=48; raise sft.max_length, or set '
                         'sft.too_long=drop or truncate.'),
])
def test_bad_rows_are_one_error_naming_file_and_line(tmp_path, bad, message):
  path = tmp_path / 'd.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in [GOOD] * 20 + [bad]), encoding='utf-8')
  cfg = _sft_cfg(path, **{'data.eval_fraction': 0.04, 'data.shuffle': False})
  with pytest.raises(ConfigError) as e:
    api.build_context(cfg, str(tmp_path / 'wd'))
  assert str(e.value) == f'data.train={path}:21: {message}'
  assert not (tmp_path / 'wd' / 'checkpoints').exists()


def test_too_long_rows_dropped_with_a_count_or_truncated(tmp_path, capsys):
  path = tmp_path / 'd.jsonl'
  rows = [GOOD] * 20 + [{'text': 'x' * 60}, {'prompt': 'y' * 60, 'completion': 'z'}]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
  task = data.build_task(_sft_cfg(path, **{'data.eval': str(path)}))
  task.encode(_tokenizer(data.PLAIN_CHAT_TEMPLATE), EOS, 48, 'drop')
  assert (task.num_train(), task.dropped) == (20, 2)
  task = data.build_task(_sft_cfg(path, **{'data.eval': str(path)}))
  task.encode(_tokenizer(data.PLAIN_CHAT_TEMPLATE), EOS, 48, 'truncate')  # the prompt-only cut leaves no target: dropped
  assert (task.num_train(), task.dropped, task.longest()) == (21, 1, 48)


def _cli(tmp_path, rows, *flags):
  path = tmp_path / 'd.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, JAX_LOG_COMPILES='1')
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/sft_arith.py:smoke',
       f'--config.data.train={path}', '--config.data.shuffle=False',
       '--config.data.eval_fraction=0.04', f'--workdir={tmp_path}/wd', *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  lines = [l for l in (done.stdout + done.stderr).splitlines() if l.strip()]
  assert done.returncode == 2 and len(lines) == 1, (done.returncode, lines[-20:])
  assert 'Compiling' not in done.stderr and not (tmp_path / 'wd' / 'checkpoints').exists()
  return lines[0], path


def test_cli_bad_rows_one_error_line_exit_2(tmp_path):
  """One CLI run, with the bad row found last (a length, once the tokenizer is built); each other
  bad row's message is test_bad_rows_are_one_error_naming_file_and_line's, in process."""
  line, path = _cli(tmp_path, [GOOD] * 20 + [{'text': 'x' * 60}], '--config.sft.max_length=48')
  assert line == (f'error: data.train={path}:21: 61 tokens exceeds sft.max_length=48; raise '
                  'sft.max_length, or set sft.too_long=drop or truncate.')


def test_a_row_ending_with_the_eos_text_gets_no_second_eos():
  """TRL 1.16's add_eos (sft_trainer.py): the eos text is appended only where the text does not
  already end with it, so no row trains EOS -> EOS; the ids are the tokenizer's of that text."""
  tok = _tokenizer()
  trl = lambda s: tok(s if s.endswith(tok.eos_token) else s + tok.eos_token,
                      add_special_tokens=False)['input_ids']
  for body in ('abc', 'abc' + tok.eos_token):
    ids, mask = sft_data.encode_row(tok, _row(text=body), EOS)
    assert ids == trl(body) and ids.count(EOS) == 1 and mask == [0] + [1] * (len(ids) - 1)
    ids, mask = sft_data.encode_row(tok, _row(prompt='What is 2+3?', completion='5' + body[3:]),
                                    EOS)
    assert _trained_text(tok, ids, mask) == '5<eos>' and ids.count(EOS) == 1


def _bos_tokenizer():
  """A base-model tokenizer that puts BOS before a text (as a base Llama's or Gemma's does)."""
  import transformers  # pylint: disable=import-outside-toplevel
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, 'tests/fixtures/llama_tiny'))
  tok.add_bos_token = True
  assert tok('ab')['input_ids'][0] == tok.bos_token_id and not tok.chat_template
  return tok


def test_base_model_text_starts_with_the_tokenizers_bos_as_trl_tokenizes_it():
  """TRL 1.16 tokenizes non-conversational text with the tokenizer's special tokens
  (processing_class(text=...)): a base Llama's BOS starts an SFT text row and a string prompt
  (the sequence the model was pretrained to see); a chat template's prompt gets no second BOS."""
  from jaxrl_ga.tasks import chat  # pylint: disable=import-outside-toplevel
  tok = _bos_tokenizer()
  eos = tok.eos_token_id
  ids, mask = sft_data.encode_row(tok, _row(text='hello world'), eos)
  assert ids == tok('hello world' + tok.eos_token)['input_ids']  # TRL's add_eos, then tokenize
  assert ids[0] == tok.bos_token_id and mask[0] == 0 and all(mask[1:])
  ids, mask = sft_data.encode_row(tok, _row(prompt='What is 2+3?', completion='5'), eos)
  head = tok('What is 2+3?')['input_ids']
  assert ids[:len(head)] == head and ids[0] == tok.bos_token_id
  assert chat.prompt_ids(tok, 'What is 2+3?') == head
  tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
  assert chat.prompt_ids(tok, 'hi') == tok('<bos>hi', add_special_tokens=False)['input_ids']
  assert chat.prompt_ids(tok, 'hi').count(tok.bos_token_id) == 1


# A template that renders tool schemas and calls as tool-calling chat templates do (Qwen2.5's
# <tools>/<tool_call> blocks, reduced), and a template flag (Qwen3's enable_thinking's /no_think).
TOOLS_TEMPLATE = (
    "{% if enable_thinking is false %}/no_think\n{% endif %}"
    "{% if tools %}<|system|>\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|end|>\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'tool' %}{{ m.name }}={% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOL_SCHEMA = {'type': 'function', 'function': {
    'name': 'multiply', 'parameters': {'type': 'object', 'properties': {'a': {'type': 'integer'}}}}}
TOOL_CALL_ROW = [
    {'role': 'user', 'content': 'What is 6*7?'},
    {'role': 'assistant', 'tool_calls': [
        {'type': 'function', 'function': {'name': 'multiply', 'arguments': {'a': 6, 'b': 7}}}]},
    {'role': 'tool', 'name': 'multiply', 'content': '42'},
    {'role': 'assistant', 'content': 'It is 42.'}]


@pytest.mark.parametrize('tools_as_json', [False, True])
def test_tool_calls_and_the_tools_column_reach_the_template_as_trl_passes_them(tools_as_json):
  """TRL's tool-calling SFT rows: an assistant turn of tool calls (no content), a tool turn with
  its name, the schemas in a "tools" column (a list, or JSON text as TRL reads it). The ids are
  transformers' own render of the whole conversation with tools=, and the loss is on the two
  assistant turns, the call included. Before, messages kept only role and content and the
  tools column was ignored: no schemas in the context and an empty first assistant turn (the
  model learned to end its turn where it should call the tool)."""
  import json
  tok = _tokenizer(TOOLS_TEMPLATE)
  tools = json.dumps([TOOL_SCHEMA]) if tools_as_json else [TOOL_SCHEMA]
  ids, mask = sft_data.encode_row(tok, _row(messages=TOOL_CALL_ROW, tools=tools), EOS)
  want = tok.apply_chat_template(TOOL_CALL_ROW, tools=[TOOL_SCHEMA], tokenize=False)
  assert want.startswith('<|system|>\ntools: multiply<|end|>\n')
  assert tok.decode(ids) == want
  assert _trained_text(tok, ids, mask) == (
      '<call>multiply{"a": 6, "b": 7}</call><|end|>\nIt is 42.<|end|>\n')
  # chat_template_kwargs reach the template too (a conversational prompt-completion row).
  ids, mask = sft_data.encode_row(tok, _row(
      prompt=TOOL_CALL_ROW[:1], completion=[{'role': 'assistant', 'content': '42'}],
      chat_template_kwargs={'enable_thinking': False}), EOS)
  assert tok.decode(ids) == '/no_think\n<|user|>\nWhat is 6*7?<|end|>\n<|assistant|>\n42<|end|>\n'
  assert _trained_text(tok, ids, mask) == '42<|end|>\n'


def test_a_string_rows_own_template_columns_reach_the_template():
  """A string prompt-completion row goes through the template as one user message (the
  library's rule): its own chat_template_kwargs and tools columns reach that render, as they do
  for message rows and DPO rows. The reference is transformers' render with them. Before, both
  columns were dropped for string rows: a row's enable_thinking=False trained in thinking mode."""
  tok = _tokenizer(TOOLS_TEMPLATE)
  row = _row(prompt='What is 6*7?', completion='42', tools=[TOOL_SCHEMA],
             chat_template_kwargs={'enable_thinking': False})
  ids, mask = sft_data.encode_row(tok, row, EOS)
  head = tok.apply_chat_template([{'role': 'user', 'content': 'What is 6*7?'}],
                                 add_generation_prompt=True, tokenize=False, tools=[TOOL_SCHEMA],
                                 enable_thinking=False)
  assert head.startswith('/no_think\n<|system|>\ntools: multiply')
  n = len(tok(head, add_special_tokens=False)['input_ids'])
  assert ids[:n] == tok(head, add_special_tokens=False)['input_ids'] and not any(mask[:n])


def test_without_assistant_only_loss_a_rewriting_template_trains_the_whole_render():
  """sft.assistant_only_loss=False trains every token of the conversation as the template
  renders it whole (TRL 1.16's tokenization), so a template that rewrites earlier turns (Qwen3's
  drops their reasoning blocks: here, the last assistant turn alone gets one) is fine; with
  assistant_only_loss its assistant text cannot be found and the row is refused, as before.
  Before, the row was refused either way."""
  tok = _tokenizer("{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' and "
                   "loop.last %}<think></think>{% endif %}{{ m.content }}<|end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
  messages = [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'},
              {'role': 'user', 'content': 'c'}, {'role': 'assistant', 'content': 'd'}]
  ids, mask = sft_data.encode_row(tok, _row(messages=messages), EOS, assistant_only=False)
  assert ids == tok(tok.apply_chat_template(messages, tokenize=False),
                    add_special_tokens=False)['input_ids']
  assert mask == [0] + [1] * (len(ids) - 1)
  with pytest.raises(ConfigError, match='renders an earlier part of this conversation'):
    sft_data.encode_row(tok, _row(messages=messages), EOS)


@pytest.mark.parametrize('column,value,message', [
    ('tools', 'not json', r'"tools" must be a list of tool schemas'),
    ('tools', {'name': 'f'}, r'"tools" must be a list of tool schemas'),
    ('chat_template_kwargs', ['x'], r'"chat_template_kwargs" must be a dict'),
])
def test_bad_template_columns_are_one_error_naming_the_row(column, value, message):
  with pytest.raises(ConfigError, match=rf'^d.jsonl:1: {message}'):
    _row(messages=CONVERSATIONS[0], **{column: value})


def test_without_data_eval_rows_are_held_out_only_to_be_asked_and_scored(tmp_path, capsys):
  """TRL's SFTTrainer trains on every row of train_dataset. Without data.eval a share of the rows
  is held out for the held-out evaluation, so only rows it can ask (a prompt: text rows have
  none) and only when a reward function can score them; said in one line. Before, 10% of any
  rows (text included) were held out with no word, text rows never evaluated, and the
  evaluation reported accuracy 0.000 with nothing to score."""
  from jaxrl_ga import data as data_lib  # pylint: disable=g-import-not-at-top
  rows = ([{'text': f'document {i}.'} for i in range(10)]
          + [{'prompt': f'What is {i}+1?', 'completion': str(i + 1)} for i in range(20)])
  path = tmp_path / 'rows.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  cfg = _sft_cfg(path)
  task = data_lib.build_task(cfg, reward_funcs=[])
  assert len(task.train) == 30 and not task.eval_rows
  assert task.held_out_note.startswith('[sft] data.train: 0 of 30 rows held out')
  task = data_lib.build_task(cfg, reward_funcs=['final_answer'])
  held = [r for r in rows if r not in [dict(t) for t in task.train]]
  assert len(task.eval_rows) == 2 == len(held)  # round(0.1 * 20) of the 20 prompt rows
  assert all('prompt' in r for r in held) and len(task.train) == 28
  assert task.held_out_note.startswith(
      '[sft] data.train: 2 of 30 rows held out for the held-out evaluation '
      '(data.eval_fraction=0.1)')
  # No reward: the line is on the console, and the evaluation says n/a, not an accuracy of 0.
  summary = api.run(api.make_config(cfg, **{'sft.num_steps': 1}), str(tmp_path / 'wd'))
  out = capsys.readouterr().out
  assert summary.get('eval/accuracy_after') is None
  assert 'held-out accuracy after SFT: n/a' in out and '[sft] data.train: 0 of 30 rows' in out


def test_trls_loss_mask_options_train_on_every_token():
  """TRL 1.16's assistant_only_loss=False (its default) trains a conversation on every token,
  and completion_only_loss=False a prompt-completion row on its prompt too: the labels are the
  input ids, every token but the first predicted. The ids do not change, and a text row is the
  same either way. Through the run's config: the encoded rows of build_context."""
  tok = _tokenizer()
  rows = [_row(messages=CONVERSATIONS[1]),
          _row(prompt=[{'role': 'user', 'content': 'What is 2+3?'}],
               completion=[{'role': 'assistant', 'content': '5'}]),
          _row(prompt='What is 2+3?', completion='5'), _row(text='abc')]
  for row in rows:
    ids, mask = sft_data.encode_row(tok, row, EOS)
    all_ids, all_mask = sft_data.encode_row(tok, row, EOS, assistant_only=False,
                                            completion_only=False)
    assert all_ids == ids and all_mask == [0] + [1] * (len(ids) - 1)
    assert (mask == all_mask) == ('text' in row)  # the defaults mask the prompt, text aside
  only = lambda **kw: [sft_data.encode_row(tok, r, EOS, **kw)[1] for r in rows]
  assert only(assistant_only=False)[1:] == only()[1:]  # each option its own rows' kind
  assert only(completion_only=False)[0] == only()[0]


def test_the_loss_mask_options_reach_the_encoded_rows(tmp_path):
  path = tmp_path / 'rows.jsonl'
  path.write_text(json.dumps(GOOD) + '\n')
  for value in (True, False):
    ctx, _ = api.build_context(_sft_cfg(path, **{'sft.assistant_only_loss': value,
                                                 'data.eval': str(path)}), str(tmp_path / str(value)))
    ids, mask = ctx.task.sequences[0]
    assert (mask == [0] + [1] * (len(ids) - 1)) == (not value)
