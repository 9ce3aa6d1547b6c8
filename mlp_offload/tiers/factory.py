"""The one place tiers are built from the config: the resident tiers (device memory, host memory)
and the file tiers (streamed), each typed by its protocol (``tiers.base``)."""

from __future__ import annotations

from typing import Dict, Optional

from ..config import GPU_TIER, HOST_TIER, OffloadConfig
from .base import ResidentTier
from .device import DeviceMemory
from .files import FileIo, FileTier, TierOwner
from .host import HostMemory
from .tokens import TierTokens


def resident_tiers(cfg: OffloadConfig) -> Dict[str, ResidentTier]:
    """The memory tiers, fastest first. Host memory is always built: it holds the pipeline's buffers
    even where ``"host"`` keeps no resident subgroups (its budget then covers just those)."""
    tiers: Dict[str, ResidentTier] = {}
    if GPU_TIER in cfg.tiers:
        # The auto mode's budget is what it has promoted so far: counted, not capped.
        tiers[GPU_TIER] = DeviceMemory(cfg.device, None if cfg.gpu_budget_auto else cfg.budget_of(GPU_TIER))
    tiers[HOST_TIER] = HostMemory(cfg.host_budget_bytes, cfg.pin_memory)
    return tiers


def file_tier(cfg: OffloadConfig, name: str, tokens: Optional[TierTokens]) -> FileTier:
    try:
        return FileTier(name, cfg.paths[name], TierOwner(cfg.resolved_run_id(), cfg.rank, cfg.local_rank == 0),
                        FileIo(cfg.io_block_bytes, cfg.io_threads, op_threads=cfg.prefetch_depth + 2,
                               use_odirect=cfg.use_odirect, verify_checksums=cfg.verify_checksums),
                        tokens=tokens, lock_root=cfg.lock_dir)
    except BaseException:
        if tokens is not None:
            tokens.close()
        raise
