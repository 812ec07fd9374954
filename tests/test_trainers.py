"""End-to-end: every config runs at smoke size; a stopped GRPO run resumes bitwise; SIGTERM leaves
a restorable checkpoint; the CLI rejects invalid configs before compiling; export round-trips."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import jax
import numpy as np
import pytest
import helpers
import smoke_configs

from jaxrl_ga import api
from jaxrl_ga import sharding
from jaxrl_ga.config import ConfigError, RunConfig, from_mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_smoke = smoke_configs.smoke


def _env():
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env['XLA_FLAGS'] = helpers.xla_flags(2)
  return env


@pytest.mark.slow
@pytest.mark.parametrize('name', ['sft_arith', 'grpo_arith', 'dpo_arith'])
def test_each_config_runs_end_to_end(name, tmp_path):
  summary = api.run(_smoke(name), str(tmp_path))
  assert 0.0 <= summary['eval/accuracy_after'] <= 1.0
  files = set(os.listdir(tmp_path))
  assert {'metrics.jsonl', 'summary.json', 'tokenizer', 'checkpoints', 'tensorboard'} <= files
  lines = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert all('phase' in l and 'step' in l for l in lines)
  if name == 'grpo_arith':
    grpo = [l for l in lines if l['phase'] == 'grpo']
    assert grpo and all('reward/mean' in l for l in grpo)
    assert summary['schedule/counts_per_period'] == {'trl_static': 6, 'rollout_rule': 2,
                                                     'slice_rule': 1}
    # The run paid exactly the slice rule's forward passes.
    assert (summary['grpo/old_logprob_forward_passes'] ==
            summary['schedule/recompute_counts_this_run']['slice_rule'])
    # Export the trained policy; our loader reads back the checkpoint's params exactly, and the
    # directory holds what transformers reads (config.json with the architecture, tokenizer).
    from jaxrl_ga import checkpoint, export  # pylint: disable=g-import-not-at-top
    from jaxrl_ga.models import hf  # pylint: disable=g-import-not-at-top
    out = tmp_path / 'hf'
    export.export_checkpoint(str(tmp_path / 'checkpoints' / 'grpo'), str(out))
    stored, _, fingerprint = checkpoint.Checkpointer(
        str(tmp_path / 'checkpoints' / 'grpo')).restore_raw(
            checkpoint.latest_step(str(tmp_path / 'checkpoints' / 'grpo')))
    cfg = hf.model_config_from_hf(str(out))
    assert cfg.hidden_size == fingerprint['model']['hidden_size']
    reloaded = hf.load_params(str(out), cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 reloaded, stored['learner']['params'])
    assert json.load(open(out / 'config.json'))['architectures'] == ['Qwen2ForCausalLM']
    assert (out / 'tokenizer.json').exists()
    # The plot command draws the run's curves.
    from jaxrl_ga import plot  # pylint: disable=g-import-not-at-top
    pngs = plot.plot_run(str(tmp_path))
    assert {os.path.basename(p) for p in pngs} >= {'sft.png', 'grpo.png', 'accuracy.png'}
    for p in pngs:
      data = open(p, 'rb').read()
      assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000


def _grpo_metrics_steps(workdir):
  """The optimizer steps of a run's GRPO rows in metrics.jsonl, in order."""
  return [r['step'] for r in map(json.loads, open(workdir / 'metrics.jsonl'))
          if r['phase'] == 'grpo']


# The uninterrupted run that the two plain resume tests compare with: 2 optimizer steps (K=3, S=2:
# 6 micro-steps, rollouts at 0, 2, 4), a checkpoint only at the end.
_PLAIN = {'grpo.num_steps': 2, 'checkpoint.every_steps': 0}


@pytest.fixture(scope='module')
def plain_grpo_run(tmp_path_factory):
  """_PLAIN's uninterrupted run, once per module: (params, its GRPO metrics steps)."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = _smoke('grpo_arith', stages='grpo', **_PLAIN)
  workdir = tmp_path_factory.mktemp('plain_grpo_run')
  ctx, params = api.build_context(cfg, str(workdir))
  want, _ = grpo.GRPOLoop(ctx, cfg.grpo).run(params)
  return want, _grpo_metrics_steps(workdir)


@pytest.mark.slow
@pytest.mark.parametrize('lora', [{}, {'model.lora.rank': 4, 'grpo.loss.beta': 0.04,
                                       'grpo.schedule.micro_batch_size': 16}])
def test_grpo_resume_is_bitwise_exact(tmp_path, lora, request):
  """Stopped after optimizer step 1 (micro-step 3: the middle of rollout 1, K=3, S=2) and again
  one micro-step into the next window, then resumed to the end of step 2 (a new rollout at
  micro-step 4 and an optimizer step after each resume): same params as an uninterrupted run, and
  each resumed run really started from the checkpoint (it ran only the micro-steps left). Also
  with LoRA, whose checkpoints hold the adapters only (the base is rebuilt on resume) and whose
  reference (beta > 0) is the base with the adapters disabled; there B = 16 over 8 devices, so
  pairs of rows share their prompt's forward (model.share_prompt_prefix) in generation, the
  learner and the reference log-probs."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = _smoke('grpo_arith', stages='grpo', **_PLAIN, **lora)

  def trainer(workdir):
    ctx, params = api.build_context(cfg, str(workdir))
    return grpo.GRPOLoop(ctx, cfg.grpo), params

  if lora:
    t, params = trainer(tmp_path / 'a')
    want, _ = t.run(params)
    want_steps = _grpo_metrics_steps(tmp_path / 'a')
  else:
    want, want_steps = request.getfixturevalue('plain_grpo_run')
  got, _ = helpers.run_grpo_in_pieces(trainer, tmp_path / 'b', (3, 4), total_micro_steps=6)
  helpers.assert_trees_equal(got, want)
  # Each optimizer step is logged once, though steps 1..2 were reached by three processes' runs.
  assert want_steps and _grpo_metrics_steps(tmp_path / 'b') == want_steps


@pytest.mark.slow
def test_a_grpo_checkpoint_without_the_policy_version_resumes_bitwise(tmp_path, capsys,
                                                                     plain_grpo_run):
  """A GRPO checkpoint written before the rollout buffer carried ``policy_version`` (rewritten
  here as that code wrote it: the buffer's dataclass without the field) resumes with the version
  that generated its buffer, and the run goes on bitwise as an uninterrupted one. Stops at
  micro-steps 3 and 5 (K=3, E=2): their buffers were generated at micro-steps 2 and 4, versions
  0 and 1, so neither a constant 0 nor micro_step // K (1 at 3) would pass the learner's check
  of each micro-step's rollout. The leaf missing and any other difference: refused."""
  import flax  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import rollout  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = _smoke('grpo_arith', stages='grpo', **_PLAIN)
  sched = cfg.grpo.schedule
  assert (sched.optimizer_every, sched.micro_steps_per_rollout) == (3, 2)
  kept = [f for f in rollout.RolloutBuffer.__dataclass_fields__ if f != 'policy_version']
  old_buffer = flax.struct.dataclass(type('RolloutBuffer', (), {'__annotations__': {
      f: Any for f in kept}}))
  stripped = []

  def trainer(workdir):
    ctx, params = api.build_context(cfg, str(workdir))
    t = grpo.GRPOLoop(ctx, cfg.grpo)
    step = checkpoint.latest_step(str(workdir / 'checkpoints' / 'grpo'))
    if step is None:
      return t, params
    # The stopped run's checkpoint, rewritten as the older code wrote it.
    abstract = t.programs.abstract_state()
    with ctx.checkpointer('grpo') as ckpt:
      state, meta = ckpt.restore(step, abstract)
      b = state['buffer']
      ckpt.save(step, {**state, 'buffer': old_buffer(**{f: getattr(b, f) for f in kept})}, meta,
                replace=True)
      ckpt.wait()
      raw, _, _ = ckpt.restore_raw(step)
      assert 'policy_version' not in raw['buffer'] and 'completion_tokens' in raw['buffer']
      stripped.append((meta['micro_step'], int(b.policy_version)))
      adv = abstract['advantages']
      other = dict(abstract, advantages=jax.ShapeDtypeStruct(adv.shape, np.int32,
                                                             sharding=adv.sharding))
      with pytest.raises(checkpoint.CheckpointMismatchError, match='advantages') as e:
        ckpt.restore(step, other, (grpo._older_buffer_policy_version(sched),))
      assert 'buffer.policy_version: in the current state, not in the checkpoint' in str(e.value)
    return t, params

  want, _ = plain_grpo_run  # the uninterrupted run
  capsys.readouterr()
  got, _ = helpers.run_grpo_in_pieces(trainer, tmp_path / 'b', (3, 5), total_micro_steps=6)
  helpers.assert_trees_equal(got, want)
  assert stripped == [(3, 0), (5, 1)]  # the versions the current code had saved there
  out = capsys.readouterr().out
  assert out.count('was written before buffer.policy_version existed: its rollout buffer is '
                   'given policy version ') == 2, out
  assert 'policy version 0, ' in out and 'policy version 1, ' in out


@pytest.mark.slow
def test_a_larger_num_steps_trains_on_as_one_run(tmp_path, plain_grpo_run):
  """A finished 1-step GRPO stage re-run with num_steps=2 trains on: the same params as one
  2-step run, bit for bit; a finished stage with the same num_steps is skipped. Step 1 ends at
  micro-step 3, in the middle of rollout 1 (K=3, S=2): the stage trains on from its buffer."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  cfg = lambda n: _smoke('grpo_arith', stages='grpo', **{'grpo.num_steps': n,
                                                         'checkpoint.every_steps': 1})

  def run(workdir, n):
    ctx, params = api.build_context(cfg(n), str(workdir))
    return grpo.GRPOLoop(ctx, cfg(n).grpo).run(params)

  want, _ = plain_grpo_run  # one 2-step run (its checkpoint at the end only)
  run(tmp_path / 'two', 1)
  got, summary = run(tmp_path / 'two', 2)
  assert summary['grpo/resumed_from_micro_step'] == 3
  assert summary['grpo/micro_steps_this_run'] == 3 and summary['grpo/optimizer_steps'] == 2
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
               want)
  again, summary = run(tmp_path / 'two', 2)
  assert 'grpo/micro_steps_this_run' not in summary  # skipped: nothing ran
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again,
               want)


def _cli(workdir, *overrides, timeout=300):
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
         f'--workdir={workdir}', '--config.stages=grpo', *overrides]
  return subprocess.run(cmd, cwd=ROOT, env=dict(_env(), JAX_LOG_COMPILES='1'),
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_resume_with_a_changed_schedule_is_refused_before_compiling(tmp_path, capsys):
  # The finished run to resume, in this process (its checkpoints are the CLI's: the mesh is not in
  # their fingerprint); the refused resume is the CLI's (its exit status and one error line), the
  # accepted one runs in this process (the CLI runs it as api.run, main_body.run).
  api.run(_smoke('grpo_arith', stages='grpo', **{'grpo.num_steps': 2}), str(tmp_path))
  done = _cli(tmp_path, '--config.grpo.num_steps=2', '--config.grpo.schedule.grad_accum_steps=2')
  assert done.returncode == 2, done.stderr[-3000:]
  errors = [l for l in done.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'grpo.schedule.grad_accum_steps: checkpoint 3, current 2' in errors[0]
  assert 'Traceback' not in done.stderr and 'Compiling' not in done.stderr
  # Safe settings may change: logging cadence, evaluation, checkpoint cadence.
  capsys.readouterr()
  api.run(_smoke('grpo_arith', stages='grpo', **{
      'grpo.num_steps': 2, 'grpo.log_every': 7, 'eval.num_examples': 8,
      'checkpoint.every_steps': 5}), str(tmp_path))
  assert '[grpo] already finished (2 optimizer steps); skipping' in capsys.readouterr().out


@pytest.mark.slow
def test_an_error_right_after_a_save_keeps_that_save(tmp_path, capsys):
  """The reward function raises at the rollout right after the step-1 checkpoint started writing
  (in the background); the process dies of the error. The save must still land, and a re-run
  (in this process) resumes from it."""
  script = tmp_path / 'fail.py'
  script.write_text(textwrap.dedent(f'''
      import sys
      sys.path.insert(0, {ROOT!r})
      from tests.smoke_configs import smoke as _smoke
      from jaxrl_ga import api
      from jaxrl_ga.trainers import grpo
      cfg = _smoke('grpo_arith', stages='grpo', **{{'grpo.num_steps': 2,
                                                   'checkpoint.every_steps': 1}})
      ctx, params = api.build_context(cfg, sys.argv[1])
      trainer = grpo.GRPOLoop(ctx, cfg.grpo)
      calls = []
      def fn(prompts, completions, **fields):
        calls.append(1)
        if len(calls) == 3:  # rollout 2, at micro-step 4: just after the save of micro-step 3
          raise RuntimeError('reward server unreachable')
        return [0.0] * len(completions)
      trainer.rewards = [type(trainer.rewards[0])('correct', fn)]
      trainer.run(params)
  '''))
  done = subprocess.run([sys.executable, str(script), str(tmp_path / 'run')], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 1 and 'reward server unreachable' in done.stderr, done.stderr[-3000:]
  from jaxrl_ga import checkpoint  # pylint: disable=g-import-not-at-top
  assert checkpoint.all_steps(tmp_path / 'run' / 'checkpoints' / 'grpo') == [3]
  capsys.readouterr()
  summary = api.run(_smoke('grpo_arith', stages='grpo', **{'grpo.num_steps': 2,
                                                           'checkpoint.every_steps': 1}),
                    str(tmp_path / 'run'))
  assert summary['grpo/optimizer_steps'] == 2 and not summary['stopped_early']
  assert '[grpo] resumed at micro-step 3 (optimizer step 1)' in capsys.readouterr().out


@pytest.mark.slow
def test_sigterm_leaves_a_restorable_checkpoint(tmp_path, capsys):
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py:smoke',
         f'--workdir={tmp_path}', '--config.stages=grpo', '--config.grpo.num_steps=400',
         '--config.checkpoint.every_steps=0']
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 600  # wall time: the start-up is slow on a loaded machine
  metrics = tmp_path / 'metrics.jsonl'
  while time.time() < deadline and proc.poll() is None:  # wait until GRPO is training
    if metrics.exists() and '"phase": "grpo"' in metrics.read_text():
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]  # "not finished" to a scheduler
  assert 'stopped early (SIGTERM: grpo stopped at micro-step' in out
  ckpts = os.listdir(tmp_path / 'checkpoints' / 'grpo')
  assert len(ckpts) == 1 and int(ckpts[0]) > 0
  stopped_at = int(ckpts[0])
  summary = json.load(open(tmp_path / 'summary.json'))
  assert summary['stopped_early'] is True and summary['stopped_at_micro_step'] == stopped_at
  assert summary['stopped_by'] == 'SIGTERM' and summary['stopped_stage'] == 'grpo'
  # Resume (to a shorter run that ends right after the stop point) from that checkpoint, in this
  # process (on its 8 devices: the checkpoint restores onto any mesh).
  capsys.readouterr()
  api.run(_smoke('grpo_arith', stages='grpo', **{'grpo.num_steps': stopped_at // 3 + 1,
                                                 'checkpoint.every_steps': 0}), str(tmp_path))
  assert f'[grpo] resumed at micro-step {stopped_at}' in capsys.readouterr().out
  assert json.load(open(tmp_path / 'summary.json'))['stopped_early'] is False


def test_cli_rejects_invalid_config_before_compiling(tmp_path):
  cmd = [sys.executable, '-m', 'jaxrl_ga.main', '--config=configs/grpo_arith.py',
         f'--workdir={tmp_path}', '--config.grpo.schedule.micro_batch_size=6']
  env = dict(_env(), JAX_LOG_COMPILES='1')
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert 'error:' in done.stderr and 'num_generations' in done.stderr
  assert 'Traceback' not in done.stderr
  assert 'Compiling' not in done.stderr
  assert not (tmp_path / 'checkpoints').exists()


def test_a_grpo_group_of_one_completion_is_refused_before_compiling(tmp_path):
  """G = 1: every advantage is the reward minus itself, 0, so loss and gradient are 0 for the
  whole run (it ran to the end, rc 0). TRL 1.16 refuses num_generations < 2; so does the run,
  before anything compiles. SFT-only runs keep the setting unread."""
  import smoke_configs  # pylint: disable=import-outside-toplevel
  cfg = smoke_configs.smoke('grpo_arith', **{'grpo.schedule.num_generations': 1})
  with pytest.raises(ConfigError, match=r'^grpo.schedule.num_generations=1: a group of one '
                                        r'completion has advantage 0'):
    api.run(cfg, str(tmp_path / 'wd'))
  assert not (tmp_path / 'wd' / 'checkpoints').exists()
  sft = smoke_configs.smoke('sft_arith', **{'grpo.schedule.num_generations': 1,
                                            'sft.num_steps': 1})
  assert not api.run(sft, str(tmp_path / 'sft'))['stopped_early']


def test_run_config_names_unknown_settings():
  with pytest.raises(ConfigError, match=r'grpo\.schedule\.grad_acum_steps'):
    from_mapping(RunConfig, {'grpo': {'schedule': {'grad_acum_steps': 3}}})


@pytest.mark.slow
def test_grpo_public_hooks_see_every_rollout_and_micro_step(tmp_path, capsys):
  """on_rollout gets each rollout (its micro-step, buffer, group-centered advantages, the learner
  that trains on it, times, and its prompts' real lengths); on_micro_step gets each learner step;
  the first rollout's prompt lengths against max_prompt_length are printed once."""
  from jaxrl_ga.trainers import grpo  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top
  # B = 16 over the 8 devices: runs of R = 2 rows share a prompt's forward (at the smoke B = 8
  # every device holds one row and nothing is shared).
  cfg = _smoke('grpo_arith', stages='grpo',
               **{'grpo.num_steps': 2, 'grpo.schedule.micro_batch_size': 16})
  ctx, params = api.build_context(cfg, str(tmp_path))
  events, steps = [], []

  def on_rollout(e):  # read during the call: the next learner step donates e.learner's buffers
    events.append((e.micro_step, int(e.learner.optimizer_step), np.asarray(e.advantages),
                   e.buffer.completion_tokens.shape[:2], e))

  trainer = grpo.GRPOLoop(ctx, cfg.grpo, on_rollout=on_rollout,
                          on_micro_step=lambda s, started, out: steps.append(s))
  trainer.run(params)
  sched = cfg.grpo.schedule  # K=3, S=2: 6 micro-steps, a rollout every 2
  assert steps == list(range(6))
  assert [e[0] for e in events] == [0, 2, 4]
  assert [e[1] for e in events] == [0, 0, 1]
  for _, _, adv, shape, e in events:
    adv = adv.reshape(-1, sched.num_generations)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)  # centered per group
    assert shape == (sched.steps_per_generation, sched.micro_batch_size)
    assert e.generate_s > 0 and e.host_s > 0 and 0 <= e.host_stats['reward/accuracy'] <= 1
  # The prompt lengths, from the task's own prompts (each rollout takes the next S*B/G of them,
  # every one G times): tokenized here, not read from the buffer.
  per_rollout = sched.steps_per_generation * sched.micro_batch_size // sched.num_generations
  for r, (*_, e) in enumerate(events):
    lengths = [len(text.encode_prompt(ctx.tokenizer, ctx.task.train_example(i, cfg.seed).prompt))
               for i in range(r * per_rollout, (r + 1) * per_rollout)]
    assert e.host_stats['rollout/prompt_length'] == pytest.approx(np.mean(lengths))
    assert e.host_stats['rollout/prompt_length_max'] == max(lengths)
  width = cfg.grpo.sampling.max_prompt_length
  first = [len(text.encode_prompt(ctx.tokenizer, ctx.task.train_example(i, cfg.seed).prompt))
           for i in range(per_rollout)]
  lines = [l for l in capsys.readouterr().out.splitlines() if 'prompt' in l and '[grpo]' in l]
  # Runs of R = gcd(G, B / data shards) rows share a prompt (a group, cut by the micro-batch and
  # the shards).
  share = math.gcd(sched.num_generations,
                   sched.micro_batch_size // sharding.data_parallel_size(ctx.mesh))
  assert share > 1
  assert lines == [f"[grpo] the first rollout's prompts: {np.mean(first):.0f} tokens on average, "
                   f'{max(first)} at most, left-padded to grpo.sampling.max_prompt_length='
                   f'{width} ({1 - np.mean(first) / width:.0%} of the prompt positions are '
                   'padding)',
                   f"[grpo] each prompt's forward runs once per {share} of its completions "
                   '(model.share_prompt_prefix)']
