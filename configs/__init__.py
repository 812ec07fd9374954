"""ml_collections config files for ``python -m jaxrl_ga.main --config=configs/<name>.py``.

A ``pip install`` of the project installs this folder as ``jaxrl_ga.configs``: the CLI (and
``jaxrl_ga.config.load_config_file``) resolves ``configs/<name>.py`` to that copy when the
current directory has no such file, so the configs work without a clone.
"""
