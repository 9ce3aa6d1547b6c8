"""Which update paths an engine runs, chosen once at start-up before its rates are measured (they time them):
the device update (where the device may update anything: a gpu tier, or host state streamed through it),
its one-pass kernel where a sample shows it bit-identical, that kernel on the model's own grads and params
where the sources give views, and the CPU's one pass (in the device kernel's arithmetic on a GPU run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import GPU_TIER, OffloadConfig
from ..kernels.cpu_one_pass import cpu_one_pass_for_device, verified_cpu_one_pass
from ..kernels.fused_update import verified_fused_update
from ..state_formats import StateCodec
from .deferred import DeferredWork
from .device_side import DeviceUpdate


@dataclass
class UpdatePaths:
    device_update: Optional[DeviceUpdate]  # None: the CPU updates everything
    deferred: Optional[DeferredWork]  # defer_device_wait: what a step leaves queued
    cpu_one_pass: object  # the CPU's one-pass kernel, or None (the multi-pass path)
    cpu_one_pass_how: str
    on_model_buffers: bool  # the device's kernel reads the model's grads and writes its params in place


def choose_update_paths(cfg: OffloadConfig, codecs: Sequence[StateCodec], largest: int, adam, device_adam,
                        sources_give_views: bool) -> UpdatePaths:
    """``sources_give_views``: the grad and param sources give ``views`` and params go back to the model
    (``gradients.ModelBuffers``)."""
    device = None
    if GPU_TIER in cfg.tiers or cfg.update_on != "cpu":  # on a CPU run the "device" is the CPU (the twin)
        device = DeviceUpdate(cfg.device, codecs, cfg.device_chunk_elems, largest)
    deferred = DeferredWork(device.streams) if device is not None and cfg.defer_device_wait else None
    if device is not None and cfg.device_one_pass:
        device.fused, device.fused_how = verified_fused_update(cfg.device, codecs, device_adam)
    fused = device.fused if device is not None else None
    if fused is not None and fused.on_model_ok and cfg.device_model_buffers and sources_give_views:
        device.on_model_buffers = True
    cpu_one_pass, how = None, "multi-pass"
    if cfg.cpu_one_pass and fused is not None and cfg.on_cuda:  # the CPU's subgroups get the device's bits
        cpu_one_pass, how = cpu_one_pass_for_device(fused, codecs, cfg.device)
    if cfg.cpu_one_pass and cpu_one_pass is None:
        cpu_one_pass, how = verified_cpu_one_pass(codecs, adam)
    return UpdatePaths(device, deferred, cpu_one_pass, how, device is not None and device.on_model_buffers)
