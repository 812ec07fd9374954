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
  """The reason the CLIs' JAX imports stay in functions: plan sets JAX_PLATFORMS, main and
  sample set host_memory's environment, before JAX is imported; importing them must not."""
  code = ('import sys, jaxrl_ga.config, jaxrl_ga.plan, jaxrl_ga.main, jaxrl_ga.sample, '
          'jaxrl_ga.explain, jaxrl_ga.fit; '
          'print(sorted(m for m in ("jax", "flax", "orbax") if m in sys.modules))')
  env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS=helpers.xla_flags())
  env.pop('JAX_PLATFORMS', None)
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120, check=True)
  assert out.stdout.strip() == '[]', out.stdout + out.stderr


def test_config_error_is_one_class():
  from jaxrl_ga import config, errors  # pylint: disable=g-import-not-at-top
  assert config.ConfigError is errors.ConfigError
