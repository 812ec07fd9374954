r"""Trains a policy: stages (SFT warm start -> GRPO or DPO) from an ml_collections config file.

  python -m jaxrl_ga.main --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith

Any config field can be overridden on the command line, e.g.
  --config.grpo.schedule.grad_accum_steps=4 --config.stages=sft,grpo --config.seed=1

The config is validated into typed objects (``jaxrl_ga.config.RunConfig``) before anything is
compiled; an invalid one prints ``error: ...`` naming the setting and exits with status 2.
Outputs in --workdir (a local path, or gs://bucket/dir with the [tpu] extra): metrics.jsonl,
tensorboard/, summary.json, tokenizer/, checkpoints/<stage>/.
Re-running with the same --workdir resumes from the latest checkpoint (SIGTERM writes one).
Print the schedule of a config with ``python -m jaxrl_ga.explain --config=...``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

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
flags.mark_flags_as_required(['config', 'workdir'])


def init_distributed(coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None, process_id: Optional[int] = None,
                     pci_root: str = '/sys/bus/pci/devices') -> str:
  """jax.distributed: explicit with a coordinator address, automatic on a Cloud TPU VM.
  -> 'explicit', 'tpu_vm' or 'none' (one process)."""
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
  if _on_cloud_tpu_vm(pci_root):
    jax.distributed.initialize()  # jax reads the slice's workers from the VM metadata
    return 'tpu_vm'
  return 'none'


def _on_cloud_tpu_vm(pci_root: str) -> bool:
  """A Google TPU on the PCI bus (vendor 0x1ae0), as jax's own TPU detection checks."""
  import glob  # pylint: disable=g-import-not-at-top
  for path in glob.glob(os.path.join(pci_root, '*', 'vendor')):
    try:
      with open(path, encoding='ascii') as f:
        if f.read().strip() == '0x1ae0':
          return True
    except OSError:
      continue
  return False


def load_run_config(config_dict):
  """ConfigDict -> validated RunConfig (raises ConfigError)."""
  from jaxrl_ga.config import RunConfig, from_mapping  # pylint: disable=g-import-not-at-top
  return from_mapping(RunConfig, config_dict.to_dict())


def validate_against_mesh(cfg, mesh) -> None:
  """Checks that need the device count (batch sizes vs data parallelism), before compiling."""
  from jaxrl_ga import schedule, sharding  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ScheduleConfig  # pylint: disable=g-import-not-at-top
  dp = sharding.data_parallel_size(mesh)
  if 'grpo' in cfg.stages:
    schedule.validate(cfg.grpo.schedule, dp)
    schedule.build_table(cfg.grpo.schedule)  # strict_on_policy check
  for stage in ('sft', 'dpo'):
    if stage in cfg.stages:
      sc = getattr(cfg, stage)
      schedule.validate_for_mesh(ScheduleConfig(micro_batch_size=sc.micro_batch_size,
                                                num_generations=1, steps_per_generation=1,
                                                grad_accum_steps=sc.grad_accum_steps), dp)


def build_context(cfg, workdir: str):
  """Mesh, task, tokenizer (saved to workdir/tokenizer), model and metric writer of a run,
  checked against the mesh before anything compiles. -> (RunContext, initial params)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import fileio, sharding, tasks  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import common  # pylint: disable=g-import-not-at-top

  mesh = sharding.make_mesh(cfg.mesh)
  validate_against_mesh(cfg, mesh)
  task = tasks.get_task(cfg.task.name, **dict(cfg.task.options))
  tokenizer = hf.load_tokenizer(cfg.model.hf_path) if cfg.model.hf_path else task.tokenizer()
  if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
    raise ConfigError('the tokenizer needs an eos and a pad token; set them in its '
                      'tokenizer_config.json.')
  fileio.makedirs(workdir)
  if jax.process_index() == 0:
    fileio.save_directory(fileio.join(workdir, 'tokenizer'), tokenizer.save_pretrained)
  model_cfg, graphdef, params, shardings = common.build_model(cfg, len(tokenizer), mesh)
  ctx = common.RunContext(cfg=cfg, workdir=workdir, mesh=mesh, task=task, tokenizer=tokenizer,
                          model_cfg=model_cfg, graphdef=graphdef, param_shardings=shardings,
                          writer=common.MetricWriter(workdir))
  return ctx, params


def check_workdir(workdir: str) -> None:
  """A workdir that is a file, or that cannot be written, is a ConfigError (before any work)."""
  from jaxrl_ga import fileio  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  if fileio.is_remote(workdir):
    return
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; give a directory path.')
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f'--workdir={workdir}: {parent} is a file, not a directory; give another '
                      f'path.')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f'--workdir={workdir}: {parent} is not writable; give a directory you can '
                      f'write to.')


def run(cfg, workdir: str) -> dict:
  """Runs every stage of ``cfg``; returns the summary (also written to workdir/summary.json).

  SIGTERM or SIGINT at any point checkpoints the running stage and raises
  checkpoint.Preempted; summary.json then says where the run stopped (``stopped_early``).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import common, dpo, grpo, sft  # pylint: disable=g-import-not-at-top

  t0 = time.time()
  check_workdir(workdir)
  with checkpoint.PreemptionGuard() as guard:
    ctx, params = build_context(cfg, workdir)
    ctx.guard = guard
    common.check_resume(ctx)
    writer, mesh = ctx.writer, ctx.mesh
    summary: dict = {'stages': list(cfg.stages), 'devices': jax.device_count(),
                     'mesh': dict(mesh.shape)}
    try:
      for stage in cfg.stages:
        if stage == 'sft':
          params, s = sft.run_sft(ctx, cfg.sft, params)
        elif stage == 'grpo':
          params, s = grpo.GRPOTrainer(ctx, cfg.grpo).run(params)
        else:
          params, s = dpo.run_dpo(ctx, cfg.dpo, params)
        summary.update(s)
    except checkpoint.Preempted as e:
      summary.update({'stopped_early': True, 'stopped_stage': e.stage,
                      'stopped_at_micro_step': e.micro_step,
                      'stopped_by': signal.Signals(e.signum).name if e.signum else 'another '
                                    'process', 'wall_time_s': time.time() - t0})
      _write_summary(workdir, summary)
      raise
    finally:
      writer.close()
  if 'eval/accuracy_after' not in summary and 'eval/accuracy_after_sft' in summary:
    summary['eval/accuracy_after'] = summary['eval/accuracy_after_sft']  # an SFT-only run
  summary['stopped_early'] = False
  summary['wall_time_s'] = time.time() - t0
  _write_summary(workdir, summary)
  return summary


def _write_summary(workdir: str, summary: dict) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import fileio  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    fileio.write_text(fileio.join(workdir, 'summary.json'),
                      json.dumps(summary, indent=2, sort_keys=True))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad ``--config.<field>`` override (unknown name, wrong type) or
  config file reported as one line naming it, exit status 2, no traceback."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError,
          SyntaxError) as e:
    if isinstance(e, KeyError) and e.args:  # ml_collections: "'key'\nDid you mean ...?"
      first, *rest = str(e.args[0]).split('\n')
      msg = f'no setting named {first}' + ''.join(f' ({r.strip()})' for r in rest if r.strip())
    else:
      msg = ' '.join(str(e).split())
    bad = _config_override_named(argv, msg)
    where = f'{bad}: ' if bad else ''
    print(f'error: {where}{msg.rstrip(".")}. Fix the setting (`python -m jaxrl_ga.main --helpfull` lists '
          f'every --config.<field>).', file=sys.stderr)
    sys.exit(2)


def _config_override_named(argv: list[str], msg: str) -> Optional[str]:
  """The --config... argument an error message is about (its quoted key), if one can tell."""
  import re  # pylint: disable=g-import-not-at-top
  keys = re.findall(r"'([^']+)'", msg)
  for arg in argv[1:]:
    name = arg.split('=', 1)[0]
    if name.startswith('--config') and any(k in name.split('.') or k == name for k in keys):
      return name
  return None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers.common import NonFiniteError  # pylint: disable=g-import-not-at-top
  try:
    cfg = load_run_config(_CONFIG.value)
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    summary = run(cfg, _WORKDIR.value)
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
  logging.info('done: %s', summary)
  keys = [k for k in sorted(summary) if k.startswith('eval/')] + ['wall_time_s']
  print('summary: ' + ', '.join(f'{k}={summary[k]:.3f}' if isinstance(summary[k], float)
                                else f'{k}={summary[k]}' for k in keys if k in summary))


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
