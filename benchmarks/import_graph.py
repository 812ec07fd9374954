r"""The import graph of jaxrl_ga/: its circles and its function-level imports.

  python benchmarks/import_graph.py                 # prints the report
  python benchmarks/import_graph.py --json=out.json  # and writes it as JSON

Reads the package's source with ``ast`` (nothing is imported, standard library only) and builds
the graph module -> the jaxrl_ga modules it imports. Every import statement counts, at module
level or inside a function: a function-level import still makes one module need the other, it
only moves the moment (and hides a circle from Python's import machinery). ``from jaxrl_ga.x
import y`` is an edge to ``jaxrl_ga.x.y`` when that is a module, else to ``jaxrl_ga.x``; a
package's ``__init__`` is the package's node; importing ``jaxrl_ga.a.b`` is not counted as an
edge to ``jaxrl_ga.a`` (every package would be a circle with its own children).

Prints the strongly-connected components of more than one module (the circles, Tarjan's
algorithm) and every function-level import statement (jaxrl_ga's own and third-party ones) with
its file:line and the ``# lazy: <reason>`` comment it carries, if any (on its lines, or on a
comment line above it or above the run of import lines it belongs to). ``tests/test_imports.py``
uses ``analyse`` to assert no circle and a reason on every function-level import.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import sys

PACKAGE = 'jaxrl_ga'
_LAZY = re.compile(r'#\s*lazy:\s*(\S.*)$')


@dataclasses.dataclass(frozen=True)
class LocalImport:
  """One import statement inside a function body."""

  path: str  # relative to the repository root
  line: int
  statement: str  # the source text, first line
  targets: tuple[str, ...]  # the jaxrl_ga modules it imports (empty: third-party only)
  reason: str | None  # the text after '# lazy:', or None


@dataclasses.dataclass(frozen=True)
class Report:
  modules: tuple[str, ...]
  edges: dict[str, tuple[str, ...]]  # module -> modules it imports (all statements)
  circles: tuple[tuple[str, ...], ...]  # SCCs of size > 1, each sorted, largest first
  local_imports: tuple[LocalImport, ...]

  def to_json(self) -> dict:
    return {
        'modules': len(self.modules),
        'edges': sum(len(v) for v in self.edges.values()),
        'circles': [list(c) for c in self.circles],
        'function_level_imports': len(self.local_imports),
        'function_level_imports_internal': sum(1 for i in self.local_imports if i.targets),
        'function_level_imports_without_reason': sum(
            1 for i in self.local_imports if not i.reason),
        'local_imports': [dataclasses.asdict(i) for i in self.local_imports],
    }


def _module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, root)[:-len('.py')].split(os.sep)
  if rel[-1] == '__init__':
    rel = rel[:-1]
  return '.'.join(rel)


def _resolve(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
  """The jaxrl_ga modules one import statement loads."""
  found = set()
  if isinstance(node, ast.Import):
    for alias in node.names:
      if alias.name == PACKAGE or alias.name.startswith(PACKAGE + '.'):
        found.add(alias.name)
  elif isinstance(node, ast.ImportFrom):
    if node.level:  # relative import
      parts = module.split('.')
      if not is_package:
        parts = parts[:-1]
      parts = parts[:len(parts) - (node.level - 1)]
      base = '.'.join(parts + ([node.module] if node.module else []))
    else:
      base = node.module or ''
    if base == PACKAGE or base.startswith(PACKAGE + '.'):
      for alias in node.names:
        sub = f'{base}.{alias.name}'
        found.add(sub if sub in modules else base)
  return {m for m in found if m in modules}


class _Visitor(ast.NodeVisitor):
  """Collects import statements with whether they sit inside a function."""

  def __init__(self):
    self.imports: list[tuple[ast.AST, bool]] = []
    self._depth = 0

  def _function(self, node):
    self._depth += 1
    self.generic_visit(node)
    self._depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def visit_Import(self, node):
    self.imports.append((node, self._depth > 0))

  visit_ImportFrom = visit_Import


def _reason(lines: list[str], node: ast.AST) -> str | None:
  """The '# lazy:' reason on the statement's lines, else on a comment line above it or above
  the block of import (and comment) lines it closes: one comment may head several imports."""
  first, last = node.lineno, node.end_lineno or node.lineno
  for i in range(first, last + 1):
    m = _LAZY.search(lines[i - 1])
    if m:
      return m.group(1).strip()
  i = first - 1
  while i >= 1:
    line = lines[i - 1].strip()
    m = _LAZY.search(line)
    if m and line.startswith('#'):
      return m.group(1).strip()
    if not line.startswith(('import ', 'from ', '#')):
      return None
    i -= 1
  return None


def _circles(modules, edges) -> list[list[str]]:
  """Tarjan's strongly-connected components, iterative."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  counter = 0
  for start in modules:
    if start in index:
      continue
    work = [(start, iter(edges[start]))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      v, it = work[-1]
      advanced = False
      for w in it:
        if w not in index:
          index[w] = low[w] = counter
          counter += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(edges[w])))
          advanced = True
          break
        if w in on_stack:
          low[v] = min(low[v], index[w])
      if advanced:
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return sorted(out, key=lambda c: (-len(c), c))


def analyse(repo_root: str) -> Report:
  """The import graph of ``repo_root/jaxrl_ga``."""
  files = {}
  for dirpath, dirnames, filenames in os.walk(os.path.join(repo_root, PACKAGE)):
    dirnames[:] = sorted(d for d in dirnames if d != '__pycache__')
    for f in sorted(filenames):
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        files[_module_name(repo_root, path)] = path
  modules = set(files)
  edges, local = {}, []
  for module in sorted(files):
    path = files[module]
    with open(path, encoding='utf-8') as fh:
      source = fh.read()
    lines = source.splitlines()
    visitor = _Visitor()
    visitor.visit(ast.parse(source, path))
    targets = set()
    for node, in_function in visitor.imports:
      found = _resolve(node, module, path.endswith('__init__.py'), modules) - {module}
      targets |= found
      if in_function:
        local.append(LocalImport(
            path=os.path.relpath(path, repo_root), line=node.lineno,
            statement=lines[node.lineno - 1].strip(), targets=tuple(sorted(found)),
            reason=_reason(lines, node)))
    edges[module] = tuple(sorted(targets))
  ordered = tuple(sorted(modules))
  return Report(modules=ordered, edges=edges, circles=tuple(
      tuple(c) for c in _circles(ordered, edges)), local_imports=tuple(local))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root', default=os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))), help='repository root (default: this checkout)')
  parser.add_argument('--json', default=None, help='write the report as JSON to this path')
  args = parser.parse_args(argv)
  report = analyse(args.root)
  summary = report.to_json()
  print(f'{summary["modules"]} modules, {summary["edges"]} import edges')
  print(f'circles (strongly-connected components of size > 1): {len(report.circles)}')
  for c in report.circles:
    print(f'  {len(c)}: ' + ' '.join(m[len(PACKAGE) + 1:] or PACKAGE for m in c))
  print(f'function-level imports: {summary["function_level_imports"]} '
        f'({summary["function_level_imports_internal"]} of jaxrl_ga modules, '
        f'{summary["function_level_imports_without_reason"]} without a "# lazy:" reason)')
  for i in report.local_imports:
    why = f'  # lazy: {i.reason}' if i.reason else ''
    stmt = i.statement.split('#')[0].strip()
    print(f'  {i.path}:{i.line}: {stmt}{why}')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as fh:
      json.dump(summary, fh, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
