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
This module is flags only and imports no JAX: after host_memory's settings ``main()`` imports
``jaxrl_ga.main_body``, which runs the run and turns its errors into exit statuses; building,
validating and running a run are ``jaxrl_ga.api`` (``api.run``, ``api.build_context``,
``GRPOTrainer``), the library's entry point.
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from jaxrl_ga import cli
from jaxrl_ga import host_memory

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


def _library():
  """``jaxrl_ga.main_body``, which imports the library (JAX, orbax, the trainers): the one import
  site of this command, so that ``main()`` applies host_memory's settings first."""
  # lazy: startup order: the library only after main()'s host_memory settings (JAX starts threads)
  from jaxrl_ga import main_body  # pylint: disable=g-import-not-at-top
  return main_body


def __getattr__(name):
  """``main.init_distributed``: the body's (``jaxrl_ga.main_body``), imported on first use."""
  if name == 'init_distributed':
    return getattr(_library(), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


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
  _library().run(_CONFIG.value, _WORKDIR.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                 _PROCESS_ID.value)

if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
