"""Which update paths an engine runs, chosen once at start-up before its rates are measured (they time them):
the device update (where the device may update anything: a gpu tier, or host state streamed through it),
its one-pass kernel where a sample shows it bit-identical, that kernel on the model's own grads and params
where the sources give views, and the CPU's one pass (in the device kernel's arithmetic on a GPU run).
The one place that decides them: both sides are built complete from this decision (nothing set after)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..config import GPU_TIER, OffloadConfig
from ..kernels.cpu_one_pass import cpu_one_pass_for_device, verified_cpu_one_pass
from ..kernels.fused_update import verified_fused_update
from ..kernels.update import AdamKernel
from ..state_formats import StateCodec, is_blockwise
from .deferred import DeferredWork
from .device_side import MULTI_PASS, DeviceKernel, DeviceUpdate
from .eight_bit import EightBitUpdate, choose_kernel


@dataclass(frozen=True)
class UpdatePaths:
    adam: AdamKernel  # the CPU's multi-pass kernel (also what its rate is measured with)
    device_adam: AdamKernel  # the device's multi-pass kernel
    device_update: Optional[DeviceUpdate]  # None: the CPU updates everything
    deferred: Optional[DeferredWork]  # defer_device_wait: what a step leaves queued
    cpu_one_pass: Optional[Callable]  # the CPU's one-pass kernel, or None (the multi-pass path)
    cpu_one_pass_how: str
    cpu_eight_bit: Optional[EightBitUpdate] = None  # 8-bit moments: the CPU's update (then also ``cpu_one_pass``)

    @property
    def device_type(self) -> Optional[str]:
        """Where the device update runs ("cuda", or "cpu" on the CPU twin); None without one."""
        return None if self.device_update is None else self.device_update.device.type

    @property
    def on_model_buffers(self) -> bool:
        """The device's kernel reads the model's grads and writes its params in place."""
        return self.device_update is not None and self.device_update.on_model_buffers


def choose_update_paths(cfg: OffloadConfig, codecs: Sequence[StateCodec], largest: int, adam: AdamKernel,
                        device_adam: AdamKernel, sources_give_views: bool,
                        largest_blocks: Optional[int] = None) -> UpdatePaths:
    """``adam``, ``device_adam``: the CPU's and the device's multi-pass kernels (``update.AdamKernel``);
    ``sources_give_views``: the grad and param sources give ``views`` and params go back to the model
    (``gradients.ModelBuffers``)."""
    if is_blockwise(codecs):
        return _eight_bit_paths(cfg, codecs, largest, adam, device_adam, largest_blocks, sources_give_views)
    if GPU_TIER not in cfg.tiers and cfg.update_on == "cpu":  # on a CPU run the "device" is the CPU (the twin)
        return UpdatePaths(adam, device_adam, None, None, *_cpu_one_pass(cfg, codecs, adam, None))
    kernel = _device_kernel(cfg, codecs, device_adam, sources_give_views)
    device = DeviceUpdate(cfg.device, codecs, cfg.device_chunk_elems, largest, kernel)
    deferred = DeferredWork(device.streams) if cfg.defer_device_wait else None
    return UpdatePaths(adam, device_adam, device, deferred, *_cpu_one_pass(cfg, codecs, adam, kernel.fused))


def _eight_bit_paths(cfg: OffloadConfig, codecs: Sequence[StateCodec], largest: int, adam, device_adam,
                     largest_blocks: Optional[int], sources_give_views: bool) -> UpdatePaths:
    """8-bit moments: every side runs the 8-bit kernels (``eight_bit``), whatever the one-pass settings;
    the CPU's doubles as its one-pass kernel for the rate probes. The device's on the model's own grads
    and params where its kernel has that pass and the sources give views (else through copies)."""
    cpu = EightBitUpdate(choose_kernel("cpu", codecs), codecs, largest, "cpu")
    if GPU_TIER not in cfg.tiers and cfg.update_on == "cpu":
        return UpdatePaths(adam, device_adam, None, None, cpu.whole, cpu.how, cpu)
    on_device = cpu if torch.device(cfg.device).type == "cpu" else EightBitUpdate(
        choose_kernel(cfg.device, codecs), codecs, largest, cfg.device)
    on_model = on_device.on_model and cfg.device_model_buffers and sources_give_views
    device = DeviceUpdate(cfg.device, codecs, cfg.device_chunk_elems, largest,
                          DeviceKernel(None, on_device.how + ("; on the model's buffers" if on_model else ""),
                                       on_model),
                          eight_bit=on_device, largest_blocks=largest_blocks)
    deferred = DeferredWork(device.streams) if cfg.defer_device_wait else None
    return UpdatePaths(adam, device_adam, device, deferred, cpu.whole, cpu.how, cpu)


def _device_kernel(cfg: OffloadConfig, codecs: Sequence[StateCodec], device_adam,
                   sources_give_views: bool) -> DeviceKernel:
    if not cfg.device_one_pass:
        return MULTI_PASS
    fused, how = verified_fused_update(cfg.device, codecs, device_adam)
    on_model = fused is not None and fused.on_model_ok and cfg.device_model_buffers and sources_give_views
    return DeviceKernel(fused, how, bool(on_model))


def _cpu_one_pass(cfg: OffloadConfig, codecs: Sequence[StateCodec], adam, device_fused):
    """(the CPU's one-pass kernel or None, how it updates): on a GPU run in the device kernel's
    arithmetic (the CPU's subgroups get the device's bits), else verified against ``adam``."""
    if not cfg.cpu_one_pass:
        return None, "multi-pass"
    one_pass, how = None, "multi-pass"
    if device_fused is not None and cfg.on_cuda:
        one_pass, how = cpu_one_pass_for_device(device_fused, codecs, cfg.device)
    if one_pass is None:
        one_pass, how = verified_cpu_one_pass(codecs, adam)
    return one_pass, how
