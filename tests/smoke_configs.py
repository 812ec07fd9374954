"""A config file's ':smoke' variant with dotted overrides, as a validated RunConfig (for tests)."""

import os

from jaxrl_ga.config import RunConfig, from_mapping, load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(name: str = 'grpo_arith', **overrides) -> RunConfig:
  """configs/<name>.py:smoke with e.g. ``**{'grpo.num_steps': 3}`` applied."""
  d = load_config_file(os.path.join(ROOT, 'configs', f'{name}.py'), 'smoke').to_dict()
  for key, value in overrides.items():
    node = d
    *path, last = key.split('.')
    for p in path:
      node = node[p]
    node[last] = value
  return from_mapping(RunConfig, d)
