"""Adam moments in 8 bits with one fp32 scale per block of elements: the formats, the block
layout of a shard, quantize/dequantize, and one AdamW step on an fp32 master with 8-bit moments.

This torch path defines the arithmetic; ``blockwise8_cpu`` (C++) and ``blockwise8_device``
(Triton) are its one-pass twins and give the same bits. Every operation is elementwise and
rounded once as IEEE fp32 rounds it (no fused multiply-adds; sqrt through float64, which is
correctly rounded where torch's vectorised fp32 CPU sqrt is not; divisions only tensor by tensor,
since torch's CUDA division by a Python scalar multiplies by its reciprocal), except each block's
absmax, a reduction whose result does not depend on its order.

Codes. A moment ``x`` in a block with scale ``s`` is stored as ``code = encode(x / s)`` and read
back as ``code * s``; ``s = absmax / qmax`` (0 for a block of zeros, whose codes are then 0).
The quotient is clamped to ``[-qmax, qmax]`` before encoding (a subnormal scale can push it
out), then rounded to nearest even: by the cast for the float8 codes, by adding and subtracting
1.5 * 2**23 for the integer codes (exact in every IEEE implementation). A "root" format stores
``sqrt(v)`` instead of ``v`` (read back as ``(code * s)**2``): half of ``v``'s exponent range.
Moments must be finite (the training loop skips a step whose gradients are not).

Blocks follow each parameter's own indices: block ``j`` of a param is its elements
``[j*B, (j+1)*B)``; its last block is short where the param's size is no multiple of ``B``. A
flat shard holds pieces of params; the caller describes it as segments ``(shard_start,
param_start, length)`` in shard order, tiling the shard (padding is a segment of its own, with
``param_start`` 0), so a block never straddles two params. Where the shard's edge cuts a param's
block, the shard holds a short block of the elements it has, with a scale of its own; the
neighbouring shard holds the rest of that block under another scale.

Resharding. Codes are one byte per element at the element's own position and scales one per
block in shard order, so a range of a shard whose both ends fall on block boundaries of the old
and of the new layout (``BlockLayout.block_span``; both ends on a multiple of ``B`` within the
param, or at its end, on both sides) moves as its codes plus the slice of scales, unchanged: the
same bits as if it had never moved. A cut inside a block cannot move unchanged: the new shard
has a short block where the old one had a whole one (or the reverse), so those blocks are
dequantized and quantized again under the new layout (one more rounding, in those blocks only).
A reshard that keeps bits therefore cuts params at multiples of ``B`` (megatron-core's shards
follow the bucket's size, not ``B``: the integration must align them, or requantize the edges).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

import torch

from .fused_update import AdamHyper, ModelPass, f32
from .remainders import merge, split_

# Adding then subtracting this rounds a float of magnitude below 2**22 to an integer, to nearest even.
ROUNDER = 12582912.0  # 1.5 * 2**23


@dataclass(frozen=True)
class CodeFormat:
    """How one moment is coded: ``dtype`` of the codes, ``qmax`` the largest code magnitude,
    ``integer`` codes (rounded by ``ROUNDER``) or float8 (rounded by the cast), ``root``: the codes
    hold ``sqrt`` of the moment (second moment only)."""

    name: str
    dtype: torch.dtype
    qmax: float
    integer: bool
    root: bool = False

    @property
    def signed(self) -> bool:
        return self.dtype != torch.uint8


FORMATS = {f.name: f for f in (
    CodeFormat("e4m3", torch.float8_e4m3fn, 448.0, integer=False),
    CodeFormat("e5m2", torch.float8_e5m2, 57344.0, integer=False),
    CodeFormat("int8", torch.int8, 127.0, integer=True),
    CodeFormat("sqrt-e4m3", torch.float8_e4m3fn, 448.0, integer=False, root=True),
    CodeFormat("sqrt-uint8", torch.uint8, 255.0, integer=True, root=True),
)}


@dataclass(frozen=True)
class Scheme:
    """Both moments' formats and the block size: what a stored 8-bit state is."""

    exp_avg: str = "e4m3"
    exp_avg_sq: str = "sqrt-e4m3"
    block: int = 128

    def __post_init__(self):
        for field, name in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            if name not in FORMATS:
                raise ValueError(f"{field} format {name!r}: expected one of {', '.join(FORMATS)}")
        if FORMATS[self.exp_avg].root or not FORMATS[self.exp_avg].signed:
            raise ValueError(f"exp_avg format {self.exp_avg!r}: the first moment needs a signed, non-root format")
        if not 1 <= self.block <= 4096 or self.block & (self.block - 1):
            raise ValueError(f"block {self.block}: expected a power of two from 1 to 4096")

    @property
    def formats(self) -> Tuple[CodeFormat, CodeFormat]:
        return FORMATS[self.exp_avg], FORMATS[self.exp_avg_sq]

    def moment_bytes_per_param(self) -> float:
        """Bytes per element of both moments, scales included (whole blocks)."""
        return 2 * (1 + 4 / self.block)

    def describe(self) -> str:
        return f"{self.exp_avg}/{self.exp_avg_sq} per {self.block}"


DEFAULT = Scheme()


class BlockLayout:
    """The blocks of one flat shard: ``lengths`` (int64, one per block, in shard order) and
    ``starts`` (their first elements; one more entry, the shard's size). See the module's docstring."""

    def __init__(self, segments: Iterable[Tuple[int, int, int]], block: int,
                 starts: Optional[torch.Tensor] = None):
        """``starts``: the blocks' starts themselves (from 0), in place of ``segments`` (``span``)."""
        if block < 1:
            raise ValueError(f"block {block}: must be positive")
        self.block = block
        self._cached = {}
        if starts is not None:
            self.starts, self.numel = starts, int(starts[-1])
            return
        pieces, at = [], 0
        for shard_start, param_start, length in segments:
            if shard_start != at or param_start < 0 or length < 1:
                raise ValueError(f"segment ({shard_start}, {param_start}, {length}): segments must tile the shard "
                                 f"in order with positive lengths (expected shard_start {at})")
            pieces.append(_segment_lengths(param_start, length, block))
            at += length
        self.numel = at
        lengths = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])  # kept alone: 8 B a block

    @property
    def lengths(self) -> torch.Tensor:
        return self.starts.diff()

    @classmethod
    def whole(cls, numel: int, block: int) -> "BlockLayout":
        """One param from its first element."""
        return cls([(0, 0, numel)], block)

    @property
    def blocks(self) -> int:
        return self.starts.numel() - 1

    def block_index(self, device) -> torch.Tensor:
        """Each element's block (int64; made per call: 8 bytes per element is too much to keep for a shard)."""
        return torch.repeat_interleave(torch.arange(self.blocks, device=device), self.lengths.to(device))

    def starts_on(self, device) -> torch.Tensor:
        """``starts`` on ``device``, kept per device (the one-pass kernels read it)."""
        return self._on(device, "starts", lambda: self.starts)

    def _on(self, device, what: str, make) -> torch.Tensor:
        key = (what, str(torch.device(device)))
        if key not in self._cached:
            self._cached[key] = make().to(device)
        return self._cached[key]

    def span(self, first: int, last: int) -> "BlockLayout":
        """Blocks ``[first, last)`` as a layout of their own (from their first element)."""
        return BlockLayout((), self.block, starts=self.starts[first: last + 1] - self.starts[first])

    def block_span(self, start: int, stop: int) -> Tuple[int, int]:
        """The blocks that elements ``[start, stop)`` make up exactly; a ValueError where an end
        falls inside a block (those elements cannot move without quantizing again)."""
        ends = []
        for end in (start, stop):
            k = int(torch.searchsorted(self.starts, end))
            if k >= self.starts.numel() or int(self.starts[k]) != end:
                raise ValueError(f"element {end} is inside a block of this shard (block {k - 1} starts at "
                                 f"{int(self.starts[k - 1])}): it cannot move without quantizing again")
            ends.append(k)
        return ends[0], ends[1]


def _segment_lengths(param_start: int, length: int, block: int) -> torch.Tensor:
    """Block lengths of one param's elements ``[param_start, param_start + length)``."""
    end = param_start + length
    head = min(end, (param_start // block + 1) * block) - param_start
    full = (length - head) // block
    tail = length - head - full * block
    parts = [torch.tensor([head], dtype=torch.int64), torch.full((full,), block, dtype=torch.int64)]
    if tail:
        parts.append(torch.tensor([tail], dtype=torch.int64))
    return torch.cat(parts)


@dataclass
class Quantized:
    """One moment of one shard: ``codes`` (one per element, ``fmt.dtype``) and ``scales`` (fp32, one per block)."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: CodeFormat

    @classmethod
    def zeros(cls, layout: BlockLayout, fmt: CodeFormat, device="cpu") -> "Quantized":
        return cls(torch.zeros(layout.numel, dtype=fmt.dtype, device=device),
                   torch.zeros(layout.blocks, dtype=torch.float32, device=device), fmt)

    def take(self, layout: BlockLayout, start: int, stop: int) -> "Quantized":
        """Elements ``[start, stop)`` as they are (codes and their blocks' scales, views): what a
        reshard moves where both ends fall on block boundaries (else a ValueError, ``block_span``)."""
        first, last = layout.block_span(start, stop)
        return Quantized(self.codes[start:stop], self.scales[first:last], self.fmt)


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root on every device (through float64, whose rounding
    twice is still correct for fp32 operands)."""
    return x.double().sqrt_().float()


def block_scales(values: torch.Tensor, layout: BlockLayout, qmax: float) -> torch.Tensor:
    """``absmax / qmax`` per block of ``values`` (fp32; the values coded, i.e. the root for a root format)."""
    index = layout.block_index(values.device)
    absmax = torch.zeros(layout.blocks, dtype=torch.float32, device=values.device)
    absmax.scatter_reduce_(0, index, values.abs(), "amax")
    return absmax / torch.full_like(absmax, qmax)


def encode(values: torch.Tensor, scale_per_element: torch.Tensor, fmt: CodeFormat,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes of ``values`` (fp32, already the root for a root format) under their blocks' scales."""
    q = torch.where(scale_per_element > 0, values / scale_per_element, 0.0).clamp_(-fmt.qmax, fmt.qmax)
    if fmt.integer:
        q = q.add_(ROUNDER).sub_(ROUNDER)
    if out is None:
        return q.to(fmt.dtype)
    return out.copy_(q)


def quantize(x: torch.Tensor, layout: BlockLayout, fmt: CodeFormat, out: Optional[Quantized] = None) -> Quantized:
    """``x`` (fp32, the moment itself) in ``fmt``, block by block of ``layout``."""
    if x.numel() != layout.numel:
        raise ValueError(f"quantize: {x.numel()} elements for a layout of {layout.numel}")
    values = ieee_sqrt(x) if fmt.root else x
    return _quantize_values(values, layout, fmt, out)


def _quantize_values(values, layout, fmt, out: Optional[Quantized]) -> Quantized:
    scales = block_scales(values, layout, fmt.qmax)
    per_element = scales[layout.block_index(values.device)]
    if out is None:
        return Quantized(encode(values, per_element, fmt), scales, fmt)
    encode(values, per_element, fmt, out=out.codes)
    out.scales.copy_(scales)
    return out


def dequantize(q: Quantized, layout: BlockLayout) -> torch.Tensor:
    """The fp32 moment ``q`` codes (``code * scale``, squared for a root format)."""
    value = q.codes.float() * q.scales[layout.block_index(q.codes.device)]
    return value * value if q.fmt.root else value


@dataclass(frozen=True)
class StepScalars:
    """One step's fp32 scalars, rounded as ``fused_update`` rounds them."""

    decay: float
    w1: float
    beta2: float
    w2: float
    inv_bc2: float
    eps: float
    neg_step: float

    @property
    def small_lerp(self) -> bool:  # torch's lerp takes the other form for weights of 0.5 and more
        return abs(self.w1) < 0.5

    def as_list(self):
        return [self.decay, self.w1, self.beta2, self.w2, self.inv_bc2, self.eps, self.neg_step]


@functools.lru_cache(maxsize=256)
def step_scalars(hyper: AdamHyper, step: int) -> StepScalars:
    bc1 = 1 - hyper.beta1 ** step
    bc2_sqrt = (1 - hyper.beta2 ** step) ** 0.5
    return StepScalars(f32(1 - hyper.lr * hyper.weight_decay), f32(1 - hyper.beta1), f32(hyper.beta2),
                       f32(1 - hyper.beta2), f32(1.0 / f32(bc2_sqrt)), f32(hyper.eps), f32(-(hyper.lr / bc1)))


TAKES_REMAINDERS = True  # ``high``: a master stored as remainders (merged before, split after)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
               layout: BlockLayout, hyper: AdamHyper, step: int, param_out: Optional[torch.Tensor] = None,
               high: Optional[torch.Tensor] = None) -> None:
    """One AdamW step (``step`` counts from 1) on an fp32 ``master`` with 8-bit moments, all in place:
    dequantize, the fp32 AdamW (``fused_update``'s arithmetic with no fused multiply-adds and the
    reciprocal of the bias correction's root), quantize again. ``param_out`` (any float dtype)
    receives the updated master cast to nearest even. ``high``: ``master`` is the int16 remainders of
    the fp32 master whose bf16 high halves ``high`` holds (``remainders``); both are updated."""
    if high is not None:
        wide = merge(high, master)
        adamw_step(wide, grad, exp_avg, exp_avg_sq, layout, hyper, step)
        split_(wide, master, high)
        return
    for name, t in (("master", master), ("grad", grad)):
        if t.dtype != torch.float32 or t.numel() != layout.numel:
            raise ValueError(f"adamw_step: {name} must be fp32 with {layout.numel} elements "
                             f"(got {t.dtype}, {t.numel()})")
    m, v, root = adamw_fp32(master, grad, dequantize(exp_avg, layout), dequantize(exp_avg_sq, layout),
                            step_scalars(hyper, step), hyper.weight_decay != 0)
    _quantize_values(m, layout, exp_avg.fmt, exp_avg)
    _quantize_values(root if exp_avg_sq.fmt.root else v, layout, exp_avg_sq.fmt, exp_avg_sq)
    if param_out is not None:
        param_out.copy_(master)


def adamw_step_model(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
                     layout: BlockLayout, hyper: AdamHyper, step: int, high: Optional[torch.Tensor],
                     model: ModelPass, step_fn=None) -> None:
    """``adamw_step`` (or ``step_fn``, one of its twins) on the model's own buffers, in passes: the
    model's grads (any training dtype) converted to fp32 as ``update.convert_grads`` does (unscale,
    then the clip coefficient), the step (``high``: the model's bf16 params, a remainders master's
    high halves, updated in place), then the grads zeroed where ``model.zero_grad`` and an fp32
    master's update cast into ``model.param_out``. What the device's one pass must equal."""
    from .update import convert_grads

    wide = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
    convert_grads(grad, wide, model.unscale, model.clip_coef)
    (step_fn or adamw_step)(master, wide, exp_avg, exp_avg_sq, layout, hyper, step,
                            **({} if high is None else {"high": high}))
    if model.zero_grad:
        grad.zero_()
    if model.param_out is not None and high is None:
        model.param_out.copy_(master)


def adamw_fp32(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: StepScalars,
               decay: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp32 AdamW arithmetic, op by op as the one-pass kernels do it: ``master`` updated in
    place; returns the new moments and ``sqrt`` of the second (a root format stores it)."""
    if decay:
        master.mul_(s.decay)
    d = grad - m
    m = m + d * s.w1 if s.small_lerp else grad - d * f32(1.0 - s.w1)
    v = v * s.beta2 + (grad * grad) * s.w2
    root = ieee_sqrt(v)
    denom = root * s.inv_bc2 + s.eps
    master.add_((m / denom) * s.neg_step)
    return m, v, root


def shard_state(layout: BlockLayout, scheme: Scheme, device="cpu") -> Tuple[Quantized, Quantized]:
    """Both moments of a fresh shard (zeros)."""
    return tuple(Quantized.zeros(layout, fmt, device) for fmt in scheme.formats)


def segments_of(sizes: Sequence[int]) -> Tuple[Tuple[int, int, int], ...]:
    """The segments of a shard that holds whole params of ``sizes``, in order."""
    out, at = [], 0
    for n in sizes:
        out.append((at, 0, n))
        at += n
    return tuple(out)
