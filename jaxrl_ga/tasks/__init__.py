"""Tasks: prompts, datasets, answer checking and reward functions (host-side Python).

  task = tasks.get_task('arithmetic', num_digits=2, operations='+')
  example = task.train_example(index=0, seed=0)    # Example(prompt='37+45=', answer='82', ...)
  task.sft_completion(example)                     # '28' (reversed digits; the trainer ends it)
  task.reward_functions()                          # [WeightedReward('correct', ...), ('format')]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_ga.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from jaxrl_ga.tasks.base import Example, Task, reward_fields
from jaxrl_ga.tasks.gsm8k import GSM8KConfig, GSM8KTask, load_gsm8k
from jaxrl_ga.tasks.number_questions import NumberQuestionsConfig, NumberQuestionsTask
from jaxrl_ga.tasks.tokenizer import build_char_tokenizer

# name -> (task class, its config dataclass)
TASKS: dict[str, tuple[type[Task], type]] = {
    'arithmetic': (ArithmeticTask, ArithmeticConfig),
    'gsm8k': (GSM8KTask, GSM8KConfig),
    'number_questions': (NumberQuestionsTask, NumberQuestionsConfig),
}


def get_task(name: str, **config_fields: Any) -> Task:
  """The task ``name`` built from its config's fields (e.g. ``num_digits=3``); others default."""
  if name not in TASKS:
    raise ValueError(f'unknown task {name!r}; known tasks: {", ".join(sorted(TASKS))}.')
  task_cls, config_cls = TASKS[name]
  known = {f.name for f in dataclasses.fields(config_cls)}
  unknown = sorted(set(config_fields) - known)
  if unknown:
    raise ValueError(f'task {name!r} has no option(s) {", ".join(unknown)}; its options: '
                     f'{", ".join(sorted(known))}.')
  return task_cls(config_cls(**config_fields))


__all__ = ['ArithmeticConfig', 'ArithmeticTask', 'Example', 'GSM8KConfig', 'GSM8KTask',
           'NumberQuestionsConfig', 'NumberQuestionsTask', 'TASKS', 'Task',
           'build_char_tokenizer', 'get_task', 'load_gsm8k', 'reward_fields']
