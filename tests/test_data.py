"""Your data and rewards (jaxrl_ga.data, jaxrl_ga.rewards): every source reads the same rows, the
order is a seeded per-epoch permutation, bad input is one error naming file and line, and the
built-in rewards score by hand-checked cases."""

import json
import os
import subprocess
import sys
import textwrap

import helpers
import numpy as np
import pytest

from jaxrl_ga import data
from jaxrl_ga import rewards as R
from jaxrl_ga import rows as rows_lib
from jaxrl_ga.config import ConfigError, DataConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [{'prompt': f'{a}+{b} égale 数?', 'answer': str(a + b), 'lang': 'fr'}
        for a in range(4) for b in range(3)]


def _write_all(tmp_path, rows):
  """rows as .jsonl, .json, .csv, .parquet and a save_to_disk directory."""
  import datasets  # pylint: disable=g-import-not-at-top
  paths = {}
  paths['jsonl'] = tmp_path / 'd.jsonl'
  paths['jsonl'].write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                            encoding='utf-8')
  paths['json'] = tmp_path / 'd.json'
  paths['json'].write_text(json.dumps(rows, ensure_ascii=False), encoding='utf-8')
  paths['csv'] = tmp_path / 'd.csv'
  paths['csv'].write_text('prompt,answer,lang\n' + ''.join(
      f'"{r["prompt"]}",{r["answer"]},{r["lang"]}\n' for r in rows), encoding='utf-8')
  ds = datasets.Dataset.from_list(rows)
  paths['parquet'] = tmp_path / 'd.parquet'
  ds.to_parquet(str(paths['parquet']))
  paths['disk'] = tmp_path / 'disk'
  ds.save_to_disk(str(paths['disk']))
  return {k: str(v) for k, v in paths.items()}, ds


def test_every_source_reads_the_same_rows(tmp_path):
  paths, ds = _write_all(tmp_path, ROWS)
  for kind, source in list(paths.items()) + [('list', ROWS), ('dataset', ds)]:
    got = [dict(r) for r in data.read_rows(source)]
    assert got == ROWS, kind
  where = [r.where for r in data.read_rows(paths['jsonl'])]
  assert where[:2] == [f'data.train={paths["jsonl"]}:1', f'data.train={paths["jsonl"]}:2']


def test_a_hub_id_reads_from_the_datasets_cache_offline(tmp_path):
  """The cache layout that `datasets` leaves after loading a hub dataset once, built here from a
  local file (no network): with HF_DATASETS_OFFLINE=1 the id 'someone/adds' loads from it."""
  import datasets  # pylint: disable=g-import-not-at-top
  paths, _ = _write_all(tmp_path, ROWS)
  cache = tmp_path / 'cache'
  datasets.load_dataset('json', data_files={'train': paths['jsonl']}, cache_dir=str(cache))
  (config_dir,) = (cache / 'json').iterdir()
  os.makedirs(cache / 'someone___adds')
  os.rename(config_dir, cache / 'someone___adds' / 'default')
  for arrow in (cache / 'someone___adds').rglob('json-train.arrow'):
    arrow.rename(arrow.with_name('adds-train.arrow'))
  env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_DATASETS_OFFLINE='1',
             HF_HUB_OFFLINE='1', HF_HOME=str(tmp_path / 'hf_home'), PYTHONPATH=ROOT)
  # One process (datasets reads these variables when it is imported): the rows of the cached
  # id, then the error of an id that is not cached.
  code = textwrap.dedent('''
      import json
      from jaxrl_ga import data
      from jaxrl_ga.config import ConfigError
      print(json.dumps([dict(r) for r in data.read_rows("someone/adds")], ensure_ascii=False))
      try:
        data.read_rows("someone/none")
      except ConfigError as e:
        print(json.dumps(str(e)))
  ''')
  done = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  rows, missing = done.stdout.splitlines()[-2:]
  assert json.loads(rows) == ROWS
  assert 'data.train=someone/none: the hub dataset (split \'train\') cannot be loaded' in (
      json.loads(missing))


def test_prompts_chat_messages_and_columns():
  rows = [{'question': 'q1', 'solution': '#### 3'},
          {'question': [{'role': 'system', 'content': 'be brief'},
                        {'role': 'user', 'content': 'q2'}], 'solution': '4'}]
  got = data.prepare(data.read_rows(rows), data.parse_columns('question:prompt'), 'data.train')
  assert got[0] == {'prompt': 'q1', 'solution': '#### 3'}
  assert got[1]['prompt'][1] == {'role': 'user', 'content': 'q2'}
  ex = data.DataTask(got, []).example(got[1])
  assert ex.fields == {'solution': '4'} and ex.answer is None
  # The plain template of a fresh model renders messages; a string is one user message.
  task = data.DataTask(got, got[:1], [R.WeightedReward('f', R.final_answer)])
  tok = task.tokenizer()
  from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top
  assert tok.decode(text.encode_prompt(tok, ex.prompt)) == (
      'system: be brief\nuser: q2\nassistant: ')
  assert tok.decode(text.encode_prompt(tok, 'q1')) == 'user: q1\nassistant: '


def test_epochs_are_seeded_permutations_and_positions_resume():
  rows = data.prepare(data.read_rows(ROWS), {}, 'data.train')
  task = data.DataTask(rows, rows[:1])
  n = len(rows)
  stream = [task.train_example(i, seed=3).prompt for i in range(3 * n)]
  for e in range(3):  # each epoch visits every row once
    assert sorted(stream[e * n:(e + 1) * n]) == sorted(r['prompt'] for r in rows)
  assert stream[:n] != stream[n:2 * n]  # a new order per epoch
  want = [rows[i]['prompt'] for i in np.random.default_rng([3, 1]).permutation(n)]
  assert stream[n:2 * n] == want
  fresh = data.DataTask(rows, rows[:1])  # a resumed run: position 2n+1 first, same example
  assert fresh.train_example(2 * n + 1, seed=3).prompt == stream[2 * n + 1]
  assert data.DataTask(rows, rows[:1], shuffle=False).train_example(n + 2, 3).prompt == (
      rows[2]['prompt'])


def test_held_out_fraction_is_seeded_and_disjoint():
  rows = data.prepare(data.read_rows(ROWS), {}, 'data.train')
  train, held = data.held_out_split(rows, 0.25, seed=0)
  assert len(held) == 3 and len(train) == 9
  assert not {r['prompt'] for r in train} & {r['prompt'] for r in held}
  assert data.held_out_split(rows, 0.25, seed=0)[1] == held
  assert data.held_out_split(rows, 0.25, seed=1)[1] != held


def _cfg(**values):
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  return api.make_config({'stages': 'grpo', 'grpo': {'schedule': {
      'micro_batch_size': 8, 'num_generations': 4, 'steps_per_generation': 1}}}, **values)


def _error(tmp_path, content=None, name='d.jsonl', raw=None, **cfg):
  path = tmp_path / name
  if raw is not None:
    path.write_bytes(raw)
  elif content is not None:
    path.write_text(content, encoding='utf-8')
  cfg = {'data.train': str(path), 'grpo.reward_funcs': 'final_answer', **cfg}
  with pytest.raises(ConfigError) as e:
    data.build_task(_cfg(**cfg))
  return str(e.value)


def test_bad_input_names_file_line_column_or_function(tmp_path):
  good = ''.join(json.dumps({'prompt': f'p{i}', 'answer': '1'}) + '\n' for i in range(20))
  p = tmp_path / 'd.jsonl'
  assert _error(tmp_path, name='nope.jsonl') == (
      f'data.train={tmp_path}/nope.jsonl: no such file; give an existing .jsonl, .json, .csv or '
      '.parquet file.')
  assert _error(tmp_path, good + '{"prompt": "x",\n') == (
      f'data.train={p}:21: invalid JSON (Expecting property name enclosed in double quotes: '
      'column 16); each line must be one JSON object.')
  msg = _error(tmp_path, raw=good.encode() + b'{"prompt": "caf\xe9"}\n')
  assert msg.startswith(f'data.train={p}:21: bytes that are not UTF-8')
  assert _error(tmp_path, good + '{"question": "x"}\n') == (
      f'data.train={p}:21: no "prompt" column (columns: question); rename a column with '
      'data.columns=<name>:prompt.')
  assert _error(tmp_path, good + '{"prompt": 7}\n').startswith(
      f'data.train={p}:21: the prompt is a int (\'7\'); give a string or a list of chat messages')
  assert _error(tmp_path, good + '{"prompt": [{"role": "user"}]}\n').startswith(
      f'data.train={p}:21: the prompt is a list')
  assert _error(tmp_path, '\n') == 'data.train is empty; give at least one row.'
  few = ''.join(json.dumps({'prompt': f'p{i}'}) + '\n' for i in range(3))
  assert 'fewer than the 4 distinct prompts one rollout needs' in _error(
      tmp_path, few, **{'grpo.schedule.steps_per_generation': 2})
  assert _error(tmp_path, good, **{'grpo.reward_funcs': ''}).startswith(
      'data.train needs reward functions: set grpo.reward_funcs=')
  assert _error(tmp_path, good, **{'stages': 'sft,grpo'}).startswith(
      'stages=sft,grpo: data.train rows train GRPO (stages=grpo), SFT alone (stages=sft)')


def test_a_jsonl_file_is_parsed_only_at_the_rows_a_process_trains_on(tmp_path, monkeypatch):
  """build_task with ``owns`` (a process's GRPO data positions) parses the held-out rows and the
  rows at its positions of the first epoch, no other line; a fresh model's tokenizer covers
  every character (escaped in the file) without parsing a line."""
  rows = [{'prompt': f'p{i} caf\u00e9 \U0001F600\t', 'answer': str(i)} for i in range(20)]
  lines = []
  for i, r in enumerate(rows):
    lines.append(json.dumps(r))  # ensure_ascii: the accent, the emoji and the tab are escapes
    lines += ['  '] if i % 5 == 0 else []  # a blank line is no row
  (tmp_path / 'd.jsonl').write_text('\r\n'.join(lines) + '\r\n', encoding='utf-8')
  line_of = [n for n, l in enumerate(lines, 1) if l.strip()]  # row i's line (1-based)
  parsed, parse = [], rows_lib._jsonl_line  # pylint: disable=protected-access
  monkeypatch.setattr(rows_lib, '_jsonl_line', lambda l, n, *a: parsed.append(n) or parse(l, n, *a))
  cfg = _cfg(**{'data.train': str(tmp_path / 'd.jsonl'), 'grpo.reward_funcs': 'final_answer'})
  task = data.build_task(cfg, owns=lambda position: position % 2 == 0)
  held = np.random.default_rng([cfg.seed, 4099]).permutation(20)[:2]  # 10% held out
  train = [i for i in range(20) if i not in held]
  epoch = np.random.default_rng([cfg.seed, 0]).permutation(18)
  want = {line_of[i] for i in held} | {line_of[train[epoch[d]]] for d in range(0, 18, 2)}
  assert set(parsed) == want and len(want) == 11
  assert sorted(e.prompt for e in task.eval_examples()) == sorted(rows[i]['prompt'] for i in held)
  count = len(parsed)
  tok = task.tokenizer()
  assert len(parsed) == count  # the vocabulary came from the file's text
  for r in rows:
    assert tok.decode(tok.encode(r['prompt'], add_special_tokens=False)) == r['prompt']


def test_reward_import_strings(tmp_path, monkeypatch):
  (tmp_path / 'user_rewards_mod.py').write_text(textwrap.dedent('''
      NOT_A_FUNCTION = 3
      def exact(prompts, completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]
  '''))
  (tmp_path / 'broken_rewards_mod.py').write_text('import no_such_module_here\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  got = R.resolve('user_rewards_mod:exact=2, final_answer, length_penalty=0.5')
  assert [(r.name, r.weight, r.marks_correctness) for r in got] == [
      ('exact', 2.0, False), ('final_answer', 1.0, True), ('length_penalty', 0.5, False)]
  fn = lambda p, c, **k: [0.0] * len(c)  # noqa: E731
  assert [(r.name, r.weight) for r in R.resolve([fn, (R.final_answer, 3)])] == [
      ('<lambda>', 1.0), ('final_answer', 3.0)]
  with pytest.raises(ConfigError, match=r"grpo.reward_funcs: 'broken_rewards_mod:f': module "
                                        r"'broken_rewards_mod' does not import \("
                                        r"ModuleNotFoundError: No module named "
                                        r"'no_such_module_here'\); put its directory on "
                                        r"PYTHONPATH."):
    R.resolve('broken_rewards_mod:f')
  with pytest.raises(ConfigError, match=r"'user_rewards_mod:NOT_A_FUNCTION': "
                                        r"user_rewards_mod:NOT_A_FUNCTION is not callable \(type "
                                        r"int\); name a function"):
    R.resolve('user_rewards_mod:NOT_A_FUNCTION')
  with pytest.raises(ConfigError, match=r"module 'user_rewards_mod' has no 'exakt'"):
    R.resolve('user_rewards_mod:exakt')
  with pytest.raises(ConfigError, match=r"the weight 'x' is not a number"):
    R.resolve('user_rewards_mod:exact=x')
  with pytest.raises(ConfigError, match=r"not \"module:function\[=weight\]\" nor a built-in"):
    R.resolve('exact')
  with pytest.raises(ConfigError, match=r'name\(s\) final_answer given twice'):
    R.resolve('final_answer,final_answer=2')


def test_builtin_rewards_by_hand():
  completions = ['so #### 42', 'thus \\boxed{42}', 'it is 41, no 42.', '#### 1,234',
                 '\\boxed{x}', 'no number', '#### 42.0']
  answers = ['42', '#### 42', '42', '1234', '1', '3', '42']
  got = R.final_answer([''] * 7, completions, answer=answers)
  assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
  assert R.final_answer(['', ''], ['42', '7'], answer=[None, 'seven']) == [None, None]
  assert R.final_answer(['', ''], ['42', '7']) == [None, None]  # no answer column
  assert R.answer_format([''] * 4, ['x #### 5', '\\boxed{a}', '5', '####']) == [1, 1, 0, 0]
  assert R.length_penalty(['', ''], ['abc', '']) == [-0.003, -0.0]
  bold = R.regex_reward(r'\*\*.*\*\*', 'bold')
  assert bold.__name__ == 'bold' and bold([''] * 2, ['**x**', 'x']) == [1.0, 0.0]


def test_none_means_does_not_apply(monkeypatch):
  warnings = []
  monkeypatch.setattr(R, '_warned_none_apply', False)
  monkeypatch.setattr(R.logging, 'warning', lambda msg, *a: warnings.append(msg % a))
  a = R.WeightedReward('a', lambda p, c, **k: [1.0, None, None], 2.0)
  b = R.WeightedReward('b', lambda p, c, **k: [0.5, 3.0, None], 1.0)
  total, per_fn = R.compute_rewards([a, b], ['p'] * 3, ['x', 'y', 'z'])
  np.testing.assert_array_equal(total, np.float32([2.5, 3.0, 0.0]))
  np.testing.assert_array_equal(per_fn['a'], np.float32([1.0, np.nan, np.nan]))
  R.compute_rewards([a, b], ['p'] * 3, ['x', 'y', 'z'])
  # No completions (a process without held-out rows): empty arrays, no error.
  each = R.WeightedReward('each', lambda p, c, **k: [None for _ in c])
  total, per_fn = R.compute_rewards([each], [], [])
  assert total.shape == per_fn['each'].shape == (0,)
  assert warnings == ['no reward function applies to 1 of 3 completions (every one returned '
                      'None): their total reward is 0 in the logs, and in GRPO they count in no '
                      'group statistic and get advantage 0, as in TRL. (Warned once.)']


def test_data_config_columns_from_a_mapping():
  assert DataConfig(columns={'question': 'prompt', 'sol': 'answer'}).columns == (
      'question:prompt,sol:answer')
  with pytest.raises(ConfigError, match='data.eval_fraction must be in'):
    DataConfig(eval_fraction=1.0)


# -- end to end: your JSONL and reward module, through the CLI and through the Python API ---------
USER_REWARDS = '''
"""A user's reward module, outside the package: it logs every call to $USER_REWARD_LOG."""
import json
import os


def _log(fn, prompts, completions, columns):
  with open(os.environ['USER_REWARD_LOG'], 'a', encoding='utf-8') as f:
    for i, (p, c) in enumerate(zip(prompts, completions)):
      f.write(json.dumps({'fn': fn, 'prompt': p, 'completion': c,
                          **{k: v[i] for k, v in columns.items() if k not in TRL_KEYWORDS}},
                         ensure_ascii=False) + '\\n')


# TRL's keywords besides the columns (rewards.trl_keywords): a **columns function gets them too
TRL_KEYWORDS = ('completion_ids', 'trainer_state', 'log_extra', 'log_metric')


def correct(prompts, completions, answer, **columns):
  _log('correct', prompts, completions, dict(answer=answer, **columns))
  return [float(c.strip() == a) for c, a in zip(completions, answer)]


def brevity(prompts, completions, lang, **columns):
  """Does not apply to French rows (None)."""
  _log('brevity', prompts, completions, dict(lang=lang, **columns))
  columns['log_metric']('brevity/rows', float(len(completions)))  # TRL's logging keywords
  columns['log_extra']('chars', [len(c) for c in completions])
  return [None if l == 'fr' else -len(c) / 10 for c, l in zip(completions, lang)]


def share_with_digit(prompts, completions, **columns):
  return [float(any(ch.isdigit() for ch in c)) for c in completions]
'''


def _user_rows(n, split):
  rows = []
  for i in range(n):
    a, b = i % 7, (3 * i) % 5
    lang = ('en', 'fr', 'zh')[i % 3]
    text = {'en': f'{a}+{b}=', 'fr': f'{a}+{b} égale ?', 'zh': f'{a}加{b}等于'}[lang]
    prompt = text if i % 2 else [{'role': 'system', 'content': 'Réponds ✓'},
                                 {'role': 'user', 'content': text}]
    rows.append({'prompt': prompt, 'answer': str(a + b), 'lang': lang, 'id': f'{split}{i}',
                 'split': split})
  return rows


_OVERRIDES = {'stages': 'grpo', 'grpo.num_steps': 2, 'grpo.sampling.max_prompt_length': 64,
              'grpo.sampling.max_completion_length': 4, 'eval.max_completion_length': 4,
              'model.max_position_embeddings': 96, 'grpo.completions_every': 1,
              'grpo.completions_logged': 16, 'checkpoint.every_steps': 0}


def _env(tmp_path, log):
  """The CLI's environment: this process's 8 devices and matmul precision (conftest.py), so that
  its run and the Python API's in this process compute the same, bit for bit."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=f'{ROOT}:{tmp_path / "user"}',
             USER_REWARD_LOG=str(log), JAX_DEFAULT_MATMUL_PRECISION='highest')
  env['XLA_FLAGS'] = helpers.xla_flags(8)
  return env


def _params(workdir):
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  directory = os.path.join(workdir, 'checkpoints', 'grpo')
  stored, _, _ = checkpoint.Checkpointer(directory).restore_raw(
      checkpoint.latest_step(directory))
  return stored['learner']['params']


@pytest.mark.slow
def test_your_jsonl_and_reward_module_cli_and_python_api_agree(tmp_path, monkeypatch):
  """A JSONL (multi-byte text; every other prompt a chat message list) and a reward module outside
  the package: GRPO through the CLI (import strings) and through the Python API (callables) ends
  with bitwise-equal params; the reward functions saw every completion with its row's columns;
  completions.jsonl holds each completion with its rewards and its group advantage."""
  (tmp_path / 'user').mkdir()
  (tmp_path / 'user' / 'user_rewards.py').write_text(USER_REWARDS, encoding='utf-8')
  train, held_out = _user_rows(24, 'train'), _user_rows(6, 'eval')
  for name, rows in (('train.jsonl', train), ('eval.jsonl', held_out)):
    (tmp_path / name).write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                                 encoding='utf-8')
  overrides = {**_OVERRIDES, 'grpo.sampling.max_prompt_length': 0}  # the data's longest prompt
  cli = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={tmp_path / "cli"}', f'--config.data.train={tmp_path / "train.jsonl"}',
       f'--config.data.eval={tmp_path / "eval.jsonl"}',
       '--config.grpo.reward_funcs=user_rewards:correct,user_rewards:brevity=0.5',
       '--config.eval.metric=user_rewards:share_with_digit',
       *[f'--config.{k}={v}' for k, v in overrides.items()]],
      cwd=ROOT, env=_env(tmp_path, tmp_path / 'cli.log'), capture_output=True, text=True,
      timeout=600)
  assert cli.returncode == 0, cli.stderr[-3000:]
  # The Python API in this process (the CLI's subprocess is what the CLI test needs).
  monkeypatch.syspath_prepend(str(tmp_path / 'user'))
  monkeypatch.setenv('USER_REWARD_LOG', str(tmp_path / 'api.log'))
  import user_rewards  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from jaxrl_ga import GRPOTrainer  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.api import make_config  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  config = make_config(load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke'),
                       **overrides)
  eval_rows = [json.loads(l) for l in open(tmp_path / 'eval.jsonl', encoding='utf-8')]
  summary = GRPOTrainer(reward_funcs=[user_rewards.correct, (user_rewards.brevity, 0.5)],
                        train_dataset=str(tmp_path / 'train.jsonl'), eval_dataset=eval_rows,
                        config=config, workdir=str(tmp_path / 'api'),
                        metric=user_rewards.share_with_digit).train()
  sys.modules.pop('user_rewards', None)

  helpers.assert_trees_equal(_params(tmp_path / 'cli'), _params(tmp_path / 'api'))
  cli_log = [json.loads(l) for l in open(tmp_path / 'cli.log', encoding='utf-8')]
  api_log = [json.loads(l) for l in open(tmp_path / 'api.log', encoding='utf-8')]
  assert cli_log == api_log  # the same completions, in the same order, with the same columns
  # First the dry call before compiling (GRPOStage.check_inputs): 2 rows, 2 placeholders each.
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  dry = len(R.DRY_COMPLETIONS) * grpo.DRY_CALL_ROWS
  assert [r['completion'] for r in api_log[:2 * dry]] == 2 * list(R.DRY_COMPLETIONS) * 2
  api_log = api_log[2 * dry:]
  # The prompt width, chosen from the data: its longest prompt through the plain chat template,
  # one token per UTF-8 byte (tasks/tokenizer.py), counted here; rounded up to 8.
  as_messages = lambda p: [{'role': 'user', 'content': p}] if isinstance(p, str) else p
  longest = max(len((''.join(f'{m["role"]}: {m["content"]}\n' for m in as_messages(r['prompt']))
                     + 'assistant: ').encode('utf-8')) for r in train + held_out)
  assert (f'left-padded to grpo.sampling.max_prompt_length={-(-longest // 8) * 8} ' in cli.stdout
          and f'chosen from the data: its longest prompt has {longest} tokens)' in cli.stdout)

  by_id = {r['id']: r for r in train + held_out}
  for record in api_log:  # each completion came with its own row's prompt and columns
    row = by_id[record['id']]
    assert {k: record[k] for k in row} == row
  per_rollout = 16  # steps_per_generation * micro_batch_size
  train_seen = [r for r in api_log if r['split'] == 'train']
  for fn in ('correct', 'brevity'):
    assert len([r for r in train_seen if r['fn'] == fn]) == summary['grpo/rollouts'] * per_rollout
    evals = [r for r in api_log if r['split'] == 'eval' and r['fn'] == fn]
    assert sorted(r['id'] for r in evals) == sorted(2 * [r['id'] for r in held_out])  # before, after

  # completions.jsonl: every completion (16 logged of 16 per rollout), its rewards, recomputed
  # here, and its advantage: the float64 group formula over the G = 4 completions of its prompt.
  logged = [json.loads(l) for l in open(tmp_path / 'api' / 'completions.jsonl',
                                        encoding='utf-8')]
  assert len(logged) == summary['grpo/rollouts'] * per_rollout
  assert all(r['chars'] == len(r['completion']) for r in logged)  # the rewards' log_extra
  metrics = [json.loads(l) for l in open(tmp_path / 'api' / 'metrics.jsonl', encoding='utf-8')]
  rows = [m['brevity/rows'] for m in metrics if 'brevity/rows' in m]  # the rewards' log_metric
  assert rows and all(v == float(per_rollout) for v in rows)
  assert sorted((json.dumps(r['prompt']), r['completion']) for r in logged) == sorted(
      (json.dumps(r['prompt']), r['completion']) for r in train_seen if r['fn'] == 'correct')
  answer = {json.dumps(r['prompt'], ensure_ascii=False): r for r in train}
  for group in (logged[i:i + 4] for i in range(0, len(logged), 4)):
    assert len({json.dumps(r['prompt']) for r in group}) == 1
    row = answer[json.dumps(group[0]['prompt'], ensure_ascii=False)]
    want = []
    for r in group:
      correct = float(r['completion'].strip() == row['answer'])
      brevity = None if row['lang'] == 'fr' else -len(r['completion']) / 10
      assert r['reward/correct'] == correct
      assert r['reward/brevity'] == (None if brevity is None else pytest.approx(brevity))
      want.append(correct + (0.0 if brevity is None else 0.5 * brevity))
    want = np.asarray(want, np.float64)
    adv = (want - want.mean()) / (want.std(ddof=1) + 1e-4)
    if np.all(want == want[0]):
      adv = np.zeros(4)
    np.testing.assert_allclose([r['advantage'] for r in group], adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([r['reward'] for r in group], want, rtol=1e-6, atol=1e-6)
  # The held-out evaluation: each reward's mean and the metric's, before and after.
  assert summary['eval/accuracy_after'] is None  # no reward marks correctness
  assert {'eval/reward/correct_after', 'eval/reward/brevity_after',
          'eval/metric_after'} <= set(summary)
  assert 'held-out accuracy after GRPO: n/a (no reward marks correctness)' in cli.stdout


@pytest.mark.slow
def test_grpo_resume_is_bitwise_exact_with_a_file_dataset(tmp_path):
  """As tests/test_trainers.py's resume test, on a JSONL file with the built-in rewards: stopped
  in the middle of a rollout and again one micro-step into the next window (data positions
  mid-epoch: 12 training rows, 4 prompts per rollout), then resumed: the same params as an
  uninterrupted run. The prompt width is chosen from the data (max_prompt_length=0), as in the
  CLI test above: its longest prompt is as long as there, so the programs are the ones that test
  compiled."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  rows = _user_rows(15, 'train')
  for r in rows:
    r['answer'] = f'#### {r["answer"]}'  # final_answer reads the number after ####
  path = tmp_path / 'train.jsonl'
  path.write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                  encoding='utf-8')
  cfg = api.make_config(load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke'),
                        **{**_OVERRIDES, 'grpo.num_steps': 3, 'data.train': str(path),
                           'grpo.sampling.max_prompt_length': 0,
                           'data.eval_fraction': 0.2, 'grpo.completions_every': 0,
                           'grpo.reward_funcs': 'final_answer,answer_format=0.1,'
                                                'length_penalty=0.5'})

  def trainer(workdir):
    ctx, params = api.build_context(cfg, str(workdir))
    assert len(ctx.task.train) == 12 and len(ctx.task.eval_rows) == 3
    return grpo.GRPOLoop(ctx, cfg.grpo), params

  t, params = trainer(tmp_path / 'a')
  want, _ = t.run(params)
  got, summary = helpers.run_grpo_in_pieces(trainer, tmp_path / 'b', (3, 4), total_micro_steps=9)
  assert summary['grpo/rollouts'] == 5  # 20 prompts: the 12 rows, then 8 of the next epoch
  helpers.assert_trees_equal(got, want)


def test_gsm8k_config_documented_data_override():
  """configs/grpo_gsm8k_tpu.py's docstring: other math rows through data.train, renamed with
  data.columns, scored by final_answer; a GSM8K solution scores 1 against its own row."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  fixture = os.path.join(ROOT, 'tests', 'fixtures', 'gsm8k_tiny.jsonl')
  cfg = api.make_config('configs/grpo_gsm8k_tpu.py', **{
      'data.train': fixture, 'data.columns': 'question:prompt',
      'data.eval_fraction': 0.25, 'grpo.reward_funcs': 'final_answer,answer_format=0.1',
      'grpo.schedule.micro_batch_size': 8, 'grpo.schedule.steps_per_generation': 1})
  task = data.build_task(cfg)
  examples = task.eval_examples() + [task.train_example(i, 0) for i in range(len(task.train))]
  raw = [json.loads(l) for l in open(fixture, encoding='utf-8')]
  assert sorted(e.prompt for e in examples) == sorted(r['question'] for r in raw)
  solutions = [e.fields['answer'] for e in examples]
  fields = {'answer': solutions}
  total, per_fn = R.compute_rewards(task.reward_functions(), [e.prompt for e in examples],
                                    solutions, fields)
  np.testing.assert_array_equal(per_fn['final_answer'], 1.0)
  np.testing.assert_allclose(total, 1.1)
  wrong = R.final_answer([''] * len(solutions), solutions[1:] + solutions[:1], answer=solutions)
  assert wrong.count(1.0) < len(solutions)  # another row's solution is (mostly) wrong


def test_every_row_is_length_checked_before_anything_compiles(tmp_path):
  """One long prompt among 2000 rows (a probe of 256 would likely miss it): the run stops in
  build_context (before the model is built or anything compiles), naming the setting and the
  length needed."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  rows = [{'prompt': f'{i % 10}+1=', 'answer': '1'} for i in range(1999)]
  rows.append({'prompt': 'x' * 80, 'answer': '1'})
  path = tmp_path / 'train.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
  cfg = api.make_config(load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke'),
                        **{**_OVERRIDES, 'data.train': str(path), 'data.eval_fraction': 0.001,
                           'grpo.reward_funcs': 'final_answer'})
  with pytest.raises(ConfigError) as e:
    api.build_context(cfg, str(tmp_path / 'wd'))
  # 'user: ' + 80 characters + '\nassistant: ' through the plain chat template: 98 tokens.
  assert str(e.value) == ('grpo.sampling.max_prompt_length=64, but data.train/data.eval has a '
                          'prompt (or SFT example) of 98 tokens; set '
                          'grpo.sampling.max_prompt_length to 98 or more.')
  assert not (tmp_path / 'wd' / 'checkpoints').exists()


def test_trainer_arguments_become_the_run_config():
  from jaxrl_ga import DPOTrainer, GRPOTrainer  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  t = GRPOTrainer(model='org/model', reward_funcs='final_answer,length_penalty=0.5',
                  config={'seed': 3, 'stages': 'sft,grpo', 'grpo': {'num_steps': 7}},
                  workdir='/tmp/unused')
  cfg = t.config
  assert (cfg.stages, cfg.seed, cfg.grpo.num_steps, cfg.model.hf_path) == (
      ('grpo',), 3, 7, 'org/model')
  assert cfg.grpo.reward_funcs == 'final_answer,length_penalty=0.5' and t.reward_funcs is None
  fn = lambda p, c, **k: [0.0] * len(c)  # noqa: E731
  t = GRPOTrainer(reward_funcs=[fn, 'final_answer'], config='configs/grpo_arith.py:smoke')
  assert t.reward_funcs == [fn, 'final_answer'] and t.config.grpo.reward_funcs == ''
  assert t.config.grpo.num_steps == 4 and os.path.isdir(t.workdir)  # the file's smoke variant
  assert DPOTrainer(config=cfg).config.stages == ('dpo',)
  assert api.make_config(cfg) == cfg  # a RunConfig round-trips
  with pytest.raises(ConfigError, match=r'grpo\.num_stepz'):
    api.make_config(None, **{'grpo.num_stepz': 1})


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
  """Excel's "CSV UTF-8" (and Notepad's UTF-8) starts the file with a BOM. datasets reads the
  first column by its name; before, jaxrl_ga named it '\\ufeffanswer', so no reward saw an
  'answer' and every completion went unscored (a .jsonl with a BOM was refused)."""
  import datasets  # pylint: disable=g-import-not-at-top
  bom = '\ufeff'.encode('utf-8')
  csv_path, jsonl_path = tmp_path / 'd.csv', tmp_path / 'd.jsonl'
  csv_path.write_bytes(bom + b'answer,prompt\n2,1+1?\n3,1+2?\n')
  jsonl_path.write_bytes(bom + b'{"answer": "2", "prompt": "1+1?"}\n')
  want = datasets.load_dataset('csv', data_files=str(csv_path), split='train').column_names
  assert want == ['answer', 'prompt']
  assert [sorted(r) for r in rows_lib.read_rows(str(csv_path))] == [want, want]
  assert [dict(r) for r in rows_lib.read_rows(str(jsonl_path))] == [
      {'answer': '2', 'prompt': '1+1?'}]


@pytest.mark.parametrize('text,message', [
    ('prompt,answer\nq0,1\nq1\n', ':3: 1 cell(s), the header has 2; give every row one cell'),
    ('prompt,answer\nq0,1\nq1,2,EXTRA\n', ':3: 3 cell(s), the header has 2'),
    ('prompt,answer,answer\nq0,1,2\n', ":1: the header has a repeated column name 'answer'"),
    ('prompt,,answer\nq0,1,2\n', ':1: the header has an empty column name'),
])
def test_a_ragged_csv_is_refused_naming_the_line_as_datasets_refuses_it(tmp_path, text, message):
  """A row with fewer cells than the header got None silently, one with more a None key that
  crashed the reward fields mid-training; a repeated header name kept the last column only.
  pandas (datasets' csv reader) refuses the ragged row; here each is one error naming the line."""
  path = tmp_path / 'd.csv'
  path.write_text(text)
  with pytest.raises(ConfigError) as e:
    rows_lib.read_rows(str(path))
  assert str(e.value).startswith(f'data.train={path}{message}'), str(e.value)


def test_two_columns_renamed_to_one_name_and_a_split_that_is_ignored_are_refused(tmp_path):
  """data.columns=q:prompt,p:prompt kept whichever column came last in the file (datasets'
  rename_columns refuses it); data.eval naming data.train's own saved dataset without splits,
  whose data.eval_split was ignored, evaluated the model on its training rows. The same file
  given twice is the user's explicit choice (TRL allows eval_dataset=train_dataset)."""
  import datasets  # pylint: disable=g-import-not-at-top
  for columns in ('q:prompt,p:prompt', {'q': 'prompt', 'p': 'prompt'}):
    with pytest.raises(ConfigError, match=r"^data.columns: 'q' and 'p' are both renamed to "
                                          r"'prompt'"):
      rows_lib.parse_columns(columns)
  paths, _ = _write_all(tmp_path, ROWS)
  same = lambda kind: data.build_task(_cfg(**{'data.train': paths[kind],
                                              'data.eval': paths[kind],
                                              'grpo.reward_funcs': 'final_answer'}))
  with pytest.raises(ConfigError, match=r"is data.train's saved dataset, which has no splits: "
                                        r"data.eval_split=test would read the training rows"):
    same('disk')
  assert len(same('jsonl').eval_rows) == len(ROWS)
  splits = datasets.DatasetDict({'train': datasets.Dataset.from_list(ROWS[:8]),
                                 'test': datasets.Dataset.from_list(ROWS[8:])})
  splits.save_to_disk(str(tmp_path / 'dict'))
  task = data.build_task(_cfg(**{'data.train': str(tmp_path / 'dict'),
                                 'data.eval': str(tmp_path / 'dict'),
                                 'grpo.reward_funcs': 'final_answer'}))
  assert len(task.eval_rows) == 4 and task.num_train() == 8  # its splits tell them apart


def test_a_resume_on_other_rows_is_refused_before_anything_runs(tmp_path):
  """The data order and the held-out split are functions of the rows: a run resumed after rows
  were added to (or changed in) data.train would not continue as it began, and went on without a
  word. The stage's checkpoint keeps a digest of the file; a resume on other bytes is one error
  line, on the same bytes it goes on."""
  import shutil  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, checkpoint  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  rows = _user_rows(15, 'train')
  path = tmp_path / 'train.jsonl'
  text = ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows)
  path.write_text(text, encoding='utf-8')
  cfg = api.make_config(load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke'),
                        **{**_OVERRIDES, 'data.train': str(path), 'grpo.completions_every': 0,
                           'checkpoint.every_steps': 1, 'grpo.reward_funcs': 'final_answer'})
  api.run(cfg, str(tmp_path / 'wd'))
  ckpts = tmp_path / 'wd' / 'checkpoints' / 'grpo'
  steps = checkpoint.all_steps(str(ckpts))
  shutil.rmtree(ckpts / str(steps[-1]))  # as if stopped after the first optimizer step
  path.write_text(text + json.dumps(rows[0]) + '\n', encoding='utf-8')
  with pytest.raises(ConfigError, match=r'^data.train: its rows differ from those the grpo '
                                        r'checkpoint in .* was training on'):
    api.run(cfg, str(tmp_path / 'wd'))
  assert checkpoint.all_steps(str(ckpts)) == steps[:-1]
  path.write_text(text, encoding='utf-8')
  assert not api.run(cfg, str(tmp_path / 'wd'))['stopped_early']


# A template with Qwen3's switch (reduced): enable_thinking=False writes an empty reasoning block
# after the generation prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
    "enable_thinking is false %}<think></think>{% endif %}{% endif %}")


def _with_template(tmp_path, fixture: str) -> str:
  """A copy of tests/fixtures/<fixture> whose tokenizer has THINKING_TEMPLATE."""
  import shutil  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  path = tmp_path / fixture
  shutil.copytree(helpers.fixture_dir(fixture), path)
  tok = transformers.AutoTokenizer.from_pretrained(path)
  tok.chat_template = THINKING_TEMPLATE
  tok.save_pretrained(path)
  return str(path)


def test_chat_template_kwargs_reach_every_rendering_as_trl_passes_them(tmp_path):
  """model.chat_template_kwargs (TRL's GRPOConfig.chat_template_kwargs; Qwen3's enable_thinking):
  the run's prompts and a reward model's texts are transformers' apply_chat_template with them;
  a call's own keyword (a row's chat_template_kwargs column) wins; they are in the checkpoints'
  fingerprint (unset: left out, as before the setting existed); trl_args maps TRL's dict. Before,
  there was no such setting: a Qwen3 run always sampled in thinking mode."""
  import transformers  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import reward_model  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import load_config_file  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top
  model = _with_template(tmp_path, 'qwen3_tiny')
  path = tmp_path / 'train.jsonl'
  path.write_text(''.join(json.dumps({'prompt': f'{i}+1=', 'answer': str(i + 1)}) + '\n'
                          for i in range(20)), encoding='utf-8')
  base = load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke')
  overrides = {**_OVERRIDES, 'data.train': str(path), 'grpo.reward_funcs': 'final_answer',
               'model.hf_path': model}
  cfg = api.make_config(base, trl_args={'chat_template_kwargs': {'enable_thinking': False}},
                        **overrides)
  assert cfg.model.chat_template_kwargs == '{"enable_thinking": false}'
  ctx, _ = api.build_context(cfg, str(tmp_path / 'wd'))
  ref = transformers.AutoTokenizer.from_pretrained(model)
  render = lambda **kw: ref.apply_chat_template([{'role': 'user', 'content': '3+1='}],
                                                add_generation_prompt=True, tokenize=False, **kw)
  assert render(enable_thinking=False) != render()  # the switch changes the prompt
  assert text.encode_prompt(ctx.tokenizer, '3+1=') == ref(
      render(enable_thinking=False), add_special_tokens=False)['input_ids']
  assert ctx.tokenizer.apply_chat_template(  # a call's own value wins
      [{'role': 'user', 'content': '3+1='}], add_generation_prompt=True, tokenize=False,
      enable_thinking=True) == render(enable_thinking=True)
  assert ctx.fingerprint('grpo')['model']['chat_template_kwargs'] == '{"enable_thinking": false}'
  plain, _ = api.build_context(api.make_config(base, **overrides), str(tmp_path / 'wd2'))
  assert text.encode_prompt(plain.tokenizer, '3+1=') == ref(render(), add_special_tokens=False)[
      'input_ids']
  assert 'chat_template_kwargs' not in plain.fingerprint('grpo')['model']

  rm_path = _with_template(tmp_path, 'qwen2_reward_tiny')
  rm = reward_model.RewardModel(rm_path, chat_template_kwargs={'enable_thinking': False})
  rm_ref = transformers.AutoTokenizer.from_pretrained(rm_path)
  conversation = [{'role': 'user', 'content': '3+1='}, {'role': 'assistant', 'content': '4'}]
  assert rm.texts([conversation[:1]], ['4']) == [rm_ref.apply_chat_template(
      conversation, tokenize=False, enable_thinking=False)]


@pytest.mark.parametrize('value,message', [
    ('{bad', r"^model\.chat_template_kwargs='\{bad' is not JSON; give a JSON object"),
    ('[1]', r'^model\.chat_template_kwargs=\[1\] is not a JSON object of keyword arguments'),
    ('{"tools": []}', r"^model\.chat_template_kwargs: tools is apply_chat_template's own"),
])
def test_bad_chat_template_kwargs_are_one_error_naming_the_setting(value, message):
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=message):
    api.make_config(None, **{'model.chat_template_kwargs': value})


def test_a_column_only_some_rows_have_is_none_in_the_others_as_in_trls_datasets(tmp_path):
  """TRL 1.16 reads rows through `datasets`, where a column is every row's (None where a JSON row
  lacks it), and passes every column to the reward functions and to an environment's reset. Here
  the fields of each row are the `datasets` row's (the reference: Dataset.from_list), for the
  training rows once the first epoch is parsed (data.build_task does it up front) and for the
  held-out rows. Before, a row had only its own keys: a batch without a 'hint' row called a
  reward requiring `hint` without it (a TypeError mid-run) and reset(**row) likewise."""
  import datasets  # pylint: disable=g-import-not-at-top
  rows = [{'prompt': f'{i}+1=', 'answer': str(i + 1),
           **({'hint': 'add one'} if i % 4 == 0 else {}), **({'level': i} if i == 5 else {})}
          for i in range(12)]
  held = [{'prompt': 'x', 'answer': '1'}, {'prompt': 'y', 'answer': '2', 'source': 'web'}]

  def read_as_trl_does(name, table):  # load_dataset('json'): every column in every row
    path = tmp_path / f'{name}.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in table), encoding='utf-8')
    return datasets.load_dataset('json', data_files=str(path), split='train',
                                 cache_dir=str(tmp_path / 'cache'))

  task = data.DataTask(data.prepare(data.read_rows(rows), {}, 'data.train'),
                       data.prepare(data.read_rows(held), {}, 'data.eval'))
  task.first_epoch(seed=0)
  strip = lambda r: {k: v for k, v in r.items() if k != 'prompt'}
  want = {r['prompt']: strip(r) for r in read_as_trl_does('train', rows)}
  for i in range(12):
    ex = task.train_example(i, seed=0)
    assert ex.fields == want[ex.prompt], (ex.prompt, ex.fields)
  assert [e.fields for e in task.eval_examples()] == [
      strip(r) for r in read_as_trl_does('eval', held)]
