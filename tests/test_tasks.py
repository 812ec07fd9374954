"""Task layer: char tokenizer, arithmetic and GSM8K tasks, rewards, the registry. Host-side only."""

import itertools
import json
import os
import pickle
import re
import sys
import types

import numpy as np
import pytest
import transformers

from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga import tasks
from jaxrl_ga.tasks import arithmetic, gsm8k
from jaxrl_ga.tasks.base import Example, reward_fields

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'gsm8k_tiny.jsonl')
TEXT_ALPHABET = '0123456789+-*=() \n.,:?abcdefghijklmnopqrstuvwxyzXYZ'


# -- tokenizer ------------------------------------------------------------------------------------
def _ids(tok, text):
  return tok(text, add_special_tokens=True)['input_ids']


def test_char_tokenizer_ids_and_round_trip():
  tok = tasks.build_char_tokenizer(TEXT_ALPHABET)
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
  assert (tok.pad_token, tok.bos_token, tok.eos_token) == ('<pad>', '<bos>', '<eos>')
  assert len(tok) == 3 + len(TEXT_ALPHABET)
  assert _ids(tok, '0') == [3] and _ids(tok, ' ') == [3 + TEXT_ALPHABET.index(' ')]
  text = 'what is 12 + 34?\n  46.\n\nxyz: (7*8)=56 '
  ids = _ids(tok, text)
  assert len(ids) == len(text)  # one token per character, no specials added
  assert tok.decode(ids) == text
  assert tok.decode([1] + ids + [2, 0, 0], skip_special_tokens=True) == text
  assert tasks.build_char_tokenizer(TEXT_ALPHABET).get_vocab() == tok.get_vocab()  # deterministic


def test_char_tokenizer_non_ascii_and_unknown_characters():
  tok = tasks.build_char_tokenizer('ab é')
  assert tok.decode(_ids(tok, 'é a b')) == 'é a b'
  assert len(_ids(tok, 'é')) == 2  # one token per UTF-8 byte
  assert tok.decode(_ids(tok, 'abc')) == 'ab'  # out-of-alphabet characters are dropped
  with pytest.raises(ValueError, match='empty'):
    tasks.build_char_tokenizer('')


@pytest.mark.parametrize('model_type', [None, 'qwen2', 'llama'])
def test_char_tokenizer_reloads_with_same_ids(tmp_path, model_type):
  tok = tasks.build_char_tokenizer(TEXT_ALPHABET)
  tok.save_pretrained(tmp_path)
  if model_type:  # as an exported checkpoint: transformers 5 picks Qwen2Tokenizer for qwen2
    transformers.AutoConfig.for_model(model_type, vocab_size=64).save_pretrained(tmp_path)
  text = '12 + 34 =\n46  xyz'
  for loaded in (transformers.AutoTokenizer.from_pretrained(tmp_path),
                 transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)):
    assert _ids(loaded, text) == _ids(tok, text), type(loaded).__name__
    assert loaded.decode(_ids(loaded, text)) == text
    assert len(loaded) == len(tok)  # no extra '<|endoftext|>' unk from Qwen2Tokenizer
    assert ((loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id)
            == (0, 1, 2)), type(loaded).__name__


# -- Example and reward_fields ---------------------------------------------------------------------
def test_example_fields_hold_answer_and_pickle():
  ex = Example('1+1=', '2')
  assert ex.fields == {'answer': '2'}
  assert pickle.loads(pickle.dumps(ex)) == ex
  with pytest.raises(ValueError, match='differs'):
    Example('1+1=', '2', fields={'answer': '3'})
  cols = reward_fields([Example('a', '1', {'k': 'x'}), Example('b', '2', {'k': 'y'})], 2)
  assert cols == {'answer': ['1', '1', '2', '2'], 'k': ['x', 'x', 'y', 'y']}
  assert reward_fields([]) == {}
  # TRL 1.16 leaves a data row's completion and completion_ids out of the reward keywords
  # (_calculate_rewards): completion_ids is its own keyword, the ids of the sampled completion.
  cols = reward_fields([Example('a', '1', {'completion': 'ref', 'completion_ids': [1], 'k': 0})])
  assert cols == {'answer': ['1'], 'k': [0]}


# -- arithmetic -----------------------------------------------------------------------------------
_PROBLEM = re.compile(r'([0-9]+)([-+*])([0-9]+)=')


def _solve(prompt):
  a, op, b = _PROBLEM.fullmatch(prompt).groups()
  return int(a), op, int(b), {'+': int(a) + int(b), '-': int(a) - int(b),
                              '*': int(a) * int(b)}[op]


def test_arithmetic_examples_are_well_formed():
  task = tasks.get_task('arithmetic', num_digits=2, operations='+-*')
  seen_ops = set()
  for ex in itertools.islice(task.train_examples(seed=3), 500):
    a, op, b, value = _solve(ex.prompt)
    seen_ops.add(op)
    assert 0 <= a < 100 and 0 <= b < 100 and value >= 0
    assert ex.answer == str(value) and ex.fields['answer'] == ex.answer
  assert seen_ops == set('+-*')


def test_arithmetic_deterministic_and_resumable():
  task = tasks.get_task('arithmetic')
  stream = list(itertools.islice(task.train_examples(seed=7), 60))
  assert stream == [task.train_example(i, 7) for i in range(60)]
  assert stream[25:] == list(itertools.islice(task.train_examples(seed=7, start=25), 35))
  assert stream == [tasks.get_task('arithmetic').train_example(i, 7) for i in range(60)]
  assert stream != [task.train_example(i, 8) for i in range(60)]
  assert len({ex.prompt for ex in stream}) > 50  # i.i.d. draws from 9,000 training problems
  with pytest.raises(ValueError, match='>= 0'):
    task.train_example(-1, 0)


def test_arithmetic_eval_is_fixed_and_held_out():
  task = tasks.get_task('arithmetic', operations='+-')
  evals = task.eval_examples()
  assert len(evals) == 256 and len({ex.prompt for ex in evals}) == 256
  assert evals == tasks.get_task('arithmetic', operations='+-').eval_examples()
  assert evals[:10] == tasks.get_task('arithmetic', operations='+-', num_eval=10).eval_examples()
  for ex in evals:
    a, op, b, _ = _solve(ex.prompt)
    assert task.is_held_out(a, op, b)
  eval_prompts = {ex.prompt for ex in evals}
  for ex in itertools.islice(task.train_examples(seed=0), 5000):
    a, op, b, _ = _solve(ex.prompt)
    assert not task.is_held_out(a, op, b) and ex.prompt not in eval_prompts


def test_arithmetic_split_fraction_and_nesting():
  a, b = np.meshgrid(np.arange(100), np.arange(100))
  op = np.zeros(a.size, np.int64)
  small = arithmetic.held_out_mask(op, a.ravel(), b.ravel(), 0.1)
  large = arithmetic.held_out_mask(op, a.ravel(), b.ravel(), 0.3)
  assert 0.08 < small.mean() < 0.12 and 0.27 < large.mean() < 0.33
  assert np.all(large[small])  # raising eval_fraction only adds problems to the held-out set


@pytest.mark.parametrize('reverse', [True, False])
def test_arithmetic_sft_completion_is_correct(reverse):
  task = tasks.get_task('arithmetic', reverse_answer=reverse)
  tok = task.tokenizer()
  for ex in itertools.chain(itertools.islice(task.train_examples(0), 200), task.eval_examples()):
    completion = task.sft_completion(ex)
    assert completion == (ex.answer[::-1] if reverse else ex.answer)
    assert task.is_correct(ex, completion)
    assert len(_ids(tok, ex.prompt)) <= task.max_prompt_length
    assert len(_ids(tok, completion)) + 1 <= task.max_completion_length
    assert tok.decode(_ids(tok, ex.prompt + completion)) == ex.prompt + completion
  assert task.sft_completion(task.example_for(99, '+', 99)) == ('891' if reverse else '198')
  assert task.max_prompt_length == 6 and task.max_completion_length == 4


@pytest.mark.parametrize('reverse, completion, correct, well_formed', [
    (True, '28', 1, 1),
    (True, ' 28\n', 1, 1),      # surrounding whitespace is stripped
    (True, '82', 0, 1),         # wrong: not reversed
    (True, '280', 0, 1),        # reads back as '082': leading zero is wrong
    (True, '2 8', 0, 0),        # malformed
    (True, '', 0, 0),           # empty (e.g. eos first)
    (True, '28+1', 0, 0),       # trailing junk
    (True, '28=', 0, 0),
    (False, '82', 1, 1),
    (False, '082', 0, 1),
    (False, '-82', 0, 1),
    (False, '83', 0, 1),
    (False, 'x82', 0, 0),
])
def test_arithmetic_rewards(reverse, completion, correct, well_formed):
  task = tasks.get_task('arithmetic', reverse_answer=reverse)
  ex = task.example_for(37, '+', 45)
  assert (ex.prompt, ex.answer) == ('37+45=', '82')
  total, per_fn = rewards_lib.compute_rewards(task.reward_functions(), [ex.prompt],
                                              [completion], reward_fields([ex]))
  assert per_fn['correct'][0] == correct and per_fn['format'][0] == well_formed
  np.testing.assert_allclose(total, [1.0 * correct + 0.1 * well_formed], rtol=1e-6)
  assert task.is_correct(ex, completion) == bool(correct)


def test_arithmetic_reward_weights_and_groups():
  task = tasks.get_task('arithmetic', reverse_answer=False)
  exs = [task.example_for(1, '+', 2), task.example_for(9, '*', 9)]
  fns = task.reward_functions(correct_weight=2.0, format_weight=0.0)
  assert [(r.name, r.weight) for r in fns] == [('correct', 2.0), ('format', 0.0)]
  total, per_fn = rewards_lib.compute_rewards(
      fns, [ex.prompt for ex in exs for _ in range(2)], ['3', '4', '81', 'x'],
      reward_fields(exs, num_generations=2))
  np.testing.assert_array_equal(per_fn['correct'], [1, 0, 1, 0])
  np.testing.assert_array_equal(per_fn['format'], [1, 1, 1, 0])
  np.testing.assert_array_equal(total, [2, 0, 2, 0])


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_digits=0), 'num_digits'),
    (dict(num_digits=10), 'num_digits'),
    (dict(operations='/'), 'operations'),
    (dict(operations=''), 'operations'),
    (dict(eval_fraction=1.0), 'eval_fraction'),
    (dict(num_eval=0), 'num_eval'),
    (dict(num_digits=1, num_eval=256), 'held-out problems'),
])
def test_arithmetic_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tasks.get_task('arithmetic', **kwargs)


def test_arithmetic_tokenizer_vocab():
  tok = tasks.get_task('arithmetic').tokenizer()
  assert len(tok) == 3 + len(arithmetic.ALPHABET)
  assert tok.convert_ids_to_tokens(list(range(3, 7))) == ['0', '1', '2', '3']


# -- GSM8K ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('text, number', [
    ('so 1,000 + 234 = 1,234\n#### 1,234', '1234'),
    ('#### $5.', '5'),
    ('#### 5', '5'),
    ('####12', '12'),
    ('#### -3', '-3'),
    ('#### -$7', '-7'),
    ('#### $-7', '-7'),
    ('#### 2.5', '2.5'),
    ('#### 1,234.50.', '1234.50'),
    ('#### .5', '.5'),
    ('#### 72 dollars', '72'),
    ('#### 3\nthen\n#### 4', '4'),  # the last marker wins
    ('The answer is 42.', None),
    ('', None),
    ('####', None),
    ('#### $', None),
    ('#### -', None),
    ('#### ,', None),
    ('#### forty', None),
])
def test_gsm8k_extract_final_number(text, number):
  assert gsm8k.extract_final_number(text) == number


def test_gsm8k_numbers_equal():
  assert gsm8k.numbers_equal('2.50', '2.5') and gsm8k.numbers_equal('.5', '0.5')
  assert gsm8k.numbers_equal('1234', '1234') and not gsm8k.numbers_equal('-3', '3')
  assert not gsm8k.numbers_equal('5', 'five')


def _no_datasets(monkeypatch):
  monkeypatch.setitem(sys.modules, 'datasets', None)  # makes `import datasets` fail


def test_gsm8k_loads_local_jsonl_offline_without_datasets(monkeypatch):
  _no_datasets(monkeypatch)
  rows = tasks.load_gsm8k(FIXTURE, split='train')
  with open(FIXTURE, encoding='utf-8') as f:
    assert rows == [json.loads(line) for line in f]
  assert len(rows) >= 10 and all(set(r) == {'question', 'answer'} for r in rows)
  assert all(gsm8k.extract_final_number(r['answer']) for r in rows)


def test_gsm8k_loads_a_local_dataset_through_datasets(tmp_path, monkeypatch):
  """``datasets`` is in the test extra, so this runs (no skip). A JSONL file that ``datasets``
  itself writes from in-memory records loads through ``datasets.load_dataset('json', ...)``,
  offline (hub off, a private cache), in order, extra columns dropped."""
  import datasets  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(datasets.config, 'HF_HUB_OFFLINE', True)
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_OFFLINE', True)
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_CACHE', str(tmp_path / 'cache'))
  records = [{'question': f'What is {i} + {i}?', 'answer': f'{i} + {i} = {2 * i}\n#### {2 * i}',
              'id': i} for i in range(7)]
  path = str(tmp_path / 'tiny_gsm8k.jsonl')
  datasets.Dataset.from_list(records).to_json(path)
  calls, load_dataset = [], datasets.load_dataset

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    return load_dataset(*args, **kwargs)

  monkeypatch.setattr(datasets, 'load_dataset', spy)
  rows = tasks.load_gsm8k(path, split='test')
  assert calls == [(('json',), {'data_files': {'test': path}, 'split': 'test'})]
  assert rows == [{'question': r['question'], 'answer': r['answer']} for r in records]
  assert os.listdir(tmp_path / 'cache')  # datasets cached there, not in the home directory


def test_gsm8k_routes_through_datasets(monkeypatch):
  calls = []

  def load_dataset(*args, **kwargs):
    calls.append((args, kwargs))
    return [{'question': 'q?', 'answer': 'a\n#### 1', 'extra': 0}]

  monkeypatch.setitem(sys.modules, 'datasets', types.SimpleNamespace(load_dataset=load_dataset))
  assert tasks.load_gsm8k() == [{'question': 'q?', 'answer': 'a\n#### 1'}]
  tasks.load_gsm8k(FIXTURE, split='test')
  assert calls == [(('openai/gsm8k', 'main'), {'split': 'train'}),
                   (('json',), {'data_files': {'test': FIXTURE}, 'split': 'test'})]


def test_gsm8k_hub_without_datasets_says_how_to_install(monkeypatch):
  _no_datasets(monkeypatch)
  with pytest.raises(ImportError, match='pip install datasets'):
    tasks.load_gsm8k('openai/gsm8k')


def test_gsm8k_bad_files(tmp_path, monkeypatch):
  _no_datasets(monkeypatch)
  with pytest.raises(FileNotFoundError):
    tasks.load_gsm8k(str(tmp_path / 'missing.jsonl'))
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
  with pytest.raises(ValueError, match='bad.jsonl:2'):
    tasks.load_gsm8k(str(bad))
  bad.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match='record 0'):
    tasks.load_gsm8k(str(bad))


@pytest.fixture(name='gsm_task')
def _gsm_task(monkeypatch):
  _no_datasets(monkeypatch)
  return tasks.get_task('gsm8k', source=FIXTURE)


def test_gsm8k_task_split_and_stream(gsm_task):
  train = [gsm_task.train_example(i, 0) for i in range(gsm_task.num_train())]
  evals = gsm_task.eval_examples()
  assert evals and train and len(train) + len(evals) == len(tasks.load_gsm8k(FIXTURE))
  assert not {e.fields['question'] for e in train} & {e.fields['question'] for e in evals}
  assert len({e.prompt for e in train}) == len(train)  # an epoch visits each problem once
  stream = list(itertools.islice(gsm_task.train_examples(seed=0), 3 * len(train)))
  assert stream[:len(train)] == train
  assert stream[5:] == list(itertools.islice(gsm_task.train_examples(0, start=5), len(stream) - 5))
  assert stream[len(train):2 * len(train)] != train  # a new order each epoch
  assert [gsm_task.train_example(i, 1) for i in range(len(train))] != train


def test_gsm8k_prompt_and_sft_completion(gsm_task):
  ex = gsm_task.train_example(0, 0)
  assert ex.prompt.startswith('Solve the math problem.') and ex.fields['question'] in ex.prompt
  assert '#### <number>' in ex.prompt
  completion = gsm_task.sft_completion(ex)
  assert '<<' not in completion and completion.endswith('#### ' + ex.fields['solution']
                                                        .rsplit('#### ', 1)[1])
  assert gsm_task.is_correct(ex, completion)
  custom = tasks.get_task('gsm8k', source=FIXTURE, prompt_template='Q: {question}\nA:',
                          strip_calculator_annotations=False)
  ex = custom.train_example(0, 0)
  assert ex.prompt == f'Q: {ex.fields["question"]}\nA:'
  assert custom.sft_completion(ex) == ex.fields['solution']


def test_gsm8k_rewards(gsm_task):
  ex = Example('Q', '1250', {'answer': '1250'})
  completions = ['25 * 50 = 1250\n#### 1,250', '#### $1250.', 'The answer is 1250.',
                 '#### 1251', '#### twelve', '', '#### 1250.00']
  _, per_fn = rewards_lib.compute_rewards(gsm_task.reward_functions(), ['Q'] * 7, completions,
                                          reward_fields([ex], 7))
  np.testing.assert_array_equal(per_fn['correct'], [1, 1, 0, 0, 0, 0, 1])
  np.testing.assert_array_equal(per_fn['format'], [1, 1, 0, 1, 0, 0, 1])
  assert gsm_task.tokenizer() is None


def test_gsm8k_config_errors(monkeypatch):
  _no_datasets(monkeypatch)
  with pytest.raises(ValueError, match='question'):
    tasks.get_task('gsm8k', prompt_template='no field')
  same = tasks.get_task('gsm8k', source=FIXTURE, eval_source=FIXTURE)
  with pytest.raises(ValueError, match='non-empty'):
    same.eval_examples()


# -- registry -------------------------------------------------------------------------------------
def test_get_task_registry():
  assert isinstance(tasks.get_task('arithmetic'), tasks.ArithmeticTask)
  assert tasks.get_task('arithmetic', num_digits=3).config.num_digits == 3
  assert isinstance(tasks.get_task('gsm8k', source=FIXTURE), tasks.GSM8KTask)  # loads lazily
  with pytest.raises(ValueError, match='arithmetic, gsm8k'):
    tasks.get_task('sudoku')
  with pytest.raises(ValueError, match='num_digit.*options: '):
    tasks.get_task('arithmetic', num_digit=3)
