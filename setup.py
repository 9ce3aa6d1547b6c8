from setuptools import find_namespace_packages, setup

# megatron/ is a namespace-package portion beside megatron-core's megatron.core: it has no
# __init__.py, so find_namespace_packages picks up megatron.training without shadowing megatron.
setup(
    name="mlp-offload",
    version="0.1.0",
    description="Megatron-style training with multi-level, multi-path optimizer-state offload",
    packages=find_namespace_packages(include=["megatron.training*", "mlp_offload*"]),
    package_data={"megatron.training.args": ["megatron_lm_flags.txt"]},  # unknown flags told apart from typos
    python_requires=">=3.10",
    install_requires=["torch", "numpy"],
    extras_require={
        # psutil: megatron-core's dist_checkpointing needs it but does not declare it.
        "megatron": ["megatron-core==0.16.1", "psutil"],
        "logging": ["tensorboard==2.21.0", "wandb==0.31.0"],
        "tokenizers": ["tokenizers==0.23.3", "sentencepiece==0.2.3", "tiktoken==0.14.0", "transformers==5.23.0"],
        # tools/hf_checkpoint.py reads and writes safetensors itself; these are for loading its output
        # (and what its tests compare against).
        "hf": ["transformers==5.23.0", "safetensors==0.8.0"],
        "test": ["pytest", "pytest-xdist==3.8.0", "megatron-core==0.16.1", "psutil", "matplotlib==3.10.3",
                 "hypothesis==6.155.2",
                 "tensorboard==2.21.0", "wandb==0.31.0", "tokenizers==0.23.3", "sentencepiece==0.2.3",
                 "tiktoken==0.14.0", "transformers==5.23.0", "safetensors==0.8.0"],
    },
)
