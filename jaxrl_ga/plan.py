r"""Compiles a run's GRPO programs ahead of time for a TPU topology, without a TPU.

  python -m jaxrl_ga.plan --config=configs/grpo_gsm8k_tpu.py:v5e-8 --topology=v5e:2x4
  python -m jaxrl_ga.plan --config=configs/grpo_gsm8k_tpu.py:v5e-8 \
      --config.grpo.schedule.micro_batch_size=32 --topology=v5e:2x4 --format=json

The model is built abstractly (``jax.eval_shape``; no weights are read or allocated) with the
shapes of ``--hf_config`` (a local config.json or checkpoint directory), else of ``model.hf_path``
when it is a local directory, else of the config's architecture fields (``model.hidden_size``,
..., ``model.vocab_size``: configs for hub checkpoints write the real shapes there). The steps
are the trainer's own programs, built by the same factory (``programs.build_grpo_programs``: the
layers scanned or unrolled, remat, the log-prob chunk, the shared prompt forward, deferred old
log-probs, LoRA; tests/test_plan.py checks that the lowered text is the trainer's), on a mesh
(``sharding.make_mesh``) of the topology's devices (``jax.experimental.topologies``; libtpu must be
installed: ``pip install 'jax[tpu]'``), lowered at the config's real shapes and shardings and
compiled by the TPU compiler. Topologies with several hosts (e.g. v4:2x2x4, 4 hosts) compile the
same way. With ``grpo.advantage.order_by_advantage_sign`` the reorder step, which then computes the
old log-probs, is compiled and reported too. Every other entry of the factory's table is compiled
as well and reported by its memory (``programs`` in the report, a line each, and in ``fits``):
``evaluation`` (the held-out evaluation's greedy generation) and ``decode`` (one iteration of the
rollout's decode loop at the run's shapes).

Per chip and per step it reports the compiler's memory analysis (argument, output, temp and peak
bytes; the chip's HBM), flops and bytes, and estimates derived from them. These are compiler
numbers and estimates, not a measurement:

  * ``flops``: from the model's shapes (``jaxrl_ga.flops``, the FLOP model the benchmarks use:
    matmuls and attention, forward and backward, the shared prompt forward, LoRA, remat and
    log-prob chunking recompute included, the reference log-probs when beta > 0), per chip. The
    compiler's own count (``compiler_flops``) counts a loop body (the layer scan, the decode
    loop) once; tests/test_plan.py checks the analytic count against a compile with the layers
    unrolled (``model.scan_layers=False``).
  * ``bytes_accessed``: the larger of the compiler's count (loop bodies once) and a lower bound
    from the shapes (weights read per pass, the filled KV cache read per decode step, as many
    decode steps as ``decode.steps_at_max_length``).
  * ``roofline_seconds`` = max(flops / peak flop/s, bytes / HBM bandwidth) with the chip's
    published peaks; ``optimal_seconds``: the compiler's cost-model time, reported only when it
    is sane, else null: positive (it comes back negative for most of these programs on libtpu
    0.0.42.1) and not below the flops at the chip's peak (it too counts a loop body once).
  * ``mfu_estimate``: model flops (no recompute) / (roofline time * peak): an upper bound, as the
    roofline assumes perfect overlap of compute and memory traffic.

The rollout is the trainer's (``decode``, ``prompt_share`` in the report): with
``grpo.sampling.decode_slots`` > 0 its decode loop is the slot pool's, else batches of
``rollout_micro_batch_size`` rows (0: all); each prompt is prefilled once for its
``prompt_share.generation`` rows, and the old-log-prob pass runs each prompt's forward once per
``prompt_share.old_logprobs`` rows. ``decode`` models the loop from one of its steps, the loop's
own body compiled alone (``programs.decode_program``: the draw of the next token included, the
loop's per-layer weights sharded at rest, and a KV cache at the mean fill of a completion of
max_completion_length tokens, Tp + Tc // 2 slots, read whole: the filled-blocks attention reads
that many on average): the compiler's ``compiler_flops`` and
``compiler_bytes_accessed`` per chip, ``roofline_seconds`` = max(flops / peak, bytes / HBM
bandwidth), ``optimal_seconds`` (the cost model's, when sane), ``step_seconds`` (the larger),
``tokens_per_second`` = ``rows_per_step`` / step_seconds (an upper bound), and
``steps_at_max_length`` / ``seconds_at_max_length``: a rollout whose completions all reach the
maximum (the pool: its tokens over its slots; batches: each chunk's Tc - 1 steps).

With ``model.lora`` the learner is the LoRA one (adapters trained, the frozen base a step
argument; ``jaxrl_ga.lora``), its flops count no gradient of the base weights, and the report
names the adapters' rank, targets and trained params.

``model.remat='auto'`` and ``model.logprob_chunk_size=-1`` ('auto') are chosen as a run chooses
them (``jaxrl_ga.fit``: the least recompute whose steps fit), against (1 - --headroom) of the
chip's HBM (``fitted_steps``); the report gives the choice, marked ``(auto)``. When no setting
fits, the least-memory one is reported.

A step fits when its peak is at most (1 - --headroom) of the chip's HBM (default: 10% to spare);
when one does not, the tool prints the knobs that lower memory and exits with status 1. A bad
flag or config prints one ``error:`` line and exits with status 2.

This module is the command line and imports no JAX: ``run()`` defaults ``JAX_PLATFORMS`` to cpu
first, then the library, ``jaxrl_ga.planning``, is imported (``plan.lower_grpo``, ``plan.plan``, ...
are its functions).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from jaxrl_ga import cli
from jaxrl_ga.config import RunConfig, from_mapping
from jaxrl_ga.errors import ConfigError
from jaxrl_ga.host_memory import quiet_libtpu_env


def _library():
  """``jaxrl_ga.planning``, which imports JAX: the one import site of this command, so that
  ``run()`` sets ``JAX_PLATFORMS`` first (jax reads it when imported)."""
  # lazy: startup order: JAX only after run() set JAX_PLATFORMS=cpu (jax reads it when imported)
  from jaxrl_ga import planning  # pylint: disable=g-import-not-at-top
  return planning


def __getattr__(name):
  """``plan.lower_grpo``, ``plan.CHIPS``, ...: the library's (``jaxrl_ga.planning``), imported
  on first use."""
  if name.startswith('__'):
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(_library(), name)


def _define_flags():
  config_flags.DEFINE_config_file('config', None, 'An ml_collections config file (configs/X.py'
                                  '[:arg]); fields can be overridden with --config.<field>=...',
                                  lock_config=True)
  flags.DEFINE_string('topology', None, 'TPU topology, e.g. v5e:2x4, v5p:2x2x1, v4:2x2x4.')
  flags.DEFINE_enum('format', 'text', ['text', 'json'], 'Output format.')
  flags.DEFINE_string('hf_config', None, 'An HF config.json (or checkpoint directory) for the '
                      'model\'s shapes; default: model.hf_path if a local directory, else the '
                      'config\'s model.* fields.')
  flags.DEFINE_integer('num_slices', 1, 'Slices of the topology (multi-slice, over DCN).')
  flags.DEFINE_float('headroom', 0.1, 'Fraction of HBM that must stay free for a step to fit.')
  cli.define_print_config()


def main(argv):
  f = flags.FLAGS
  try:
    if len(argv) > 1:
      raise ConfigError(f'unexpected arguments {argv[1:]}; flags only (see --help).')
    if f.config is None:
      raise ConfigError('--config is required (e.g. --config=configs/grpo_gsm8k_tpu.py:v5e-8).')
    if not f.topology:
      raise ConfigError('--topology is required (e.g. --topology=v5e:2x4).')
    if not 0 <= f.headroom < 1:
      raise ConfigError(f'--headroom={f.headroom} must be in [0, 1).')
    cfg = from_mapping(RunConfig, f.config.to_dict())
    if f.num_slices < 1:
      raise ConfigError(f'--num_slices={f.num_slices} must be 1 or more.')
    lib = _library()
    rep = lib.plan(cfg, f.topology, hf_config=f.hf_config, headroom=f.headroom,
                   num_slices=f.num_slices)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(json.dumps(lib.public(rep), indent=2) if f.format == 'json' else lib.render_text(rep))
  sys.exit(0 if rep['fits'] else 1)


def _parse_flags(argv):
  """Bad flags as ``main`` reports them (jaxrl_ga.cli.parse_flags)."""
  return cli.parse_flags(argv)


def run():
  quiet_libtpu_env()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile for the topology; take no local chip
  _define_flags()
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run()
