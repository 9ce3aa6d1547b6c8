"""Optional packages: a flag that needs one which is missing is refused at start-up in one line
naming the flag and the package (tools/setup_env.sh installs each optional package only where it
can be had, so a node may lack some). The pins are tools/setup_env.sh's."""

from __future__ import annotations

import importlib.util
from typing import List, Tuple

from megatron.training.errors import UserError

REQUIREMENT = {
    "wandb": "wandb==0.31.0",
    "tensorboard": "tensorboard==2.21.0",
    "transformers": "transformers==5.23.0",
    "tokenizers": "tokenizers==0.23.3",
    "sentencepiece": "sentencepiece==0.2.3",
    "tiktoken": "tiktoken==0.14.0",
    "matplotlib": "matplotlib==3.10.3",
}

# --tokenizer-type -> packages megatron-core's tokenizer for it imports (transformers for all of them).
TOKENIZER_PACKAGES = {
    "GPT2BPETokenizer": ("transformers", "tokenizers"),
    "HuggingFaceTokenizer": ("transformers", "tokenizers"),
    "SentencePieceTokenizer": ("transformers", "sentencepiece"),
    "GPTSentencePieceTokenizer": ("transformers", "sentencepiece"),
    "Llama2Tokenizer": ("transformers", "sentencepiece"),
    "TikTokenizer": ("transformers", "tiktoken"),
}


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def require(what: str, module: str) -> None:
    """``what`` (a flag and its value) needs ``module``: one line if it is not installed."""
    if missing(module):
        raise UserError(f"{what}: needs the {module} package, which is not installed here "
                        f"(pip install {REQUIREMENT.get(module, module)}; tools/setup_env.sh installs it "
                        "where it can be had)")


def needed_by_flags(args) -> List[Tuple[str, str]]:
    """(flag, package) for every optional package the parsed flags need."""
    needs = []
    if getattr(args, "wandb_project", None):
        needs.append(("--wandb-project", "wandb"))
    if getattr(args, "tensorboard_dir", None):
        needs.append(("--tensorboard-dir", "tensorboard"))
    kind = getattr(args, "tokenizer_type", None)
    needs += [(f"--tokenizer-type {kind}", module) for module in TOKENIZER_PACKAGES.get(kind, ())]
    return needs


def check_flags(args) -> None:
    for flag, module in needed_by_flags(args):
        require(flag, module)
