"""metrics.jsonl on resume: the rows after the resumed step go, and so does a row that a kill cut
short, so that every line of the file stays one JSON object."""

import json

from jaxrl_ga.trainers import reporting


def test_resume_drops_later_rows_and_a_row_cut_short(tmp_path):
  rows = [{'phase': 'grpo', 'step': s, 'loss': 0.5} for s in (1, 2, 3)]
  text = ''.join(json.dumps(r) + '\n' for r in rows)
  (tmp_path / 'metrics.jsonl').write_text(text + '{"phase": "grpo", "step": 4, "lo')  # killed
  writer = reporting.MetricWriter(str(tmp_path))
  writer.drop_after('grpo', 2)
  writer.write('grpo', 3, {'loss': 0.25})
  writer.close()
  got = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert got == rows[:2] + [{'phase': 'grpo', 'step': 3, 'loss': 0.25}]


def test_a_whole_last_row_without_its_newline_is_kept_apart(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"phase": "grpo", "step": 1, "loss": 0.5}')
  writer = reporting.MetricWriter(str(tmp_path))
  writer.drop_after('grpo', 1)
  writer.write('grpo', 2, {'loss': 0.25})
  writer.close()
  got = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in got] == [1, 2]
