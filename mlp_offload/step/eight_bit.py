"""The update of a subgroup whose Adam moments are stored in 8 bits with block scales
(``state_formats.Blockwise8``): each param group's piece in one pass of the 8-bit kernel, on the
codes and scales where they lie, the master widened to fp32 around it where it is stored narrower
(remainders, fp16, bf16). Both sides run it (the CPU on host state, the device on its own or
streamed state); which kernel runs is chosen once (``choose_kernel``): the compiled one where a
sample gives the torch path's bits on this device, else the torch path (same bits, slower).

On the device, where the sources give the model's buffers (``gradients.ModelBuffers``), one pass
reads the model's grads and writes its params in place (``model_step``, ``run_on_model``): a
remainders master is merged from and split into the model's bf16 params inside the kernel, and no
fp32 grad, bf16 param or fp32 master copy is made (about 16 bytes an element instead of 44).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..kernels import blockwise8
from ..kernels.blockwise8 import BlockLayout, Quantized
from ..kernels.fused_update import AdamHyper, ModelPass, hyper_of
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
    # ``blockwise8.adamw_step_model``'s signature: the step on the model's own grads and params (the
    # device's one pass where a sample gives the reference's bits; the reference around ``step`` elsewhere)
    on_model: Optional[Callable] = None


@dataclass(frozen=True)
class ModelLaunch:
    """One call of the kernel on the model's buffers: ``piece``, the part of a param-group piece (its
    elements and blocks in the subgroup) where one of the model's buffers lies, and its grads and params."""
    piece: BlockPiece
    grad: torch.Tensor
    param: torch.Tensor


@dataclass(frozen=True)
class ModelStep:
    """A subgroup's launches on the model's buffers, and the grads of its padding (no param group) that
    a read would zero."""
    launches: List[ModelLaunch]
    padding: List[torch.Tensor]


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
                return EightBitKernel(step, f"8-bit {name}", takes, _on_model_kernel(compiled, step, takes, device,
                                                                                   codecs))
            whys.append(f"the {name} differs from the torch path on a sample")
        except Exception as err:  # a build or launch failure: the next one, or the torch path, still gives the bits
            whys.append(f"the {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    log.warning("8-bit moments on %s: %s; the torch path runs instead (same bits, slower)", device.type,
                "; ".join(whys))
    return EightBitKernel(blockwise8.adamw_step, "8-bit torch path", True, blockwise8.adamw_step_model)


def _on_model_kernel(compiled, step: Step8, takes_remainders: bool, device, codecs) -> Optional[Callable]:
    """The step on the model's buffers: the compiled module's own one pass where it has one and a sample
    gives the reference's bits (else None: the device goes through copies, one line says why); on a
    device without one (the CPU), the reference's passes around ``step``."""
    one_pass = getattr(compiled, "adamw_step_model", None)
    if one_pass is None:
        return functools.partial(blockwise8.adamw_step_model,
                                 step_fn=step if takes_remainders else blockwise8.adamw_step)
    try:
        if all(same_bits_on_model(one_pass, device, codecs, rem) for rem in (False, True)):
            return one_pass
        why = "differs from the reference on a sample"
    except Exception as err:  # a build or launch failure: the copies still give the bits
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    log.warning("8-bit moments on %s: the one pass on the model's buffers %s; through copies of the grads and "
                "params instead", torch.device(device).type, why)
    return None


SAMPLE_SEGMENTS = ((0, 37, 1000), (1000, 0, 3000), (4000, 200, 1000))  # three params, two cut by the shard
SAMPLE_HYPER = AdamHyper(1e-2, 0.9, 0.95, 1e-8, 0.1)


def same_bits(step: Step8, device, codecs: Sequence[StateCodec], remainders: bool = False, numel: int = 5000) -> bool:
    """Whether ``step`` gives ``blockwise8.adamw_step``'s bits on a sample of three params over two
    steps (``remainders``: a master stored as int16 remainders beside its bf16 high halves)."""
    return _same_outputs((blockwise8.adamw_step, step), device, codecs, remainders, numel, on_model=False)


def same_bits_on_model(one_pass: Callable, device, codecs: Sequence[StateCodec], remainders: bool,
                       numel: int = 5000) -> bool:
    """Whether ``one_pass`` gives ``blockwise8.adamw_step_model``'s bits (with the torch path) on the
    sample of ``same_bits``, on bf16 grads unscaled, clipped and zeroed: master, codes, scales, the
    model's params (a remainders master's high halves, else the cast of the fp32 master) and grads."""
    return _same_outputs((blockwise8.adamw_step_model, one_pass), device, codecs, remainders, numel, on_model=True)


def _same_outputs(fns, device, codecs: Sequence[StateCodec], remainders: bool, numel: int, on_model: bool) -> bool:
    """Whether both of ``fns`` leave the same bits in everything they write, from the same sample."""
    layout = BlockLayout(SAMPLE_SEGMENTS, codecs[1].block)
    runs = []
    for fn in fns:
        gen = torch.Generator().manual_seed(8)
        master = torch.randn(numel, generator=gen).to(device)
        rem, high = split(master) if remainders else (master, None)
        params = high if remainders else torch.zeros(numel, dtype=torch.bfloat16, device=device)
        m, v = (Quantized.zeros(layout, c.fmt, device) for c in codecs[1:])
        written = [rem, m.codes, m.scales, v.codes, v.scales, *(() if high is None else (high,))]
        for k in (1, 2):
            grad = torch.randn(numel, generator=gen) * 10.0 ** -k
            if on_model:
                grad = grad.to(torch.bfloat16).to(device)
                fn(rem, grad, m, v, layout, SAMPLE_HYPER, k, high,
                   ModelPass(1 / 1024, 0.7, True, None if remainders else params))
                written.append(grad)  # zeroed after its read
            else:
                fn(rem, grad.to(device), m, v, layout, SAMPLE_HYPER, k, **({"high": high} if remainders else {}))
        runs.append(written + ([] if remainders or not on_model else [params]))
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*runs))


class EightBitUpdate:
    """One subgroup's update with 8-bit moments, on ``device``. ``largest``: elements of the
    largest subgroup (the fp32 master's working copy, for a master stored narrower)."""

    def __init__(self, kernel: EightBitKernel, codecs: Sequence[StateCodec], largest: int, device):
        self.kernel, self.codecs, self.device = kernel, list(codecs), torch.device(device)
        self.largest = largest
        self._master: Optional[torch.Tensor] = None  # made at first use
        self._spans = {}  # (subgroup, lo, hi) -> the part of a piece the model's buffers cut (its layout kept)

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

    @property
    def on_model(self) -> bool:
        """Whether it can update on the model's own grads and params: a one pass there, and a master
        stored in fp32 (the model's param gets its cast) or as remainders (the param is its high half)."""
        master = self.codecs[0]
        return self.kernel.on_model is not None and (master.is_fp32 or master.kernel_key == "rem16")

    def model_step(self, sg, pieces: Sequence[BlockPiece], model) -> Optional[ModelStep]:
        """Subgroup ``sg``'s launches on the model's buffers (``gradients.ModelBuffers``): each of its
        param-group pieces cut where the model's buffers are; None where a cut falls inside a block
        (the subgroup then goes through copies)."""
        base, launches, padding = sg.start, [], []
        for lo, hi, grad, param in model.pieces(sg.start, sg.end):
            covered = lo
            for p in pieces:
                a, b = max(lo, base + p.lo), min(hi, base + p.hi)
                if a >= b:
                    continue
                part = self._part(sg.index, p, a - base - p.lo, b - base - p.lo)
                if part is None:
                    return None
                if covered < a:
                    padding.append(grad[covered - lo: a - lo])
                launches.append(ModelLaunch(part, grad[a - lo: b - lo], param[a - lo: b - lo]))
                covered = b
            if covered < hi:
                padding.append(grad[covered - lo:])
        return ModelStep(launches, padding)

    def _part(self, index: int, p: BlockPiece, x: int, y: int) -> Optional[BlockPiece]:
        """Elements ``[x, y)`` of piece ``p`` as a piece of their own (its blocks in the subgroup, its
        layout kept: the starts are copied to the device once), or None where an end cuts a block."""
        if x == 0 and y == p.hi - p.lo:
            return p
        key = (index, p.lo + x, p.lo + y)
        if key not in self._spans:
            try:
                f, l = p.layout.block_span(x, y)
            except ValueError:
                return None
            self._spans[key] = BlockPiece(p.lo + x, p.lo + y, p.g, p.first + f, p.first + l, p.layout.span(f, l))
        return self._spans[key]

    def run_on_model(self, sg, stored: Sequence[torch.Tensor], plan: ModelStep, hyper: Callable[[int], AdamHyper],
                     step: int, grad_scale: Tuple[Optional[float], Optional[float]], zero_grads: bool) -> None:
        """``plan``'s launches on the subgroup's ``stored`` regions (master or remainders, exp_avg,
        exp_avg_sq): the model's grads read (times ``grad_scale``: unscale, clip coefficient) and, with
        ``zero_grads``, zeroed, with the padding's; its params written."""
        m, v = (c.split(t, sg.numel, sg.blocks) for c, t in zip(self.codecs[1:], stored[1:]))
        remainders = self.codecs[0].needs_high
        for L in plan.launches:
            pass_ = ModelPass(grad_scale[0], grad_scale[1], zero_grads, None if remainders else L.param)
            p = L.piece
            self.kernel.on_model(stored[0][p.lo:p.hi], L.grad, _piece(m, p), _piece(v, p), p.layout, hyper(p.g), step,
                                 L.param if remainders else None, pass_)
        if zero_grads:
            for grad in plan.padding:
                grad.zero_()

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
