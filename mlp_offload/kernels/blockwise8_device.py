"""The device one-pass AdamW with 8-bit block-scaled moments (Triton): one program per block of
the layout, mirroring ``blockwise8.adamw_step`` operation by operation (its CPU twin, which the CPU
tests run): every fp32 operation rounded once (``enable_fp_fusion=False``: no contraction into
fused multiply-adds; ``div_rn``, ``sqrt_rn``), the block's absmax a max over its elements.

Run on one H200 (2026-11-27): the same bits as the torch path for every scheme of the tests
(``tests/unit/test_blockwise8.py``, in the GPU suite). Before the engine uses it, a start-up sample
should still compare it with the torch path on the device at hand, as
``fused_update.verified_fused_update`` does; what decides the bits: Triton's fp32 -> float8 cast (``cvt.rn.satfinite`` on sm_90: nearest even, as c10's;
the quotient is clamped first, so saturation never decides) and subnormal scales (no flush to zero).
"""

from __future__ import annotations

from typing import Optional

import torch

from .blockwise8 import ROUNDER, BlockLayout, Quantized, step_scalars
from .fused_update import AdamHyper, f32

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

if triton is not None:
    @triton.jit
    def _encode(x, mask, qmax, code_ptr, scale_ptr, block, offs, rounding, INTEGER: tl.constexpr):
        """blockwise8.encode of one block, and its scale (absmax / qmax)."""
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
        scale = tl.div_rn(amax, qmax)
        tl.store(scale_ptr + block, scale)
        q = tl.where(scale > 0, tl.div_rn(x, tl.where(scale > 0, scale, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(q, -qmax), qmax)
        if INTEGER:
            q = (q + rounding) - rounding  # a runtime scalar: nothing to fold
            tl.store(code_ptr + offs, q.to(code_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(code_ptr + offs, q.to(code_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _adamw8_block(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, starts_ptr, out_ptr,
                      decay, w1, one_minus_w1, beta2, w2, inv_bc2, eps, neg_step, qmax_m, qmax_v, rounding,
                      SMALL: tl.constexpr, DECAY: tl.constexpr, ROOT: tl.constexpr, M_INT: tl.constexpr,
                      V_INT: tl.constexpr, PARAM_OUT: tl.constexpr, B: tl.constexpr):
        block = tl.program_id(0)
        lo = tl.load(starts_ptr + block)
        hi = tl.load(starts_ptr + block + 1)
        offs = lo + tl.arange(0, B)
        mask = offs < hi
        # no `other` for the codes (Triton casts no integer to float8); masked lanes are never used
        m = tl.load(mc_ptr + offs, mask=mask).to(tl.float32) * tl.load(ms_ptr + block)
        v = tl.load(vc_ptr + offs, mask=mask).to(tl.float32) * tl.load(vs_ptr + block)
        if ROOT:
            v = v * v
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if DECAY:
            p = p * decay
        d = g - m
        if SMALL:
            m = m + d * w1
        else:
            m = g - d * one_minus_w1
        v = v * beta2 + (g * g) * w2
        r = tl.sqrt_rn(v)
        denom = r * inv_bc2 + eps
        p = p + tl.div_rn(m, denom) * neg_step
        tl.store(p_ptr + offs, p, mask=mask)
        if PARAM_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        _encode(m, mask, qmax_m, mc_ptr, ms_ptr, block, offs, rounding, M_INT)
        if ROOT:
            _encode(r, mask, qmax_v, vc_ptr, vs_ptr, block, offs, rounding, V_INT)
        else:
            _encode(v, mask, qmax_v, vc_ptr, vs_ptr, block, offs, rounding, V_INT)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
               layout: BlockLayout, hyper: AdamHyper, step: int, param_out: Optional[torch.Tensor] = None) -> None:
    """``blockwise8.adamw_step`` on CUDA tensors, one program per block (the same bits, to be
    verified on the device; see the module's docstring)."""
    if triton is None:
        raise RuntimeError("the 8-bit device update needs Triton (torch's CUDA builds ship it)")
    if layout.blocks == 0:
        return
    s = step_scalars(hyper, step)
    fm, fv = exp_avg.fmt, exp_avg_sq.fmt
    _adamw8_block[(layout.blocks,)](
        master, grad, exp_avg.codes, exp_avg.scales, exp_avg_sq.codes, exp_avg_sq.scales,
        layout.starts_on(master.device), master if param_out is None else param_out,
        s.decay, s.w1, f32(1.0 - s.w1), s.beta2, s.w2, s.inv_bc2, s.eps, s.neg_step, fm.qmax, fv.qmax, ROUNDER,
        SMALL=s.small_lerp, DECAY=hyper.weight_decay != 0, ROOT=fv.root, M_INT=fm.integer, V_INT=fv.integer,
        PARAM_OUT=param_out is not None, B=layout.block, num_warps=max(1, min(8, layout.block // 64)),
        enable_fp_fusion=False)
