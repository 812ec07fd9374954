"""jaxrl_ga: RL post-training of language models in JAX/Flax with exact gradient accumulation."""

__version__ = '0.1.0'
