"""The update on the CPU, subgroup by subgroup: its gradients converted into one of two fp32
scratch buffers (the next subgroup's arrive in the other during this one's Adam), its stored state
widened to fp32, AdamW, rounded back (or all three in one pass, ``cpu_one_pass``), and the updated
params handed to the caller.
``device_side`` is the device's share of a step; the engine decides which subgroup goes where.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .device_side import DONE
from ..kernels.fused_update import hyper_of
from ..pipeline import StateViews
from ..kernels.update import AdamKernel, Fp32Working, adam_piece
from .context import SideInputs, StepContext


@dataclass(frozen=True)
class CpuKernel:
    """How the CPU updates a subgroup (``update_paths`` chooses): ``one_pass``, a verified one-pass
    kernel (``cpu_one_pass.verified_cpu_one_pass``, with the signature of ``fused_update.FusedAdamW``)
    in place of widen, Adam and round back; None: ``adam`` on fp32 copies made in ``working``."""
    adam: AdamKernel
    working: Fp32Working
    one_pass: Optional[Callable] = None
    eight_bit: Optional[Callable] = None  # 8-bit moments: ``eight_bit.EightBitUpdate`` (then the others are unused)


class CpuUpdate:
    """The CPU's subgroups of one step, in the order ``begin`` was given. ``scratch``: two fp32 buffers
    for the gradients; ``high``: a host buffer for a remainders master's bf16 high halves, else None."""

    asynchronous = False  # done when ``update`` returns

    def __init__(self, inputs: SideInputs, kernel: CpuKernel, scratch, high: Optional[torch.Tensor]):
        self.subgroups, self.segments, self.grad_source = inputs.subgroups, inputs.segments, inputs.grad_source
        self.param_high, self.on_params_updated, self.trace = inputs.param_high, inputs.on_params, inputs.trace
        self.adam, self.working, self.one_pass, self.eight_bit = kernel.adam, kernel.working, kernel.one_pass, \
            kernel.eight_bit
        self.blocks = inputs.blocks
        self.scratch, self.high = scratch, high
        self._high_fence = None  # the last subgroup's bf16 params may still be copied out of ``high``
        self._order, self._turn = [], {}
        self.ctx: Optional[StepContext] = None

    def begin(self, ctx: StepContext, order: Sequence[int]) -> None:
        """A step's CPU subgroups in update order; the first one's gradients start arriving now."""
        self.ctx = ctx
        self._order, self._turn = list(order), {i: k for k, i in enumerate(order)}
        if self._order:
            first = self.subgroups[self._order[0]]
            self.grad_source.start(first.start, first.end, self.scratch[0][: first.numel], ctx.unscale, ctx.clip_coef)

    def end(self) -> None:
        """Nothing left: each update was done when it returned."""

    def update(self, i: int, views: StateViews):
        """Subgroup ``i`` (its state in ``views``): gradients, Adam, params out; times into the step's
        record. Done when it returns (its fence is ``DONE``). A deferred device step's copy out of
        this state (``ctx.written``) is waited for first."""
        ctx = self.ctx
        written = ctx.written.get(i)
        if written is not None:
            written.synchronize()
        step, unscale, clip_coef, rec = ctx.step, ctx.unscale, ctx.clip_coef, ctx.record
        sg, source, scratch = self.subgroups[i], self.grad_source, self.scratch
        k = self._turn[i]
        t0 = time.perf_counter()
        if k + 1 < len(self._order):  # the next subgroup's grads may arrive during this Adam
            nxt = self.subgroups[self._order[k + 1]]
            source.start(nxt.start, nxt.end, scratch[(k + 1) % 2][: nxt.numel], unscale, clip_coef)
        source.wait(sg.start)
        grad = scratch[k % 2][: sg.numel]
        high = None
        if self.high is not None:
            if self._high_fence is not None:
                self._high_fence.synchronize()
            high = self.high[: sg.numel]
            self.param_high.fill(sg.start, sg.end, high)
        t1 = time.perf_counter()
        # The last step's copy of these params to the model (its fence) may still read the buffer this
        # Adam rewrites: a cache hit reuses the buffer without the pipeline's wait before a read.
        views.sync_fence()
        stored = views.narrow(sg)
        if self.eight_bit is not None:
            self.eight_bit(sg, stored, grad, high, self.blocks.pieces(i), lambda g: hyper_of(ctx.groups[g]), step)
        elif self.one_pass is not None:  # on the stored views, each param group's piece in one pass
            for lo, hi, g, _ in self.segments[i]:
                self.one_pass([t[lo:hi] for t in stored], grad[lo:hi], None if high is None else high[lo:hi],
                              hyper_of(ctx.groups[g]), step)
        else:
            param, exp_avg, exp_avg_sq = wide = self.working.widen(stored, high)
            for lo, hi, g, span in self.segments[i]:
                adam_piece(self.adam, ctx.groups, param[lo:hi], grad[lo:hi], exp_avg[lo:hi],
                           exp_avg_sq[lo:hi], g, span, step)
            self.working.round_back(stored, wide, high)
        t2 = time.perf_counter()
        if high is not None:
            self._high_fence = self.on_params_updated(sg.start, sg.end, high)
        elif self.on_params_updated is not None:
            views.fence = self.on_params_updated(sg.start, sg.end, views.param[: sg.numel])
        t3 = time.perf_counter()
        if self.trace is not None:
            self.trace.compute("gradients", t0, t1, subgroup=i, step=step)
            self.trace.compute("adam", t1, t2, subgroup=i, step=step, elements=sg.numel)
            if self.on_params_updated is not None:
                self.trace.compute("params callback", t2, t3, subgroup=i, step=step)
        rec.convert_s += t1 - t0
        rec.adam_s += t2 - t1
        rec.callback_s += t3 - t2
        return DONE
