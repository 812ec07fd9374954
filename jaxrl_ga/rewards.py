"""Reward functions and group-normalized advantages (host side, numpy).

A reward function is a plain Python callable, TRL's signature:

    fn(prompts: list, completions: list[str], **columns) -> Sequence[float | None]

where ``columns`` holds the dataset's other columns, one list entry per completion (a prompt's
values are repeated for each of its G completions); a prompt is a string or a list of chat
messages, as in the dataset. ``None`` means "does not apply to this completion" (TRL's
convention): a completion's reward is the weighted sum over the functions that apply to it, and
one to which none applies gets 0 (with a warning, once). Several functions combine with weights.
A function that raises, returns the wrong number of values, or returns NaN gets a clear error that
names it: first on a dry call before anything compiles (:func:`check_on_dry_call`, a few rows
with placeholder completions), then at any call in training.

Where rewards come from (``resolve``): import strings ``module:function[=weight]``, comma
separated (``grpo.reward_funcs``; the module must be importable: on ``sys.path`` or
``PYTHONPATH``), callables, ``(callable, weight)`` pairs, reward models (a sequence classifier's
HF directory, .gguf file or pkg: source, ``path[=weight]``: ``jaxrl_ga.reward_model``, which
``data.build_task`` expands first) or the built-ins below by name:

  final_answer    1.0 iff the completion's final number (``\\boxed{42}``, else after the last
                  ``#### ``, else its last number) equals the row's ``answer`` column (a number, or
                  a solution ending in ``#### 42``) numerically; None for a row without one.
                  Marks correctness: the run's accuracy is the share of completions it gives 1.
  answer_format   1.0 iff the completion states a final answer as ``#### <number>`` or
                  ``\\boxed{...}``.
  length_penalty  -len(completion) / 1000 (characters).

A reward marks correctness when its function has ``marks_correctness = True``
(:func:`marks_correctness`); the accuracy is then the share of completions it scores above 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import inspect
import math
import re
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import numpy as np

from jaxrl_ga.answers import final_number, numbers_equal  # rewards.final_number for users
from jaxrl_ga.errors import ConfigError

RewardFn = Callable[..., Sequence[Optional[float]]]


class RewardError(RuntimeError):
  """A reward function failed; the message names it."""


@dataclasses.dataclass(frozen=True)
class WeightedReward:
  """A reward function, its name (in metrics and logs) and weight. ``marks_correctness``:
  default the function's attribute of that name (:func:`marks_correctness`)."""
  name: str
  fn: RewardFn
  weight: float = 1.0
  marks_correctness: Optional[bool] = None

  def __post_init__(self):
    try:
      finite = math.isfinite(self.weight)
    except TypeError:
      finite = False
    if not finite:
      raise ConfigError(f'reward {self.name!r}: weight {self.weight!r} is not a finite number '
                        f'(grpo.reward_funcs, or the (function, weight) pair given).')
    if self.marks_correctness is None:
      object.__setattr__(self, 'marks_correctness',
                         bool(getattr(self.fn, 'marks_correctness', False)))


def marks_correctness(fn: RewardFn) -> RewardFn:
  """Decorator: ``fn`` scores correctness (> 0: correct); the run reports its accuracy."""
  fn.marks_correctness = True
  return fn


_warned_none_apply = False


def compute_rewards(rewards: Sequence[WeightedReward], prompts: Sequence[Any],
                    completions: Sequence[str], fields: Mapping[str, Sequence[Any]] | None = None,
                    keywords: Mapping[str, Any] | None = None
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Weighted sum of the reward functions over those that apply (not None) to each completion.
  ``fields``: the columns, one entry per completion, every function gets them; ``keywords``
  (``trl_keywords``): each function gets those it takes (a parameter of that name, or
  ``**kwargs``), so that one written without them keeps working.
  -> (total [N] float32, {name: [N] float32, NaN where the function returned None})."""
  global _warned_none_apply
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f'{len(prompts)} prompts for {n} completions; pass one prompt per completion.')
  fields = dict(fields or {})
  per_fn: dict[str, np.ndarray] = {}
  total = np.zeros(n, np.float32)
  applies = np.zeros(n, bool)
  for r in rewards:
    arr, none = _values(r, prompts, completions, fields, keywords)
    per_fn[r.name] = arr
    total += np.where(none, np.float32(0), np.float32(r.weight) * arr)
    applies |= ~none
  if rewards and not applies.all() and not _warned_none_apply:
    _warned_none_apply = True
    logging.warning('no reward function applies to %d of %d completions (every one returned '
                    'None): their total reward is 0 in the logs, and in GRPO they count in no '
                    'group statistic and get advantage 0, as in TRL. (Warned once.)',
                    int((~applies).sum()), n)
  return total, per_fn


def _values(r: WeightedReward, prompts: Sequence[Any], completions: Sequence[str],
            fields: Mapping[str, Sequence[Any]], keywords: Mapping[str, Any] | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
  """One reward function's values, its contract checked (one value per completion, each a
  finite float or None). -> (values [N] float32, NaN where None; which are None [N] bool).
  Raises RewardError naming the function and what was wrong."""
  n = len(completions)
  try:
    params = _parameters(r.fn)
    taken = {k: v for k, v in (keywords or {}).items() if _takes(params, k)}
    completions_param = params.get('completions')
    if completions_param is not None and completions_param.kind in (
        completions_param.POSITIONAL_OR_KEYWORD, completions_param.KEYWORD_ONLY):
      # TRL's call: everything by keyword
      prompts_kw = {'prompts': list(prompts)} if _takes(params, 'prompts') else {}
      values = r.fn(completions=list(completions), **prompts_kw, **fields, **taken)
    else:
      values = r.fn(list(prompts), list(completions), **fields, **taken)
    if inspect.isawaitable(values):  # an async def reward (TRL 1.16 awaits those too)
      values = _run(values)
  except Exception as e:  # pylint: disable=broad-except
    raise RewardError(f'reward function {r.name!r} raised {type(e).__name__}: {e}') from e
  try:
    values = list(values)
  except TypeError:
    raise RewardError(f'reward function {r.name!r} returned {type(values).__name__}, not a '
                      f'sequence; return one float (or None) per completion.') from None
  if len(values) != n:
    raise RewardError(f'reward function {r.name!r} returned {len(values)} values for {n} '
                      f'completions; return one float (or None) per completion.')
  # One number (or None) each, as TRL 1.16's torch.tensor(values) takes them: a nested list or
  # a numeric string is refused there, not flattened or parsed.
  odd = next((i for i, v in enumerate(values) if not (
      v is None or isinstance(v, (int, float, np.integer, np.floating, np.bool_))
      or (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in 'biuf'))), None)
  if odd is not None:
    raise RewardError(f'reward function {r.name!r} returned {values[odd]!r} '
                      f'({type(values[odd]).__name__}) for completion {odd}; return one float '
                      f'(or None) per completion.')
  arr = np.asarray([np.nan if v is None else float(v) for v in values], np.float32)
  none = np.array([v is None for v in values], bool)  # bool also when there are none
  bad = np.flatnonzero(~np.isfinite(arr) & ~none)
  if bad.size:
    raise RewardError(
        f'reward function {r.name!r} returned {arr[bad[0]]} for completion {bad[0]} '
        f'({completions[bad[0]]!r}) and {bad.size - 1} more; return finite floats (e.g. 0.0 '
        f'for an unparsable completion, or None where the reward does not apply).')
  return arr, none


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
  """``fn``'s parameters by name ({} where it has no signature to read)."""
  try:
    return inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return {}


def _takes(params: Mapping[str, inspect.Parameter], name: str) -> bool:
  """Whether a function with ``params`` takes the keyword ``name`` (a parameter of that name,
  or ``**kwargs``)."""
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


async def _awaited(awaitable):
  return await awaitable


def _run(awaitable):
  """An async reward's result: on a new event loop, in a thread of its own where this one
  already runs a loop (a notebook's)."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(_awaited(awaitable))
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, _awaited(awaitable)).result()


@dataclasses.dataclass(frozen=True)
class TrainerState:
  """The ``trainer_state`` keyword of the reward functions: TRL 1.16 passes transformers'
  TrainerState, for reward shaping by training progress; these are its fields for that:
  ``global_step`` (optimizer steps done when the completions were sampled) and ``max_steps``
  (the stage's ``num_steps``)."""
  global_step: int = 0
  max_steps: int = 0


class RewardLog:
  """The ``log_metric`` and ``log_extra`` keywords of one scoring (TRL 1.16's): a reward's
  ``log_metric(name, value)`` values are averaged into the rollout's metrics under ``name``;
  ``log_extra(column, values)`` (one value per completion) adds a column to completions.jsonl."""

  def __init__(self):
    self.metrics: dict[str, list[float]] = {}
    self.extra: dict[str, list[Any]] = {}

  def log_metric(self, name: str, value: float) -> None:
    self.metrics.setdefault(str(name), []).append(float(value))

  def log_extra(self, column: str, values: Sequence[Any]) -> None:
    self.extra.setdefault(str(column), []).extend(values)  # TRL's: appended to the column

  def means(self) -> dict[str, float]:
    return {k: float(np.mean(v)) for k, v in self.metrics.items()}


def trl_keywords(completion_ids: Sequence[Sequence[int]], state: TrainerState,
                 log: Optional[RewardLog] = None) -> dict[str, Any]:
  """The keywords TRL 1.16 passes every reward function besides the columns:
  ``completion_ids`` (each completion's token ids, tool turns included), ``trainer_state``,
  ``log_extra`` and ``log_metric`` (``RewardLog``'s; a fresh one when ``log`` is None)."""
  log = log if log is not None else RewardLog()
  return {'completion_ids': [[int(t) for t in ids] for ids in completion_ids],
          'trainer_state': state, 'log_extra': log.log_extra, 'log_metric': log.log_metric}


# The completions of the dry call (check_on_dry_call): each row's prompt gets all of them.
DRY_COMPLETIONS = ('a placeholder completion: 42', 'another placeholder, with no number.')


def check_on_dry_call(rewards: Sequence[WeightedReward], prompts: Sequence[Any],
                      fields: Mapping[str, Sequence[Any]],
                      keywords: Mapping[str, Any] | None = None) -> None:
  """Each reward function called once before anything compiles, on a few rows as the trainer
  passes them (``prompts`` and columns ``fields``, one entry per completion: each row
  len(DRY_COMPLETIONS) times in a row) with DRY_COMPLETIONS as each row's completions. One that
  raises, returns another count than the completions or a non-finite value raises RewardError
  naming it (the caller's bad input: GRPOStage.check_inputs); the values are not used."""
  rows = len(prompts) // len(DRY_COMPLETIONS)
  completions = list(DRY_COMPLETIONS) * rows
  for r in rewards:
    try:
      _values(r, prompts, completions, fields, keywords)
    except RewardError as e:
      raise RewardError(f'{e} (a dry call before compiling, on {rows} row(s) of the data with '
                        f'{len(DRY_COMPLETIONS)} placeholder completions each)') from None


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str = 'group',
                     eps: float = 1e-4) -> np.ndarray:
  """Advantages of consecutive groups of ``num_generations`` completions.

  A_i = (r_i - mean(group)) / (std + eps), where std is the group's (``scale_rewards='group'``,
  sample std as in TRL), the whole batch's (``'batch'``), or 1 with no eps (``'none'``, Dr. GRPO).
  A group whose rewards are all equal gets advantage exactly 0, never NaN.

  A NaN reward marks a completion no reward function scores (``unscorable``): as in TRL 1.16's
  ``sum_then_normalize``, it counts in no group mean and no std, and its advantage is 0; a
  statistic with too few values (a group's mean with none scored, its sample std with one) is
  NaN there, and the advantages it makes are 0.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1 or r.size % num_generations:
    raise ValueError(f'{r.size} rewards do not form groups of num_generations={num_generations}.')
  if scale_rewards not in ('group', 'batch', 'none'):
    raise ValueError(f'scale_rewards={scale_rewards!r}; choose group, batch or none.')
  groups = r.reshape(-1, num_generations)
  if np.isnan(r).any():
    return _group_advantages_with_unscored(groups, scale_rewards, eps)
  centered = groups - groups.mean(axis=1, keepdims=True)
  ddof = 1 if num_generations > 1 else 0
  if scale_rewards == 'group':
    adv = centered / (groups.std(axis=1, ddof=ddof, keepdims=True) + eps)
  elif scale_rewards == 'batch':
    adv = centered / (r.std(ddof=1 if r.size > 1 else 0) + eps)
  else:
    adv = centered
  # Exactly zero for all-equal groups (the centered values are already exact zeros).
  adv = np.where(np.all(groups == groups[:, :1], axis=1, keepdims=True), 0.0, adv)
  return adv.reshape(-1).astype(np.float32)


def _group_advantages_with_unscored(groups: np.ndarray, scale_rewards: str,
                                    eps: float) -> np.ndarray:
  """``group_advantages`` where some rewards are NaN (grpo_trainer.py, TRL 1.16,
  ``_generate_and_score_completions``: nanmean, nanstd, then nan_to_num)."""
  g = groups.shape[1]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # a group with no scored completion: NaN
    centered = groups - np.nanmean(groups, axis=1, keepdims=True)
  if scale_rewards == 'group':
    std = _nanstd(groups, axis=1, keepdims=True) if g > 1 else np.zeros_like(groups)
  else:  # 'batch' (and 'none', where only the centering applies)
    std = _nanstd(groups) if groups.size > 1 else np.zeros_like(groups)
  adv = centered if scale_rewards == 'none' else centered / (std + eps)
  return np.nan_to_num(adv, nan=0.0).reshape(-1).astype(np.float32)


def unscorable(per_function: np.ndarray) -> np.ndarray:
  """[N, F] every reward function's values (NaN: it returned None) -> [N] bool: the completions
  no function scores (all F NaN; none where there is no function)."""
  per_function = np.asarray(per_function)
  if per_function.ndim != 2 or per_function.shape[1] == 0:
    return np.zeros(len(per_function), bool)
  return np.isnan(per_function).all(axis=1)


def _nanstd(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
  """Sample std ignoring NaN; NaN where fewer than 2 values (TRL 1.16's trainer.utils.nanstd)."""
  count = np.sum(~np.isnan(x), axis=axis, keepdims=keepdims)
  with np.errstate(invalid='ignore', divide='ignore'), warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # all-NaN slices: NaN, as in torch
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nansum((x - mean)**2, axis=axis, keepdims=keepdims) / (count - 1)
  return np.where(count > 1, np.sqrt(np.maximum(var, 0.0)), np.nan)


def _normalized_sum(r: np.ndarray, weights: Sequence[float], num_generations: int,
                    eps: float) -> np.ndarray:
  """[N, F] rewards -> [N]: each function's rewards normalized within each group, weighted and
  summed (NaN counts nowhere; NaN where no function applies): GDPO's per-function step."""
  grouped = r.reshape(-1, num_generations, r.shape[1])  # [groups, G, F]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # all-NaN slices: NaN, as in torch
    mean_k = np.nanmean(grouped, axis=1, keepdims=True)
  std_k = (_nanstd(grouped, axis=1, keepdims=True) if num_generations > 1
           else np.zeros_like(mean_k))
  normalized = ((grouped - mean_k) / (std_k + eps)).reshape(r.shape)  # [N, F]
  total = np.nansum(normalized * np.asarray(weights, np.float64)[None], axis=1)  # [N]
  total[np.isnan(r).all(axis=1)] = np.nan  # unscorable: in no statistic, advantage 0
  return total


def reward_statistics(per_function: np.ndarray, weights: Sequence[float], names: Sequence[str],
                      num_generations: int, scale_rewards: str, multi_objective_aggregation: str,
                      eps: float = 1e-4) -> dict[str, float]:
  """TRL 1.16's logged reward spreads (``_generate_and_score_completions``), from [N, F] rewards
  (NaN: None): ``reward/std`` (TRL's ``reward_std``: the sample std of the weighted totals, the
  unscorable left out), ``reward/<name>/std`` (``rewards/<name>/std``, each function's where it
  applies) and ``reward/frac_zero_std`` (``frac_reward_zero_std``: the share of completions whose
  advantage's std, the group's, or the rollout's with scale_rewards='batch' or
  normalize_then_sum, is 0 within torch.isclose's 1e-8)."""
  r = np.asarray(per_function, np.float64)
  totals = np.where(unscorable(r), np.nan, np.nansum(r * np.asarray(weights, np.float64), axis=1))
  if multi_objective_aggregation == 'normalize_then_sum':
    spread = _normalized_sum(r, weights, num_generations, eps)
    std = np.full(len(r), _nanstd(spread) if r.shape[0] > 1 else 0.0)
  elif scale_rewards == 'batch':
    std = np.full(len(r), _nanstd(totals) if r.shape[0] > 1 else 0.0)
  elif num_generations > 1:
    std = np.repeat(_nanstd(totals.reshape(-1, num_generations), axis=1), num_generations)
  else:
    std = np.zeros(len(r))
  out = {'reward/std': float(_nanstd(totals)),
         'reward/frac_zero_std': float(np.mean(np.abs(std) <= 1e-8)) if len(r) else float('nan')}
  for i, name in enumerate(names):
    if not np.isnan(r[:, i]).all():
      out[f'reward/{name}/std'] = float(_nanstd(r[:, i]))
  return out


def normalize_then_sum_advantages(per_function: np.ndarray, weights: Sequence[float],
                                  num_generations: int, eps: float = 1e-4) -> np.ndarray:
  """Advantages of several reward functions by GDPO's decoupled normalization (arXiv 2601.05242;
  TRL 1.16's ``multi_objective_aggregation='normalize_then_sum'``): each function's rewards are
  normalized within each group, (r_k - mean) / (std + eps); their weighted sum is normalized over
  the whole rollout the same way. NaN (the function returned None) counts in no mean or std and
  adds 0 to the sum; a completion no function applies to, or a function with fewer than 2
  values in a group, gets 0 there (TRL's NaN rules); ``advantage.scale_rewards`` does not apply.

  Args:
    per_function: [N, F] rewards of F functions, NaN where a function returned None.
    weights: [F] the functions' weights.
    num_generations: G; N is a multiple of it, groups consecutive.

  Returns:
    [N] float32 advantages.
  """
  r = np.asarray(per_function, np.float64)
  if r.ndim != 2 or r.shape[0] % num_generations or r.shape[1] != len(weights):
    raise ValueError(f'{r.shape} rewards do not form groups of num_generations='
                     f'{num_generations} for {len(weights)} functions.')
  total = _normalized_sum(r, weights, num_generations, eps)
  std = _nanstd(total) if total.size > 1 else np.float64(0.0)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)
    adv = (total - np.nanmean(total)) / (std + eps)
  return np.nan_to_num(adv, nan=0.0).astype(np.float32)


# -- built-in rewards -----------------------------------------------------------------------------
@marks_correctness
def final_answer(prompts, completions, answer=None, **unused_columns):
  """1.0 iff the completion's :func:`final_number` equals the row's ``answer`` numerically; None
  for a row without an answer (or a dataset without the column)."""
  del prompts, unused_columns
  answers = answer if answer is not None else [None] * len(completions)
  out = []
  for completion, ref in zip(completions, answers, strict=True):
    ref = None if ref is None else final_number(str(ref))
    if ref is None:
      out.append(None)
      continue
    got = final_number(completion)
    out.append(float(got is not None and numbers_equal(got, ref)))
  return out


ANSWER_FORMAT = r'(?s).*(####\s*-?\$?\s*[\d,]*\.?\d+|\\boxed\{[^{}]+\}).*'


def regex_reward(pattern: str, name: str = 'regex') -> RewardFn:
  """A reward of 1.0 for completions that ``re.fullmatch`` ``pattern``, else 0.0."""
  compiled = re.compile(pattern)

  def fn(prompts, completions, **unused_columns):
    del prompts, unused_columns
    return [float(compiled.fullmatch(c) is not None) for c in completions]

  fn.__name__ = fn.__qualname__ = name
  return fn


answer_format = regex_reward(ANSWER_FORMAT, 'answer_format')


def length_penalty(prompts, completions, **unused_columns):
  """-len(completion) / 1000: a thousandth of a point per character."""
  del prompts, unused_columns
  return [-len(c) / 1000.0 for c in completions]


BUILTIN = {'final_answer': final_answer, 'answer_format': answer_format,
           'length_penalty': length_penalty}


def resolve(reward_funcs, what: str = 'grpo.reward_funcs') -> list[WeightedReward]:
  """Reward functions from a comma-separated string of ``module:function[=weight]`` (or a
  built-in name, ``final_answer=1.0``), or a list of such strings, callables, ``(callable,
  weight)`` pairs and WeightedRewards. A string that does not import, or names something not
  callable, raises ConfigError naming it. Names must be unique."""
  out: list[WeightedReward] = []
  for item in split_specs(reward_funcs):
    if isinstance(item, WeightedReward):
      out.append(item)
    elif isinstance(item, str):
      out.append(_from_import_string(item, what))
    elif isinstance(item, tuple) and len(item) == 2 and callable(item[0]):
      out.append(WeightedReward(_name_of(item[0]), item[0], float(item[1])))
    elif callable(item):
      out.append(WeightedReward(_name_of(item), item))
    else:
      raise ConfigError(f'{what}: {item!r} is neither a callable, a (callable, weight) pair nor '
                        f'an import string "module:function[=weight]".')
  refuse_repeated([r.name for r in out], f'{what}: reward function', 'each reward needs its own '
                  'name (wrap one in rewards.WeightedReward(name, fn)).')
  return out


def refuse_repeated(names, what: str, fix: str) -> None:
  """ConfigError '<what> name(s) a, b given twice; <fix>' where ``names`` repeat one."""
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ConfigError(f'{what} name(s) {", ".join(twice)} given twice; {fix}')


def split_specs(reward_funcs) -> list:
  """``reward_funcs`` as a list: a comma-separated string split into its stripped parts."""
  if isinstance(reward_funcs, str):
    return [s for s in (p.strip() for p in reward_funcs.split(',')) if s]
  return list(reward_funcs or ())


def _name_of(fn) -> str:
  return getattr(fn, '__name__', None) or type(fn).__name__


def _from_import_string(spec: str, what: str) -> WeightedReward:
  target, sep, weight_text = spec.partition('=')
  target = target.strip()
  weight = 1.0
  if sep:
    try:
      weight = float(weight_text)
    except ValueError:
      raise ConfigError(f'{what}: {spec!r}: the weight {weight_text!r} is not a number; write '
                        f'module:function=0.5.') from None
  if target in BUILTIN:
    return WeightedReward(target, BUILTIN[target], weight)
  if ':' not in target:
    raise ConfigError(f'{what}: {spec!r} is not "module:function[=weight]" nor a built-in reward '
                      f'({", ".join(BUILTIN)}).')
  return WeightedReward(target.partition(':')[2], import_callable(target, what, spec), weight)


def import_callable(target: str, what: str, spec: Optional[str] = None) -> Callable[..., Any]:
  """The callable that the import string ``module:function`` names; ConfigError naming ``what``
  and ``spec`` (default ``target``) when it does not import or is not callable."""
  spec = target if spec is None else spec
  module_name, colon, attr = target.strip().partition(':')
  if not colon or not module_name or not attr:
    raise ConfigError(f'{what}: {spec!r} is not "module:function".')
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  (ImportError, or the module's own error)
    raise ConfigError(f'{what}: {spec!r}: module {module_name!r} does not import '
                      f'({type(e).__name__}: {e}); put its directory on PYTHONPATH.') from None
  fn = module
  for part in attr.split('.'):
    if not hasattr(fn, part):
      raise ConfigError(f'{what}: {spec!r}: module {module_name!r} has no {attr!r}.')
    fn = getattr(fn, part)
  if not callable(fn):
    raise ConfigError(f'{what}: {spec!r}: {module_name}:{attr} is not callable (type '
                      f'{type(fn).__name__}); name a function fn(prompts, completions, **columns).')
  return fn
