"""Your data: rows from files, ``datasets`` or Python, as a task the trainers draw examples from.

  data.train / data.eval (``DataConfig``) or GRPOTrainer(train_dataset=..., eval_dataset=...):
    a .jsonl, .json, .csv or .parquet file (local, or gs://... through jaxrl_ga.fileio),
    a directory written by ``datasets.Dataset.save_to_disk``,
    a hub dataset id read through ``datasets.load_dataset`` (its cache works offline:
      HF_DATASETS_OFFLINE=1), split ``data.train_split`` / ``data.eval_split``,
    and from Python also a list of dicts or a ``datasets.Dataset``.

With ``stages=sft`` the rows are SFT rows (``messages``, ``prompt`` + ``completion`` or ``text``;
``jaxrl_ga.sft_data``), read, renamed, split and ordered by ``jaxrl_ga.rows``. Rows follow TRL's
conventions for GRPO: ``prompt`` is a string or a list of chat messages
(``{"role": ..., "content": ...}``), rendered through the tokenizer's chat template (a string is
one user message when the tokenizer has a template); every other column goes to the reward
functions as a keyword argument, one value per completion (``jaxrl_ga.rewards``). DPO's
preference rows (prompt, chosen, rejected; ``dpo.pairs='dataset'``): ``jaxrl_ga.preference``.
``data.columns='question:prompt,solution:answer'`` renames columns first. Without ``data.eval``, a
seeded ``data.eval_fraction`` of ``data.train``'s rows is held out (the seed is the run's).

Order: epoch ``e`` of the training stream of seed ``s`` visits the rows in the order of
``np.random.default_rng([s, e]).permutation(n)`` (``data.shuffle=False``: file order), so the row
at data position ``i`` is a pure function of (seed, i): a resumed run continues exactly, and on
several processes each process builds the examples of only the rows its devices train on; of a
.jsonl or .parquet file (a FileRows) it parses only those, and the held-out rows
(docs/scaling.md, "Your data on several hosts"). A .jsonl file's lines end at a newline. A
fresh model (no ``model.hf_path``) gets a character tokenizer over the data's characters with a
plain chat template (``role: content`` lines).

Bad input is a ConfigError naming the file and line (or row), the column, or the setting: a
missing file, invalid JSON at line N, bytes that are not UTF-8, a row without the prompt column, a
prompt that is neither a string nor a message list, an empty dataset.
"""

from __future__ import annotations

from typing import Callable, Optional

from jaxrl_ga import preference
from jaxrl_ga import reward_model
from jaxrl_ga import rewards as rewards_lib
from jaxrl_ga import rows as rows_lib
from jaxrl_ga import sft_data
from jaxrl_ga import tasks
from jaxrl_ga.errors import ConfigError
# The rows (reading, renaming, the held-out split, DataTask) live in jaxrl_ga.rows, below this
# module and its row kinds (jaxrl_ga.sft_data, jaxrl_ga.preference); data.<name> for users.
from jaxrl_ga.rows import (BASE_ALPHABET, FILE_SUFFIXES, HELD_OUT_STREAM, PLAIN_CHAT_TEMPLATE,
                           DataTask, FileRows, Row, as_messages, check_prompt, held_out_split,
                           open_rows, parse_columns, prepare, read_rows)
from jaxrl_ga.tasks import base


def build_task(cfg, train_dataset=None, eval_dataset=None, reward_funcs=None,
               owns: Callable[[int], bool] = lambda position: True,
               environment_reward: Optional[bool] = None) -> base.Task:
  """The run's task: ``data.train`` (or ``train_dataset``) as a DataTask, else the built-in task
  ``task.name``. ``reward_funcs`` (callables, pairs, import strings or reward-model sources,
  ``jaxrl_ga.reward_model``; default ``grpo.reward_funcs``) replace a built-in task's rewards; rows need them (for GRPO)
  unless ``environment_reward``: the run's environment owns a reward (its ``get_reward``,
  ``tools.ToolSetup.reward_functions``), which TRL 1.16 accepts as the only reward source
  (False: the run has tools or an environment, none with a reward; None: neither).

  Of GRPO's rows, those at the data positions of the first epoch that ``owns`` (default all;
  ``api.build_context``: this process's, ``rollout.local_prompts``) are parsed and checked here;
  the held-out rows are parsed by every process (docs/scaling.md)."""
  spec = cfg.data
  if reward_funcs is None:
    reward_funcs = cfg.grpo.reward_funcs
  rewards = rewards_lib.resolve(reward_model.expand(
      reward_funcs, chat_template_kwargs=cfg.model.template_kwargs()))
  train_source = train_dataset if train_dataset is not None else (spec.train or None)
  eval_source = eval_dataset if eval_dataset is not None else (spec.eval or None)
  if rows_lib.split_ignored(train_source, eval_source, spec.train_split, spec.eval_split):
    raise ConfigError(f'data.eval={eval_source} is data.train\'s saved dataset, which has no '
                      f'splits: data.eval_split={spec.eval_split} would read the training rows; '
                      f'give other rows, or leave data.eval empty to hold out '
                      f'data.eval_fraction of data.train.')
  if train_source is None and cfg.dpo.pairs == 'dataset' and 'dpo' in cfg.stages:
    raise ConfigError("dpo.pairs=dataset needs data.train (a preference file of prompt, chosen "
                      "and rejected), or train_dataset= in Python.")
  if train_source is None:
    if eval_source is not None:
      raise ConfigError('data.eval needs data.train (the built-in task has its own held-out set).')
    try:
      task = tasks.get_task(cfg.task.name, **dict(cfg.task.options))
    except ConfigError:
      raise
    except (ValueError, OSError, ImportError, KeyError) as e:
      raise ConfigError(f'task {cfg.task.name!r} (task.options={dict(cfg.task.options)}): '
                        f'{e}') from None
    if rewards:  # grpo.reward_funcs replace the task's own (on this instance only)
      task.reward_functions = lambda *unused_args, **unused_kwargs: list(rewards)
    return task
  if tuple(cfg.stages) == ('sft',):  # SFT rows: messages, prompt+completion or text
    return _with_digest(_sft_task(cfg, train_source, eval_source, rewards), train_source, spec)
  if 'dpo' in cfg.stages and cfg.dpo.pairs == 'dataset':  # preference rows: jaxrl_ga.preference
    return _with_digest(preference.build_task(cfg, train_source, eval_source, rewards),
                        train_source, spec)
  if 'sft' in cfg.stages or 'dpo' in cfg.stages:
    raise ConfigError(f'stages={",".join(cfg.stages)}: data.train rows train GRPO (stages=grpo), '
                      f'SFT alone (stages=sft) or DPO alone with dpo.pairs=dataset (stages=dpo).')
  if not rewards and not environment_reward:
    env = ('' if environment_reward is None else ' (or give grpo.environment a class with '
           'get_reward(), an environment that owns the reward, as TRL allows)')
    raise ConfigError('data.train needs reward functions: set grpo.reward_funcs='
                      '"module:function[=weight],..." (or a built-in: '
                      f'{", ".join(rewards_lib.BUILTIN)}), or pass reward_funcs=[...] in '
                      f'Python{env}.')
  columns = parse_columns(spec.columns)
  train = prepare(open_rows(train_source, spec.train_split, 'data.train'), columns, 'data.train')
  if eval_source is None:
    train, eval_rows = held_out_split(train, spec.eval_fraction, cfg.seed)
  else:
    eval_rows = prepare(read_rows(eval_source, spec.eval_split, 'data.eval'), columns,
                        'data.eval')
  need = cfg.grpo.schedule.prompts_per_rollout
  if len(train) < need:
    raise ConfigError(f'data.train has {len(train)} training row(s) (after holding out '
                      f'{len(eval_rows) if eval_source is None else 0}), fewer than the {need} '
                      f'distinct prompts one rollout needs (grpo.schedule: steps_per_generation'
                      f'*micro_batch_size/num_generations); give more rows or a smaller '
                      f'schedule.')
  task = DataTask(train, eval_rows, rewards, shuffle=spec.shuffle, owns=owns)
  task.first_epoch(cfg.seed)  # bad rows are refused before anything compiles
  return _with_digest(task, train_source, spec)


def _with_digest(task, train_source, spec):
  """``task`` with ``data_digest``, what its rows are read from (``rows.source_digest``): a
  stage's checkpoints keep it, and a resume on other rows is refused (stage.check_resume)."""
  task.data_digest = rows_lib.source_digest(train_source, spec.train_split)
  return task


def _sft_task(cfg, train_source, eval_source, rewards):
  """data.train as SFT rows (``jaxrl_ga.sft_data``); rewards (optional) score the held-out rows."""
  spec, columns = cfg.data, parse_columns(cfg.data.columns)
  rename = lambda rows: [rows_lib.renamed_row(r, columns) for r in rows]
  train = rename(read_rows(train_source, spec.train_split, 'data.train'))
  if not train:
    raise ConfigError('data.train is empty; give at least one row.')
  if eval_source is None:
    # Held out: rows with a prompt to ask (a text row has none), when rewards can score them;
    # otherwise every row trains, as TRL's SFTTrainer trains on its whole train_dataset.
    asked = [i for i, r in enumerate(train) if sft_data.row_format(r) != 'text']
    held = set(held_out_split(asked, spec.eval_fraction, cfg.seed)[1]
               if rewards and len(asked) > 1 else ())
    train, eval_rows = ([r for i, r in enumerate(train) if i not in held],
                        [train[i] for i in sorted(held)])
    note = (f'[sft] data.train: {len(eval_rows)} of {len(train) + len(eval_rows)} rows held out '
            f'for the held-out evaluation' + (f' (data.eval_fraction={spec.eval_fraction})'
                                              if held else ' (no reward function to score them)')
            + '; data.eval=FILE evaluates on its rows instead.')
  else:
    eval_rows = rename(read_rows(eval_source, spec.eval_split, 'data.eval'))
    note = None
  task = sft_data.build_task(train, eval_rows, rewards, shuffle=spec.shuffle)
  task.held_out_note = note  # the stage prints it (after every row is checked)
  return task
