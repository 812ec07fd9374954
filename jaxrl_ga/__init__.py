"""jaxrl_ga: RL post-training of language models in JAX/Flax with exact gradient accumulation.

  from jaxrl_ga import GRPOTrainer
  GRPOTrainer(model=..., reward_funcs=[...], train_dataset=..., workdir=...).train()

The trainers (``jaxrl_ga.api``) import JAX on first use, so ``import jaxrl_ga.config`` stays light.
"""

import os as _os
import sys as _sys

__version__ = '0.1.0'


def _import_transformers_quietly() -> None:
  """Imports transformers without its "PyTorch was not found" advice: this package uses only its
  tokenizers, configs and file utilities (its models need PyTorch, ours are JAX), so that line is
  nothing a user can act on. Only that import is silenced; TRANSFORMERS_NO_ADVISORY_WARNINGS is
  restored right after."""
  if 'transformers' in _sys.modules:
    return
  key = 'TRANSFORMERS_NO_ADVISORY_WARNINGS'
  before = _os.environ.get(key)
  _os.environ[key] = '1'
  try:
    # lazy: startup order: once, its advisory line silenced (the environment set around it)
    import transformers  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pass  # reported where it is needed
  finally:
    if before is None:
      del _os.environ[key]
    else:
      _os.environ[key] = before


_import_transformers_quietly()


_API = ('GRPOTrainer', 'SFTTrainer', 'DPOTrainer')


def __getattr__(name):
  if name in _API:
    # lazy: startup order: api imports JAX; `import jaxrl_ga` (CLIs, configs) stays without
    from jaxrl_ga import api  # pylint: disable=g-import-not-at-top
    return getattr(api, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = list(_API)
