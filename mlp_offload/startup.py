"""Start-up: host memory, the file tiers' rates (given, cached or probed) and the CPU rates, the
I/O tokens the rates imply, then the file tiers themselves (with those tokens), placement and the
predicted update. Data flows one way: rates -> placement -> prediction."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from .config import OffloadConfig, TierBandwidth
from .placement import Placement, plan_placement, tokens_for
from .prediction import Prediction, predict_update
from .rates import measure_adam_rate, measure_convert_rate, probe_tier
from .subgroups import Subgroup
from .tiers.files import FileTier
from .tiers.host import HostMemory, check_budget_exists
from .tiers.tokens import JobTokens, TierTokens

log = logging.getLogger("mlp_offload")


@dataclass
class StartUp:
    host: HostMemory
    rates: Dict[str, TierBandwidth]
    adam_rate: float
    convert_rate: float
    tokens_per_tier: Dict[str, int]
    devices: Dict[str, object]
    placement: Placement
    prediction: Prediction


def start_up(cfg: OffloadConfig, subgroups: List[Subgroup], adam, tiers: Dict[str, FileTier],
             token_store=None) -> StartUp:
    """Measure and plan. ``tiers`` is filled with the file tiers as they are built, so the caller
    can close them if a later step fails."""
    sharing = cfg.resolved_ranks_sharing_node()
    check_budget_exists(cfg.host_budget_bytes, sharing)
    host = HostMemory(cfg.host_budget_bytes, cfg.pin_memory)
    rates = {name: cfg.bandwidths.get(name) or _probe(cfg, name, host) for name in cfg.file_tiers}
    size = min(max(sg.numel for sg in subgroups), 1 << 26)
    adam_rate = cfg.adam_elems_per_s or measure_adam_rate(
        lambda p, g, m, v, step: adam(p, g, m, v, step=step), numel=size)
    convert_rate = measure_convert_rate(size)
    # Tokens after the probe: unless given, whether ranks take turns depends on what it saw.
    tokens_per_tier = {name: cfg.tokens_per_tier or tokens_for(rates[name], sharing) for name in cfg.file_tiers}
    for name in cfg.file_tiers:
        count = tokens_per_tier[name]
        tokens = (JobTokens(cfg.paths[name], count, token_store) if token_scope(cfg, name) == "job"
                  else TierTokens(cfg.paths[name], count))
        tiers[name] = file_tier(cfg, name, tokens)
    free = {name: tier.free_bytes() for name, tier in tiers.items()}
    devices = {name: tier.device for name, tier in tiers.items()}
    placement = plan_placement(subgroups, cfg, rates, free, devices)
    prediction = predict_update(subgroups, placement, rates, adam_rate, convert_rate, devices,
                                ranks_sharing=sharing, tokens=tokens_per_tier, cache_alternating=cfg.cache_alternating)
    return StartUp(host, rates, adam_rate, convert_rate, tokens_per_tier, devices, placement, prediction)


def file_tier(cfg: OffloadConfig, name: str, tokens: Optional[TierTokens]) -> FileTier:
    try:
        return FileTier(name, cfg.paths[name], cfg.resolved_run_id(), cfg.rank, cfg.io_block_bytes,
                        cfg.io_threads, op_threads=cfg.prefetch_depth + 2, use_odirect=cfg.use_odirect,
                        verify_checksums=cfg.verify_checksums, tokens=tokens)
    except BaseException:
        if tokens is not None:
            tokens.close()
        raise


def _probe(cfg: OffloadConfig, name: str, host: HostMemory) -> TierBandwidth:
    """Through a short-lived tier of its own: the training tier is built after, with the turns the
    probe implies (the probe holds the path's probe lock instead of tokens)."""
    probe = file_tier(cfg, name, tokens=None)
    # A probe of a slow disk takes minutes: say what it moves, and how fast it went.
    log.info("bandwidth probe of %s (%s): %.3f GB written, read back, then both at once (or its cached "
             "figures) ...", name, cfg.paths[name], cfg.probe_bytes / 1e9)
    started = time.perf_counter()
    try:
        buf = host.allocate(cfg.probe_bytes, "bandwidth probe", counted=False)
        rate = probe_tier(probe, buf, concurrency=cfg.prefetch_depth, ranks_sharing=cfg.resolved_ranks_sharing_node())
    finally:
        probe.close()
    log.info("bandwidth probe of %s: done in %.1f s, read %.2f GB/s, write %.2f GB/s", name,
             time.perf_counter() - started, rate.read_bps / 1e9, rate.write_bps / 1e9)
    return rate


def token_scope(cfg: OffloadConfig, tier: str) -> str:
    return cfg.token_scope.get(tier, "node")


def describe_tiers(rates: Dict[str, TierBandwidth], tiers: Dict[str, FileTier], tokens_per_tier: Dict[str, int],
                   cfg: OffloadConfig) -> str:
    return ", ".join(
        f"{t} r {r.read_bps / 1e9:.2f} w {r.write_bps / 1e9:.2f}"
        + (f" r+w {r.mixed_bps / 1e9:.2f}" if r.mixed_bps else "")
        + (f" r+w with all ranks' streams {r.shared_mixed_bps / 1e9:.2f}" if r.shared_mixed_bps else "")
        + " GB/s" + ("" if tiers[t].odirect else " (buffered)")
        + f", {tokens_per_tier[t]} I/O token(s) per {token_scope(cfg, t)}" for t, r in rates.items())
