"""The per-subgroup arithmetic: delayed gradient conversion and the CPU AdamW step."""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.adam import adam as _functional_adam


def convert_grads(
    src: torch.Tensor, dst: torch.Tensor, unscale: Optional[float], clip_coef: Optional[float]
) -> None:
    """Low-precision gradients -> fp32 scratch, then loss-unscale and clip, in that order.

    The order and the separate multiplies match what megatron-core does to its fp32 main grads,
    so results stay bit-identical to the unoffloaded path.
    """
    dst.copy_(src)
    if unscale is not None and unscale != 1.0:
        dst.mul_(unscale)
    if clip_coef is not None and clip_coef != 1.0:
        dst.mul_(clip_coef)


class AdamKernel:
    """One AdamW/Adam step on one contiguous range, through torch's own functional kernels.

    ``fused`` is torch's fused CPU kernel (fastest); ``foreach`` and ``single`` reproduce an
    unfused ``torch.optim.AdamW`` bit for bit (the fused kernel differs from them by an ulp).
    Against ``torch.optim.AdamW(fused=True)`` the fused kernel is bit-identical where subgroup
    boundaries cut a tensor at multiples of the CPU's vector width; elsewhere the few elements
    before a cut (and before a tensor's end) can differ by one ulp, because the kernel computes
    each call's last ``length % width`` elements with scalar code.
    """

    def __init__(self, kind: str = "fused", decoupled_weight_decay: bool = True):
        if kind not in ("fused", "foreach", "single"):
            raise ValueError(f"unknown Adam kernel {kind!r}")
        self.kind = kind
        self.decoupled_weight_decay = decoupled_weight_decay

    def __call__(self, param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0):
        # torch's functional kernels increment the step tensor first, as torch.optim.AdamW does.
        state_step = torch.tensor(float(step - 1), dtype=torch.float32)
        _functional_adam(
            [param], [grad], [exp_avg], [exp_avg_sq], [], [state_step],
            foreach=self.kind == "foreach",
            fused=True if self.kind == "fused" else None,
            decoupled_weight_decay=self.decoupled_weight_decay,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
            eps=eps, maximize=False,
        )
