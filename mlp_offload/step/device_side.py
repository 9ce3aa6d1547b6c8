"""The update on the model's device: for subgroups resident in device memory (in place), and for
host-held ones streamed through it, chunk by chunk, with copy-in, Adam and copy-out on three
streams so the copies of one chunk overlap the Adam of another.

Gradients come from the gradient source straight into a device buffer (cast, unscaled and clipped
there; never copied to the host), and the updated master params are handed to the caller on the
device (no copy back up for them). On a CPU run the device is the CPU and the streams are no-op
stand-ins: the same chunking, buffers and calls run, so the CPU tests exercise this path (the CPU
twin). What it computes is the engine's AdamW (``update.AdamKernel``) on the same fp32 values, so
a subgroup gives the same bits on either side for one kernel.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..gradients import ModelBuffers
from ..kernels.fused_update import AdamHyper, FusedAdamW, ModelPass, hyper_of
from ..subgroups.param_groups import Segment
from .context import SideInputs, StepContext
from ..state_formats import StateCodec
from ..subgroups.partition import Subgroup
from ..kernels.update import AdamKernel, Fp32Working, adam_piece


class _Done:
    """The CPU twin's event: everything it stands for has already happened."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = _Done()


class Streams:
    """Copy-in, compute and copy-out streams on CUDA; on the CPU, stand-ins that run in order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_in, self.compute, self.copy_out = (torch.cuda.Stream(device) for _ in range(3))
        else:
            self.copy_in = self.compute = self.copy_out = None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def record(self, stream):
        if not self.cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if self.cuda and event is not None and event is not DONE:
            stream.wait_event(event)

    def timed_mark(self, stream):
        """A point on ``stream`` two of which give the time between them (``seconds_between``)."""
        if not self.cuda:
            return time.perf_counter()  # the CPU twin runs in order: the host clock is the device's
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def seconds_between(start, end) -> float:
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def after_caller(self) -> None:
        """Before a step: its streams see what the caller's stream did (backward's grads, params)."""
        if self.cuda:
            for stream in (self.copy_in, self.compute, self.copy_out):
                stream.wait_stream(torch.cuda.current_stream())

    def before_caller(self) -> None:
        """After a step: the caller's stream sees the params the compute stream wrote."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.compute)


@dataclass(frozen=True)
class DeviceKernel:
    """How the device updates a subgroup (``update_paths`` chooses): ``fused``, the one-pass kernel
    (``fused_update``) where it was verified bit-identical on this device, None: widen, Adam and round
    back as separate passes; ``on_model_buffers``: the one-pass kernel works on the model's own grads
    and params (``ModelBuffers``, where the engine's sources give them)."""
    fused: Optional[FusedAdamW] = None
    how: str = "multi-pass"
    on_model_buffers: bool = False


MULTI_PASS = DeviceKernel()


@dataclass(frozen=True)
class DeviceJob:
    """One subgroup's update on the device: ``stored``, its (param, exp_avg, exp_avg_sq) in their stored
    dtypes, on the device (``resident``: updated in place) or in host memory (streamed through the chunk
    buffers). ``pre_read`` (``read_ahead.PreRead``): host state already copied in; its update waits
    for that copy and then only copies the state back out. ``written``: the event of a copy out that
    may still write ``stored`` (the copies in wait for it)."""
    sg: Subgroup
    stored: List[torch.Tensor]
    resident: bool
    segments: Sequence[Segment]
    pre_read: object = None
    written: object = None
    pieces: Sequence = ()  # 8-bit moments: its param-group pieces with their blocks (``blocks.BlockPiece``)


@dataclass(frozen=True)
class DeviceIO:
    """Where a device update's inputs come from and its results go. ``fill_grads(out)`` writes the
    fp32 grads into a device tensor; ``adam(p, g, m, v, group, span)`` is the multi-pass step;
    ``on_params(start, end, params)`` gets each chunk's updated master params on the device (on the
    compute stream), or is None. With the master stored as remainders, ``fill_high(start, end, out)``
    writes the model's bf16 params of shard elements [start, end) into a device tensor (on the
    compute stream), and ``on_params`` gets the updated bf16 params. With the one-pass kernel,
    ``hyper(group)`` and ``step`` replace ``adam``; ``model``: there the model's grads (times
    ``grad_scale``: unscale, clip coefficient) and params are used where they are, and
    ``fill_grads``, ``fill_high`` and ``on_params`` are not called."""
    fill_grads: Callable[[torch.Tensor], None]
    adam: Optional[Callable]
    on_params: Optional[Callable]
    fill_high: Optional[Callable[[int, int, torch.Tensor], None]] = None
    hyper: Optional[Callable[[int], AdamHyper]] = None
    step: int = 0
    model: Optional[ModelBuffers] = None
    grad_scale: Tuple[Optional[float], Optional[float]] = (None, None)


class DeviceUpdate:
    """Updates one subgroup on the device; returns the fence to wait on before its host state is
    touched again (its copy-out), or ``DONE`` on the CPU twin."""

    def __init__(self, device, codecs: Sequence[StateCodec], chunk_elems: int, largest: int,
                 kernel: DeviceKernel = MULTI_PASS, eight_bit=None, largest_blocks: Optional[int] = None):
        self.device = torch.device(device)
        self.codecs = list(codecs)  # the stored formats (state_formats)
        # 8-bit moments (``eight_bit.EightBitUpdate``): a subgroup in one chunk (its blocks' scales
        # follow its codes; the two buffers still overlap one subgroup's copies with another's update)
        self.eight_bit = eight_bit
        self.largest_blocks = largest_blocks
        self.chunk = largest if eight_bit is not None else max(1, min(chunk_elems, largest))
        self.streams = Streams(self.device)
        self.kernel = kernel
        # Two chunk buffers in the stored dtypes: chunk k+1 arrives while chunk k is computed.
        # (made at their first use: with a read-ahead's buffers as the ring they may never be)
        self._buffers: Optional[List[List[torch.Tensor]]] = None
        self._free = [None, None]  # per buffer: its last copy-out (the next copy-in waits for it)
        # fp32 working copies for the multi-pass path only: made at its first use, so that with the
        # one-pass kernel their 1.2 GB (three fp32 chunks of 1e8) stay free for the gpu tier.
        self._working: Optional[Fp32Working] = None
        # A master stored as remainders: its chunk's bf16 high halves (read from the model, and
        # the updated ones handed back), on the device.
        # (made at first use: the one-pass kernel on the model's buffers needs neither)
        self._high: Optional[torch.Tensor] = None
        self._grad: Optional[torch.Tensor] = None
        self.largest = largest
        self._turn = 0

    @property
    def fused(self) -> Optional[FusedAdamW]:
        return self.kernel.fused

    @property
    def fused_how(self) -> str:
        return self.kernel.how

    @property
    def on_model_buffers(self) -> bool:
        """Whether the one-pass kernel works on the model's own grads and params (read by the rate probe)."""
        return self.kernel.on_model_buffers

    def update(self, job: DeviceJob, io: DeviceIO) -> object:
        """Queue ``job`` (its chunks through the chunk buffers unless resident); returns the fence of
        its last copy (the compute stream's for a resident one)."""
        s, n = self.streams, job.sg.numel
        plan8 = self._eight_bit_plan(job, io)
        if self._one_pass_on(io) and io.model is not None:
            def compute(chunk, c0, c1):
                self._on_model(job, io, chunk, c0, c1)
        elif plan8 is not None:
            def compute(chunk, c0, c1):
                self.eight_bit.run_on_model(job.sg, chunk, plan8, io.hyper, io.step, io.grad_scale,
                                            io.model.zero_grads)
        else:
            if self._grad is None:
                self._grad = torch.empty(self.largest, dtype=torch.float32, device=self.device)
            grad = self._grad[:n]
            with s.on(s.compute):
                io.fill_grads(grad)

            def compute(chunk, c0, c1):
                self._compute(job, io, chunk, grad, (c0, c1))
        for c0 in range(0, n, self.chunk):
            c1 = min(n, c0 + self.chunk)
            if job.resident:
                with s.on(s.compute):
                    compute(self._chunk_of(job.stored, c0, c1), c0, c1)
                continue
            self._stream_chunk(job, c0, c1, compute)
        return s.record(s.compute if job.resident else s.copy_out)

    def _one_pass_on(self, io: DeviceIO) -> bool:
        return self.kernel.fused is not None and io.hyper is not None

    def _eight_bit_plan(self, job: DeviceJob, io: DeviceIO):
        """8-bit moments on the model's buffers: the subgroup's launches there (``eight_bit.ModelStep``),
        or None (through copies: no such pass, or a buffer's edge inside one of its blocks)."""
        if self.eight_bit is None or not self.kernel.on_model_buffers or io.model is None or io.hyper is None:
            return None
        return self.eight_bit.model_step(job.sg, job.pieces, io.model)

    def _stream_chunk(self, job: DeviceJob, c0: int, c1: int, compute: Callable) -> None:
        """Chunk [c0, c1) of host state: copied in (or read ahead), computed, copied back out."""
        s, pre_read = self.streams, job.pre_read
        host = self._chunk_of(job.stored, c0, c1)
        if pre_read is not None:
            dev, arrived = self._chunk_of(pre_read.tensors, c0, c1), pre_read.arrived
        else:
            b = self._turn % 2
            self._turn += 1
            if self._buffers is None:
                self._buffers = [[c.empty(self.chunk, self.device, blocks=self.largest_blocks) for c in self.codecs]
                                 for _ in range(2)]
            dev = [buf[: h.numel()] for buf, h in zip(self._buffers[b], host)]
            with s.on(s.copy_in):
                s.wait(s.copy_in, self._free[b])
                s.wait(s.copy_in, job.written)
                for d, h in zip(dev, host):
                    d.copy_(h, non_blocking=True)
                arrived = s.record(s.copy_in)
        with s.on(s.compute):
            s.wait(s.compute, arrived)
            compute(dev, c0, c1)
            computed = s.record(s.compute)
        with s.on(s.copy_out):
            s.wait(s.copy_out, computed)
            for d, h in zip(dev, host):
                h.copy_(d, non_blocking=True)
            copied_out = s.record(s.copy_out)
            if pre_read is None:
                self._free[b] = copied_out

    def _chunk_of(self, stored: Sequence[torch.Tensor], c0: int, c1: int) -> List[torch.Tensor]:
        """Elements [c0, c1) of each stored tensor (8-bit moments: always the whole subgroup)."""
        return list(stored) if self.eight_bit is not None else [t[c0:c1] for t in stored]

    def _compute(self, job: DeviceJob, io: DeviceIO, chunk: List[torch.Tensor], grad: torch.Tensor,
                 span: Tuple[int, int]) -> None:
        """Chunk ``span`` = [c0, c1) of the subgroup (``chunk``: its state on the device) from ``grad``."""
        (c0, c1), sg = span, job.sg
        high = None
        if self.codecs[0].needs_high:
            if self._high is None:
                self._high = torch.empty(self.chunk, dtype=torch.bfloat16, device=self.device)
            high = self._high[: c1 - c0]
            io.fill_high(sg.start + c0, sg.start + c1, high)
        if self.eight_bit is not None:
            self.eight_bit(sg, chunk, grad, high, job.pieces, io.hyper, io.step)
        elif self._one_pass_on(io):
            self._one_pass(chunk, grad, high, span, job.segments, io)
        else:
            self._multi_pass(chunk, grad, high, span, job.segments, io.adam)
        if io.on_params is not None:
            io.on_params(sg.start + c0, sg.start + c1, chunk[0] if high is None else high)

    def _multi_pass(self, chunk: List[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                    span: Tuple[int, int], segments: Sequence[Segment], adam: Callable) -> None:
        """Widen the chunk to fp32, each param group's piece through ``adam``, round back."""
        c0, c1 = span
        if self._working is None:
            self._working = Fp32Working(self.codecs, self.chunk, self.device)
        param, exp_avg, exp_avg_sq = wide = self._working.widen(chunk, high)
        for lo, hi, g, seg_span in segments:
            a, b = max(lo, c0), min(hi, c1)
            if a >= b:
                continue
            piece_span = (seg_span[0] + (a - lo), seg_span[1])  # where this piece lies in its range
            adam(param[a - c0:b - c0], grad[a:b], exp_avg[a - c0:b - c0], exp_avg_sq[a - c0:b - c0], g, piece_span)
        self._working.round_back(chunk, wide, high)

    def _one_pass(self, chunk: List[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                  span: Tuple[int, int], segments: Sequence[Segment], io: DeviceIO) -> None:
        """Each param group's piece of the chunk in one kernel pass (no fp32 working copies)."""
        c0, c1 = span
        for lo, hi, g, _ in segments:
            a, b = max(lo, c0), min(hi, c1)
            if a < b:
                self.kernel.fused([t[a - c0:b - c0] for t in chunk], grad[a:b],
                                  None if high is None else high[a - c0:b - c0], io.hyper(g), io.step)

    def _on_model(self, job: DeviceJob, io: DeviceIO, chunk: List[torch.Tensor], c0: int, c1: int) -> None:
        """The chunk's param-group pieces in one kernel pass each, on the model's grads and params
        where they lie (a piece of the model's buffers and of one group at a time)."""
        model, grad_scale = io.model, io.grad_scale
        base, remainders, zero = job.sg.start, self.codecs[0].needs_high, model.zero_grads
        for lo, hi, grad, param in model.pieces(base + c0, base + c1):
            covered = lo
            for s_lo, s_hi, g, _ in job.segments:
                a, b = max(lo, base + s_lo), min(hi, base + s_hi)
                if a >= b:
                    continue
                if zero and covered < a:  # elements of no group (padding): zeroed as a read would
                    grad[covered - lo: a - lo].zero_()
                covered = b
                pieces = [t[a - base - c0: b - base - c0] for t in chunk]
                this = param[a - lo: b - lo]
                self.kernel.fused(pieces, grad[a - lo: b - lo], this if remainders else None, io.hyper(g), io.step,
                                  ModelPass(grad_scale[0], grad_scale[1], zero, None if remainders else this))
            if zero and covered < hi:
                grad[covered - lo:].zero_()


class DeviceSide:
    """The device's share of a step, as the engine's step loop sees both sides (``context``):
    ``DeviceUpdate`` with what each subgroup's update needs, built once. ``adam``: the device's
    multi-pass kernel; ``in_device_memory(i)``: where the placement has subgroup i now; ``read_ahead``
    (``read_ahead.ReadAhead``) or None; ``model``: the model's grads and params, where the one-pass
    kernel uses them in place; ``deferred``: a step's work is left queued past it (``DeferredWork``),
    so ``end`` leaves the caller's stream as it is."""

    asynchronous = True  # ``update`` queues the work on the device's streams

    def __init__(self, inputs: SideInputs, device_update: DeviceUpdate, adam: AdamKernel,
                 in_device_memory: Callable[[int], bool], read_ahead=None, model: Optional[ModelBuffers] = None,
                 deferred: bool = False):
        self.device_update, self.subgroups, self.segments = device_update, inputs.subgroups, inputs.segments
        self.grad_source, self.on_params, self.param_high = inputs.grad_source, inputs.on_params, inputs.param_high
        self.trace, self.adam, self.model, self.blocks = inputs.trace, adam, model, inputs.blocks
        self.read_ahead, self.deferred = read_ahead, deferred
        self.in_device_memory = in_device_memory
        self.streams = device_update.streams
        self.ctx: Optional[StepContext] = None

    def begin(self, ctx: StepContext, order: Sequence[int]) -> None:
        """Its streams see what the caller's stream did (backward's grads, the params)."""
        self.ctx = ctx
        self.streams.after_caller()

    def end(self) -> None:
        """The caller's stream sees the params the update wrote (a deferred step: left to the
        deferral, which the next forward waits on subgroup by subgroup)."""
        if not self.deferred:
            self.streams.before_caller()

    def update(self, i: int, views) -> object:
        """Queue subgroup ``i``'s update (in place where it lives in device memory, else streamed
        through it); returns the fence of its last copy. A deferred step's copy out that may still
        write its host state (``ctx.written``) is followed by its copy in."""
        ctx, sg = self.ctx, self.subgroups[i]
        views.sync_fence()  # a copy of its params from this buffer may still run (host state)
        resident = self.in_device_memory(i)
        written = ctx.written.get(i)
        pre = ahead = None
        if self.read_ahead is not None and not resident:
            pre = ahead = self.read_ahead.take(i)
            if pre is None:  # through the read-ahead's buffers as a ring, where one is free
                pre = self.read_ahead.stream_in(list(views.narrow(sg)), written)
        t0 = time.perf_counter()
        job = DeviceJob(sg, list(views.narrow(sg)), resident, self.segments[i], pre, written,
                        self.blocks.pieces(i) if self.blocks is not None else ())
        fence = self.device_update.update(job, self._io(ctx, sg))
        if pre is not None:
            self.read_ahead.returned(pre, fence)
            ctx.record.read_ahead += ahead is not None
        t1 = time.perf_counter()
        ctx.record.device_s += t1 - t0
        if self.trace is not None:
            self.trace.compute("device update queued", t0, t1, subgroup=i, step=ctx.step, elements=sg.numel)
        return fence

    def _io(self, ctx: StepContext, sg: Subgroup) -> DeviceIO:
        """Subgroup ``sg``'s grads, kernel and params' way back for this step."""
        groups, step, unscale, clip_coef = ctx.groups, ctx.step, ctx.unscale, ctx.clip_coef
        return DeviceIO(
            lambda out: self.grad_source.to_device(sg.start, sg.end, out, unscale, clip_coef),
            lambda p, g, m, v, group, span: adam_piece(self.adam, groups, p, g, m, v, group, span, step),
            self.on_params, self.param_high.to_device if self.param_high is not None else None,
            hyper=lambda g: hyper_of(groups[g]), step=step, model=self.model, grad_scale=(unscale, clip_coef))
