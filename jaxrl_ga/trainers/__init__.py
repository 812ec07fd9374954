"""The host side of training: one module per stage, chained by ``jaxrl_ga.main``.

  sft.py, grpo.py, dpo.py  each stage's loop, top to bottom (``run_sft``, ``GRPOTrainer.run``,
                           ``run_dpo``): batch or rollout, learner step, then the loop's
                           bookkeeping by name
  stage.py                 that bookkeeping (``StageLoop``: logging, evaluation, checkpoints,
                           non-finite windows, SIGTERM) and a stage's restore / finish
  context.py               ``RunContext`` (what every stage shares) and the policy it starts from
  text.py                  prompts and completions <-> padded token rows
  evaluation.py            held-out greedy accuracy
  reporting.py             metrics.jsonl / TensorBoard / W&B rows and the console lines
"""
