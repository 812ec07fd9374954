"""The micro-benchmarks take the trainer's programs from the program table (issue 43, item 2).

``jaxrl_ga.programs`` builds every jitted program a stage runs; a benchmark that builds a
``Learner``, a task loss, a ``Sampler``, a generate or decode function or a ``RolloutEngine``
itself times a program the trainer may not run. Read with ``ast`` (nothing is imported or run):
no call of those constructors through a name bound to a jaxrl_ga module, and no private
attribute (``_name``) read through one. The checker is run on a known-bad source first.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The benchmarks that time the trainer's programs (their reference arms, where they have one,
# say in their docstrings why they are no table program).
TABLE_BENCHMARKS = ('learner.py', 'learner_ab.py', 'memory.py', 'multisteps_overhead.py',
                    'scan_layers.py', 'decode.py', 'uneven_rollout.py', 'recompute.py')
# What programs.py builds the table's programs from.
BUILDERS = {'Learner', 'grpo_task_loss', 'sft_task_loss', 'dpo_task_loss', 'Sampler',
            'make_generate_fn', 'make_decode_step', 'RolloutEngine', 'build_reference_logps'}


def package_names(tree: ast.AST) -> set[str]:
  """The names a module binds to jaxrl_ga modules and objects (``from jaxrl_ga import x``,
  ``from jaxrl_ga.m import y as z``, ``import jaxrl_ga.m as w``), at any level."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'jaxrl_ga':
      names.update(a.asname or a.name for a in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.asname or a.name.split('.')[0] for a in node.names
                   if a.name.split('.')[0] == 'jaxrl_ga')
  return names


def violations(source: str) -> list[str]:
  """'line: what' for every builder called and every private attribute read through a name
  bound to the package."""
  tree = ast.parse(source)
  names, out = package_names(tree), []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    root = node.value
    while isinstance(root, ast.Attribute):
      root = root.value
    if not (isinstance(root, ast.Name) and root.id in names):
      continue
    if node.attr.startswith('_') and not node.attr.startswith('__'):
      out.append(f'{node.lineno}: private {node.attr}')
    elif node.attr in BUILDERS:
      out.append(f'{node.lineno}: builds {node.attr}')
  return out


def test_checker_flags_builders_and_private_attributes():
  bad = '''
import jax
from jaxrl_ga import learner as learner_lib
from jaxrl_ga.models import transformer as tfm
import jaxrl_ga.sampling as smp

def f(graphdef, params):
  lrn = learner_lib.Learner(graphdef, learner_lib.grpo_task_loss(None, 8), None, None, None)
  fn = smp.make_generate_fn(graphdef, smp.Sampler(max_completion_length=4))
  return lrn, fn, tfm._scan_layers, learner_lib.Learner._micro_step
'''
  got = sorted(v.split(': ')[1] for v in violations(bad))
  assert got == sorted(['builds Learner', 'builds grpo_task_loss', 'builds make_generate_fn',
                        'builds Sampler', 'private _scan_layers', 'builds Learner',
                        'private _micro_step']), got
  # Public reads of the same modules, and private names of other objects, are fine.
  good = '''
from jaxrl_ga import programs
import machine

def f(progs, params, state):
  step = progs.table['learner'].fn
  return step, progs.learner.task_loss, machine._MALLOC_SETTINGS, state._replace()
'''
  assert violations(good) == []


def test_table_benchmarks_build_no_program_themselves():
  found = {}
  for name in TABLE_BENCHMARKS:
    with open(os.path.join(REPO, 'benchmarks', name), encoding='utf-8') as f:
      bad = violations(f.read())
    if bad:
      found[name] = bad
  assert not found, ('benchmarks that build the trainer\'s programs themselves or read private '
                     f'parts of jaxrl_ga (take them from programs.build_*_programs): {found}')


def test_bad_input_to_a_benchmark_is_one_error_line_with_status_2():
  """machine.run: an unknown flag, and a peer package missing (torch is never in the tests'
  environment), are one `error:` line and status 2, before any work; before, absl's usage block
  and status 1, and a torch import traceback even for --help."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  cases = [(['tied_head.py', '--nosuchflag'], "error: Unknown command line flag 'nosuchflag'")]
  if importlib.util.find_spec('torch') is None:
    cases.append((['skinny_products.py'], 'error: this benchmark needs torch'))
  for args, want in cases:
    done = subprocess.run([sys.executable, os.path.join(REPO, 'benchmarks', args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
    assert done.returncode == 2, (args, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), (args, done.stderr[-2000:])
    assert 'Traceback' not in done.stderr and not done.stdout.strip(), args
