"""What an engine is given of the model it updates: where its gradients come from, where the updated
params go, and the model's bf16 params (a remainders master's high halves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ModelLink:
    """``grad_dtype``: the gradients' dtype in the host buffer the caller fills (the engine's ``grad_buffer``,
    converted there), where no ``grad_source`` (``gradients.GradientSource``) gives them as fp32 instead,
    straight into one of two scratch buffers (e.g. cast on the GPU and copied while the previous subgroup's
    Adam runs; then there is no ``grad_buffer``); ``on_params_updated(start, end, params)``: each subgroup's
    updated params (None: nobody wants them); ``param_high`` (``kernels.remainders.ParamHighSource``): the
    model's bf16 params, read as the master's high halves where it is stored as remainders
    (``config.param_remainders``: the master kept as int16 remainders; ``on_params_updated`` then gets the
    updated bf16 params, what the model must hold, and the initial master is the model's, ``params``
    rounded half away, remainders of zero for bf16 values). ``param_segments``: where the model's params
    lie in the shard, ``(shard_start, param_start, length)`` each (``subgroups.blocks.ShardParams``):
    8-bit moments take their blocks from each param's own indices; None: each param-group range is
    one param from its first element."""
    grad_dtype: torch.dtype = torch.bfloat16
    grad_source: Optional[object] = None
    on_params_updated: Optional[Callable[[int, int, torch.Tensor], object]] = None
    param_high: Optional[object] = None
    param_segments: Optional[Sequence[Tuple[int, int, int]]] = None

    def __post_init__(self):
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"gradient dtype must be one of {GRAD_DTYPES}, got {self.grad_dtype}")
