"""What the command-line programs (``main``, ``explain``, ``plan``) share: parsing ``--config``
with bad input reported as one ``error:`` line (exit status 2, no traceback), and
``--print_config``, which lists every setting with its value, default and meaning.

A config file's own failure is reported by kind: a ``ConfigError`` it raises (for example an
argument it does not know, ``configs/grpo_arith.py:nosuch``) is one line; any other exception is
the user's code failing, so its traceback is printed as Python would.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import traceback
import typing
from typing import Any, Iterator, Optional

from absl import flags
from absl import logging

from jaxrl_ga import config as config_lib
from jaxrl_ga import tasks

def fail(message: str, status: int = 2) -> typing.NoReturn:
  """Prints ``error: <message>`` to stderr and exits (2: bad input)."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(status)


def define_print_config() -> flags.FlagHolder:
  return flags.DEFINE_bool(
      'print_config', False, 'Print every setting of --config (after the --config.<field> '
      'overrides) with its value, its default and its meaning, then exit.')


def warnings_only_unless_asked(verbose: bool = False) -> None:
  """absl's verbosity (which orbax's INFO lines and, through the root logger, JAX's follow):
  WARNING unless ``verbose`` or an explicit --verbosity/-v asks for more. Call it after parsing
  (absl's app.run raises a verbosity left unset to INFO then)."""
  if not flags.FLAGS['verbosity'].present:
    flags.FLAGS.verbosity = logging.INFO if verbose else logging.WARNING


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for a program with an ml_collections ``--config`` flag.

  ``--config=configs/<name>.py`` that the current directory lacks is the project's own copy
  (config.resolve_config_argv). A bad override (unknown name, wrong type) or config file is one
  ``error:`` line naming it, exit status 2. With ``--print_config`` the settings table is printed
  and the program exits 0.
  """
  try:
    argv = config_lib.resolve_config_argv(argv)
  except config_lib.ConfigError as e:
    fail(str(e))
  try:
    remaining = flags.FLAGS(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError,
          SyntaxError) as e:
    _report_flag_error(argv, e)
  if 'print_config' in flags.FLAGS and flags.FLAGS.print_config:
    cfg = flags.FLAGS['config'].value if 'config' in flags.FLAGS else None
    if cfg is None:
      fail('--print_config needs --config=<file> (e.g. --config=configs/grpo_arith.py).')
    try:  # checked and resolved as a run would take them (loss_type -> its pair)
      resolved = config_lib.to_config_dict(config_lib.from_mapping(config_lib.RunConfig,
                                                                   cfg.to_dict()))
    except config_lib.ConfigError as e:
      fail(str(e))
    try:
      print(render_settings(resolved), flush=True)
    except BrokenPipeError:  # e.g. piped into head
      sys.stdout = None
    sys.exit(0)
  return remaining


def _raised_in(e: BaseException, path: str) -> Optional[BaseException]:
  """The exception of e's chain whose traceback runs through the file ``path``, if any (a config
  file's own: ml_collections re-raises its TypeError/ValueError with the traceback as text, and
  absl may wrap that again)."""
  seen: list[BaseException] = []
  cur: Optional[BaseException] = e
  while cur is not None and not any(cur is x for x in seen):
    seen.append(cur)
    cur = cur.__cause__ or cur.__context__
  target = os.path.realpath(path)
  for exc in reversed(seen):  # innermost first
    frames = traceback.extract_tb(exc.__traceback__)
    if any(os.path.realpath(f.filename) == target for f in frames):
      return exc
  return None


def _file_and_arg(config_arg: str) -> list[str]:
  """``--config=<file>[:<arg>]`` -> [file] or [file, arg]."""
  return config_arg.split('=', 1)[1].split(':', 1)


def _report_flag_error(argv: list[str], e: BaseException) -> typing.NoReturn:
  config_arg = next((a for a in argv[1:] if a.startswith(('--config=', '-config='))), None)
  original = _raised_in(e, _file_and_arg(config_arg)[0]) if config_arg else None
  if isinstance(original, config_lib.ConfigError):
    fail(f'{config_arg}: {original}')
  if original is not None:  # the user's own code failed: its traceback, from its first frame
    frames = traceback.extract_tb(original.__traceback__)
    target = os.path.realpath(_file_and_arg(config_arg)[0])
    first = next(i for i, f in enumerate(frames) if os.path.realpath(f.filename) == target)
    print('Traceback (most recent call last):\n'
          + ''.join(traceback.format_list(frames[first:]))
          + ''.join(traceback.format_exception_only(type(original), original)), end='',
          file=sys.stderr)
    fail(f'{config_arg}: the config file raised {type(original).__name__} (traceback above).')
  if isinstance(e, (KeyError, AttributeError)) and e.args:
    # ml_collections: KeyError("'key'\nDid you mean ...?"), or an AttributeError around one
    inner = e.args[0]
    while isinstance(inner, (KeyError, AttributeError)) and inner.args:
      inner = inner.args[0]
    first, *rest = str(inner).strip('"').split('\n')
    msg = f'no setting named {first}' + ''.join(f' ({r.strip()})' for r in rest if r.strip())
  else:
    msg = ' '.join(str(e).split())
  bad = _config_override_named(argv, msg)
  where = f'{bad}: ' if bad else ''
  known = _known_fields(config_arg, bad) if bad else ''
  fail(f'{where}{msg.rstrip(".")}.{known} {_hint(config_arg)}.')


def _hint(config_arg: Optional[str]) -> str:
  """Where the settings are listed (the same line from main, explain and plan)."""
  value = config_arg.split('=', 1)[1] if config_arg else '<file>'
  return f'`python -m jaxrl_ga.main --config={value} --print_config` lists every setting'


def _config_override_named(argv: list[str], msg: str) -> Optional[str]:
  """The --config... argument an error message is about (its quoted key), if one can tell."""
  keys = re.findall(r"'([^']+)'", msg)
  for arg in argv[1:]:
    name = arg.split('=', 1)[0]
    if name.startswith('--config.') and any(k in name.split('.') or k == name for k in keys):
      return name
  return None


def _known_fields(config_arg: Optional[str], override: str) -> str:
  """' The settings under <parent>: a, b, c.' for a bad ``--config.<parent>.<name>`` override."""
  config = flags.FLAGS['config'].value if 'config' in flags.FLAGS else None
  if config is None and config_arg:  # absl stopped before setting it: read the file again
    try:
      config = config_lib.load_config_file(*_file_and_arg(config_arg))
    except Exception:  # pylint: disable=broad-except
      return ''
  parts = override[len('--config.'):].split('.')
  node = config
  for part in parts[:-1]:
    try:
      node = node[part]
    except (KeyError, TypeError, AttributeError):
      return ''
  if node is None or not hasattr(node, 'keys') or parts[-1] in node:
    return ''
  parent = '.'.join(['config'] + parts[:-1])
  return f' The settings under --{parent}: {", ".join(sorted(node.keys()))}.'


# -- --print_config ---------------------------------------------------------------------------
def _attribute_docs(cls: type) -> dict[str, str]:
  """{field: meaning} from the Google-style ``Attributes:`` sections of cls and its bases
  (``a, b: text`` documents both)."""
  docs: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    doc = inspect.cleandoc(klass.__dict__.get('__doc__') or '')
    if 'Attributes:' not in doc:
      continue
    current: list[str] = []
    indent = None
    for line in doc.split('Attributes:', 1)[1].splitlines():
      if not line.strip():
        continue
      m = re.match(r'^(\s+)([\w, ]+):\s+(.*)$', line)
      if m and (indent is None or len(m.group(1)) <= indent):
        indent = len(m.group(1))
        current = [n.strip() for n in m.group(2).split(',')]
        for name in current:
          docs[name] = m.group(3).strip()
      elif indent is not None and len(line) - len(line.lstrip()) <= indent - 1:
        break  # the end of the section
      else:
        for name in current:
          docs[name] += ' ' + line.strip()
  return docs


def _one_line(text: str, width: int = 110) -> str:
  text = ' '.join(text.split())
  # the first sentence: a period ends it, but not one of an abbreviation (e.g., i.e., Eq.)
  sentence = re.split(r'(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\bEq\.)(?<=\.)\s', text, maxsplit=1)[0]
  return sentence if len(sentence) <= width else sentence[:width - 3].rstrip() + '...'


def _rows(cls: type, values: Any, defaults: Any, prefix: str) -> Iterator[tuple[str, ...]]:
  settings = config_lib.settings(cls)
  docs: dict[str, str] = {}
  for owner in [*dict.fromkeys(o for _, o in settings.values() if o is not cls), cls]:  # cls last
    docs.update(_attribute_docs(owner))
  for name, (hint, _) in settings.items():
    path = prefix + name
    value = values.get(name) if values is not None else None
    default = defaults.get(name) if defaults is not None else None
    if dataclasses.is_dataclass(hint):
      yield from _rows(hint, value, default, path + '.')
    elif name == 'options' and cls is config_lib.TaskSpec:
      yield from _task_option_rows(values, path + '.')
    else:
      yield path, _show(value), _show(default), _one_line(docs.get(name, ''))


def _task_option_rows(task: Any, prefix: str) -> Iterator[tuple[str, ...]]:
  name = task.get('name') if task is not None else None
  options = dict(task.get('options') or {}) if task is not None else {}
  if name not in tasks.TASKS:
    for key, value in sorted(options.items()):
      yield prefix + key, _show(value), '', ''
    return
  option_cls = tasks.TASKS[name][1]
  yield from _rows(option_cls, options, config_lib.to_config_dict(option_cls()), prefix)


def _show(value: Any) -> str:
  if hasattr(value, 'get') and callable(getattr(value, 'get', None)) and hasattr(value, 'keys'):
    return '{' + ', '.join(f'{k}: {_show(value[k])}' for k in value.keys()) + '}'
  if isinstance(value, float) or (isinstance(value, str) and (not value or value != value.strip()
                                                               or '\n' in value)):
    return repr(value)
  return 'None' if value is None else str(value)


def settings_table(config: Any) -> list[tuple[str, str, str, str]]:
  """(setting, value, default, meaning) for every field of RunConfig, values from ``config``
  (a ConfigDict after overrides), defaults from RunConfig (task options: the task's own)."""
  defaults = config_lib.default_config_dict()
  return list(_rows(config_lib.RunConfig, config, defaults, ''))


def render_settings(config: Any) -> str:
  rows = settings_table(config)
  width = max(len(r[0]) for r in rows)
  lines = [f'{"setting":<{width}}  value  [default if different]  meaning',
           'override any of them with --config.<setting>=<value>']
  for path, value, default, meaning in rows:
    changed = '' if value == default else f'  [default {default}]'
    lines.append(f'{path:<{width}}  {value}{changed}  # {meaning}' if meaning
                 else f'{path:<{width}}  {value}{changed}')
  return '\n'.join(lines)
