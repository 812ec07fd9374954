"""Helpers shared by test files (instead of tests importing each other's private functions)."""

import jax
import numpy as np


def assert_trees_equal(got, want) -> None:
  """Bitwise equality of two pytrees of arrays."""
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
               want)


def run_grpo_in_pieces(make_trainer, workdir, stops, total_micro_steps: int):
  """``make_trainer(workdir) -> (grpo.GRPOTrainer, params)`` run stopped after each micro-step of
  ``stops``, then to the end, each run a fresh trainer resuming from the last one's checkpoint;
  asserts that each resumed where the last stopped and ran only the micro-steps left.
  -> (params, summary) of the last run."""
  previous = 0
  for stop in (*stops, None):
    trainer, params = make_trainer(workdir)
    got, summary = trainer.run(params, stop_at_micro_step=stop)
    assert summary['grpo/resumed_from_micro_step'] == previous
    assert summary['grpo/micro_steps_this_run'] == (stop or total_micro_steps) - previous
    previous = stop
  return got, summary
