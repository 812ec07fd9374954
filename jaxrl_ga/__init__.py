"""jaxrl_ga: RL post-training of language models in JAX/Flax with exact gradient accumulation.

  from jaxrl_ga import GRPOTrainer
  GRPOTrainer(model=..., reward_funcs=[...], train_dataset=..., workdir=...).train()

The trainers (``jaxrl_ga.api``) import JAX on first use, so ``import jaxrl_ga.config`` stays light.
"""

__version__ = '0.1.0'

_API = ('GRPOTrainer', 'SFTTrainer', 'DPOTrainer')


def __getattr__(name):
  if name in _API:
    from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
    return getattr(api, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = list(_API)
