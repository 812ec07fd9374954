r"""Trains a policy: stages (SFT warm start -> GRPO or DPO) from an ml_collections config file.

  python -m jaxrl_ga.main --config=configs/grpo_arith.py --workdir=/tmp/grpo_arith

Any config field can be overridden on the command line, e.g.
  --config.grpo.schedule.grad_accum_steps=4 --config.stages=sft,grpo --config.seed=1

The config is validated into typed objects (``jaxrl_ga.config.RunConfig``) before anything is
compiled; an invalid one prints ``error: ...`` naming the setting and exits with status 2.
Outputs in --workdir (a local path, or gs://bucket/dir with the [tpu] extra): metrics.jsonl,
tensorboard/, summary.json, tokenizer/, checkpoints/<stage>/.
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
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from typing import Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxrl_ga import cli

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
  from jaxrl_ga import host_memory  # pylint: disable=g-import-not-at-top
  return host_memory.TPU_PCI_VENDOR in host_memory.pci_vendors(pci_root)


def load_run_config(config_dict):
  """ConfigDict -> validated RunConfig (raises ConfigError)."""
  from jaxrl_ga.config import RunConfig, from_mapping  # pylint: disable=g-import-not-at-top
  return from_mapping(RunConfig, config_dict.to_dict())


def validate_against_mesh(cfg, mesh) -> None:
  """Checks that need the device count (batch sizes vs data parallelism), before compiling."""
  from jaxrl_ga import schedule, sharding  # pylint: disable=g-import-not-at-top
  dp = sharding.data_parallel_size(mesh)
  if 'grpo' in cfg.stages:
    schedule.validate(cfg.grpo.schedule, dp)
  for stage in ('sft', 'dpo'):
    if stage in cfg.stages:
      schedule.check_micro_batch(getattr(cfg, stage).micro_batch_size, dp,
                                 name=f'{stage}.micro_batch_size')


def validate_rollout_chunks(cfg) -> None:
  """sampling.rollout_micro_batch_size must divide the rows generated at once."""
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import dpo  # pylint: disable=g-import-not-at-top
  rows = {}
  if 'grpo' in cfg.stages:
    rows['grpo'] = (cfg.grpo.sampling, cfg.grpo.schedule.completions_per_rollout,
                    'the completions of a rollout, steps_per_generation*micro_batch_size')
  if 'dpo' in cfg.stages:
    rows['dpo'] = (cfg.dpo.sampling, dpo.GENERATION_PROMPTS * cfg.dpo.samples_per_prompt,
                   f'the completions sampled at once, {dpo.GENERATION_PROMPTS}*samples_per_prompt')
  for stage, (sampling_cfg, n, what) in rows.items():
    size = sampling_cfg.rollout_micro_batch_size
    if 0 < size < n and n % size:
      divisors = [d for d in range(1, n) if n % d == 0]
      near = ([d for d in divisors if d < size][-1:] + [d for d in divisors if d > size][:1])
      raise ConfigError(
          f'{stage}.sampling.rollout_micro_batch_size={size} must divide the {n} rows generated '
          f'at once ({what}); set it to {" or ".join(map(str, near))}, or 0 (all at once).')


# The training stream (seed + this) whose prompts validate_lengths measures before any stage.
LENGTH_CHECK_STREAM = 7907


def validate_lengths(cfg, task, tokenizer, model_cfg, probe: int = 256) -> None:
  """Before any stage runs: the prompts (a sample of the training stream, the held-out set) fit
  each stage's length settings, and the longest sequence fits model.max_position_embeddings."""
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top
  held_out = task.eval_examples()
  held_out = held_out[:cfg.eval.num_examples] if cfg.eval.num_examples else held_out
  # A stream of its own: every host checks the same examples, and the training stream's data
  # positions stay each host's own (tests/test_multihost.py counts who builds which example).
  train = [task.train_example(i, cfg.seed + LENGTH_CHECK_STREAM) for i in range(probe)]
  longest = lambda examples, ids: max((len(ids(e)) for e in examples), default=0)
  prompt = lambda e: text.encode_prompt(tokenizer, e.prompt)  # as the trainers encode them
  prompt_eval, prompt_train = longest(held_out, prompt), longest(train, prompt)
  needs = []  # (setting, its value, tokens needed)
  positions = []  # (what, positions a sequence of the stage can take)
  if 'sft' in cfg.stages:
    sft = cfg.sft
    example = longest(train, lambda e: prompt(e) + text.encode(
        tokenizer, task.sft_completion(e))) + 1  # + eos
    needs += [('sft.max_length', sft.max_length, max(example, prompt_eval))]
    positions += [('sft.max_length + eval.max_completion_length',
                   sft.max_length + cfg.eval.max_completion_length)]
  for stage in ('grpo', 'dpo'):
    if stage in cfg.stages:
      sampling = getattr(cfg, stage).sampling
      needs += [(f'{stage}.sampling.max_prompt_length', sampling.max_prompt_length,
                 max(prompt_train, prompt_eval))]
      positions += [(f'{stage}.sampling.max_prompt_length + max({stage}.sampling.'
                     f'max_completion_length, eval.max_completion_length)',
                     sampling.max_prompt_length + max(sampling.max_completion_length,
                                                      cfg.eval.max_completion_length))]
  if 'dpo' in cfg.stages:
    positions += [('dpo.max_length', cfg.dpo.max_length)]
  for setting, value, needed in needs:
    if needed > value:
      raise ConfigError(f'{setting}={value}, but task {cfg.task.name!r} has a prompt (or SFT '
                        f'example) of {needed} tokens; set {setting} to {needed} or more.')
  limit = model_cfg.max_position_embeddings
  for what, n in positions:
    if n > limit:
      raise ConfigError(f'{what} = {n} positions exceeds model.max_position_embeddings={limit}; '
                        f'raise model.max_position_embeddings or shorten the sequences.')


def build_context(cfg, workdir: str):
  """Mesh, task, tokenizer (saved to workdir/tokenizer), model and metric writer of a run,
  checked against the mesh and against the workdir's checkpoints (stage.check_resume) before
  any weight is read or anything compiles. -> (RunContext, initial params)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import fileio, sharding, tasks  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import context, reporting, stage  # pylint: disable=g-import-not-at-top

  mesh = sharding.make_mesh(cfg.mesh)
  validate_against_mesh(cfg, mesh)
  try:  # a task's data (e.g. a local .jsonl file) is read here: its errors are bad input
    task = tasks.get_task(cfg.task.name, **dict(cfg.task.options))
    task.eval_examples()
    task.train_example(0, cfg.seed + LENGTH_CHECK_STREAM)
  except ConfigError:
    raise
  except (ValueError, OSError, ImportError, KeyError) as e:
    raise ConfigError(f'task {cfg.task.name!r} (task.options={dict(cfg.task.options)}): '
                      f'{e}') from None
  from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
  hf.check_model_source(cfg.model.hf_path)
  model_cfg = context.model_config(cfg, 0) if cfg.model.hf_path else None  # its config first
  try:
    tokenizer = (hf.load_tokenizer(cfg.model.hf_path) if cfg.model.hf_path
                 else task.tokenizer())
  except (OSError, ValueError) as e:  # a hub id that cannot be fetched, a broken tokenizer
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f'model.hf_path={cfg.model.hf_path}: its tokenizer cannot be loaded '
                      f'({first}); give a local model directory, a .gguf file or '
                      f'pkg:<package>.') from None
  if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
    raise ConfigError('the tokenizer needs an eos and a pad token; set them in its '
                      'tokenizer_config.json.')
  fileio.makedirs(workdir)
  if jax.process_index() == 0:
    fileio.save_directory(fileio.join(workdir, 'tokenizer'), tokenizer.save_pretrained)
  model_cfg = model_cfg or context.model_config(cfg, len(tokenizer))
  validate_rollout_chunks(cfg)
  validate_lengths(cfg, task, tokenizer, model_cfg)
  graphdef, shapes, axes = sharding.abstract_model(model_cfg)
  ctx = context.RunContext(cfg=cfg, workdir=workdir, mesh=mesh, task=task, tokenizer=tokenizer,
                          model_cfg=model_cfg, graphdef=graphdef,
                          param_shardings=sharding.param_shardings(shapes, axes, mesh),
                          writer=reporting.MetricWriter(workdir))
  stage.check_resume(ctx)  # before any weight is read or any step compiles
  try:
    graphdef, params, ctx.param_shardings = context.build_model(cfg, model_cfg, mesh)
  except (ValueError, OSError) as e:  # a damaged or missing weights file (the message names it)
    if isinstance(e, ConfigError):
      raise
    raise ConfigError(f'model.hf_path={cfg.model.hf_path}: {e}') from None
  ctx.graphdef = graphdef
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
  try:  # root passes os.access checks; a read-only mount or an immutable directory does not
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ConfigError(f'--workdir={workdir} cannot be written ({e.strerror}); give a directory '
                      f'you can write to.') from None


def run(cfg, workdir: str) -> dict:
  """Runs every stage of ``cfg``; returns the summary (also written to workdir/summary.json).

  SIGTERM or SIGINT at any point checkpoints the running stage and raises
  checkpoint.Preempted; summary.json then says where the run stopped (``stopped_early``).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import checkpoint, workdir_lock  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import dpo, grpo, sft  # pylint: disable=g-import-not-at-top

  t0 = time.time()
  check_workdir(workdir)
  # One run per workdir (held until summary.json is written), before any other work.
  with checkpoint.PreemptionGuard() as guard, workdir_lock.held(workdir):
    ctx, params = build_context(cfg, workdir)
    ctx.guard = guard
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
      writer.close(quiet=sys.exc_info()[0] is not None)  # not hiding the error on its way out
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
  """absl's flag parsing with bad flags or config file as one ``error:`` line, exit status 2
  (jaxrl_ga.cli.parse_flags); --print_config prints the settings and exits."""
  remaining = cli.parse_flags(argv)
  set_console_verbosity()
  return remaining


def set_console_verbosity() -> None:
  """absl's verbosity (which the 'absl' logger, orbax's log lines and, through the root logger,
  JAX's follow): WARNING unless --verbose or an explicit --verbosity/-v asks for more. absl's
  app.run raises a verbosity left unset to INFO after parsing; setting it here keeps WARNING."""
  if not flags.FLAGS['verbosity'].present:
    flags.FLAGS.verbosity = logging.INFO if _VERBOSE.value else logging.WARNING


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _CONFIG.value is None or not _WORKDIR.value:
    print(f'error: --{"config" if _CONFIG.value is None else "workdir"} is required (e.g. '
          f'--config=configs/grpo_arith.py --workdir=/tmp/grpo_arith).', file=sys.stderr)
    sys.exit(2)
  from jaxrl_ga import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.quiet_absent_tpu()  # before JAX starts: an idle libtpu's warnings
  host_memory.apply_flag(_REUSE_FREED_MEMORY.value)  # before JAX's backend starts its threads
  from jaxrl_ga import checkpoint, fileio  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers.stage import NonFiniteError  # pylint: disable=g-import-not-at-top
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
