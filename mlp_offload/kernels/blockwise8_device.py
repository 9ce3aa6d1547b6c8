"""The device one-pass AdamW with 8-bit block-scaled moments (Triton): blocks of the layout as rows
of a tile, several a program, mirroring ``blockwise8.adamw_step`` operation by operation (its CPU twin, which the CPU
tests run): every fp32 operation rounded once (``enable_fp_fusion=False``: no contraction into
fused multiply-adds; ``div_rn``, ``sqrt_rn``), the block's absmax a max over its elements.

It gives the torch path's bits for every scheme of the tests (``tests/unit/test_blockwise8.py``, in
the GPU suite; docs/design.md, "Adam moments in 8 bits"). The engine compares it with the torch path
on a sample at start-up (``step.eight_bit``) and runs the torch path where they differ; what decides
the bits: Triton's fp32 -> float8 cast (``cvt.rn.satfinite`` on sm_90: nearest even, as c10's; the
quotient is clamped first, so saturation never decides) and subnormal scales (no flush to zero).
"""

from __future__ import annotations

from typing import Optional

import torch

from .blockwise8 import ROUNDER, BlockLayout, Quantized, step_scalars
from .fused_update import PLAIN, AdamHyper, ModelPass, f32, factor_applies

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None

if triton is not None:
    @triton.jit
    def _adam(p, g, m, v, decay, w1, one_minus_w1, beta2, w2, inv_bc2, eps, neg_step, SMALL: tl.constexpr,
              DECAY: tl.constexpr, ROOT: tl.constexpr):
        """The fp32 AdamW of decoded moments (v: its root's square where ROOT), op by op as
        ``blockwise8.adamw_fp32``: (master, m, v, sqrt(v))."""
        if ROOT:
            v = v * v
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
        return p, m, v, r

    @triton.jit
    def _encode_rows(x, mask, row_ok, rows, qmax, code_ptr, scale_ptr, offs, rounding, INTEGER: tl.constexpr):
        """blockwise8.encode of ROWS blocks (a row each), and their scales (absmax / qmax)."""
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        scale = tl.div_rn(amax, qmax)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.where(scale[:, None] > 0, tl.div_rn(x, safe[:, None]), 0.0)
        q = tl.minimum(tl.maximum(q, -qmax), qmax)
        if INTEGER:
            q = (q + rounding) - rounding
            tl.store(code_ptr + offs, q.to(code_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(code_ptr + offs, q.to(code_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _adamw8_rows(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, starts_ptr, out_ptr, high_ptr, nblocks,
                     decay, w1, one_minus_w1, beta2, w2, inv_bc2, eps, neg_step, qmax_m, qmax_v, rounding,
                     unscale, clip, SMALL: tl.constexpr, DECAY: tl.constexpr, ROOT: tl.constexpr,
                     M_INT: tl.constexpr, V_INT: tl.constexpr, PARAM_OUT: tl.constexpr, REMAINDERS: tl.constexpr,
                     UNSCALE: tl.constexpr, CLIP: tl.constexpr, ZERO_GRAD: tl.constexpr, B: tl.constexpr,
                     ROWS: tl.constexpr):
        """ROWS blocks per program, a row of a [ROWS, B] tile each (one block a program ran far slower
        on state in HBM). No ``other`` for the codes' loads (Triton casts no
        integer to float8): masked lanes are never stored nor counted in a row's absmax. On the
        model's buffers (``adamw_step_model``): the grads in their training dtype, widened and
        multiplied as ``update.convert_grads`` does, zeroed after the read (ZERO_GRAD); a remainders
        master merged from and split back into the model's bf16 param (REMAINDERS, as ``remainders``)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < nblocks
        lo = tl.load(starts_ptr + rows, mask=row_ok, other=0)
        hi = tl.load(starts_ptr + rows + 1, mask=row_ok, other=0)
        offs = lo[:, None] + tl.arange(0, B)[None, :]
        mask = offs < hi[:, None]
        sm = tl.load(ms_ptr + rows, mask=row_ok, other=0.0)
        sv = tl.load(vs_ptr + rows, mask=row_ok, other=0.0)
        m = tl.load(mc_ptr + offs, mask=mask).to(tl.float32) * sm[:, None]
        v = tl.load(vc_ptr + offs, mask=mask).to(tl.float32) * sv[:, None]
        if REMAINDERS:  # fp32 master = bf16 high half << 16 + int16 remainder (remainders.merge)
            high = tl.load(high_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
            rem = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
            p = ((high << 16) + rem).to(tl.float32, bitcast=True)
        else:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNSCALE:
            g = g * unscale
        if CLIP:
            g = g * clip
        p, m, v, r = _adam(p, g, m, v, decay, w1, one_minus_w1, beta2, w2, inv_bc2, eps, neg_step, SMALL, DECAY, ROOT)
        if REMAINDERS:  # remainders.split_: the high half rounded half away, the low half as remainder
            bits = p.to(tl.int32, bitcast=True)
            h = (bits + 32768) >> 16
            tl.store(p_ptr + offs, (bits - (h << 16)).to(tl.int16), mask=mask)
            tl.store(high_ptr + offs, h.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(p_ptr + offs, p, mask=mask)
        if PARAM_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if ZERO_GRAD:
            tl.store(g_ptr + offs, tl.zeros_like(g).to(g_ptr.dtype.element_ty), mask=mask)
        _encode_rows(m, mask, row_ok, rows, qmax_m, mc_ptr, ms_ptr, offs, rounding, M_INT)
        if ROOT:
            _encode_rows(r, mask, row_ok, rows, qmax_v, vc_ptr, vs_ptr, offs, rounding, V_INT)
        else:
            _encode_rows(v, mask, row_ok, rows, qmax_v, vc_ptr, vs_ptr, offs, rounding, V_INT)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
               layout: BlockLayout, hyper: AdamHyper, step: int, param_out: Optional[torch.Tensor] = None) -> None:
    """``blockwise8.adamw_step`` on CUDA tensors, blocks in rows of a tile, 2,048 elements' worth a
    program (the same bits, verified on the device; see the module's docstring)."""
    _launch(master, grad, exp_avg, exp_avg_sq, layout, hyper, step, param_out, None, PLAIN)


def adamw_step_model(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
                     layout: BlockLayout, hyper: AdamHyper, step: int, high: Optional[torch.Tensor],
                     model: ModelPass) -> None:
    """``blockwise8.adamw_step_model`` in one pass: on the model's own grads (any training dtype;
    unscaled, clipped and zeroed as ``model`` says) and params (``high``: the bf16 params of a master
    stored as int16 remainders ``master``; else ``model.param_out`` gets the fp32 master's update)."""
    _launch(master, grad, exp_avg, exp_avg_sq, layout, hyper, step, model.param_out if high is None else None,
            high, model)


def _launch(master, grad, exp_avg: Quantized, exp_avg_sq: Quantized, layout: BlockLayout, hyper: AdamHyper,
            step: int, param_out: Optional[torch.Tensor], high: Optional[torch.Tensor], model: ModelPass) -> None:
    if triton is None:
        raise RuntimeError("the 8-bit device update needs Triton (torch's CUDA builds ship it)")
    if layout.blocks == 0:
        return
    s = step_scalars(hyper, step)
    fm, fv = exp_avg.fmt, exp_avg_sq.fmt
    rows = max(1, 2048 // layout.block)
    unscale, clip = factor_applies(model.unscale), factor_applies(model.clip_coef)
    _adamw8_rows[(-(-layout.blocks // rows),)](
        master, grad, exp_avg.codes, exp_avg.scales, exp_avg_sq.codes, exp_avg_sq.scales,
        layout.starts_on(master.device), master if param_out is None else param_out,
        master if high is None else high, layout.blocks,
        s.decay, s.w1, f32(1.0 - s.w1), s.beta2, s.w2, s.inv_bc2, s.eps, s.neg_step, fm.qmax, fv.qmax, ROUNDER,
        f32(model.unscale or 1.0), f32(model.clip_coef or 1.0),
        SMALL=s.small_lerp, DECAY=hyper.weight_decay != 0, ROOT=fv.root, M_INT=fm.integer, V_INT=fv.integer,
        PARAM_OUT=param_out is not None, REMAINDERS=high is not None, UNSCALE=unscale, CLIP=clip,
        ZERO_GRAD=model.zero_grad, B=layout.block, ROWS=rows, num_warps=8, enable_fp_fusion=False)
