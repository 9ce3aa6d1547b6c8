"""One pass per element for the device update: widen the stored state, AdamW, round back, in one
GPU kernel instead of eight to eleven full passes over fp32 working copies.

The multi-pass path (``update.Fp32Working`` around ``update.AdamKernel``) reads and writes about
70 bytes per element on the device; this kernel reads the stored state, the fp32 gradient and the
bf16 high halves once and writes them once: 20 bytes per element with remainders and bf16 moments.

It is exact: it performs the same fp32 operations, each rounded as torch's own kernels round it,
as ``torch.optim.AdamW``'s foreach kernel on CUDA. Whether a contraction into a fused multiply-add
happened inside torch's compiled kernels (lerp, addcmul, addcdiv) or a division by a scalar became a
multiply by its reciprocal is a property of that build, so the kernel comes in variants and
``verified_fused_update`` picks, at start-up, the first one whose results on a random sample are
bit-identical to the multi-pass path with the engine's own kernel; where none is, the multi-pass
path stays (and the start-up line says so). On a CPU device there is no such kernel: the
multi-pass path is the CPU twin, and the CPU tests run it.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

log = logging.getLogger("mlp_offload")

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None


@dataclass(frozen=True)
class AdamHyper:
    """One param group's AdamW hyperparameters for one step (a scheduler may change lr between steps)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def hyper_of(group: dict) -> AdamHyper:
    beta1, beta2 = group["betas"]
    return AdamHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


@dataclass(frozen=True)
class Variant:
    """How torch's build rounds three of AdamW's operations (see the module's docstring)."""

    fma_lerp: bool
    fma_addcmul: bool
    fma_addcdiv: bool
    reciprocal_div: bool

    def describe(self) -> str:
        fma = [name for name, on in (("lerp", self.fma_lerp), ("addcmul", self.fma_addcmul),
                                     ("addcdiv", self.fma_addcdiv)) if on]
        return f"fma in {'/'.join(fma) or 'none'}, {'reciprocal' if self.reciprocal_div else 'true'} division"


# Most likely first: nvcc contracts a*b+c into an FMA by default; torch's foreach division by a
# list of scalars divides, its tensor/CPU-scalar division multiplies by the reciprocal.
VARIANTS: Tuple[Variant, ...] = tuple(
    Variant(*flags) for flags in sorted(itertools.product((True, False), repeat=4),
                                        key=lambda f: (not f[0], not f[1], not f[2], f[3])))

if triton is not None:
    @triton.jit
    def _adamw_pass(p_ptr, high_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n,
                    decay, w1, beta2, w2, inv_or_bc2, eps, neg_step_size, unscale, clip,
                    REMAINDERS: tl.constexpr, DECAY: tl.constexpr, LERP_SMALL: tl.constexpr,
                    FMA_LERP: tl.constexpr, FMA_ADDCMUL: tl.constexpr, FMA_ADDCDIV: tl.constexpr,
                    RECIPROCAL: tl.constexpr, UNSCALE: tl.constexpr, CLIP: tl.constexpr,
                    ZERO_GRAD: tl.constexpr, PARAM_OUT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # The grads in their training dtype, widened and multiplied as gradients.convert_grads does
        # (two rounded fp32 multiplies: the loss unscale, then the clip coefficient)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNSCALE:
            g = g * unscale
        if CLIP:
            g = g * clip
        if REMAINDERS:  # fp32 master = bf16 high half << 16 + int16 remainder (remainders.merge)
            high = tl.load(high_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
            rem = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
            p = ((high << 16) + rem).to(tl.float32, bitcast=True)
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DECAY:  # _foreach_mul_(params, 1 - lr * weight_decay)
            p = p * decay
        d = g - m  # _foreach_lerp_(exp_avgs, grads, 1 - beta1)
        if LERP_SMALL:
            if FMA_LERP:
                m = tl.fma(w1, d, m)
            else:
                m = m + w1 * d
        else:
            if FMA_LERP:
                m = tl.fma(-d, 1.0 - w1, g)
            else:
                m = g - d * (1.0 - w1)
        v = v * beta2  # _foreach_mul_(exp_avg_sqs, beta2); _foreach_addcmul_(.., grads, grads, 1 - beta2)
        gg = g * g
        if FMA_ADDCMUL:
            v = tl.fma(w2, gg, v)
        else:
            v = v + w2 * gg
        root = tl.sqrt_rn(v)  # _foreach_sqrt, _foreach_div_(.., sqrt(1 - beta2^t)), _foreach_add_(.., eps)
        if RECIPROCAL:
            root = root * inv_or_bc2
        else:
            root = tl.div_rn(root, inv_or_bc2)
        denom = root + eps
        q = tl.div_rn(m, denom)  # _foreach_addcdiv_(params, exp_avgs, denom, -lr / (1 - beta1^t))
        if FMA_ADDCDIV:
            p = tl.fma(neg_step_size, q, p)
        else:
            p = p + neg_step_size * q
        if REMAINDERS:  # remainders.split_: high half rounded half away, the low half as remainder
            bits = p.to(tl.int32, bitcast=True)
            h = (bits + 32768) >> 16
            tl.store(p_ptr + offs, (bits - (h << 16)).to(tl.int16), mask=mask)
            tl.store(high_ptr + offs, h.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            kept = p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(p_ptr + offs, kept, mask=mask)
            if PARAM_OUT:  # the model's param: the stored master cast as a copy_ casts (to nearest even)
                wide = kept.to(tl.float32)  # (exact; Triton rounds only from fp32: an fp16 master via it)
                tl.store(out_ptr + offs, wide.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if ZERO_GRAD:  # the training loop leaves zeroing the grads to the update that reads them (a store
            # before the other loads made it much slower: they could no longer be issued ahead of it)
            tl.store(g_ptr + offs, tl.zeros_like(g).to(g_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, eq=False)
class ModelPass:
    """What a kernel call does beyond AdamW where it works on the model's own buffers: the grads
    are the model's (multiplied by ``unscale``, then ``clip_coef``, each as an fp32 multiply, and
    zeroed after the read with ``zero_grad``), and ``param_out`` (an fp32 master's model param, any
    float dtype) receives the updated param cast to nearest even. A remainders master's ``high`` is
    then the model's bf16 param itself."""

    unscale: Optional[float] = None
    clip_coef: Optional[float] = None
    zero_grad: bool = False
    param_out: Optional[torch.Tensor] = None


PLAIN = ModelPass()


def factor_applies(factor: Optional[float]) -> bool:
    return factor is not None and factor != 1.0  # (convert_grads skips a factor of 1 too)


def f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), as torch rounds a Python scalar for an fp32 kernel."""
    return float(np.float32(x))


@functools.lru_cache(maxsize=256)
def _kernel_scalars(hyper: AdamHyper, step: int, reciprocal: bool, unscale: Optional[float],
                    clip_coef: Optional[float]) -> Tuple[float, ...]:
    """The kernel's fp32 scalars for one param group's step: computed once a step, not per launch (a step's
    few hundred launches spent more host time on them than the device on its small pieces)."""
    bc1 = 1 - hyper.beta1 ** step
    bc2_sqrt = (1 - hyper.beta2 ** step) ** 0.5
    # torch's CUDA division by a CPU scalar multiplies by its fp32 reciprocal
    divisor = 1.0 / f32(bc2_sqrt) if reciprocal else bc2_sqrt
    return (f32(1 - hyper.lr * hyper.weight_decay), f32(1 - hyper.beta1), f32(hyper.beta2),
            f32(1 - hyper.beta2), f32(divisor), f32(hyper.eps), f32((hyper.lr / bc1) * -1),
            f32(unscale or 1.0), f32(clip_coef or 1.0))


# The stored formats (``state_formats.StateCodec.kernel_key``) the one-pass kernels, this one and
# its CPU twin ``cpu_one_pass``, read and write: a master in any of them, moments in a float one.
# A format outside them (say 8-bit blockwise moments before their kernels) runs the multi-pass path.
ONE_PASS_KEYS = ({"fp32", "bf16", "fp16", "rem16"}, {"fp32", "bf16", "fp16"}, {"fp32", "bf16", "fp16"})


def one_pass_handles(codecs: Sequence) -> bool:
    """Whether the one-pass kernels take state stored in ``codecs`` (param, exp_avg, exp_avg_sq)."""
    return all(c.kernel_key in keys for c, keys in zip(codecs, ONE_PASS_KEYS))


def unhandled(codecs: Sequence) -> str:
    """The path taken where no one-pass kernel handles ``codecs``, as the start-up line says it."""
    return f"multi-pass (no one-pass kernel for {'/'.join(c.describe() for c in codecs)})"


class FusedAdamW:
    """AdamW in one pass over state stored in ``codecs`` (``one_pass_handles``: param or int16
    remainders, exp_avg, exp_avg_sq), on CUDA tensors; ``variant`` says how it rounds (``Variant``)."""

    BLOCK = 2048

    def __init__(self, variant: Variant, codecs: Sequence):
        if triton is None:
            raise RuntimeError("the fused device update needs Triton (torch's CUDA builds ship it)")
        if not one_pass_handles(codecs):
            raise ValueError(unhandled(codecs))
        self.variant = variant
        self.remainders = codecs[0].kernel_key == "rem16"  # the kernel's REMAINDERS path
        self.on_model_ok = False  # bit-identical on the model's own buffers too (verified_fused_update)

    def __call__(self, stored: Sequence[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                 hyper: AdamHyper, step: int, model: "ModelPass" = None) -> None:
        """``stored``: (param or remainders, exp_avg, exp_avg_sq), updated in place; ``grad`` fp32;
        ``high``: the bf16 high halves of a remainders master (read and updated in place). With
        ``model``, ``grad`` is the model's own (any training dtype) and what ``model`` says applies."""
        model = model or PLAIN
        p, m, v = stored
        n = p.numel()
        if n == 0:
            return
        remainders = self.remainders
        if remainders and high is None:
            raise ValueError("a master stored as remainders needs its bf16 high halves")
        var = self.variant
        scalars = _kernel_scalars(hyper, step, var.reciprocal_div, model.unscale, model.clip_coef)
        grid = (triton.cdiv(n, self.BLOCK),)
        out = model.param_out if model.param_out is not None and not remainders else None
        _adamw_pass[grid](
            p, high if remainders else p, grad, m, v, p if out is None else out, n, *scalars,
            REMAINDERS=remainders, DECAY=hyper.weight_decay != 0, LERP_SMALL=abs(scalars[1]) < 0.5,
            FMA_LERP=var.fma_lerp, FMA_ADDCMUL=var.fma_addcmul, FMA_ADDCDIV=var.fma_addcdiv,
            RECIPROCAL=var.reciprocal_div, UNSCALE=factor_applies(model.unscale), CLIP=factor_applies(model.clip_coef),
            ZERO_GRAD=model.zero_grad, PARAM_OUT=out is not None, BLOCK=self.BLOCK, num_warps=8,
            enable_fp_fusion=False)


def multi_pass_step(adam_kernel, codecs: Sequence, stored: Sequence[torch.Tensor], grad: torch.Tensor,
                    high: Optional[torch.Tensor], hyper: AdamHyper, step: int, model: ModelPass = PLAIN) -> None:
    """The reference the fused kernel must equal: the grads converted (``model``), widen to fp32,
    the engine's AdamW, round back, then the model's grads zeroed and its param written."""
    from .update import Fp32Working, convert_grads

    wide_grad = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
    convert_grads(grad, wide_grad, model.unscale, model.clip_coef)
    working = Fp32Working(codecs, stored[0].numel(), stored[0].device)
    wide = working.widen(list(stored), high)
    adam_kernel(wide[0], wide_grad, wide[1], wide[2], step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                eps=hyper.eps, weight_decay=hyper.weight_decay)
    working.round_back(list(stored), wide, high)
    if model.zero_grad:
        grad.zero_()
    if model.param_out is not None and high is None:
        model.param_out.copy_(stored[0])


def sample_state(codecs: Sequence, numel: int, device, seed: int = 0):
    """Random state stored in ``codecs`` (``state_formats``; remainders of random fp32 masters where
    its format needs the high halves), fp32 grads and the masters' bf16 high halves, spread over
    magnitudes where rounding differences show."""
    from .remainders import split

    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-8, 4, (numel,), generator=gen).float())
    high = split(master)[1]
    first = codecs[0].pack(master, high=high.clone()) if codecs[0].needs_high else codecs[0].pack(master)
    m = codecs[1].pack(torch.randn(numel, generator=gen) * 1e-3)
    v = codecs[2].pack(torch.rand(numel, generator=gen) * 1e-6)
    grad = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-12, 0, (numel,), generator=gen).float())
    return [t.to(device) for t in (first, m, v)], grad.to(device), high.to(device)


SAMPLE_HYPERS = (AdamHyper(3e-4, 0.9, 0.95, 1e-8, 0.1), AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0))


def matches(fused: Callable, adam_kernel, codecs: Sequence, device, numel: int = 1 << 20,
            steps: int = 3, on_model: bool = False) -> bool:
    """Whether ``fused`` gives the multi-pass path's bits on random state, over ``steps`` steps of
    each sample hyperparameter set (weight decay on and off). ``on_model``: called as on the model's
    own buffers (bf16 grads unscaled and clipped, then zeroed; an fp32 master's bf16 param written)."""
    for seed, hyper in enumerate(SAMPLE_HYPERS):
        ours, grad, high_ours = sample_state(codecs, numel, device, seed)
        ref = [t.clone() for t in ours]
        high_ref = high_ours.clone()
        grad_ours = grad_ref = grad
        outs = [None, None]
        if on_model:
            outs = [torch.zeros(numel, dtype=torch.bfloat16, device=grad.device) for _ in range(2)]
        for step in range(1, steps + 1):
            if on_model:  # (the grads are zeroed by each step: fresh ones for each)
                grad_ours, grad_ref = grad.to(torch.bfloat16) * step, grad.to(torch.bfloat16) * step
            high = high_ours if codecs[0].needs_high else None
            passes = [ModelPass(1 / 1000, 0.7, True, out) if on_model else PLAIN for out in outs]
            fused(ours, grad_ours, high, hyper, step, *([passes[0]] if on_model else []))
            multi_pass_step(adam_kernel, codecs, ref, grad_ref, high_ref if high is not None else None, hyper, step,
                            passes[1])
            if on_model and not (torch.equal(grad_ours, grad_ref) and torch.equal(outs[0].view(torch.int16),
                                                                                   outs[1].view(torch.int16))):
                return False
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, ref))
        if not same or not torch.equal(high_ours.view(torch.int16), high_ref.view(torch.int16)):
            return False
    return True


def verified_fused_update(device, codecs: Sequence, adam_kernel,
                          variants: Sequence[Variant] = VARIANTS) -> Tuple[Optional[FusedAdamW], str]:
    """The fused kernel in the first variant bit-identical to the multi-pass path with
    ``adam_kernel`` on this device, or None (the multi-pass path stays); and a phrase for the log.
    Its ``on_model_ok`` says whether it was bit-identical on the model's own buffers too (else the
    device update goes through copies of the grads and params)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "multi-pass (CPU device)"
    if triton is None:
        return None, "multi-pass (no Triton)"
    if adam_kernel.kind == "fused":  # torch's fused CUDA kernel computes another formula
        return None, "multi-pass (torch's fused kernel)"
    if not one_pass_handles(codecs):
        return None, unhandled(codecs)
    tried: List[str] = []
    for variant in variants:
        fused = FusedAdamW(variant, codecs)
        try:
            if not matches(fused, adam_kernel, codecs, device):
                tried.append(variant.describe())
                continue
        except Exception as err:  # a Triton that cannot build it: the multi-pass path is always there
            log.warning("fused device update unavailable (%s: %s); using the multi-pass path",
                        type(err).__name__, err)
            return None, "multi-pass (fused kernel failed to build)"
        how = f"one pass ({variant.describe()}; bit-identical to the multi-pass path on a sample"
        try:
            fused.on_model_ok = matches(fused, adam_kernel, codecs, device, on_model=True)
        except Exception as err:
            log.warning("fused device update on the model's buffers unavailable (%s: %s); through copies",
                        type(err).__name__, err)
        return fused, how + ("" if fused.on_model_ok else "; through copies of the grads and params") + ")"
    return None, f"multi-pass (no fused variant was bit-identical: tried {len(tried)})"


class ReferenceOnePass:
    """The one-pass interface over the multi-pass arithmetic: the fused kernel's stand-in where
    there is no GPU, so the CPU tests run the device update's one-pass slicing (chunks, param
    group pieces, high halves, the model's own buffers) and compare it with the multi-pass path."""

    on_model_ok = True

    def __init__(self, adam_kernel, codecs: Sequence):
        self.adam_kernel, self.codecs = adam_kernel, list(codecs)

    def __call__(self, stored: Sequence[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                 hyper: AdamHyper, step: int, model: ModelPass = PLAIN) -> None:
        multi_pass_step(self.adam_kernel, self.codecs, stored, grad, high, hyper, step, model or PLAIN)
