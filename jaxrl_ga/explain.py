r"""Prints the schedule of a configuration: the timeline of TRL PR #3493's diagram, generated.

The rules are in the design doc (docs/design, "Schedule semantics").

One row per micro-step (optimizer step, micro-step, rollout/slice/iteration, policy version,
ON/OFF-policy), a line where each optimizer step fires, then which rollouts and slices compute old
log-probs and how many forward passes that costs versus TRL's static rule. Pure numpy; no model.

  python -m jaxrl_ga.explain --micro_batch_size=6 --num_generations=2 \
      --steps_per_generation=3 --grad_accum_steps=4
  python -m jaxrl_ga.explain --config=configs/X.py --num_devices=8 --format=json

With --config the schedule is ``config.schedule`` (or ``config.grpo.schedule``); flags given
explicitly override it, and ``config.mesh`` (data*fsdp) is checked against micro_batch_size. An
invalid configuration prints ``error: <message>`` to stderr and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Optional

from absl import app
from absl import flags
from ml_collections import config_flags

from jaxrl_ga import cli
from jaxrl_ga import schedule
from jaxrl_ga.config import (UPDATE_MODES, MeshConfig, ScheduleConfig, from_mapping)
from jaxrl_ga.errors import ConfigError

_SCHEDULE_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduleConfig))


def _define_flags():
  """CLI flags, defined only when run as a program (importing the module defines none, so it
  can sit beside jaxrl_ga.main, which has its own --config, in one process)."""
  flags.DEFINE_integer('micro_batch_size', None, 'B: completions per micro-step (whole mesh).')
  flags.DEFINE_integer('num_generations', None, 'G: completions per prompt (a group).')
  flags.DEFINE_integer('steps_per_generation', None, 'S: micro-steps fed by one rollout.')
  flags.DEFINE_integer('num_iterations', None, 'mu: passes over each rollout.')
  flags.DEFINE_integer('grad_accum_steps', None, 'K: micro-steps per optimizer step.')
  flags.DEFINE_enum('update_mode', None, UPDATE_MODES, 'accumulate (K micro-steps per optimizer '
                    'step) or sequential (an optimizer step after every micro-step).')
  flags.DEFINE_bool('strict_on_policy', None, 'Reject configurations with an off-policy slice.')
  flags.DEFINE_integer('data_parallel_size', None, 'The mesh data*fsdp size: micro_batch_size '
                       'must divide by it. Overrides config.mesh.')
  flags.DEFINE_integer('num_devices', None, 'Devices, to resolve a -1 size in config.mesh.')
  flags.DEFINE_integer('num_periods', None, 'Periods of the timeline to print (default: at '
                       'least 2 periods and 12 micro-steps, 1 period if that is over 240 rows).')
  flags.DEFINE_enum('format', 'text', ['text', 'json'], 'text: the timeline; json: the table.')
  config_flags.DEFINE_config_file('config', None, 'An ml_collections config file (configs/X.py).')
  cli.define_print_config()


FLAGS = flags.FLAGS

_MAX_DEFAULT_ROWS = 240
# Used when stdout cannot encode the diagram's symbols.
_ASCII = str.maketrans({'π': 'pi', 'μ': 'mu', '·': '*', '─': '-', '→': '->', '←': '<-',
                        '└': '`', '…': '...'})


def render_text(table: schedule.ScheduleTable, num_periods: Optional[int] = None,
                data_parallel_size: Optional[int] = None, note: str = '') -> str:
  """The timeline diagram and the recompute summary for ``num_periods`` periods (default: at
  least 2 periods and 12 micro-steps), then ``note``."""
  cfg = table.config
  b, g, s_, mu, k = (cfg.micro_batch_size, cfg.num_generations, cfg.steps_per_generation,
                     cfg.num_iterations, cfg.grad_accum_steps)
  every, per_rollout = cfg.optimizer_every, cfg.micro_steps_per_rollout
  period, num_rollouts = table.period_micro_steps, table.period_rollouts
  steps_per_period = period // every
  if num_periods is None:
    num_periods = max(2, math.ceil(12 / period))
    if num_periods * period > _MAX_DEFAULT_ROWS:
      num_periods = 1
  if every == 1:
    stepping = 'an optimizer step after every micro-step (update_mode=sequential)'
  else:
    stepping = f'an optimizer step every K = {k} micro-steps'
  out = [
      f'Schedule: micro_batch_size B = {b}, num_generations G = {g}, steps_per_generation S = '
      f'{s_},',
      f'          num_iterations μ = {mu}, grad_accum_steps K = {k}, update_mode = '
      f'{cfg.update_mode}.',
      f'A rollout every E = S·μ = {per_rollout} micro-steps; {stepping}.',
      f'Period: lcm({every}, {per_rollout}) = {period} micro-steps = '
      f'{_count(num_rollouts, "rollout")} = {_count(steps_per_period, "optimizer step")}; '
      f'rollout r uses table row r mod {num_rollouts}.',
      '',
      'opt step  micro-step  rollout  slice  iter  policy',
  ]
  for p in range(num_periods):
    if p:
      out.append(f'· · · period {p + 1}: the same pattern, {steps_per_period} policy versions '
                 'later · · ·')
    for i in range(period):
      s = p * period + i
      version = p * steps_per_period + int(table.policy_version[i])
      rollout = p * num_rollouts + int(table.rollout[i])
      start = int(table.rollout[i]) * per_rollout  # first micro-step of the rollout
      made_by = p * steps_per_period + int(table.policy_version[start])
      row = (f'{version:8d}  {s:10d}  {rollout:7d}  {int(table.slice[i]):5d}  '
             f'{int(table.iteration[i]):4d}  π{version:<5d} ')
      if table.off_policy[i]:
        row += f'OFF  data from π{made_by}'
      else:
        row += 'ON '
      if i == start:
        row += f'  ← generate rollout {rollout} with π{made_by}'
        row += _recompute_note(table.slice_recompute[int(table.rollout[i])])
      out.append(row.rstrip())
      if table.optimizer_step_after[i]:
        out.append(f'{"└─ optimizer step " + str(version) + " → π" + str(version + 1):>52s}')
  out.append('')
  out.extend(_summary(table, data_parallel_size))
  if note:
    out.append(note)
  return '\n'.join(out)


def _count(n: int, noun: str) -> str:
  return f'{n} {noun}{"" if n == 1 else "s"}'


def _recompute_note(slice_flags) -> str:
  slices = [j for j, flag in enumerate(slice_flags) if flag]
  if not slices:
    return ''
  which = ('all slices' if len(slices) == len(slice_flags) else
           f'slice{"s" if len(slices) > 1 else ""} {", ".join(map(str, slices))}')
  return f'; old log-probs for {which}'


def _summary(table: schedule.ScheduleTable, data_parallel_size: Optional[int]) -> list[str]:
  cfg = table.config
  b, g, s_ = cfg.micro_batch_size, cfg.num_generations, cfg.steps_per_generation
  every, num_rollouts = cfg.optimizer_every, table.period_rollouts
  steps_per_period = table.period_micro_steps // every
  rollouts = [r for r in range(num_rollouts) if table.rollout_recompute[r]]
  slices = ['rollout {} slice{} {}'.format(r, 's' if row.sum() > 1 else '',
                                           ', '.join(str(j) for j in row.nonzero()[0]))
            for r, row in enumerate(table.slice_recompute) if row.any()]
  num_off = int(table.off_policy.sum())
  out = [
      f'Off-policy micro-steps: {num_off} of {table.period_micro_steps} per period.',
      f'Old log-probs per period (1 unit = one forward pass over one slice of B = {b} '
      'completions):',
      f'  rollout rule: {len(rollouts)} of {num_rollouts} rollouts recompute'
      + (f' ({", ".join(map(str, rollouts))}), S = {s_} units each' if rollouts else ''),
      f'  slice rule:   {int(table.slice_recompute.sum())} of {num_rollouts * s_} slices '
      'recompute' + (f' ({"; ".join(slices)})' if slices else ''),
      '',
      f'  {"rule":<40s}{"units/period":>12s}{"per opt step":>14s}{"vs TRL":>8s}',
  ]
  trl = table.counts['trl_static']
  names = {'trl_static': 'TRL static rule (all if K % (S·μ) != 0)',
           'rollout_rule': 'rollout rule (TRL #5770)',
           'slice_rule': 'slice rule (jaxrl_ga)'}
  for key, name in names.items():
    units = table.counts[key]
    ratio = f'{units / trl:.0%}' if trl else '-'
    out.append(f'  {name:<40s}{units:>12d}{units / steps_per_period:>14.2f}{ratio:>8s}')
  out += [
      '',
      f'Samples per optimizer step: {every * b} completions '
      f'({"K" if every > 1 else "1"}·B = {every}·{b}), '
      f'{every * b / g:g} prompts.',
      f'Samples per rollout: {s_ * b} completions (S·B = {s_}·{b}), {cfg.prompts_per_rollout} '
      f'prompts (S·B/G).',
  ]
  if data_parallel_size is not None:
    out.append(f'Data-parallel size (mesh data*fsdp): {data_parallel_size}, '
               f'{b // data_parallel_size} completions per shard per micro-step.')
  return out


def _load_config():
  """ScheduleConfig, data-parallel size (or None) and a note from --config and the flags."""
  values, data_parallel_size, note = {}, None, ''
  config = FLAGS.config
  if config is not None:
    if 'schedule' in config:
      section, prefix = config.schedule, 'schedule.'
    elif 'grpo' in config and 'schedule' in config.grpo:
      section, prefix = config.grpo.schedule, 'grpo.schedule.'
    else:
      raise ConfigError('the config has no schedule section: expected config.schedule or '
                        'config.grpo.schedule.')
    values = dict(section.to_dict())
    if 'mesh' in config:
      mesh = from_mapping(MeshConfig, config.mesh.to_dict(), prefix='mesh.')
      data_parallel_size = _data_parallel_size(mesh, FLAGS.num_devices)
      if data_parallel_size is None:
        note = ('Mesh check skipped: config.mesh has a -1 size (the devices that are left); '
                'pass --num_devices to check micro_batch_size against mesh data*fsdp.')
  else:
    prefix = ''
  for name in _SCHEDULE_FIELDS:
    if FLAGS[name].value is not None:  # given explicitly: overrides the config file
      values[name] = FLAGS[name].value
  cfg = from_mapping(ScheduleConfig, values, prefix=prefix)
  if FLAGS.data_parallel_size is not None:
    data_parallel_size, note = FLAGS.data_parallel_size, ''
  return cfg, data_parallel_size, note


def _data_parallel_size(mesh: MeshConfig, num_devices: Optional[int]) -> Optional[int]:
  """data*fsdp of the mesh; None if it depends on a -1 size and num_devices is not given.
  Mirrors sharding.make_mesh without importing jax."""
  sizes = (mesh.data, mesh.fsdp, mesh.tensor)
  fixed = math.prod(size for size in sizes if size != -1)
  if num_devices is not None and -1 not in sizes and fixed != num_devices:
    raise ConfigError(
        f'mesh data={mesh.data}, fsdp={mesh.fsdp}, tensor={mesh.tensor} needs {fixed} devices '
        f'but --num_devices={num_devices}; make the product equal {num_devices} or set one '
        f'size to -1.')
  if mesh.data != -1 and mesh.fsdp != -1:
    return mesh.data * mesh.fsdp
  if num_devices is None:
    return None
  if num_devices % fixed:
    raise ConfigError(
        f'--num_devices={num_devices} is not divisible by the fixed mesh sizes (mesh.data='
        f'{mesh.data}, mesh.fsdp={mesh.fsdp}, mesh.tensor={mesh.tensor}, product {fixed}); '
        f'use a multiple of {fixed} devices or change the mesh.')
  rest = num_devices // fixed
  return (rest if mesh.data == -1 else mesh.data) * (rest if mesh.fsdp == -1 else mesh.fsdp)


def _print(text: str) -> None:
  encoding = sys.stdout.encoding or 'ascii'
  try:
    text.encode(encoding)
  except UnicodeEncodeError:
    text = text.translate(_ASCII)
  try:
    print(text, flush=True)
  except BrokenPipeError:  # e.g. piped into `head`: stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}; flags look like --grad_accum_steps=4.',
          file=sys.stderr)
    sys.exit(2)
  try:
    cfg, data_parallel_size, note = _load_config()
    schedule.validate(cfg, data_parallel_size)
    if FLAGS.num_periods is not None and FLAGS.num_periods < 1:
      raise ConfigError(f'--num_periods must be 1 or more, got {FLAGS.num_periods}.')
    table = schedule.build_table(cfg)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  if FLAGS.format == 'json':
    result = table.to_json_dict()
    result['data_parallel_size'] = data_parallel_size
    _print(json.dumps(result, indent=1))
  else:
    _print(render_text(table, FLAGS.num_periods, data_parallel_size, note))


def _parse_flags(argv: list[str]) -> list[str]:
  """Bad flags as ``main`` reports them (jaxrl_ga.cli.parse_flags)."""
  return cli.parse_flags(argv)


if __name__ == '__main__':
  _define_flags()
  app.run(main, flags_parser=_parse_flags)
