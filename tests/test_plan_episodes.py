"""``plan`` and ``fit`` with multi-turn rollouts (docs/design.md, "Multi-turn rollouts"; issue 44):

* the table's 'multi_turn' and 'evaluation_episodes' entries, lowered by ``plan.lower_grpo`` at
  their abstract arguments, are the StableHLO of the segment calls the trainer and the evaluator
  make (``EpisodeRunner.run``'s first segment call, caught as ``RolloutEngine.rollout_rows`` and
  ``Evaluator._run_episodes`` make it), as
  tests/test_plan.py checks the single-turn entries;
* ``fit`` (the memory check before the first step) compiles the segment program of a run with
  multi-turn rollouts, once.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_ga import plan


class _Stop(Exception):
  pass


class _NoTools:
  """An interaction that ends every episode; its prompts (the evaluator's) are [1, 2, 3]."""

  def submit(self, row, turn_tokens):
    del row, turn_tokens
    future = concurrent.futures.Future()
    future.set_result(None)
    return future

  def padded_prompts(self, length, pad_id):
    from jaxrl_ga.trainers import text  # pylint: disable=g-import-not-at-top
    return text.left_pad([[1, 2, 3]] * self.rows, length, pad_id, 'test')


def _first_segment_call(runner, go):
  """``go()`` runs ``runner`` (an EpisodeRunner) as the trainer or the evaluator does, stopped
  at its first segment call: that call lowered at the very arguments it was given."""
  calls, real = [], runner.segment_fn

  def record(*args):
    calls.append(args)
    raise _Stop

  runner.segment_fn = record
  try:
    go()
  except _Stop:
    pass
  finally:
    runner.segment_fn = real
  assert len(calls) == 1
  return real.lower(*calls[0])


def test_plan_lowers_the_multi_turn_programs_the_trainer_runs(tmp_path):
  """The smoke config with B = 16 rows over 8 devices, R = 2 rows per prompt, a pool of 8."""
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import api, sharding  # pylint: disable=g-import-not-at-top
  from jaxrl_ga.trainers import evaluation, grpo  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'grpo.schedule.micro_batch_size': 16, 'grpo.sampling.decode_slots': 8})
  ctx, params = api.build_context(cfg, str(tmp_path))
  trainer = grpo.GRPOLoop(ctx, cfg.grpo, make_interaction=lambda examples: None)
  progs = trainer.programs
  assert {'multi_turn', 'evaluation_episodes'} <= set(progs.table)
  state = progs.init_state(params)
  prompts = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding),
                         trainer.engine.abstract_prompts())
  trained = {'multi_turn': _first_segment_call(
      trainer.engine.episodes, lambda: trainer.engine.rollout_rows(  # as GRPOLoop._new_rollout
          sharding.sync_weights(params, ctx.roles['rollout']), state['ref_params'],
          state['rollout'], prompts, prompts, interaction=_NoTools()))}
  evaluator = evaluation.Evaluator(ctx, progs.table['evaluation'], runner=progs.eval_episodes,
                                   make_interaction=lambda chunk: None)
  interaction = _NoTools()
  interaction.rows = evaluator.batch_size
  trained['evaluation_episodes'] = _first_segment_call(
      progs.eval_episodes, lambda: evaluator._run_episodes(  # pylint: disable=protected-access
          (progs.eval_episodes, lambda chunk: interaction), params,
          [None] * evaluator.batch_size, np.ones(evaluator.batch_size, bool),
          np.ones(evaluator.batch_size, bool)))
  planned = plan.lower_grpo(cfg, ctx.model_cfg, list(ctx.mesh.devices.flat), eos_id=ctx.eos_id,
                            pad_id=ctx.pad_id, multi_turn=True,
                            steps=('multi_turn', 'evaluation_episodes'))
  assert set(planned.others) == set(trained)
  for name, program in trained.items():
    assert planned.others[name].as_text() == program.as_text(), name
  # Not vacuous: the rollout's segment holds the pool's KV cache [P = 8, K, Tp + Tc - 1, H].
  m, sp = ctx.model_cfg, cfg.grpo.sampling
  assert (f'tensor<8x{m.num_key_value_heads}x{sp.max_prompt_length + sp.max_completion_length - 1}'
          f'x{m.head_size}x') in trained['multi_turn'].as_text()


def test_fit_compiles_the_segment_program_of_a_multi_turn_run(compile_log):
  """Under a memory limit (mesh.device_memory_gib) the programs fit builds for a multi-turn run
  have their segment program compiled and checked before the first step, as the learner's."""
  import smoke_configs  # pylint: disable=g-import-not-at-top
  from jaxrl_ga import programs, sharding  # pylint: disable=g-import-not-at-top
  cfg = smoke_configs.smoke('grpo_arith', stages='grpo', **{
      'model.remat': 'none', 'model.logprob_chunk_size': 0, 'mesh.device_memory_gib': 64.0})
  model_cfg = cfg.model.architecture_config(vocab_size=24)
  mesh = plan.lower_grpo(cfg, model_cfg, jax.devices(), steps=()).mesh
  _, shapes, axes = sharding.abstract_model(model_cfg)
  shardings = sharding.param_shardings(shapes, axes, mesh)
  programs.fitted_grpo_programs(cfg, model_cfg, mesh, shardings, eos_id=0, pad_id=0,
                                say=lambda line: None, multi_turn=True)
  assert compile_log.count('_micro_step') == 1, compile_log.names
  assert compile_log.count('segment_fn') == 1, compile_log.names
