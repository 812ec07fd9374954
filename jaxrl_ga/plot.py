r"""Writes PNG curves of a run's metrics (WORKDIR/metrics.jsonl) to WORKDIR/plots/.

  python -m jaxrl_ga.plot --workdir=/tmp/grpo_arith [--out=DIR] [--metrics=loss,reward/mean]

One PNG per phase (sft, grpo, dpo, ...) with a panel per metric, plus one with every held-out
accuracy point of the run (the *_eval phases). Needs matplotlib (`pip install -e .[plot]`).
"""

from __future__ import annotations

import collections
import io
import json
import math
import sys
from typing import Optional, Sequence

from absl import app
from absl import flags

from jaxrl_ga import fileio


def _define_flags():
  """CLI flags, defined only when run as a program (the library import defines none, so it
  can sit beside jaxrl_ga.main in one process)."""
  flags.DEFINE_string('workdir', None, 'A run directory holding metrics.jsonl.')
  flags.DEFINE_string('out', None, 'Where to write the PNGs (default: WORKDIR/plots).')
  flags.DEFINE_list('metrics', None, 'Metrics to plot per phase (default: all that have at '
                    'least two finite points).')

# The first panels of each phase, when present.
_PREFERRED = ('loss', 'reward/mean', 'reward/accuracy', 'rewards/accuracies', 'rewards/margins',
              'kl', 'entropy', 'grad_norm', 'clip_ratio/region_mean', 'align/cosine')


def read_metrics(path: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """metrics.jsonl -> {phase: {metric: [(step, value), ...]}}, non-finite values dropped."""
  series: dict = collections.defaultdict(lambda: collections.defaultdict(list))
  for n, line in enumerate(fileio.read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{n} is not JSON ({e}); is it a jaxrl_ga metrics.jsonl?') from e
    phase, step = row.pop('phase', None), row.pop('step', None)
    if phase is None or step is None:
      raise ValueError(f'{path}:{n} has no "phase"/"step"; is it a jaxrl_ga metrics.jsonl?')
    for k, v in row.items():
      if isinstance(v, (int, float)) and math.isfinite(v):
        series[phase][k].append((int(step), float(v)))
  return {p: dict(m) for p, m in series.items()}


def plot_run(workdir: str, out: Optional[str] = None,
             metrics: Optional[Sequence[str]] = None) -> list[str]:
  """Writes the PNGs; returns their paths."""
  # lazy: optional dependency (matplotlib)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  # lazy: optional dependency (matplotlib), after use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  path = fileio.join(workdir, 'metrics.jsonl')
  if not fileio.exists(path):
    raise FileNotFoundError(f'no metrics.jsonl in {workdir}; pass the --workdir of a run.')
  series = read_metrics(path)
  out = out or fileio.join(workdir, 'plots')
  written = []
  evals = {p: m['accuracy'] for p, m in series.items() if p.endswith('_eval') or
           p.endswith('_probe')}
  for phase, by_metric in sorted(series.items()):
    if phase in evals:
      continue
    names = [m for m in (metrics or by_metric) if len(by_metric.get(m, ())) >= 2]
    names.sort(key=lambda m: (_PREFERRED.index(m) if m in _PREFERRED else len(_PREFERRED), m))
    if not names:
      continue
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
      steps, values = zip(*by_metric[name])
      ax.plot(steps, values, lw=1.2)
      ax.set_title(name, fontsize=9)
      ax.set_xlabel('optimizer step', fontsize=8)
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
      ax.axis('off')
    fig.suptitle(f'{fileio.path(workdir).name}: {phase}', fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, fileio.join(out, f'{phase}.png'), plt))
  if evals:
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for phase, points in sorted(evals.items()):
      steps, values = zip(*points)
      ax.plot(steps, values, marker='o', ms=3, label=phase)
    ax.set_xlabel('optimizer step (of the phase)')
    ax.set_ylabel('accuracy')
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title('held-out (eval) and training-probe accuracy', fontsize=10)
    fig.tight_layout()
    written.append(_save(fig, fileio.join(out, 'accuracy.png'), plt))
  return written


def _save(fig, path: str, plt) -> str:
  buf = io.BytesIO()
  fig.savefig(buf, format='png', dpi=110)
  plt.close(fig)
  fileio.write_bytes(path, buf.getvalue())  # atomic
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  if not f.workdir:
    raise app.UsageError('--workdir is required.')
  try:
    paths = plot_run(f.workdir, f.out, f.metrics)
  except (FileNotFoundError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  for p in paths:
    print(p)


if __name__ == '__main__':
  _define_flags()
  app.run(main)
