"""The per-subgroup arithmetic: delayed gradient conversion and the CPU AdamW step."""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

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

    The fused kernel computes a call's last ``length % width`` elements with scalar code, which
    can round differently from its vector code. A range that is a slice of a larger tensor (a
    subgroup boundary cuts it) therefore says where it lies, ``span=(offset, tensor length)``: its
    elements then take the same path as in one call over the whole tensor (the slice's own tail
    goes through a padded vector-width call), so the result is bit-identical to
    ``torch.optim.AdamW(fused=True)`` wherever the cuts fall.
    """

    def __init__(self, kind: str = "fused", decoupled_weight_decay: bool = True):
        if kind not in ("fused", "foreach", "single"):
            raise ValueError(f"unknown Adam kernel {kind!r}")
        self.kind = kind
        self.decoupled_weight_decay = decoupled_weight_decay

    def __call__(self, param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                 span: Optional[Tuple[int, int]] = None):
        hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        whole = span is None or span == (0, param.numel())  # one call is then exactly torch's
        width = 1 if whole or self.kind != "fused" else fused_vector_width()
        if width <= 1:
            self._call(param, grad, exp_avg, exp_avg_sq, **hyper)
            return
        offset, length = span
        n = param.numel()
        # Where the whole tensor's scalar tail starts, in this slice's coordinates.
        vector_end = min(n, max(0, length - length % width - offset))
        body = vector_end - vector_end % width
        tensors = (param, grad, exp_avg, exp_avg_sq)
        if body:
            self._call(*(t[:body] for t in tensors), **hyper)
        if vector_end > body:  # vector elements that would land in this call's scalar tail
            padded = [torch.zeros(width, dtype=t.dtype, device=t.device) for t in tensors]
            for pad, t in zip(padded, tensors):
                pad[: vector_end - body].copy_(t[body:vector_end])
            self._call(*padded, **hyper)
            for pad, t in zip(padded[:1] + padded[2:], tensors[:1] + tensors[2:]):
                t[body:vector_end].copy_(pad[: vector_end - body])
        if n > vector_end:  # the whole tensor's own tail: scalar there too (fewer than width)
            self._call(*(t[vector_end:] for t in tensors), **hyper)

    def _call(self, param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
        # torch's functional kernels increment the step tensor first, as torch.optim.AdamW does.
        # On CPU, as torch.optim.AdamW keeps it; the fused CUDA kernel wants it on the device.
        state_step = torch.tensor(float(step - 1), dtype=torch.float32,
                                  device=param.device if self.kind == "fused" else "cpu")
        _functional_adam(
            [param], [grad], [exp_avg], [exp_avg_sq], [], [state_step],
            foreach=self.kind == "foreach",
            fused=True if self.kind == "fused" else None,
            decoupled_weight_decay=self.decoupled_weight_decay,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
            eps=eps, maximize=False,
        )


@functools.lru_cache(maxsize=None)
def fused_vector_width() -> int:
    """Elements the fused CPU Adam kernel computes per vector step, measured on this CPU.

    The smallest chunk length whose chunk-by-chunk calls give exactly what one call over the
    whole tensor gives (shorter chunks fall to the scalar tail); 2 also where scalar and vector
    code agree (aligning to it is then harmless); 0 if no chunk up to 64 agrees (then slices are
    not aligned). Measured once per process (its cost: docs/design.md, "Adam on slices, bit for bit").
    """
    n = 1 << 14
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]

    def run(chunk: int) -> torch.Tensor:
        state = [t.clone() for t in base]
        # One call over a list of chunk-long views: each view is a tensor of its own to the kernel.
        p, g, m, v = ([t[s:s + chunk] for s in range(0, n, chunk)] for t in state)
        steps = [torch.tensor(2.0) for _ in p]
        _functional_adam(p, g, m, v, [], steps, foreach=False, fused=True, decoupled_weight_decay=True,
                         amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-2, weight_decay=0.1, eps=1e-8,
                         maximize=False)
        return state[0]

    whole = run(n)
    for chunk in (2, 4, 8, 16, 32, 64):
        if torch.equal(run(chunk), whole):
            return chunk
    return 0


class Fp32Working:
    """fp32 working copies of the state tensors stored narrower than fp32: each subgroup's are
    widened before its Adam and rounded back after it by their codecs (``state_formats``:
    round-to-nearest-even), so the arithmetic is exactly the fp32 AdamW's. fp32-stored tensors are
    updated in place.

    A format that ``needs_high`` (the master stored as remainders) is merged with its bf16 high
    half (``high``) instead, and split back into both."""

    def __init__(self, codecs, largest: int, device="cpu"):
        self.codecs = list(codecs)
        self.scratch = [None if c.is_fp32 else torch.empty(largest, dtype=torch.float32, device=device)
                        for c in self.codecs]
        self.remainders = self.codecs[0].needs_high

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * 4 for s in self.scratch if s is not None)

    @staticmethod
    def planned_bytes(codecs, largest: int) -> int:
        """``nbytes`` of the working copies for state stored in ``codecs``."""
        return sum(largest * 4 for c in codecs if not c.is_fp32 and not c.block)  # 8-bit moments: no copies

    def widen(self, stored, high: Optional[torch.Tensor] = None):
        """``high``: the bf16 params of a master stored as remainders."""
        wide = [t if s is None else s[: t.numel()] for t, s in zip(stored, self.scratch)]
        for t, w, codec in zip(stored, wide, self.codecs):
            if w is not t:
                codec.unpack(t, out=w, high=high if codec.needs_high else None)
        return wide

    def round_back(self, stored, wide, high: Optional[torch.Tensor] = None) -> None:
        """``high`` receives the bf16 params of a master stored as remainders (the working
        master is spent doing so)."""
        for t, w, s, codec in zip(stored, wide, self.scratch, self.codecs):
            if s is not None:
                codec.pack_(w, t, high=high if codec.needs_high else None)


def adam_piece(kernel: AdamKernel, param_groups: Sequence[dict], param, grad, exp_avg, exp_avg_sq, g: int,
               span, step: int) -> None:
    """AdamW on one piece of one param group with the hyperparameters ``param_groups`` give it (the
    step's own: a scheduler may have changed them since the last step)."""
    group = param_groups[g]
    beta1, beta2 = group["betas"]
    kernel(param, grad, exp_avg, exp_avg_sq, step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
           eps=group["eps"], weight_decay=group["weight_decay"], span=span if param.device.type == "cpu" else None)
