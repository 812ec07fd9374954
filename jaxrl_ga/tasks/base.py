"""What a task gives the trainers: examples, SFT targets, answer checking and reward functions.

All host-side Python. A trainer draws ``train_example(index, seed)`` for data positions
``index = 0, 1, 2, ...`` (so that resuming at a position needs no replay), tokenizes
``example.prompt``, and for SFT appends ``sft_completion(example)`` as its reply (the eos after
it, or through a chat template the assistant turn up to its end token:
``trainers.text.encode_reply``). For
GRPO it decodes the sampled completions (special tokens dropped) and calls
``rewards.compute_rewards(task.reward_functions(), prompts, completions,
reward_fields(examples, num_generations))``.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from typing import Any, Iterator, Mapping, Optional, Sequence

from jaxrl_ga.rewards import WeightedReward

# Default weights: correctness is the objective; format is a small shaping term.
CORRECT_WEIGHT = 1.0
FORMAT_WEIGHT = 0.1


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem.

  Attributes:
    prompt: the text the model is conditioned on, or a list of chat messages
      (``{'role', 'content'}``, ``jaxrl_ga.data``).
    answer: the reference final answer in canonical form (e.g. ``'82'``); None for a data row
      (``jaxrl_ga.data.DataTask``), whose reward functions read its columns.
    fields: the dataset columns handed to reward functions (a private copy; treat it as
      read-only). Holds ``answer`` when it is given (filled in when missing; a different value
      is an error).
  """
  prompt: Any
  answer: Optional[str]
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    fields = dict(self.fields)
    if self.answer is not None and fields.setdefault('answer', self.answer) != self.answer:
      raise ValueError(f'Example.fields["answer"]={fields["answer"]!r} differs from '
                       f'answer={self.answer!r}.')
    object.__setattr__(self, 'fields', fields)  # a plain dict, so that examples pickle


# Data columns TRL 1.16's _calculate_rewards does not pass to the reward functions (besides
# ``prompt``, which is never a field).
NOT_REWARD_COLUMNS = frozenset({'completion', 'completion_ids'})


def reward_fields(examples: Sequence[Example], num_generations: int = 1
                  ) -> dict[str, list[Any]]:
  """The reward-function columns of a batch: each example's fields repeated per completion.

  Completions are assumed grouped by prompt (G consecutive completions per example). A
  ``completion`` or ``completion_ids`` column of the data is not one (TRL 1.16 leaves them out
  of the reward keywords, as it does ``prompt``: ``completion_ids`` is its own keyword).
  """
  keys = sorted(set().union(*(ex.fields for ex in examples)) - NOT_REWARD_COLUMNS
                ) if examples else []
  return {k: [ex.fields.get(k) for ex in examples for _ in range(num_generations)] for k in keys}


class Task(abc.ABC):
  """A source of prompts with checkable answers. Subclasses set ``name`` and the abstract methods.

  Answer checking goes through ``extract_answer`` (completion -> canonical answer or None) and
  ``answers_equal`` (string equality unless overridden, e.g. numeric for GSM8K); the 'correct'
  reward and ``is_correct`` both use them, so they always agree.
  """

  name: str = ''

  # -- data -------------------------------------------------------------------------------------
  @abc.abstractmethod
  def train_example(self, index: int, seed: int) -> Example:
    """The example at data position ``index`` (>= 0) of the training stream of ``seed``."""

  def train_examples(self, seed: int, start: int = 0) -> Iterator[Example]:
    """The infinite training stream of ``seed`` from position ``start``: train_example(i, seed)."""
    for index in itertools.count(start):
      yield self.train_example(index, seed)

  @abc.abstractmethod
  def eval_examples(self) -> list[Example]:
    """The fixed held-out set (same every call; never produced by ``train_example``)."""

  @abc.abstractmethod
  def sft_completion(self, example: Example) -> str:
    """The SFT target text for ``example``, without eos (the trainer appends it)."""

  def tokenizer(self):
    """The task's own tokenizer (a fresh one per call), or None to use the model's."""
    return None

  # -- checking ---------------------------------------------------------------------------------
  @abc.abstractmethod
  def extract_answer(self, completion: str) -> Optional[str]:
    """The canonical answer that ``completion`` states, or None if it states none."""

  def answers_equal(self, predicted: str, reference: str) -> bool:
    """Whether an extracted answer matches the reference answer (exact string match here)."""
    return predicted == reference

  def is_well_formed(self, completion: str) -> bool:
    """Whether ``completion`` has the required format (here: an answer can be extracted)."""
    return self.extract_answer(completion) is not None

  def is_correct(self, example: Example, completion: str) -> bool:
    """Whether ``completion`` states ``example``'s answer (what the 'correct' reward scores)."""
    return self._matches(completion, example.answer)

  def _matches(self, completion: str, reference: str) -> bool:
    predicted = self.extract_answer(completion)
    return predicted is not None and self.answers_equal(predicted, reference)

  def reward_functions(self, correct_weight: float = CORRECT_WEIGHT,
                       format_weight: float = FORMAT_WEIGHT) -> list[WeightedReward]:
    """[('correct', 1.0 iff the answer matches field ``answer``), ('format', 1.0 iff well formed)].

    A weight of 0 keeps the function, so that its value is still reported as a metric.
    """

    def correct(prompts, completions, answer, **unused_fields):
      del prompts, unused_fields
      return [float(self._matches(c, ref)) for c, ref in zip(completions, answer, strict=True)]

    def well_formed(prompts, completions, **unused_fields):
      del prompts, unused_fields
      return [float(self.is_well_formed(c)) for c in completions]

    return [WeightedReward('correct', correct, correct_weight, marks_correctness=True),
            WeightedReward('format', well_formed, format_weight)]
