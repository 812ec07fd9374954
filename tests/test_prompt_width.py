"""grpo.sampling.max_prompt_length=0: the width chosen from the data before anything compiles, and
the reward functions' dry call. Each test stops in (or right after) ``api.build_context``; the
end-to-end runs with a width chosen so are tests/test_data.py's and the README's."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import helpers
from jaxrl_ga import api
from jaxrl_ga.config import ConfigError, load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING = 'grpo.sampling.max_prompt_length'
# A fresh model on the rows' characters (data.DataTask.tokenizer): one token per UTF-8 byte of the
# prompt through its plain chat template, 'role: content\n' per message, then 'assistant: '.
OVERRIDES = {'stages': 'grpo', 'grpo.num_steps': 1, 'grpo.sampling.max_completion_length': 4,
             'eval.max_completion_length': 4, 'model.max_position_embeddings': 256,
             'grpo.reward_funcs': 'final_answer', 'checkpoint.every_steps': 0}


def _rendered_length(prompt) -> int:
  """Tokens of a prompt under the plain chat template of the byte-level character tokenizer
  (tasks/tokenizer.py: a non-ASCII character is one token per UTF-8 byte), counted here."""
  messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else prompt
  rendered = ''.join(f'{m["role"]}: {m["content"]}\n' for m in messages) + 'assistant: '
  return len(rendered.encode('utf-8'))


def _rows(long_prompt, n=40, at=33):
  rows = [{'prompt': f'{i % 10}+1=', 'answer': str(i % 10 + 1)} for i in range(n)]
  rows[at] = {'prompt': long_prompt, 'answer': '3'}
  return rows


# The longest prompt: a chat conversation (a system turn, then the user's) in Japanese and French.
LONG = [{'role': 'system', 'content': 'Réponds en un mot ✓'},
        {'role': 'user', 'content': '1たす2は？数字だけで答えてください。'}]


def _config(tmp_path, rows, **overrides):
  path = tmp_path / 'train.jsonl'
  path.write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                  encoding='utf-8')
  base = load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke')
  return api.make_config(base, **{**OVERRIDES, 'data.train': str(path),
                                  'data.eval_fraction': 0.05, **overrides})


def test_zero_is_the_datas_longest_prompt_rounded_up_to_8(tmp_path, monkeypatch):
  """Every row is measured with a width of 0 (the long row lies past LENGTH_CHECK_ROWS, which
  bounds the check of an explicit width only): the width is the longest prompt, counted here
  from the template, rounded up to 8, in the run's config and in its checkpoints' fingerprint."""
  monkeypatch.setattr(api, 'LENGTH_CHECK_ROWS', 8)
  longest = _rendered_length(LONG)
  assert longest % 8 and longest > _rendered_length('9+1=')  # rounding has work to do
  cfg = _config(tmp_path, _rows(LONG), **{SETTING: 0})
  ctx, _ = api.build_context(cfg, str(tmp_path / 'wd'))
  width = -(-longest // 8) * 8
  assert ctx.cfg.grpo.sampling.max_prompt_length == width
  assert ctx.widths_from_data == {SETTING: longest}
  assert ctx.fingerprint('grpo')['grpo']['sampling']['max_prompt_length'] == width
  # A caller's own cfg.grpo (width 0) gets the chosen width, for every program the trainer builds.
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  trainer = grpo.GRPOLoop(ctx, cfg.grpo)
  assert trainer.engine.sampling_cfg.max_prompt_length == width
  assert trainer.cfg == ctx.cfg.grpo


def test_the_default_config_measures_the_data():
  """A Python API user with their own data sets no width: 0 is the default."""
  assert api.make_config().grpo.sampling.max_prompt_length == 0
  assert load_config_file(os.path.join(ROOT, 'configs', 'grpo_smollm2.py'),
                          'smoke').grpo.sampling.max_prompt_length == 0


def test_an_explicit_width_keeps_its_error(tmp_path):
  longest = _rendered_length(LONG)
  cfg = _config(tmp_path, _rows(LONG), **{SETTING: longest - 1})
  with pytest.raises(ConfigError) as e:
    api.build_context(cfg, str(tmp_path / 'wd'))
  assert str(e.value) == (f'{SETTING}={longest - 1}, but data.train/data.eval has a prompt (or '
                          f'SFT example) of {longest} tokens; set {SETTING} to {longest} or more.')


def test_the_model_positions_bound_the_chosen_width(tmp_path):
  """Rounded up only as far as the model's positions allow; data that does not fit the model
  at all is one line naming the chosen width and the longest prompt."""
  longest = _rendered_length(LONG)
  fits = longest + 4  # the prompt and 4 completion tokens, exactly
  ctx, _ = api.build_context(_config(tmp_path, _rows(LONG), **{
      SETTING: 0, 'model.max_position_embeddings': fits}), str(tmp_path / 'wd'))
  assert ctx.cfg.grpo.sampling.max_prompt_length == longest
  with pytest.raises(ConfigError) as e:
    api.build_context(_config(tmp_path, _rows(LONG), **{
        SETTING: 0, 'model.max_position_embeddings': fits - 1}), str(tmp_path / 'wd2'))
  assert str(e.value) == (
      f'{SETTING} + max(grpo.sampling.max_completion_length, eval.max_completion_length) = '
      f'{fits} positions exceeds model.max_position_embeddings={fits - 1} ({SETTING}=0 chose '
      f'{longest} for data.train/data.eval\'s longest prompt, {longest} tokens); raise '
      f'model.max_position_embeddings or shorten the sequences.')


def test_a_resume_compares_the_chosen_width(tmp_path):
  """A checkpoint written with width 0 fits a re-run on the same data; data whose longest prompt
  needs another width is refused as a changed explicit width would be."""
  rows = _rows(LONG)
  cfg = _config(tmp_path, rows, **{SETTING: 0})
  ctx, _ = api.build_context(cfg, str(tmp_path / 'wd'))
  with ctx.checkpointer('grpo') as ckpt:
    ckpt.save(1, {'x': np.zeros(2, np.float32)},
              meta={'micro_step': 1, 'done': False, 'summary': {}})
  ctx2, _ = api.build_context(cfg, str(tmp_path / 'wd'))  # the same data: resumes
  assert ctx2.cfg.grpo.sampling.max_prompt_length == ctx.cfg.grpo.sampling.max_prompt_length
  longer = LONG[:1] + [{'role': 'user', 'content': LONG[1]['content'] * 2}]
  width, wider = ctx.cfg.grpo.sampling.max_prompt_length, -(-_rendered_length(longer) // 8) * 8
  with pytest.raises(ConfigError, match=(rf'grpo\.sampling\.max_prompt_length: checkpoint {width}'
                                         rf', current {wider}')):
    api.build_context(_config(tmp_path, _rows(longer), **{SETTING: 0}), str(tmp_path / 'wd'))


# -- the reward functions' dry call ---------------------------------------------------------------
def wrong_count(prompts, completions, **columns):
  return [0.0] * (len(completions) - 1)


def not_finite(prompts, completions, answer, **columns):
  return [float('nan') if a == '3' else 0.0 for a in answer]


def raises(prompts, completions, **columns):
  raise KeyError('score')


def seen_columns(prompts, completions, answer, **columns):
  """Counts what it is called with (SEEN)."""
  SEEN.append((list(prompts), list(completions), list(answer)))
  return [1.0] * len(completions)


SEEN = []


@pytest.mark.parametrize('fn, message', [
    (wrong_count, "reward function 'wrong_count' returned 3 values for 4 completions; return one "
                  "float (or None) per completion."),
    (not_finite, "reward function 'not_finite' returned nan for completion 0 ('a placeholder "
                 "completion: 42') and 3 more; return finite floats"),
    (raises, "reward function 'raises' raised KeyError: 'score'"),
])
def test_a_bad_reward_is_refused_before_anything_compiles(tmp_path, compile_log, fn, message):
  """Every row's answer is '3', so that not_finite is NaN on the dry call's rows."""
  rows = [{'prompt': f'{i}+2=', 'answer': '3'} for i in range(40)]
  cfg = _config(tmp_path, rows, **{SETTING: 0})
  with pytest.raises(ConfigError) as e:
    api.build_context(cfg, str(tmp_path / 'wd'), reward_funcs=[fn])
  assert message in str(e.value) and '\n' not in str(e.value)
  assert 'a dry call before compiling, on 2 row(s) of the data' in str(e.value)
  assert not compile_log.names  # refused before the model is built or any step compiles
  assert not (tmp_path / 'wd' / 'checkpoints').exists()


def test_the_dry_call_passes_rows_as_the_trainer_does(tmp_path):
  """Two rows, each with both placeholder completions, its prompt and its columns."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  SEEN.clear()
  rows = [{'prompt': f'{i}+1=', 'answer': str(i + 1)} for i in range(10)]
  grpo.GRPOStage().check_inputs(_config(tmp_path, rows), _task(tmp_path, rows, [seen_columns]),
                                None)
  (prompts, completions, answers), = SEEN
  from jaxrl_ga import rewards  # pylint: disable=g-import-not-at-top
  assert completions == list(rewards.DRY_COMPLETIONS) * 2
  assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]
  assert [str(int(p[0]) + 1) for p in prompts] == answers  # each row's own answer


def _task(tmp_path, rows, reward_funcs):
  from jaxrl_ga import data  # pylint: disable=g-import-not-at-top
  return data.build_task(_config(tmp_path, rows), reward_funcs=reward_funcs)


def test_a_bad_reward_is_one_cli_line(tmp_path):
  """Through the CLI: exit status 2, one error line, no traceback."""
  (tmp_path / 'user').mkdir()
  (tmp_path / 'user' / 'bad_rewards.py').write_text(
      'def short(prompts, completions, **columns):\n  return [0.0]\n', encoding='utf-8')
  rows = [{'prompt': f'{i}+1=', 'answer': str(i + 1)} for i in range(10)]
  (tmp_path / 'train.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=f'{ROOT}:{tmp_path / "user"}',
             XLA_FLAGS=helpers.xla_flags(2))
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={tmp_path / "wd"}', f'--config.data.train={tmp_path / "train.jsonl"}',
       '--config.stages=grpo', '--config.grpo.reward_funcs=bad_rewards:short',
       '--config.grpo.sampling.max_prompt_length=0', '--config.model.max_position_embeddings=64'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1] == (
      "error: reward function 'short' returned 1 values for 4 completions; return one float (or "
      "None) per completion. (a dry call before compiling, on 2 row(s) of the data with 2 "
      "placeholder completions each)")
  assert 'Traceback' not in done.stderr


# -- sft.max_length and dpo.max_length of 0 -------------------------------------------------------
def test_sft_max_length_zero_is_the_longest_row(tmp_path, capsys):
  """SFT text rows: a row is its UTF-8 bytes and the eos (counted here)."""
  long_text = 'Un exemple plus long : 3+4=7 ✓ 三たす四は七'
  rows = [{'text': f'{i}+1={i + 1}'} for i in range(30)] + [{'text': long_text}]
  longest = len(long_text.encode('utf-8')) + 1
  cfg = _config(tmp_path, rows, **{'stages': 'sft', 'sft.max_length': 0})
  ctx, _ = api.build_context(cfg, str(tmp_path / 'wd'))
  assert ctx.cfg.sft.max_length == -(-longest // 8) * 8 and longest % 8
  assert ctx.widths_from_data == {'sft.max_length': longest}
  assert (f'[sft] sft.max_length={ctx.cfg.sft.max_length}, chosen from the data: its longest '
          f'sequence has {longest} tokens') in capsys.readouterr().out


def test_dpo_max_length_zero_is_the_longest_pair(tmp_path):
  """Preference rows through the plain chat template: the prompt 'user: P\\nassistant: ', a reply
  'R\\n' and the eos (counted here); the longer reply counts."""
  rows = [{'prompt': f'{i}+1=', 'chosen': str(i + 1), 'rejected': 'no sé'} for i in range(30)]
  rows.append({'prompt': 'Combien font 2+2 ?', 'chosen': '4', 'rejected': '四ではなく五です'})
  longest = (len('user: Combien font 2+2 ?\nassistant: '.encode('utf-8'))
             + len('四ではなく五です\n'.encode('utf-8')) + 1)
  cfg = _config(tmp_path, rows, **{'stages': 'dpo', 'dpo.pairs': 'dataset', 'dpo.max_length': 0,
                                   'dpo.micro_batch_size': 8})
  ctx, _ = api.build_context(cfg, str(tmp_path / 'wd'))
  assert ctx.cfg.dpo.max_length == -(-longest // 8) * 8 and longest % 8
  assert ctx.widths_from_data['dpo.max_length'] == longest
  assert ctx.task.truncated == 0  # no reply was cut to fit


@pytest.mark.parametrize('overrides, message', [
    ({'stages': 'sft', 'sft.max_length': 0},
     "sft.max_length=0 measures your data (data.train with stages=sft); task 'arithmetic' "
     "generates its examples: set sft.max_length."),
    ({'stages': 'dpo', 'dpo.max_length': 0},
     'dpo.max_length=0 measures a preference dataset (dpo.pairs=dataset); sampled pairs need it '
     'set (their prompt width plus completions).'),
])
def test_a_zero_length_without_data_to_measure_is_one_line(tmp_path, overrides, message):
  base = load_config_file(os.path.join(ROOT, 'configs', 'grpo_arith.py'), 'smoke')
  with pytest.raises(ConfigError) as e:
    api.build_context(api.make_config(base, **overrides), str(tmp_path / 'wd'))
  assert str(e.value) == message


def test_the_plan_needs_an_explicit_width():
  """The plan compiles one width without reading data: a width of 0 is one line, before any
  topology is asked for."""
  from jaxrl_ga import plan  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=r'^grpo\.sampling\.max_prompt_length=0 is chosen from the '
                                        r'data when a run reads it; the plan compiles one width'):
    plan.plan(api.make_config(None, stages='grpo'), 'v5e:2x4')
