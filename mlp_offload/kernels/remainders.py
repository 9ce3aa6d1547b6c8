"""Lossless 16-bit master remainders (megatron-core's ``store_param_remainders``).

The fp32 master of a bf16 model keeps only its low 16 bits (an int16 "remainder"); its high 16 bits
are the bf16 param the model already holds. Split, as transformer-engine's FusedAdam does it: the
bf16 bits are the master's high half, plus one where the remainder is negative (low half >= 0x8000:
rounds half away from zero in magnitude, where ``Tensor.to(bfloat16)`` rounds ties to even); merge
undoes it. Exact for every fp32 bit pattern whose high half is not a NaN's: 2 bytes per param
instead of 4 in every tier, transfer and checkpoint.

Plain int32 tensor ops, so the same code runs on the CPU and on CUDA.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple

import torch

_HALF = 1 << 15


def split(master: torch.Tensor, rem_out: Optional[torch.Tensor] = None,
          high_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (int16 remainders, bf16 params); into the given tensors where given."""
    rem_out = torch.empty(master.shape, dtype=torch.int16, device=master.device) if rem_out is None else rem_out
    high_out = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device) if high_out is None else high_out
    split_(master.clone(), rem_out, high_out)
    return rem_out, high_out


def split_(master: torch.Tensor, rem_out: torch.Tensor, high_out: torch.Tensor) -> None:
    """``split`` into ``rem_out`` and ``high_out``, using ``master``'s memory as scratch (it is
    garbage after): one int32 temporary, for the update's subgroup-sized calls."""
    bits = master.view(torch.int32)
    # Adding 0x8000 carries into the high half exactly where the low half is >= 0x8000; an
    # arithmetic shift keeps the sign, so this is the bf16 bits as a signed 16-bit value.
    high = (bits + _HALF).bitwise_right_shift_(16)
    high_out.view(torch.int16).copy_(high)
    bits.add_(high, alpha=-(1 << 16))  # the low half, in [-0x8000, 0x7fff] (int32 wraps as it must)
    rem_out.copy_(bits)


def merge(high: torch.Tensor, rem: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 params ``high`` and int16 remainders ``rem`` -> the fp32 master (into ``out`` if given)."""
    out = torch.empty(rem.shape, dtype=torch.float32, device=rem.device) if out is None else out
    bits = out.view(torch.int32)
    bits.copy_(high.view(torch.int16))  # sign-extended
    bits.bitwise_left_shift_(16).add_(rem)
    return out


def round_half_away(master: torch.Tensor) -> torch.Tensor:
    """The bf16 param the model holds for an fp32 master when remainders are stored."""
    return split(master)[1]


class ParamHighSource(Protocol):
    """The model's bf16 params (the masters' high halves), by element range of the shard."""

    def fill(self, start: int, end: int, out: torch.Tensor) -> None:
        """Write elements [start, end) into ``out``, a host tensor; done when this returns."""

    def to_device(self, start: int, end: int, out: torch.Tensor) -> None:
        """Write them into ``out`` on the update's device, in the current stream's order."""

    # Optional (``gradients.ModelBuffers``): ``views(start, end)``, the params of [start, end) where
    # the model keeps them, as (flat start, flat end, view) pieces.


class HostParamHigh:
    """The params in one bf16 tensor on the update's device (the CPU on a CPU run)."""

    def __init__(self, params: torch.Tensor):
        self.params = params

    def fill(self, start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(self.params[start:end])

    def to_device(self, start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(self.params[start:end])

    def views(self, start: int, end: int):
        yield start, end, self.params[start:end]


OnParams = Callable[[int, int, torch.Tensor], object]


class RemainderMaster:
    """Whole-state access (checkpoints, edits) to masters stored as remainders: callers see the
    fp32 master, merged with the model's params on the way out; on the way in it is split and the
    model's params are set from its high halves (the master is the truth: a master loaded from
    elsewhere may round to another bf16 than the model checkpoint's, which rounds ties to even)."""

    def __init__(self, source: ParamHighSource, on_params: OnParams, largest: int):
        self.source = source
        self.on_params = on_params
        self.high = torch.empty(largest, dtype=torch.bfloat16)
        self.master = torch.empty(largest, dtype=torch.float32)

    def widen(self, start: int, end: int, rem: torch.Tensor) -> torch.Tensor:
        """The fp32 master of elements [start, end), valid until the next call."""
        high = self.high[: end - start]
        self.source.fill(start, end, high)
        return merge(high, rem, out=self.master[: end - start])

    def scratch(self, numel: int) -> torch.Tensor:
        return self.master[:numel]

    def store(self, start: int, end: int, master: torch.Tensor, rem: torch.Tensor) -> None:
        """Split ``master`` (spent) into ``rem`` and the model's params of [start, end)."""
        high = self.high[: end - start]
        split_(master, rem, high)
        fence = self.on_params(start, end, high)
        if fence is not None:  # the high buffer is reused at once
            fence.synchronize()
