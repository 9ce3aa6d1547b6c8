"""The device's fields of ``OffloadConfig`` checked together: the gpu tier's size or auto mode, its margin, the
update side, the device kernels, the CPU's share under the overlap, the read-ahead and the given device rates."""

from __future__ import annotations

from ..tiers.kinds import DEVICE_MEMORY, HOST_MEMORY
from .checks import OffloadConfigError, is_int, positive, positive_finite

GPU_TIER, HOST_TIER = DEVICE_MEMORY.name, HOST_MEMORY.name
UPDATE_SIDES = ("cpu", "device", "auto")


def check_device_fields(cfg) -> None:
    """The device's fields of ``cfg`` (an ``OffloadConfig``) against each other and its tiers."""
    gpu = cfg.gpu_budget_bytes
    if gpu is not None and (not is_int(gpu) or gpu < 0):
        raise OffloadConfigError(f"gpu budget (gpu_budget_bytes) must be a whole number of bytes >= 0 or None, "
                                 f"got {gpu!r}")
    if GPU_TIER in cfg.tiers:
        if gpu is None and not cfg.gpu_budget_auto:
            raise OffloadConfigError(f"offload tier {GPU_TIER!r} needs its size: give gpu_budget_bytes or "
                                     f"gpu_budget_auto")
        if cfg.tiers == [GPU_TIER] and cfg.gpu_budget_auto:
            raise OffloadConfigError(f"offload tiers: {[GPU_TIER]} alone with gpu_budget_auto has nowhere to keep "
                                     f"the state it has not learnt room for; add {HOST_TIER!r} or a file tier")
    elif gpu is not None or cfg.gpu_budget_auto:
        raise OffloadConfigError(f"gpu_budget_bytes/gpu_budget_auto are given, but {GPU_TIER!r} is not one of "
                                 f"the offload tiers {cfg.tiers}")
    if not is_int(cfg.gpu_margin_bytes) or cfg.gpu_margin_bytes < 0:
        raise OffloadConfigError(f"gpu margin (gpu_margin_bytes) must be a whole number of bytes >= 0, "
                                 f"got {cfg.gpu_margin_bytes!r}")
    if cfg.update_on not in UPDATE_SIDES:
        raise OffloadConfigError(f"update side (update_on) must be one of {UPDATE_SIDES}, got {cfg.update_on!r}")
    if cfg.device_adam_kernel not in (None, "fused", "foreach", "single"):
        raise OffloadConfigError(f"device adam kernel (device_adam_kernel) must be 'fused', 'foreach' or "
                                 f"'single', got {cfg.device_adam_kernel!r}")
    positive("device_chunk_elems", cfg.device_chunk_elems)
    share = cfg.cpu_share_subgroups
    if share is not None:
        if share != "auto" and (not is_int(share) or share < 0):
            raise OffloadConfigError(f"the CPU's share (cpu_share_subgroups) must be a whole number of "
                                     f"subgroups >= 0, 'auto' or None, got {share!r}")
        if not cfg.defer_device_wait:
            raise OffloadConfigError(f"the CPU's share (cpu_share_subgroups={share}) splits the deferred update: "
                                     f"it needs defer_device_wait")
        if cfg.update_on != "auto":
            raise OffloadConfigError(f"the CPU's share (cpu_share_subgroups={share}) splits the deferred update: "
                                     f"it needs update_on 'auto', not {cfg.update_on!r}")
    if not is_int(cfg.device_read_ahead_bytes) or cfg.device_read_ahead_bytes < 0:
        raise OffloadConfigError(f"device read-ahead (device_read_ahead_bytes) must be a whole number of bytes "
                                 f">= 0, got {cfg.device_read_ahead_bytes!r}")
    for name in ("device_adam_elems_per_s", "device_streamed_elems_per_s"):
        rate = getattr(cfg, name)
        if rate is not None and not positive_finite(rate):
            raise OffloadConfigError(f"{name} must be a positive finite number, got {rate!r}")
