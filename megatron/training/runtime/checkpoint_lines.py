"""What a synchronous save and a load of a checkpoint moved, how long each part took, and how that compares with the
disk: the lines they print (rank 0, each figure the slowest rank's).

A checkpoint has two parts that move side by side: megatron-core's torch_dist files (the model's
weights, small objects) and the offloaded optimizer state (``offload*/``, a file per rank, some of it
taken by hard link from the nvme tier's files). The whole is counted as the checkpoint's bytes on disk,
linked ones included (what a user copies); each part gets its own bytes, seconds and GB/s, and the
time before and after the writes is named, so a slow save or load shows where its time went. The
parts' bytes come from the checkpoint (``checkpoint.integrity.part_bytes``).

The disk's rate is the offload engine's probe of a file tier lying on the checkpoint's file system,
where there is one; else the line gives none.
"""

from __future__ import annotations

import os
import time
from typing import Dict

from mlp_offload import GB


class Phases:
    """Consecutive named spans of one operation: ``mark(name)`` ends the span begun at the last mark."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.spans: Dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        self.spans[name] = self.spans.get(name, 0.0) + now - self.last
        self.last = now
        return self.spans[name]

    def total(self) -> float:
        return self.last - self.started


def disk_rates(path: str, optimizer):
    """(tier name, its probed ``TierBandwidth``) of an offload file tier on ``path``'s file system, or
    None where no engine's tier lies there."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        return None
    for shard in getattr(optimizer, "shards", None) or []:
        engine = shard.engine
        for name, tier_device in (getattr(engine, "devices", None) or {}).items():
            if tier_device == device and name in (engine.rates or {}):
                return name, engine.rates[name]
    return None


def against_disk(nbytes: float, seconds: float, rates, writing: bool) -> str:
    """The share of the disk's rate, as '; 63% of the disk's write rate (2.05 GB/s, the nvme tier's
    probe)', or "" where the rate is not known."""
    if rates is None or seconds <= 0:
        return ""
    name, bandwidth = rates
    bps = bandwidth.write_bps if writing else bandwidth.read_bps
    share = nbytes / seconds / bps
    return f"; {share:.0%} of the disk's {'write' if writing else 'read'} rate ({bps / GB:.2f} GB/s, the {name} tier's probe)"


def rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / GB:.3f} GB in {seconds:.1f} s ({nbytes / GB / max(seconds, 1e-9):.2f} GB/s)"


def spans(phases: Dict[str, float], names) -> str:
    """The named spans that took a measurable time, as ' (the state dict 0.1, ...)'."""
    shown = [f"{name} {phases[name]:.1f}" for name in names if phases.get(name, 0.0) >= 0.05]
    return f" ({', '.join(shown)})" if shown else ""


BEFORE_SAVE = ("marking it begun", "the state dict", "the params' digests")
AFTER_SAVE = ("the resume check's record", "agreeing", "the proof")


def save_line(iteration: int, root: str, sizes: Dict[str, int], figures: Dict[str, float], rates) -> str:
    """The synchronous save's line. ``figures``: the slowest rank's seconds of the "whole" save, of each
    phase (BEFORE_SAVE, "writes", AFTER_SAVE), of "torch_dist" and "offloaded" within the writes, and
    the offloaded state's bytes per rank ("offloaded bytes", "offloaded written")."""
    total, seconds = sum(sizes.values()), figures["whole"]
    line = (f"> saved checkpoint at iteration {iteration} to {root}: {rate(total, seconds)}"
            f"{against_disk(total, seconds, rates, writing=True)}; torch_dist {rate(sizes['torch_dist'], figures['torch_dist'])}")
    if figures["offloaded bytes"] > 0:
        nbytes, written = figures["offloaded bytes"], figures["offloaded written"]
        linked = max(0.0, nbytes - written)
        line += (f" beside the offloaded optimizer state {rate(nbytes, figures['offloaded'])} per rank "
                 f"({written / GB:.2f} GB written, {linked / GB:.2f} GB linked)")
    before = sum(figures[name] for name in BEFORE_SAVE)
    after = sum(figures[name] for name in AFTER_SAVE)
    return (f"{line}; the writes {figures['writes']:.1f} s, before them {before:.1f} s{spans(figures, BEFORE_SAVE)}, "
            f"after them {after:.1f} s{spans(figures, AFTER_SAVE)}")


def load_line(path: str, sizes: Dict[str, int], figures: Dict[str, float], rates, beside: bool) -> str:
    """The load's line: each part's bytes and seconds, whether the offloaded state was read beside
    torch_dist's files or after them, and the whole against the disk's read rate."""
    total = sizes["torch_dist"] + sizes["offloaded"]
    line = (f"> checkpoint read from {path}: {rate(total, figures['reads'])}"
            f"{against_disk(total, figures['reads'], rates, writing=False)}; torch_dist "
            f"{rate(sizes['torch_dist'], figures['torch_dist'])}")
    if figures.get("offloaded bytes", 0) > 0:
        line += (f", {'beside it' if beside else 'then'} the offloaded optimizer state "
                 f"{rate(figures['offloaded bytes'], figures['offloaded'])} per rank")
    return line + (f"; before the reads {figures['planning']:.1f} s (the plan), after them {figures['after']:.1f} s "
                   f"(the digests compared, the scheduler and RNG states)")


__all__ = ["Phases", "disk_rates", "against_disk", "save_line", "load_line"]
