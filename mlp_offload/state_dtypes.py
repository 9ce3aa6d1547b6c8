"""The stored dtype of each optimizer state tensor (master params, exp_avg, exp_avg_sq).

Stored narrower than fp32, a tensor is widened to fp32 for the update and rounded back after it
(round-to-nearest-even, as ``Tensor.to`` does): fewer bytes per parameter in every tier, the
same fp32 AdamW arithmetic.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

STATE_TENSORS = ("param", "exp_avg", "exp_avg_sq")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The stored form of an fp32 master whose high half is the model's bf16 param (see ``remainders``):
# a storage form, not a dtype a user names in ``state_dtypes``.
REMAINDERS = "rem16"
STORED_DTYPES = {**TORCH_DTYPES, REMAINDERS: torch.int16}
FP32_STATE: Tuple[str, str, str] = ("fp32", "fp32", "fp32")
# Accepted spellings, e.g. megatron-core's torch dtypes or their names.
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class UnsupportedStateDtype(ValueError):
    """A state dtype the engine cannot store (e.g. fp8)."""


def dtype_name(value) -> str:
    """The short name (fp32, fp16, bf16) of a state dtype given as a name or a torch dtype."""
    name = _ALIASES.get(value, value)
    if isinstance(name, str) and name.startswith("torch."):
        name = _ALIASES.get(name[len("torch."):], name)
    if name not in TORCH_DTYPES:
        raise UnsupportedStateDtype(f"{value!r} is not supported (fp32, fp16 or bf16)")
    return name


def itemsizes(names: Sequence[str]) -> Tuple[int, ...]:
    return tuple(STORED_DTYPES[n].itemsize for n in names)


def torch_dtypes(names: Sequence[str]) -> Tuple[torch.dtype, ...]:
    return tuple(STORED_DTYPES[n] for n in names)


def bytes_per_param(names: Sequence[str]) -> int:
    return sum(itemsizes(names))
