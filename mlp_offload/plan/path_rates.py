"""The update paths side by side: elements/s of the multi-pass and the one-pass update, on the CPU and
(on CUDA) on the device, resident and streamed, for one set of stored-state formats. For benchmarks and
diagnostics; the engine measures only the path it uses (``rates``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels.cpu_one_pass import verified_cpu_one_pass
from ..step.device_side import DeviceKernel, DeviceUpdate
from ..kernels.fused_update import verified_fused_update
from ..kernels.update import AdamKernel
from ..state_formats import StateCodec
from .rates import measure_cpu_update_rate, measure_device_rates

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
