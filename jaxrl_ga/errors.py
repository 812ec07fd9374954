"""The package's error for bad user input, below every other module (docs/design.md).

A :class:`ConfigError` is one line that names the setting, its value and a concrete fix; the
CLIs print it as ``error: <message>`` and exit with status 2, before anything compiles.
``jaxrl_ga.config.ConfigError`` is this class (re-exported there for users).
"""


class ConfigError(ValueError):
  """A configuration value is invalid. The message names the setting and how to fix it."""
