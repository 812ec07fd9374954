"""Host loops: SFT, GRPO and DPO stages, chained by ``jaxrl_ga.main``."""
