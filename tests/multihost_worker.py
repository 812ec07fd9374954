"""One process of a multi-process GRPO run (used by tests/test_multihost.py; not a test).

  python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR LOCAL_DEVICES

Runs 2 SFT and 2 GRPO optimizer steps of configs/grpo_arith.py:smoke (GRPO K=3, S=2:
non-aligned, rollout 1 of micro-steps 2..3 spans both windows; each step's loss logged; B=16, so
pairs of rows share a prompt's forward; sampled completions of variable length) from a fresh
model, through jax.distributed
with gloo CPU collectives when NUM_PROCESSES > 1. Process 0 writes the final params to
WORKDIR/params.npz; every process writes the training examples it built (stage, index) to
WORKDIR/loaded_<PROCESS_ID>.json, so the test can check that each host loads only its part;
every process then exports the GRPO checkpoint to WORKDIR/hf (jaxrl_ga.export).
With JAXRL_GA_TEST_DATA=<file.jsonl>: GRPO alone on those rows (jaxrl_ga.data), scored by
``length_and_answer``, every completion of process 0's rows logged to completions.jsonl, and the
file's lines this process parsed (1-based, each time) written to WORKDIR/parsed_<PROCESS_ID>.json.
With JAXRL_GA_TEST_STAGES=grpo: no SFT before GRPO.
"""

import json
import os
import sys

pid, nproc, port, workdir, ndev = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                   int(sys.argv[5]))
os.environ['JAX_PLATFORMS'] = 'cpu'
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  # tests/test_multihost.py passes conftest's flags with LOCAL_DEVICES devices (helpers.xla_flags)
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={ndev}'

import jax  # pylint: disable=g-import-not-at-top  (after the environment is set)

if nproc > 1:
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=nproc,
                             process_id=pid)

import numpy as np  # pylint: disable=g-import-not-at-top

from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
from jaxrl_ga import data  # pylint: disable=g-import-not-at-top
from jaxrl_ga import export  # pylint: disable=g-import-not-at-top
from jaxrl_ga import rows as rows_lib  # pylint: disable=g-import-not-at-top
from jaxrl_ga.config import RunConfig, from_mapping, load_config_file  # pylint: disable=g-import-not-at-top
from jaxrl_ga.errors import ConfigError  # pylint: disable=g-import-not-at-top
from jaxrl_ga.tasks import arithmetic  # pylint: disable=g-import-not-at-top
from jaxrl_ga.trainers import stage  # pylint: disable=g-import-not-at-top

loaded = []  # (index, seed) of every training example this process builds
_train_example = arithmetic.ArithmeticTask.train_example


def _recording_train_example(self, index, seed):
  if seed != stage.LENGTH_CHECK_STREAM:  # the up-front length check reads it on every host
    loaded.append((int(index), int(seed)))
    # JAXRL_GA_TEST_ROW_FAILS_ON=<process id>: a row of the second rollout that only this
    # process reads is refused (as a prompt past the up-front checks, too long, would be).
    if os.environ.get('JAXRL_GA_TEST_ROW_FAILS_ON') == str(pid) and index >= 8:
      raise ConfigError(f'data row {index} is refused (test, process {pid})')
  return _train_example(self, index, seed)


arithmetic.ArithmeticTask.train_example = _recording_train_example
_data_train_example = data.DataTask.train_example


def _recording_data_example(self, index, seed):
  if seed != stage.LENGTH_CHECK_STREAM:
    loaded.append((int(index), int(seed)))
  return _data_train_example(self, index, seed)


data.DataTask.train_example = _recording_data_example
parsed = []  # the line of every row of JAXRL_GA_TEST_DATA this process parses
_jsonl_line = rows_lib._jsonl_line  # pylint: disable=protected-access


def _recording_jsonl_line(line, n, source, what):
  parsed.append(n)
  return _jsonl_line(line, n, source, what)


rows_lib._jsonl_line = _recording_jsonl_line  # pylint: disable=protected-access


def length_and_answer(prompts, completions, answer, **unused):
  """A reward that tells completions apart (a sampled completion's length varies): its length,
  plus 10 when it holds the row's answer number (tests/test_multihost.py recomputes it). Called
  with no completion it raises: the held-out evaluation of a process without a held-out row
  called it so."""
  del prompts
  unused['log_metric']('test/process_index', float(jax.process_index()))  # each process's
  if not completions:  # as a batch-relative reward (max over the call) fails on none
    raise ValueError('called with no completion')
  return [len(c) + 10.0 * (a.split()[-1] in c) for c, a in zip(completions, answer)]


# JAXRL_GA_TEST_REWARD_RAISES_ON=<process id>: that process's reward function raises at the
# second rollout (tests/test_multihost.py checks that every process then stops).
if os.environ.get('JAXRL_GA_TEST_REWARD_RAISES_ON') == str(pid):
  _reward_functions = arithmetic.ArithmeticTask.reward_functions
  calls = []

  def _raising_reward_functions(self):
    rewards = _reward_functions(self)
    first = rewards[0]

    def fn(prompts, completions, **fields):
      calls.append(1)
      if len(calls) == 3:  # the dry call before compiling (GRPOStage.check_inputs), 2 rollouts
        raise RuntimeError(f'reward server unreachable (test, process {pid})')
      return first.fn(prompts, completions, **fields)

    return [type(first)(first.name, fn, first.weight)] + list(rewards[1:])

  arithmetic.ArithmeticTask.reward_functions = _raising_reward_functions

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
d = load_config_file(os.path.join(root, 'configs', 'grpo_arith.py'), 'smoke').to_dict()
# JAXRL_GA_TEST_STAGES=grpo: GRPO alone (the tests of how GRPO stops need no SFT before it).
d['stages'] = os.environ.get('JAXRL_GA_TEST_STAGES', 'sft,grpo')
d['sft']['num_steps'] = 2
d['grpo']['num_steps'] = int(os.environ.get('JAXRL_GA_TEST_GRPO_STEPS', 2))
d['grpo']['log_every'] = 1  # a window loss per step: the test compares them across runs
d['checkpoint']['every_steps'] = 0
# B = 16 over 8 devices: pairs of rows share their prompt's forward (model.share_prompt_prefix),
# each pair on one device, on either host.
d['grpo']['schedule']['micro_batch_size'] = 16
# JAXRL_GA_TEST_DATA=<a .jsonl file>: GRPO alone on those rows (jaxrl_ga.data).
reward_funcs = None
if os.environ.get('JAXRL_GA_TEST_DATA'):
  d['stages'] = 'grpo'
  d['data']['train'] = os.environ['JAXRL_GA_TEST_DATA']
  reward_funcs = [length_and_answer]
  d['grpo']['sampling']['max_prompt_length'] = 32
  d['grpo']['completions_every'] = 1
  d['grpo']['completions_logged'] = 64  # all of process 0's S*B/2 rows (of both slices)
  d['model']['max_position_embeddings'] = 64
try:
  api.run(from_mapping(RunConfig, d), os.path.join(workdir, 'run'), reward_funcs=reward_funcs)
except checkpoint.Preempted as e:  # what jaxrl_ga.main does
  print(f'stopped early at micro-step {e.micro_step}', flush=True)
  sys.exit(128 + e.signum)

with open(os.path.join(workdir, f'loaded_{pid}.json'), 'w', encoding='utf-8') as f:
  json.dump(loaded, f)
with open(os.path.join(workdir, f'parsed_{pid}.json'), 'w', encoding='utf-8') as f:
  json.dump(parsed, f)
ckpt_dir = os.path.join(workdir, 'run', 'checkpoints', 'grpo')
state, _, _ = checkpoint.Checkpointer(ckpt_dir).restore_raw(checkpoint.latest_step(ckpt_dir))
if not os.environ.get('JAXRL_GA_TEST_DATA'):  # every process exports, as a script would
  export.export_checkpoint(ckpt_dir, os.path.join(workdir, 'hf'))
if jax.process_index() == 0:
  leaves = jax.tree_util.tree_leaves_with_path(state['learner']['params'])
  np.savez(os.path.join(workdir, 'params.npz'),
           **{jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves})
