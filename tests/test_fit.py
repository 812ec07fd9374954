"""Does it fit (jaxrl_ga.fit): 'auto' memory knobs take the least recompute whose compiled steps fit
the device's memory (``mesh.device_memory_gib`` stands in for a GPU's ``bytes_limit`` on CPU),
checked against each candidate's memory computed here from jax's own ``memory_analysis``;
explicit knobs that do not fit stop the CLI with one ``error:`` line and exit 2 before any
checkpoint; without a limit (a plain CPU) 'auto' is remat 'none', chunk 0 and nothing compiles."""

import os
import subprocess
import sys

import jax
import pytest

from jaxrl_ga import fit
from jaxrl_ga import plan
from jaxrl_ga import programs
from jaxrl_ga.config import ConfigError
from smoke_configs import smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TC = 64  # completion positions: activations large enough next to the tiny model's params


def _memory(lowered) -> int:
  """What jax's memory analysis says the step holds at once: arguments + outputs - donated +
  temporaries (computed here, not by fit)."""
  m = lowered.compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def _cfg(**overrides):
  return smoke('grpo_arith', **{'stages': 'grpo', 'grpo.sampling.max_completion_length': TC,
                                'model.max_position_embeddings': 128,
                                'model.logprob_chunk_size': 0,
                                'model.attention': 'einsum',  # as 'auto' resolves on CPU
                                **overrides})


def test_auto_remat_takes_the_least_recompute_that_fits():
  """A limit between the learner's memory with 'full' remat and without: 'auto' takes a setting
  whose steps all fit, and every setting of less recompute has a step over the limit (each
  candidate's memory compiled here; the rollout step runs no remat, so one compile of it)."""
  cfg = _cfg()
  model_cfg = cfg.model.architecture_config(vocab_size=24)
  devices = jax.devices()
  learner = {}
  for remat in fit.remat_candidates('auto'):
    steps = plan.lower_grpo(cfg, model_cfg, devices, remat=remat, logprob_chunk_size=0,
                            steps=('learner',))
    learner[remat] = _memory(steps.learner)
  rollout = _memory(plan.lower_grpo(cfg, model_cfg, devices, steps=('rollout',)).rollout)
  assert learner['full'] < learner['none'], learner  # the knob lowers the learner's memory here
  limit = (learner['full'] + learner['none']) // 2
  assert rollout <= limit

  cfg = _cfg(**{'model.remat': 'auto', 'mesh.device_memory_gib': limit / 2**30})
  mesh = plan.lower_grpo(cfg, model_cfg, devices, steps=()).mesh  # the mesh a run builds
  lines = []
  progs = programs.fitted_grpo_programs(cfg, model_cfg, mesh, _param_shardings(model_cfg, mesh),
                                        eos_id=0, pad_id=0, say=lines.append)
  picked = progs.engine.learner_options.remat
  order = fit.remat_candidates('auto')
  assert learner[picked] <= limit
  assert all(learner[r] > limit for r in order[:order.index(picked)]), (picked, learner, limit)
  assert picked != 'none'
  assert len(lines) == 1 and lines[0].startswith(
      f'[grpo] model.remat=auto -> {picked}, model.logprob_chunk_size=0 -> 0: '), lines


def _param_shardings(model_cfg, mesh):
  from jaxrl_ga import sharding  # pylint: disable=g-import-not-at-top
  _, shapes, axes = sharding.abstract_model(model_cfg)
  return sharding.param_shardings(shapes, axes, mesh)


def test_chunk_bisection_finds_the_largest_chunk_that_fits():
  """fit.choose over synthetic steps whose memory falls with the chunk (and with remat): the
  first fitting setting in the order none < save_dots < full, chunk 0 then largest first,
  found by brute force here; and no limit: the cheapest, nothing lowered."""
  cost = {'none': 100, 'save_dots': 60, 'full': 30}

  class Lowered:
    def __init__(self, n):
      self.n = n

    def compile(self):
      n = self.n

      class Mem:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = n, 0, 0
        temp_size_in_bytes = 0

      return type('C', (), {'memory_analysis': lambda self: Mem})()

  def need(remat, chunk):
    return cost[remat] + (64 if chunk == 0 else chunk)

  lowered = []

  def build(remat, chunk):
    lowered.append((remat, chunk))
    return (remat, chunk), lambda: [('learner micro-step', Lowered(need(remat, chunk)))]

  spec = _cfg(**{'model.remat': 'auto', 'model.logprob_chunk_size': -1}).model
  order = [(r, c) for r in fit.remat_candidates('auto') for c in fit.chunk_candidates(-1, 64)]
  assert fit.chunk_candidates(-1, 64) == (0, 32, 16, 8, 4, 2, 1)
  for limit in (170, 120, 110, 101, 99, 70, 40, 31):
    lowered.clear()
    want = next(rc for rc in order if need(*rc) <= limit)
    got = fit.choose(spec, build, (limit, 'test'), stage='grpo', positions=64,
                     batch_setting='b', accum_setting='k', say=lambda _: None)
    assert got[0] == want == got[1:], (limit, got, want)
    assert len(lowered) <= 3 * 4, lowered  # bisection, not every chunk
  with pytest.raises(ConfigError, match=r'the learner micro-step needs 0\.03 KiB per device '
                     r'\(the compiler\'s memory_analysis\) with model.remat=full, '
                     r'model.logprob_chunk_size=1 \(the least memory of model.remat=auto, '
                     r'model.logprob_chunk_size=auto\), but 0\.03 KiB are available \(test\)'):
    fit.choose(spec, build, (30, 'test'), stage='grpo', positions=64, batch_setting='b',
               accum_setting='k', say=lambda _: None)
  lowered.clear()
  assert fit.choose(spec, build, None, stage='grpo', positions=64, batch_setting='b',
                    accum_setting='k')[1:] == ('none', 0)
  assert lowered == [('none', 0)]  # built, never lowered or compiled


def test_no_limit_on_cpu():
  """A plain CPU reports no bytes_limit: no limit unless mesh.device_memory_gib gives one."""
  assert fit.device_limit(0.0, jax.devices()) is None
  assert fit.device_limit(1.5, jax.devices()) == (int(1.5 * 2**30), 'mesh.device_memory_gib=1.5')


def test_explicit_settings_over_the_limit_are_one_error_line(tmp_path):
  """The CLI with explicit knobs whose learner step needs more than mesh.device_memory_gib: one
  error line naming the step, the bytes and the knobs, exit 2, no traceback, no checkpoint."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  workdir = tmp_path / 'run'
  done = subprocess.run(
      [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
       f'--workdir={workdir}', '--config.stages=grpo', '--config.model.remat=none',
       '--config.model.logprob_chunk_size=0', '--config.mesh.device_memory_gib=0.0001'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 2, done.stderr[-2000:]
  lines = [l for l in (done.stdout + done.stderr).splitlines()
           if l.strip() and not l.startswith(('W', 'I', 'E0000'))]  # absl/XLA log lines
  errors = [l for l in lines if l.startswith('error: ')]
  assert len(errors) == 1 and 'Traceback' not in done.stderr, lines
  assert errors[0].startswith('error: grpo: the learner micro-step needs '), errors
  for knob in ('model.remat', 'model.logprob_chunk_size', 'grpo.schedule.micro_batch_size',
               'mesh.fsdp', '104.86 KiB are available'):
    assert knob in errors[0], (knob, errors[0])
  ckpt = workdir / 'checkpoints'
  assert not ckpt.exists() or not list(ckpt.rglob('*/*')), list(ckpt.rglob('*'))  # no step saved


def test_checked_steps_are_not_compiled_again(tmp_path, compile_log, capsys):
  """A GRPO run under a limit that fits (explicit knobs: one candidate): fit compiles the learner
  and rollout steps before the first step, and the run then compiles neither again."""
  from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
  cfg = smoke('grpo_arith', **{'stages': 'grpo', 'grpo.num_steps': 2,
                               'model.remat': 'none', 'model.logprob_chunk_size': 0,
                               'mesh.device_memory_gib': 64.0})
  api.run(cfg, str(tmp_path))
  assert compile_log.count('_micro_step') == 1, compile_log.names
  assert compile_log.count('_rollout') == 1, compile_log.names
