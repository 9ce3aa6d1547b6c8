"""Hugging Face checkpoints in and out (tools/hf_checkpoint.py): which families map and how
(``families``), their tensors to and from this project's torch_dist layout (``tensor_map``), and the
streaming import and export (``convert``) that never hold more than a few tensors in host memory.
transformers and safetensors are optional: ``require_packages`` names the missing one in one line."""

from __future__ import annotations

import importlib.util

from megatron.training.errors import UserError

REQUIREMENTS = {"safetensors": "safetensors", "transformers": "transformers==5.23.0"}


def require_packages(*modules: str) -> None:
    """One line naming each package this step needs that is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = " and ".join(REQUIREMENTS.get(m, m) for m in missing)
        raise UserError(f"tools/hf_checkpoint.py: needs {names} (pip install {' '.join(REQUIREMENTS.get(m, m) for m in missing)}; "
                        f"tools/setup_env.sh installs them where it can)")
