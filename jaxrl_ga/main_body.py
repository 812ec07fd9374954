"""The body of ``python -m jaxrl_ga.main``: jax.distributed, the run (``api.run``), and each way
it can stop as its console line and exit status.

``jaxrl_ga.main`` (flags, ``--help``) imports this module only after it has applied
``jaxrl_ga.host_memory``'s settings, which must come before JAX and the other libraries start
their threads; this module imports them at its top.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Any, Optional

from absl import app
from absl import logging
import jax

from jaxrl_ga import api
from jaxrl_ga import checkpoint
from jaxrl_ga import fileio
from jaxrl_ga import host_memory
from jaxrl_ga import rewards
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.trainers.stage import NonFiniteError


def init_distributed(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None, process_id: Optional[int] = None,
                     pci_root: str = '/sys/bus/pci/devices') -> str:
  """jax.distributed: explicit with a coordinator address, automatic on a Cloud TPU VM.
  -> 'explicit', 'tpu_vm' or 'none' (one process)."""
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


def run(config: Any, workdir: str, coordinator_address: Optional[str] = None,
        num_processes: Optional[int] = None, process_id: Optional[int] = None) -> None:
  """Runs ``config`` (the --config ConfigDict) in ``workdir`` and prints its summary; a bad
  setting, a preemption, a non-finite loss, a reward function's error or a failed write ends
  the process with its line and exit status."""
  try:
    cfg = api.load_run_config(config)
    init_distributed(coordinator_address, num_processes, process_id)
    summary = api.run(cfg, workdir)
  except (ConfigError, checkpoint.CheckpointMismatchError) as e:
    # A mismatch is a workdir that does not fit this run (e.g. a state structure of another
    # version): the user's to fix, as a bad setting is.
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
