"""Workdir files in a bucket: a fake gs:// (the ``fake_gcs`` fixture of tests/conftest.py, an
in-memory fsspec filesystem registered for the gcs protocol, which etils.epath uses without
TensorFlow) stands in for Cloud Storage."""

import json
import os

import numpy as np
import pytest

from jaxrl_ga import fileio
from jaxrl_ga.tasks import tokenizer as tok_lib
from jaxrl_ga.trainers import reporting

import helpers


def test_metric_writer_summary_tokenizer_and_npz_in_a_bucket(fake_gcs, monkeypatch):
  import tensorboardX  # pylint: disable=g-import-not-at-top
  logdirs = []

  class _RecordingSummaryWriter:  # tensorboardX writes gs:// itself (google-cloud-storage)
    def __init__(self, logdir):
      logdirs.append(logdir)

    def add_scalar(self, *args):
      pass

    def close(self):
      pass

  monkeypatch.setattr(tensorboardX, 'SummaryWriter', _RecordingSummaryWriter)
  workdir = 'gs://bucket/runs/a'
  w = reporting.MetricWriter(workdir)
  w.write('grpo', 1, {'loss': 0.5})
  w.write('grpo', 2, {'loss': float('nan')})
  w.close()
  w = reporting.MetricWriter(workdir)  # a resumed run appends
  w.write('grpo', 3, {'loss': 0.25})
  w.close()
  rows = [json.loads(l) for l in fileio.read_text(f'{workdir}/metrics.jsonl').splitlines()]
  assert rows == [{'phase': 'grpo', 'step': 1, 'loss': 0.5},
                  {'phase': 'grpo', 'step': 2, 'loss': None},
                  {'phase': 'grpo', 'step': 3, 'loss': 0.25}]
  assert logdirs == [f'{workdir}/tensorboard'] * 2

  tokenizer = tok_lib.build_char_tokenizer('0123456789+=')
  fileio.save_directory(f'{workdir}/tokenizer', tokenizer.save_pretrained)
  saved = sorted(k for k in fake_gcs if '/tokenizer/' in k)
  assert any(k.endswith('tokenizer.json') for k in saved), saved
  text = fileio.read_text(f'{workdir}/tokenizer/tokenizer.json')
  assert json.loads(text)['model']['vocab'] == json.loads(
      tokenizer.backend_tokenizer.to_str())['model']['vocab']

  arrays = {'a': np.arange(6).reshape(2, 3), 'b': np.float32([1.5])}
  fileio.save_npz(f'{workdir}/pairs.npz', arrays)
  back = fileio.load_npz(f'{workdir}/pairs.npz')
  assert sorted(back) == ['a', 'b']
  np.testing.assert_array_equal(back['a'], arrays['a'])
  assert not any(k.startswith('/') or 'tmp' in k for k in fake_gcs)  # nothing written locally


def test_bucket_appends_upload_only_the_new_lines(fake_gcs):
  """metrics.jsonl in a bucket: each flush sends only the lines written since the last one (a
  compose appends them), not the whole file; the file holds every line in order, across a close
  and a reopen (a resumed run appends)."""
  target = 'gs://bucket/runs/b/metrics.jsonl'
  lines = [json.dumps({'step': i, 'loss': 1.0 / (i + 1)}) + '\n' for i in range(300)]
  sent = []
  appender = fileio.TextAppender(target, flush_every_s=0)  # a flush at every write: worst case
  for i, line in enumerate(lines):
    if i == 200:  # close and reopen, as a resumed run does
      appender.close()
      appender = fileio.TextAppender(target, flush_every_s=0)
    before = sum(helpers.FakeGCS.uploaded)
    appender.write(line)
    sent.append(sum(helpers.FakeGCS.uploaded) - before)
  appender.close()
  # Every write sent its own line's bytes and no more: bounded, not growing with the file
  # (rewriting the object at every write sends the whole file: quadratic in total).
  assert sent == [len(line.encode()) for line in lines]
  assert fileio.read_text(target) == ''.join(lines)
  assert [k for k in fake_gcs if 'part' in k] == []  # no part object is left behind

  # Buffered (the default): lines written within flush_every_s of the last flush wait for the
  # next flush or close, which sends them in one part.
  appender = fileio.TextAppender(target, flush_every_s=3600)
  more = [f'{{"step": {i}}}\n' for i in range(300, 310)]
  before = sum(helpers.FakeGCS.uploaded)
  for line in more:
    appender.write(line)  # the first one flushes (none yet), the rest are buffered
  assert sum(helpers.FakeGCS.uploaded) - before == len(more[0])
  assert fileio.read_text(target) == ''.join(lines + more[:1])
  appender.close()
  assert sum(helpers.FakeGCS.uploaded) - before == len(''.join(more))
  assert fileio.read_text(target) == ''.join(lines + more)


def test_local_write_is_atomic(tmp_path, monkeypatch):
  target = tmp_path / 'sub' / 'summary.json'
  fileio.write_text(target, 'old')

  def broken_replace(src, dst):
    raise OSError('disk full')

  monkeypatch.setattr(os, 'replace', broken_replace)
  with pytest.raises(OSError, match='disk full'):
    fileio.write_text(target, 'new')
  assert target.read_text() == 'old'  # the old content survives a failed write
  assert os.listdir(tmp_path / 'sub') == ['summary.json']  # and no temporary file is left


def test_an_unresolvable_storage_endpoint_is_told_at_once(monkeypatch):
  """gs:// on a host that cannot resolve the Cloud Storage endpoint: an OSError naming the host
  before any request (gcsfs would retry for about a minute); a resolvable one (an emulator on
  127.0.0.1) and local paths pass."""
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://no-such-host.invalid:9')
  with pytest.raises(OSError, match='no-such-host.invalid'):
    fileio.check_endpoint('gs://bucket/model')
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://127.0.0.1:9')
  fileio.check_endpoint('gs://bucket/model')
  fileio.check_endpoint('/no/such/local/dir')
