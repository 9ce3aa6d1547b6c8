"""Start-up: the memory tiers, the file tiers' rates (given, cached or probed), the CPU and device
update rates (with the state's real formats), the I/O tokens the rates imply, then the file tiers
themselves (with those tokens), placement and the predicted update. Data flows one way:
rates -> placement -> prediction. Every tier is built by ``tiers.factory``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..config import HOST_TIER, OffloadConfig, TierBandwidth
from ..plan.overlap_split import deferred_split
from ..plan.placement import Placement, UpdateRates, plan_placement, tokens_for
from ..plan.prediction import MeasuredRates, NodeSharing, Prediction, predict_update
from ..plan.rates import measure_convert_rate, measure_cpu_update_rate, probe_tier
from ..step.path_rates import measure_device_rates, measure_shared_rates
from ..state_formats import bytes_per_param, describe as describe_formats
from ..step.update_paths import UpdatePaths
from ..subgroups.partition import Subgroup
from ..tiers.base import ResidentTier, StreamedTier
from ..tiers.factory import file_tier, resident_tiers
from ..tiers.host import HostMemory, check_budget_exists
from ..tiers.tokens import JobTokens, TierTokens
from ..config.units import GiB

log = logging.getLogger("mlp_offload")


@dataclass
class StartUp:
    memory: Dict[str, ResidentTier]  # the memory tiers, fastest first; host always (it holds the slots)
    rates: Dict[str, TierBandwidth]
    adam_rate: float
    convert_rate: float
    tokens_per_tier: Dict[str, int]
    devices: Dict[str, object]
    placement: Placement
    prediction: Prediction
    update_rates: UpdateRates

    ranks_sharing: int = 1
    cache_alternating: bool = True
    interleaved: bool = False  # the device's held subgroups spread on a GPU's streams (``plan.device_share``)

    @property
    def host(self) -> HostMemory:
        return self.memory[HOST_TIER]

    def predict(self, subgroups: Sequence[Subgroup], placement: Placement, update_rates: Optional[UpdateRates] = None,
                tier_rates: Optional[Dict[str, TierBandwidth]] = None) -> Prediction:
        """The update predicted for ``placement`` at the rates measured here (or ``update_rates`` and
        ``tier_rates``, those the steps showed since): the one call start-up and every later re-placement make."""
        measured = MeasuredRates(tier_rates or self.rates, self.adam_rate, self.convert_rate,
                                 update_rates or self.update_rates)
        return predict_update(subgroups, placement, measured,
                              NodeSharing(self.devices, self.ranks_sharing, self.tokens_per_tier),
                              self.cache_alternating, self.interleaved)


def start_up(cfg: OffloadConfig, subgroups: List[Subgroup], paths: UpdatePaths, tiers: Dict[str, StreamedTier],
             token_store=None, memory: Optional[Dict[str, ResidentTier]] = None) -> StartUp:
    """Measure and plan. ``tiers`` is filled with the file tiers as they are built, and ``memory``
    with the memory tiers, so the caller can close them if a later step fails. ``paths``: the update
    paths chosen; its device update (with its kernel ``device_adam``) is measured where device updates
    may run, its CPU one-pass kernel where it replaces the multi-pass path (timed instead)."""
    adam, device_adam, device_update = paths.adam, paths.device_adam, paths.device_update
    cpu_one_pass = paths.cpu_one_pass
    sharing = cfg.resolved_ranks_sharing_node()
    check_budget_exists(cfg.host_budget_bytes, sharing)
    memory = {} if memory is None else memory
    memory.update(resident_tiers(cfg))
    host = memory[HOST_TIER]
    rates = {name: cfg.bandwidths.get(name) or probe_file_tier(cfg, name, host) for name in cfg.file_tiers}
    size = min(max(sg.numel for sg in subgroups), 1 << 26)
    adam_rate = cfg.adam_elems_per_s or measure_cpu_update_rate(
        lambda p, g, m, v, step: adam(p, g, m, v, step=step), cfg.state_codecs, numel=size, one_pass=cpu_one_pass)
    convert_rate = measure_convert_rate(size)
    update_rates = UpdateRates(1 / (1 / adam_rate + 1 / convert_rate))
    if device_update is not None:
        update_rates.device_resident = cfg.device_adam_elems_per_s
        update_rates.device_streamed = cfg.device_streamed_elems_per_s
        if update_rates.device_resident is None or update_rates.device_streamed is None:
            resident, streamed = measure_device_rates(
                device_update, lambda p, g, m, v, step: device_adam(p, g, m, v, step=step), cfg.state_codecs, size)
            update_rates.device_resident = update_rates.device_resident or resident
            update_rates.device_streamed = update_rates.device_streamed or streamed
        if cfg.update_on == "auto" and cfg.device_streamed_elems_per_s is None:  # a split may run both at once
            try:
                shared = measure_shared_rates(device_update, lambda p, g, m, v, step: adam(p, g, m, v, step=step),
                                              lambda p, g, m, v, step: device_adam(p, g, m, v, step=step), cfg.state_codecs,
                                              size, cpu_one_pass=cpu_one_pass)
            except (RuntimeError, ValueError) as err:  # a measurement, not the update: say so and go on
                log.warning("rates of the CPU and device side by side not measured (%s): the split and the "
                            "prediction use the rates measured alone", err)
                shared = None
            if shared is not None:
                update_rates.cpu_shared, update_rates.streamed_shared = shared
    # Tokens after the probe: unless given, whether ranks take turns depends on what it saw.
    tokens_per_tier = {name: cfg.tokens_per_tier or tokens_for(rates[name], sharing) for name in cfg.file_tiers}
    for name in cfg.file_tiers:
        count = tokens_per_tier[name]
        tokens = (JobTokens(cfg.paths[name], count, token_store) if token_scope(cfg, name) == "job"
                  else TierTokens(cfg.paths[name], count, lock_root=cfg.lock_dir))
        tiers[name] = file_tier(cfg, name, tokens)
    free = {name: tier.free_bytes() for name, tier in tiers.items()}
    devices = {name: tier.device for name, tier in tiers.items()}
    placement = plan_placement(subgroups, cfg, rates, free, devices, update_rates)
    # Deferred, the next forward hides some of the device's share; how much is not known before its
    # compute is measured (the engine re-plans then: ``Relocation.hide_under_forward``).
    deferred = deferred_split(cfg, subgroups, placement.tier_of, update_rates, 0.0, paths.device_type != "cpu")
    if deferred is not None:
        placement.update_on = deferred[0]
        log.info(deferred[1].describe(update_rates, 0.0))
    found = StartUp(memory, rates, adam_rate, convert_rate, tokens_per_tier, devices, placement, None, update_rates,
                    sharing, cfg.cache_alternating, paths.device_type == "cuda" and cfg.interleave_device_updates)
    found.prediction = found.predict(subgroups, placement)
    return found


def probe_file_tier(cfg: OffloadConfig, name: str, host: HostMemory) -> TierBandwidth:
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


def describe_tiers(rates: Dict[str, TierBandwidth], tiers: Dict[str, StreamedTier], tokens_per_tier: Dict[str, int],
                   cfg: OffloadConfig) -> str:
    return ", ".join(
        f"{t} r {r.read_bps / 1e9:.2f} w {r.write_bps / 1e9:.2f}"
        + (f" r+w {r.mixed_bps / 1e9:.2f}" if r.mixed_bps else "")
        + (f" r+w with all ranks' streams {r.shared_mixed_bps / 1e9:.2f}" if r.shared_mixed_bps else "")
        + " GB/s" + ("" if tiers[t].odirect else " (buffered)")
        + f", {tokens_per_tier[t]} I/O token(s) per {token_scope(cfg, t)}" for t, r in rates.items())


def describe_device_rates(rates: UpdateRates, device_update, read_ahead, cfg: OffloadConfig) -> str:
    """The device update's rates and read-ahead for the placement's log line ("" without a device update)."""
    if device_update is None:
        return ""
    ahead = (f"; read-ahead {read_ahead.slots} subgroups ({read_ahead.nbytes / GiB:.2f} GiB of device memory)"
             if read_ahead is not None else "")
    shared = (f" (beside the CPU: streamed {rates.streamed_shared / 1e9:.2f}, cpu {rates.cpu_shared / 1e9:.2f})"
              if rates.streamed_shared else "")
    return (f"; device {cfg.device} adam {rates.device_resident / 1e9:.2f} Gelem/s resident, "
            f"{rates.device_streamed / 1e9:.2f} streamed ({cfg.resolved_device_adam_kernel}, "
            f"{device_update.fused_how}){shared}{ahead}")


def describe_placement(cfg: OffloadConfig, subgroups: Sequence[Subgroup], start: StartUp, paths: UpdatePaths,
                       read_ahead) -> str:
    """The start-up's line of one rank: its subgroups, where they live, the host buffers, the state's
    bytes per memory tier and per param, the update's rates and the predicted update."""
    p, codecs = start.placement, cfg.state_codecs
    counts = {t: len(p.subgroups_on(t)) for t in [*start.memory, *cfg.file_tiers]}
    return (f"offload rank {cfg.rank}: {subgroups[-1].end} params in {len(subgroups)} subgroups; placement {counts}; "
            f"{p.slots} host buffers ({p.cache_slots} cache); state per memory tier "
            + ", ".join(f"{t} {b / GiB:.2f} GiB" for t, b in p.resident_bytes.items())
            + f"; state {bytes_per_param(codecs):.1f} B/param ({describe_formats(codecs)}); adam "
            f"{start.adam_rate / 1e9:.2f} Gelem/s (CPU {paths.cpu_one_pass_how})"
            f"{describe_device_rates(start.update_rates, paths.device_update, read_ahead, cfg)}; "
            f"{start.prediction.describe()}")
