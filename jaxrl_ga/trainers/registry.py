"""The stages a run can chain (``stages=sft,grpo``), by name: api.py validates, sizes and runs
each through its ``trainers.stage.Stage`` and names none itself. A new stage is one ``Stage``
subclass registered here, its config a field of ``RunConfig`` of the same name, and its name in
``config.STAGES``."""

from __future__ import annotations

from jaxrl_ga import config
from jaxrl_ga.trainers import dpo
from jaxrl_ga.trainers import grpo
from jaxrl_ga.trainers import sft
from jaxrl_ga.trainers import stage

SFT, GRPO, DPO = sft.SFTStage(), grpo.GRPOStage(), dpo.DPOStage()

# In config.STAGES order: the order in which the checks before any stage visit them.
STAGES: dict[str, stage.Stage] = {s.name: s for s in (SFT, GRPO, DPO)}


def get(name: str) -> stage.Stage:
  """The stage named ``name`` (one of config.STAGES, which RunConfig checks)."""
  return STAGES[name]


def of_run(cfg: config.RunConfig) -> list[stage.Stage]:
  """The stages of a run, in the registry's order (the checks' order; ``cfg.stages`` is the
  order they train in)."""
  return [s for s in STAGES.values() if s.name in cfg.stages]
