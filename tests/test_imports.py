"""No import circle in jaxrl_ga/, and every function-level import says why it is one.

The graph is benchmarks/import_graph.py's (``ast`` over the sources, every import statement
counted, function-level ones included); its analyser is checked here against small packages whose
graph is known by construction.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_graph():
  spec = importlib.util.spec_from_file_location(
      'import_graph', os.path.join(REPO, 'benchmarks', 'import_graph.py'))
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault('import_graph', module)  # its dataclasses look their module up
  spec.loader.exec_module(sys.modules['import_graph'])
  return sys.modules['import_graph']


def _package(root, files):
  for name, text in files.items():
    path = root / 'jaxrl_ga' / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
  return str(root)


def test_no_import_circle_in_the_package():
  report = _import_graph().analyse(REPO)
  assert len(report.modules) > 40  # the package was read
  assert report.circles == (), report.circles


def test_every_function_level_import_has_a_lazy_reason():
  report = _import_graph().analyse(REPO)
  missing = [f'{i.path}:{i.line}: {i.statement}' for i in report.local_imports if not i.reason]
  assert not missing, 'function-level imports without "# lazy: <reason>":\n' + '\n'.join(missing)


# The function-level imports there may be, by the kind their reason names and by file: an optional
# dependency; a module slow to import that few runs need; or startup order, one site per command
# line (the module that sets the environment, then imports its body: plan sets JAX_PLATFORMS,
# main and sample host_memory's malloc settings) and the package's two.
ALLOWED_LOCAL_IMPORTS = {
    'optional dependency': {'jaxrl_ga/models/gguf.py': 1, 'jaxrl_ga/plot.py': 2,
                            'jaxrl_ga/rows.py': 2, 'jaxrl_ga/tasks/gsm8k.py': 1,
                            'jaxrl_ga/trainers/reporting.py': 2},
    'import cost': {'jaxrl_ga/models/attention.py': 2, 'jaxrl_ga/models/gguf.py': 1},
    'startup order': {'jaxrl_ga/__init__.py': 2, 'jaxrl_ga/main.py': 1, 'jaxrl_ga/plan.py': 1,
                      'jaxrl_ga/sample.py': 1},
}


def test_function_level_imports_are_the_counted_few():
  """Each reason starts with its kind; per kind and file, exactly the imports allowed above (a
  new one is a deliberate change to this table, not a drift)."""
  got = {}
  for i in _import_graph().analyse(REPO).local_imports:
    kind = next((k for k in ALLOWED_LOCAL_IMPORTS if (i.reason or '').startswith(k)), None)
    assert kind, f'{i.path}:{i.line}: {i.reason!r} names none of {list(ALLOWED_LOCAL_IMPORTS)}'
    got.setdefault(kind, {}).setdefault(i.path, 0)
    got[kind][i.path] += 1
  assert got == ALLOWED_LOCAL_IMPORTS


def test_the_analyser_finds_a_circle_hidden_in_a_function(tmp_path):
  """a -> b at module level, b -> a inside a function: one circle {a, b}; b -> sub.c -> d is
  none (c's relative import resolved).
  The function-level import is listed with its reason (a comment above a block of imports
  covers the block) or without one."""
  root = _package(tmp_path, {
      '__init__.py': '',
      'a.py': 'from jaxrl_ga import b\n',
      'b.py': """\
          def f():
            # lazy: because
            import os
            from jaxrl_ga import a
            return a, os

          def g():
            from jaxrl_ga.sub import c  # lazy: inline
            return c

          def h():
            x = 1
            import json
            return x, json
          """,
      'sub/__init__.py': '',
      'sub/c.py': 'from ..d import thing\n',
      'd.py': 'thing = 1\n',
  })
  report = _import_graph().analyse(root)
  assert report.circles == (('jaxrl_ga.a', 'jaxrl_ga.b'),)
  assert report.edges['jaxrl_ga.sub.c'] == ('jaxrl_ga.d',)
  assert report.edges['jaxrl_ga.b'] == ('jaxrl_ga.a', 'jaxrl_ga.sub.c')
  got = [(i.line, i.targets, i.reason) for i in report.local_imports]
  assert got == [(3, (), 'because'), (4, ('jaxrl_ga.a',), 'because'),
                 (8, ('jaxrl_ga.sub.c',), 'inline'), (13, (), None)]


def test_a_three_module_circle_is_one_component(tmp_path):
  root = _package(tmp_path, {
      '__init__.py': '',
      'x.py': 'import jaxrl_ga.y\n',
      'y.py': 'from jaxrl_ga import z\n',
      'z.py': 'def f():\n  from jaxrl_ga.x import thing\n',
      'w.py': 'from jaxrl_ga import x\n',
  })
  assert _import_graph().analyse(root).circles == (('jaxrl_ga.x', 'jaxrl_ga.y', 'jaxrl_ga.z'),)


def test_cli_modules_import_no_jax():
  """The reason each CLI imports its body in a function: plan sets JAX_PLATFORMS, main and
  sample set host_memory's environment, before JAX is imported; importing them must not."""
  code = ('import sys, jaxrl_ga.config, jaxrl_ga.plan, jaxrl_ga.main, jaxrl_ga.sample, '
          'jaxrl_ga.explain; '
          'print(sorted(m for m in ("jax", "flax", "orbax") if m in sys.modules))')
  env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS=helpers.xla_flags())
  env.pop('JAX_PLATFORMS', None)
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120, check=True)
  assert out.stdout.strip() == '[]', out.stdout + out.stderr


def test_config_error_is_one_class():
  from jaxrl_ga import config, errors  # pylint: disable=g-import-not-at-top
  assert config.ConfigError is errors.ConfigError
