"""metrics.jsonl and completions.jsonl on resume: the rows after the resumed step go, and so does
a row that a kill cut short, so that every line of each file stays one JSON object and a resumed
run logs each step and each rollout once; log.report_to='none' leaves out TensorBoard."""

import json
import os

from jaxrl_ga.config import LogConfig
from jaxrl_ga.trainers import reporting


def test_resume_drops_later_rows_and_a_row_cut_short(tmp_path):
  rows = [{'phase': 'grpo', 'step': s, 'loss': 0.5} for s in (1, 2, 3)]
  text = ''.join(json.dumps(r) + '\n' for r in rows)
  (tmp_path / 'metrics.jsonl').write_text(text + '{"phase": "grpo", "step": 4, "lo')  # killed
  writer = reporting.MetricWriter(str(tmp_path))
  writer.drop_after('grpo', 2, 6)
  writer.write('grpo', 3, {'loss': 0.25})
  writer.close()
  got = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert got == rows[:2] + [{'phase': 'grpo', 'step': 3, 'loss': 0.25}]


def test_a_whole_last_row_without_its_newline_is_kept_apart(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"phase": "grpo", "step": 1, "loss": 0.5}')
  writer = reporting.MetricWriter(str(tmp_path))
  writer.drop_after('grpo', 1, 3)
  writer.write('grpo', 2, {'loss': 0.25})
  writer.close()
  got = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in got] == [1, 2]


def test_resume_drops_the_completions_of_rollouts_it_generates_again(tmp_path):
  """Resumed at micro-step 6 (optimizer step 2 of K = 3): the rollouts generated at micro-steps 6
  and 8 are generated (and logged) again, so their rows go; the rollout of micro-step 4, in the
  checkpoint's buffer, is not regenerated and its rows stay; so do other stages' rows."""
  def row(phase, micro_step, text):
    return {'phase': phase, 'step': micro_step // 3, 'micro_step': micro_step, 'prompt': 'q',
            'completion': text}
  rows = [row('grpo', 0, 'a'), row('grpo', 2, 'b'), row('grpo', 4, 'c'), row('sft', 9, 'd'),
          row('grpo', 6, 'e'), row('grpo', 8, 'f')]
  (tmp_path / 'completions.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in rows) + '{"phase": "grpo", "step": 3, "mi')  # killed
  writer = reporting.MetricWriter(str(tmp_path))
  writer.drop_after('grpo', 2, 6)
  writer.write_completions('grpo', 2, 6, [{'prompt': 'q', 'completion': 'e2'}])
  writer.close()
  got = [json.loads(line) for line in (tmp_path / 'completions.jsonl').read_text().splitlines()]
  assert got == rows[:4] + [row('grpo', 6, 'e2')]


def test_report_to_none_writes_metrics_jsonl_only(tmp_path):
  """log.report_to='none': no TensorBoard events, metrics.jsonl and completions.jsonl as
  always."""
  writer = reporting.MetricWriter(str(tmp_path), LogConfig(report_to='none'))
  writer.write('grpo', 1, {'loss': 0.5})
  writer.write_completions('grpo', 1, 3, [{'prompt': 'q', 'completion': 'a'}])
  writer.close()
  assert sorted(os.listdir(tmp_path)) == ['completions.jsonl', 'metrics.jsonl']
  assert json.loads((tmp_path / 'metrics.jsonl').read_text()) == {'phase': 'grpo', 'step': 1,
                                                                 'loss': 0.5}
