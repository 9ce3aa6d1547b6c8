"""The update paths' rates. The device update's, as the start-up measures them: resident and streamed
(``measure_device_rates``), and beside the CPU's update (``measure_shared_rates``). And every path side
by side (``measure_update_paths``): elements/s of the multi-pass and the one-pass update, on the CPU
and (on CUDA) on the device, resident and streamed, for one set of stored-state formats, for benchmarks
and diagnostics; the engine measures only the path it uses."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..gradients import HostGradients, ModelBuffers
from ..kernels.blockwise8 import BlockLayout
from ..kernels.cpu_one_pass import verified_cpu_one_pass
from ..kernels.fused_update import verified_fused_update
from ..kernels.remainders import HostParamHigh
from ..kernels.update import AdamKernel, Fp32Working
from ..plan.rates import best_of, measure_cpu_update_rate, measuring_hyper
from ..state_formats import StateCodec
from ..subgroups.blocks import BlockPiece
from ..subgroups.partition import Subgroup
from .device_side import DeviceIO, DeviceJob, DeviceKernel, DeviceUpdate

NAN = float("nan")


@dataclass
class PathRates:
    cpu_multi: float
    cpu_one: float
    cpu_how: str
    device_multi: Optional[tuple] = None  # (resident, streamed)
    device_one: Optional[tuple] = None
    device_on_model: Optional[tuple] = None  # the one pass on the model's own grads and params
    device_how: str = ""

    def describe(self, threads: int) -> str:
        line = (f"CPU ({threads} threads) multi-pass {self.cpu_multi / 1e9:.3f} G elem/s; one pass "
                f"{self.cpu_one / 1e9:.3f} ({self.cpu_how})")
        if self.device_multi is not None:
            (rm, sm), (ro, so) = self.device_multi, self.device_one
            line += (f"\n  device: multi-pass resident {rm / 1e9:.2f} G elem/s, streamed {sm / 1e9:.2f}; one pass "
                     f"resident {ro / 1e9:.2f}, streamed {so / 1e9:.2f} ({self.device_how})")
            if self.device_on_model is not None:
                rd, sd = self.device_on_model
                line += f"; on the model's buffers resident {rd / 1e9:.2f}, streamed {sd / 1e9:.2f}"
        return line


def measure_update_paths(codecs: Sequence[StateCodec], numel: int) -> PathRates:
    """Both paths on the CPU (torch's single-tensor kernel as the reference), and on CUDA where there
    is a device (torch's foreach kernel, the engine's device kernel there)."""
    cpu_kernel = AdamKernel("single")
    step = lambda p, g, m, v, step: cpu_kernel(p, g, m, v, step=step)  # noqa: E731
    multi = measure_cpu_update_rate(step, codecs, numel, repeats=2)
    one_pass, how = verified_cpu_one_pass(codecs, cpu_kernel)
    one = measure_cpu_update_rate(step, codecs, numel, repeats=2, one_pass=one_pass) if one_pass else NAN
    rates = PathRates(multi, one, how)
    if not torch.cuda.is_available():
        return rates
    kernel = AdamKernel("foreach")
    device_step = lambda p, g, m, v, step: kernel(p, g, m, v, step=step)  # noqa: E731
    rates.device_multi = _device_rates(DeviceKernel(), device_step, codecs, numel)
    fused, rates.device_how = verified_fused_update("cuda", codecs, kernel)
    rates.device_one = (_device_rates(DeviceKernel(fused, rates.device_how), device_step, codecs, numel)
                        if fused is not None else (NAN, NAN))
    if fused is not None and fused.on_model_ok:
        rates.device_on_model = _device_rates(DeviceKernel(fused, rates.device_how, True), device_step, codecs, numel)
    return rates


def _device_rates(kernel: DeviceKernel, device_step, codecs: Sequence[StateCodec], numel: int) -> tuple:
    """(resident, streamed) rates of a device update built with ``kernel``; its buffers freed after."""
    updater = DeviceUpdate("cuda", codecs, numel, numel, kernel)
    rates = measure_device_rates(updater, device_step, codecs, numel)
    del updater
    torch.cuda.empty_cache()
    return rates


def measure_device_rates(updater, adam_step, codecs, numel: int, repeats: int = 2):
    """(resident, streamed) elements/s of ``updater`` (a ``DeviceUpdate``): Adam on state in device
    memory, and on host state streamed through it (copies overlapped), in the real stored formats.
    On the CPU twin both are CPU figures."""
    sg = Subgroup(0, 0, numel, tuple(codecs))
    pin = updater.device.type == "cuda"
    host = [c.empty(numel, pin_memory=pin).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    dev = [t.to(updater.device) for t in host]
    segments = [(0, numel, 0, (0, numel))]

    def adam(p, g, m, v, group, span, step=[0]):
        step[0] += 1
        adam_step(p, g, m, v, step=step[0])

    # What a step does around each subgroup's Adam on the device: its grads cast from the model's
    # bf16 grad buffer, its bf16 high halves read from the model's params, its updated params
    # written back there (fills instead of these copies made the resident rate read well above what
    # the steps ran).
    grads16 = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=updater.device)
    params16 = torch.full((numel,), 0.5, dtype=torch.bfloat16, device=updater.device)
    remainders = codecs[0].needs_high
    out_dtype = torch.bfloat16 if remainders else codecs[0].storage_dtype
    params_out = torch.empty(numel, dtype=out_dtype, device=updater.device)

    def params_back(start, end, params):
        params_out[start:end].copy_(params)

    # Or, with the one-pass kernel on the model's buffers, those same two tensors read and written in place.
    model = _probe_model(updater, grads16, params16 if remainders else params_out)

    io = DeviceIO(lambda out: out.copy_(grads16[: out.numel()]), adam, params_back,
                  lambda start, end, out: out.copy_(params16[start:end]), hyper=measuring_hyper, step=1, model=model)

    pieces = whole_param_pieces(updater, numel)

    def run_k(stored, resident, k):
        def once(_):
            for _ in range(k):
                fence = updater.update(DeviceJob(sg, stored, resident, segments, pieces=pieces), io)
            fence.synchronize()
        return best_of(once, repeats)

    # Subgroups back to back, as a step issues them, and the steady rate from two run lengths: a
    # run's first copy-in and last copy-out overlap nothing, which three in a row counted a third
    # of (the streamed rate then read below what the steps streamed).
    def run(stored, resident):
        short, long = run_k(stored, resident, 1), run_k(stored, resident, 4)
        return 3 * numel / max(long - short, 1e-9) if long > short else 4 * numel / long
    return run(dev, True), run(host, False)


def whole_param_pieces(updater, numel: int):
    """A probe's subgroup as one param's blocks, where ``updater`` runs 8-bit moments (else none)."""
    if updater.eight_bit is None:
        return ()
    layout = BlockLayout.whole(numel, updater.codecs[1].block)
    return (BlockPiece(0, numel, 0, 0, layout.blocks, layout),)


def _probe_model(updater, grads: torch.Tensor, params: torch.Tensor):
    """The model's buffers for a probe of ``updater``: ``grads`` and ``params`` where it uses them in
    place (``on_model_buffers``), else None."""
    if not updater.on_model_buffers:
        return None
    return ModelBuffers(HostGradients(grads), HostParamHigh(params))


def measure_shared_rates(updater, cpu_step, adam_step, codecs, numel: int, piece: int = 1 << 21,
                         cpu_one_pass=None):
    """(CPU, streamed) elements/s while both run at once, as a split step runs them: the device
    streams host state through ``updater`` while the CPU runs ``cpu_step(p, g, m, v, step)`` (its
    Adam with the widening; or ``cpu_one_pass``, where the update runs that) piece by piece, and the CPU's grads come down and its params go up
    over PCIe on a side stream, as the Megatron adapter's path moves them. None on a CPU run:
    there the "device" is the same cores, nothing runs beside anything."""
    if updater.device.type != "cuda":
        return None
    sg = Subgroup(0, 0, numel, tuple(codecs))
    host = [c.empty(numel, pin_memory=True).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    segments = [(0, numel, 0, (0, numel))]
    piece = min(piece, numel)
    cpu_state = [c.empty(piece).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    cpu_working = Fp32Working(codecs, piece)
    # What crosses PCIe for a CPU-updated piece: fp32 grads down; with remainders its bf16 params
    # down (the high halves) and up, else the stored master up.
    high = torch.empty(piece, dtype=torch.bfloat16, pin_memory=True).fill_(0.5) if cpu_working.remainders else None
    up_dtype = torch.bfloat16 if cpu_working.remainders else codecs[0].storage_dtype
    grads_host = torch.empty(piece, pin_memory=True)
    params_host = torch.empty(piece, dtype=up_dtype, pin_memory=True)
    grads_dev = torch.full((piece,), 1e-3, device=updater.device)
    params_dev = torch.full((piece,), 0.5, dtype=up_dtype, device=updater.device)
    stream_model = _probe_model(updater, torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=updater.device),
                                torch.full((numel,), 0.5, dtype=up_dtype, device=updater.device))
    side = torch.cuda.Stream(updater.device)
    in_a_row = 8  # long enough that the CPU's pieces (~1 ms each) time it within a few percent

    def adam(p, g, m, v, group, span, step=[0]):
        step[0] += 1
        adam_step(p, g, m, v, step=step[0])

    stream_io = DeviceIO(lambda out: out.fill_(1e-3), adam, None, lambda start, end, out: out.fill_(0.5),
                         hyper=measuring_hyper, step=1, model=stream_model)
    best = None
    for attempt in range(3):  # the first warms up threads, pages and kernels
        torch.cuda.synchronize(updater.device)
        start = time.perf_counter()
        for _ in range(in_a_row):
            fence = updater.update(DeviceJob(sg, host, False, segments, pieces=whole_param_pieces(updater, numel)),
                                   stream_io)
        cpu_elems, step = 0, 0
        while not fence.query():
            with torch.cuda.stream(side):  # the CPU path's PCIe traffic: its grads down, its params up
                grads_host.copy_(grads_dev, non_blocking=True)
                if high is not None:
                    high.copy_(params_dev, non_blocking=True)
            side.synchronize()
            step += 1
            if cpu_one_pass is not None:
                cpu_one_pass(cpu_state, grads_host, high, measuring_hyper(0), step)
            else:
                wide = cpu_working.widen(cpu_state, high)
                cpu_step(wide[0], grads_host, wide[1], wide[2], step=step)
                cpu_working.round_back(cpu_state, wide, high)
            with torch.cuda.stream(side):
                params_host.copy_(high if high is not None else cpu_state[0])
                params_dev.copy_(params_host, non_blocking=True)
            cpu_elems += piece
        seconds = max(time.perf_counter() - start, 1e-9)
        if attempt and cpu_elems:
            rates = (cpu_elems / seconds, in_a_row * numel / seconds)
            best = rates if best is None or rates[1] > best[1] else best
    side.synchronize()
    return best
