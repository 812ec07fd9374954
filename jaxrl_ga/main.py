r"""Trains a policy: stages (SFT warm start -> GRPO or DPO) from an ml_collections config file.

  python -m jaxrl_ga.main --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith

Any config field can be overridden on the command line, e.g.
  --config.grpo.schedule.grad_accum_steps=4 --config.stages=sft,grpo --config.seed=1

The config is validated into typed objects (``jaxrl_ga.config.RunConfig``) before anything is
compiled; an invalid one prints ``error: ...`` naming the setting and exits with status 2.
Outputs in --workdir (a local path, or gs://bucket/dir with the [tpu] extra): metrics.jsonl,
tensorboard/ (log.report_to: and/or a Weights & Biases run), summary.json, tokenizer/,
checkpoints/<stage>/.
Re-running with the same --workdir resumes from the latest checkpoint (SIGTERM writes one).
One run at a time per workdir: a run holds WORKDIR/run.lock (jaxrl_ga.workdir_lock), and a second
one started there stops at once naming the holder. A failed write (a full disk) stops the run with
one line naming the file; the checkpoints before it are intact and the same command resumes.
The console shows progress, evaluations, warnings and a summary; --verbose adds the INFO log
lines of orbax, JAX and absl.
On a CPU host, glibc's malloc is first set to keep freed memory for reuse
(``--reuse_freed_memory``, ``jaxrl_ga.host_memory``): XLA:CPU's large per-step buffers are then
not mapped and zero-filled afresh at every step.
Print the schedule of a config with ``python -m jaxrl_ga.explain --config=...``.
This module is flags and printing only: building, validating and running a run are
``jaxrl_ga.api`` (``api.run``, ``api.build_context``, ``GRPOTrainer``), the library's entry point.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxrl_ga import cli
from jaxrl_ga import fileio
from jaxrl_ga import host_memory
from jaxrl_ga import rewards
from jaxrl_ga.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Path to an ml_collections config file (get_config()); fields can be '
    'overridden with --config.<field>=<value>.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory (created), local or gs://...; '
                               're-running with the same directory resumes the run. A multi-host '
                               'run needs one that every host sees.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0: runs jax.distributed.initialize for a '
    'multi-process run (GPU cluster, several CPU hosts). On Cloud TPU VM slices with several '
    'workers initialization is automatic.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run '
                                      '(with --coordinator_address).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process\'s index, 0 .. '
                                   'num_processes-1 (with --coordinator_address).')
_VERBOSE = flags.DEFINE_bool(
    'verbose', False, 'Also print the INFO log lines of orbax, JAX and absl (checkpoint saves and '
    'restores, backend setup), off by default; the same as --verbosity=0. The run\'s progress, '
    'evaluations, summary, warnings and errors print either way.')
_REUSE_FREED_MEMORY = flags.DEFINE_enum(
    'reuse_freed_memory', 'auto', ['auto', 'true', 'false'],
    'Set glibc\'s malloc to keep freed memory for reuse before JAX starts (jaxrl_ga.host_memory): '
    'XLA:CPU then reuses its per-step buffers instead of mapping fresh, zero-filled pages every '
    'step (a fifth of a SmolLM2 learner step on a CPU); the process keeps its peak memory. auto: '
    'on unless JAX_PLATFORMS names an accelerator or a TPU / NVIDIA device is on the PCI bus.')
_PRINT_CONFIG = cli.define_print_config()


def init_distributed(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None, process_id: Optional[int] = None,
                     pci_root: str = '/sys/bus/pci/devices') -> str:
  """jax.distributed: explicit with a coordinator address, automatic on a Cloud TPU VM.
  -> 'explicit', 'tpu_vm' or 'none' (one process)."""
  # lazy: after main()'s host_memory settings, which precede JAX's and other threads
  import jax  # pylint: disable=g-import-not-at-top
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise app.UsageError('--coordinator_address needs --num_processes and --process_id.')
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU hosts only
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return 'explicit'
  if num_processes is not None or process_id is not None:
    raise app.UsageError('--num_processes and --process_id need --coordinator_address.')
  if host_memory.on_tpu_vm(pci_root):
    jax.distributed.initialize()  # jax reads the slice's workers from the VM metadata
    return 'tpu_vm'
  return 'none'


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with bad flags or config file as one ``error:`` line, exit status 2
  (jaxrl_ga.cli.parse_flags); --print_config prints the settings and exits."""
  remaining = cli.parse_flags(argv)
  cli.warnings_only_unless_asked(_VERBOSE.value)
  return remaining


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _CONFIG.value is None or not _WORKDIR.value:
    print(f'error: --{"config" if _CONFIG.value is None else "workdir"} is required (e.g. '
          f'--config=configs/grpo_arith.py --workdir=/tmp/grpo_arith).', file=sys.stderr)
    sys.exit(2)
  host_memory.quiet_absent_tpu()  # before JAX starts: an idle libtpu's warnings
  host_memory.apply_flag(_REUSE_FREED_MEMORY.value)  # before JAX's backend starts its threads
  # lazy: the library (JAX, orbax, the trainers) only after that: it starts threads
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers.stage import NonFiniteError  # pylint: disable=g-import-not-at-top
  try:
    cfg = api.load_run_config(_CONFIG.value)
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    summary = api.run(cfg, _WORKDIR.value)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except checkpoint.Preempted as e:
    print(f'stopped early ({e}); the checkpoint is saved: re-run the same command to resume.',
          flush=True)
    sys.exit(128 + (e.signum or signal.SIGTERM))  # "not finished" for a job scheduler
  except (NonFiniteError, checkpoint.CheckpointUnreadableError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  except rewards.RewardError as e:  # a reward function's bad output, or its own exception
    if e.__cause__ is not None:  # the user's code failed: its traceback, as Python prints it
      traceback.print_exception(e.__cause__)
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except fileio.WriteError as e:  # a full disk, a quota, a lost mount
    print(f'error: {e}. Free space (or fix the storage), then re-run the same command: it '
          f'resumes from the last complete checkpoint.', file=sys.stderr)
    sys.exit(1)
  logging.info('done: %s', summary)
  keys = [k for k in sorted(summary) if k.startswith('eval/')] + ['wall_time_s']
  print('summary: ' + ', '.join(f'{k}={summary[k]:.3f}' if isinstance(summary[k], float)
                                else f'{k}={summary[k]}' for k in keys if k in summary))


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
