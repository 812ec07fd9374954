"""The host side of training: one module per stage, chained by ``jaxrl_ga.api.run``.

  sft.py, grpo.py, dpo.py  each stage (``SFTStage``, ``GRPOStage``, ``DPOStage``: its checks,
                           programs and loop, top to bottom; GRPO's loop is ``GRPOLoop``):
                           batch or rollout, learner step, then the loop's bookkeeping by name
  registry.py              the stages by name, through which api.py checks and runs a run
  stage.py                 what a stage is (``Stage``), that bookkeeping (``StageLoop``:
                           logging, evaluation, checkpoints, non-finite windows, SIGTERM) and a
                           stage's restore / finish
  context.py               ``RunContext`` (what every stage shares) and the policy it starts from
  text.py                  prompts and completions <-> padded token rows
  evaluation.py            held-out greedy accuracy
  reporting.py             metrics.jsonl / TensorBoard / W&B rows and the console lines
"""
