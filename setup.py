from setuptools import find_packages, setup

setup(
    name="aligner_ext",
    version="0.1.0",
    description="GRPO-family RL post-training for LLMs: one training loop, variants as plug-ins",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["aligner_ext", "aligner_ext.*"]),
    install_requires=[
        "torch>=2.6",
        "transformers>=4.50",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "math-verify>=0.7",
        "pyarrow>=14",
        "numpy>=1.24",
        "tensorboard>=2.14",
        "tqdm>=4.66",
        "rich>=13",
        "matplotlib>=3.7",
        "openai>=1.40",  # the remote engine's client (generation/remote.py)
        "fastapi>=0.110",  # aligner-ext serve (serving/)
        "uvicorn>=0.29",
        "psutil>=5.9",  # how many cores are free when a run starts (aligner_ext/threads.py)
        "peft>=0.17",  # policy.lora (models/lora.py): small and pure Python, so always installed
    ],
    extras_require={
        "megatron": ["megatron-core>=0.19,<0.20"],
        "vllm": ["vllm>=0.8"],
        "wandb": ["wandb>=0.17"],  # trainer.wandb.enabled (aligner_ext/trackers.py)
        "mlflow": ["mlflow>=2.10"],  # trainer.mlflow.enabled
        "liger": ["liger-kernel>=0.8.5"],  # policy.kernels=liger (CUDA)
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6"],  # the suite runs on two workers (README)
        "bench": ["trl==1.16.0", "datasets>=4.7"],  # scripts/bench/grpo_step.py's TRL side
        "openenv": ["openenv-core>=0.3,<0.4"],  # OpenEnv environment servers (agents/openenv_environment.py)
        "verifiers": ["verifiers==0.4.0"],  # verifiers environments (agents/verifiers_environment.py); asks for openai<3
    },
    entry_points={"console_scripts": ["aligner-ext=aligner_ext.cli:main"]},
)
