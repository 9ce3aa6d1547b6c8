"""The update of a subgroup whose Adam moments are stored in 8 bits with block scales
(``state_formats.Blockwise8``): each param group's piece in one pass of the 8-bit kernel, on the
codes and scales where they lie, the master widened to fp32 around it where it is stored narrower
(remainders, fp16, bf16). Both sides run it (the CPU on host state, the device on its own or
streamed state); which kernel runs is chosen once (``choose_kernel``): the compiled one where a
sample gives the torch path's bits on this device, else the torch path (same bits, slower).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..kernels import blockwise8
from ..kernels.blockwise8 import BlockLayout, Quantized
from ..kernels.fused_update import AdamHyper, hyper_of
from ..kernels.remainders import split
from ..state_formats import StateCodec
from ..subgroups.blocks import BlockPiece

log = logging.getLogger("mlp_offload")
Step8 = Callable  # blockwise8.adamw_step's signature


@dataclass(frozen=True)
class EightBitKernel:
    step: Step8
    how: str
    takes_remainders: bool = False  # ``step`` merges and splits a remainders master itself (``high=``)


def choose_kernel(device, codecs: Sequence[StateCodec]) -> EightBitKernel:
    """The 8-bit kernel for ``device``: the CPU's C++ one pass or the device's Triton one, where a
    sample gives the torch path's bits here; else the torch path (one line says why)."""
    device = torch.device(device)
    if device.type == "cuda":
        from ..kernels import blockwise8_device as compiled
        tries = [(compiled.adamw_step, "Triton one pass")]
    else:
        from ..kernels import blockwise8_cpu as compiled
        tries = [(compiled.adamw_step, "C++ one pass")]
    whys = []
    for step, name in tries:
        try:
            if same_bits(step, device, codecs):
                takes = getattr(compiled, "TAKES_REMAINDERS", False) and same_bits(step, device, codecs, True)
                return EightBitKernel(step, f"8-bit {name}", takes)
            whys.append(f"the {name} differs from the torch path on a sample")
        except Exception as err:  # a build or launch failure: the next one, or the torch path, still gives the bits
            whys.append(f"the {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    log.warning("8-bit moments on %s: %s; the torch path runs instead (same bits, slower)", device.type,
                "; ".join(whys))
    return EightBitKernel(blockwise8.adamw_step, "8-bit torch path", True)


def same_bits(step: Step8, device, codecs: Sequence[StateCodec], remainders: bool = False, numel: int = 5000) -> bool:
    """Whether ``step`` gives ``blockwise8.adamw_step``'s bits on a sample of three params over two
    steps (``remainders``: a master stored as int16 remainders beside its bf16 high halves)."""
    layout = BlockLayout([(0, 37, 1000), (1000, 0, 3000), (4000, 200, 1000)], codecs[1].block)
    hyper = AdamHyper(1e-2, 0.9, 0.95, 1e-8, 0.1)
    runs = []
    for fn in (blockwise8.adamw_step, step):
        gen = torch.Generator().manual_seed(8)
        master = torch.randn(numel, generator=gen).to(device)
        rem, high = split(master) if remainders else (master, None)
        m, v = (Quantized.zeros(layout, c.fmt, device) for c in codecs[1:])
        for k in (1, 2):
            grad = (torch.randn(numel, generator=gen) * 10.0 ** -k).to(device)
            fn(rem, grad, m, v, layout, hyper, k, **({"high": high} if remainders else {}))
        runs.append((rem, m.codes.view(torch.uint8), m.scales, v.codes.view(torch.uint8), v.scales,
                     *(() if high is None else (high,))))
    return all(torch.equal(a, b) for a, b in zip(*runs))


class EightBitUpdate:
    """One subgroup's update with 8-bit moments, on ``device``. ``largest``: elements of the
    largest subgroup (the fp32 master's working copy, for a master stored narrower)."""

    def __init__(self, kernel: EightBitKernel, codecs: Sequence[StateCodec], largest: int, device):
        self.kernel, self.codecs, self.device = kernel, list(codecs), torch.device(device)
        self.largest = largest
        self._master: Optional[torch.Tensor] = None  # made at first use

    @property
    def how(self) -> str:
        return self.kernel.how

    @property
    def working_bytes(self) -> int:
        return 0 if self.codecs[0].is_fp32 else self.largest * 4

    def __call__(self, sg, stored: Sequence[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                 pieces: Sequence[BlockPiece], hyper: Callable[[int], AdamHyper], step: int) -> None:
        """``stored``: the subgroup's (master, exp_avg, exp_avg_sq) regions; ``high``: the bf16
        params of a master stored as remainders (updated in place with it)."""
        n, master_codec = sg.numel, self.codecs[0]
        m, v = (c.split(t, n, sg.blocks) for c, t in zip(self.codecs[1:], stored[1:]))
        if master_codec.needs_high and self.kernel.takes_remainders:  # merged and split inside the pass
            for p in pieces:
                self.kernel.step(stored[0][p.lo:p.hi], grad[p.lo:p.hi], _piece(m, p), _piece(v, p), p.layout,
                                 hyper(p.g), step, high=high[p.lo:p.hi])
            return
        if master_codec.is_fp32:
            master = stored[0]
        else:
            if self._master is None:
                self._master = torch.empty(self.largest, dtype=torch.float32, device=self.device)
            master = master_codec.unpack(stored[0], out=self._master[:n], high=high if master_codec.needs_high else None)
        for p in pieces:
            self.kernel.step(master[p.lo:p.hi], grad[p.lo:p.hi], _piece(m, p), _piece(v, p), p.layout,
                             hyper(p.g), step)
        if not master_codec.is_fp32:
            master_codec.pack_(master, stored[0], high=high if master_codec.needs_high else None)

    def whole(self, stored, grad, high, hyper: AdamHyper, step: int) -> None:
        """The one-pass kernels' signature over one param's ``stored`` regions (the rate probes)."""
        n = grad.numel()
        layout = BlockLayout.whole(n, self.codecs[1].block)
        from ..subgroups.partition import Subgroup
        sg = Subgroup(0, 0, n, tuple(self.codecs), layout.blocks)
        self(sg, stored, grad, high, [BlockPiece(0, n, 0, 0, layout.blocks, layout)], lambda g: hyper, step)


def _piece(q: Quantized, p: BlockPiece) -> Quantized:
    return Quantized(q.codes[p.lo:p.hi], q.scales[p.first:p.last], q.fmt)


def hyper_for(groups) -> Callable[[int], AdamHyper]:
    return lambda g: hyper_of(groups[g])
