"""Hypothesis strategies for engine tests: small, valid engine set-ups drawn at random."""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from hypothesis import strategies as st

from mlp_offload import MiB, OffloadConfig, TierBandwidth
from mlp_offload.subgroups.partition import partition

TIER_MIXES = (["host"], ["nvme"], ["host", "nvme"], ["host", "nvme", "pfs"], ["nvme", "pfs"])


@dataclass
class Setup:
    """One engine set-up: the shard, its param groups and the config's options (paths aside)."""

    numel: int
    tiers: List[str]
    options: dict  # OffloadConfig fields other than tiers and paths
    groups: Optional[List[Tuple[List[Tuple[int, int]], dict]]] = None

    def config(self, root: str) -> OffloadConfig:
        """The config, its file tiers in directories under ``root``."""
        paths = {}
        for name in self.tiers:
            if name != "host":
                paths[name] = os.path.join(root, name)
                os.makedirs(paths[name], exist_ok=True)
        return OffloadConfig(tiers=list(self.tiers), paths=paths, **self.options)

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one pipeline buffer: the largest subgroup's state."""
        return partition(self.numel, self.options["subgroup_size"])[0].state_bytes


def fixed_setup(tiers, numel, groups=None, **options) -> Setup:
    """One set-up for an explicit example: small, fast defaults (rates given), then ``options``."""
    defaults = dict(subgroup_size=10_000, prefetch_depth=2, io_threads=2, io_block_bytes=64 * 1024,
                    adam_kernel="fused", adam_elems_per_s=1e9, run_id="prop", pin_memory=False, host_budget_bytes=None,
                    bandwidths={t: TierBandwidth(2e9, 1e9) for t in tiers if t != "host"})
    return Setup(numel, list(tiers), {**defaults, **options}, groups)


@st.composite
def setups(draw, tier_mixes=TIER_MIXES, probe: bool = True, max_numel: int = 200_000) -> Setup:
    """A valid set-up: at most 12 subgroups of a shard of at most ``max_numel`` elements; with
    ``probe``, sometimes no bandwidths, so that the engine probes its tiers at start."""
    tiers = list(draw(st.sampled_from(tier_mixes)))
    numel = draw(st.integers(1, max_numel))
    subgroup_size = draw(st.integers(max(1, -(-numel // 12)), numel + 1000))
    file_tiers = [t for t in tiers if t != "host"]
    options = dict(
        subgroup_size=subgroup_size,
        prefetch_depth=draw(st.integers(1, 5)),
        io_threads=draw(st.integers(1, 4)),
        io_block_bytes=4096 * draw(st.one_of(st.integers(1, 16), st.integers(1, 4096))),
        cache_alternating=draw(st.booleans()),
        verify_checksums=draw(st.booleans()),
        use_odirect=draw(st.booleans()),
        adam_kernel=draw(st.sampled_from(["single", "foreach", "fused"])),
        adam_elems_per_s=1e9,
        run_id="prop",
        pin_memory=False,
    )
    if probe and file_tiers and draw(st.booleans()):
        options["bandwidths"] = {}  # probed at start
        options["probe_bytes"] = draw(st.integers(MiB, 64 * MiB))
        options["ranks_sharing_node"] = draw(st.integers(1, 3))  # >1: the all-ranks phase too
    else:
        options["bandwidths"] = {t: TierBandwidth(draw(st.sampled_from([0.5e9, 1e9, 3e9])), 1e9)
                                 for t in file_tiers}
    subgroups = partition(numel, subgroup_size)
    slot, total, n_sub = subgroups[0].state_bytes, sum(sg.state_bytes for sg in subgroups), len(subgroups)
    if not file_tiers:  # host only: no budget, or one the whole state fits
        budget = draw(st.one_of(st.none(), st.integers(total, 2 * total)))
    elif "host" in tiers:  # from the pipeline's minimum of two buffers to more than all of it
        budget = draw(st.integers(2 * slot, (n_sub + 5 * len(file_tiers) + 2) * slot))
    else:  # no host tier: the pipeline's buffers only, as many as the budget allows
        budget = draw(st.one_of(st.none(), st.integers(2 * slot, 12 * slot)))
    options["host_budget_bytes"] = budget
    return Setup(numel, tiers, options, draw(param_groups(numel)))


@st.composite
def param_groups(draw, numel: int):
    """None (one group), or the shard cut at random points into ranges, each given to one of up
    to three groups with their own lr and weight decay."""
    if numel < 2 or draw(st.booleans()):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, numel - 1), max_size=4)))
    bounds = [0] + cuts + [numel]
    n_groups = draw(st.integers(1, 3))
    options = [draw(st.fixed_dictionaries({}, optional={
        "lr": st.sampled_from([1e-4, 3e-3, 1e-2]), "weight_decay": st.sampled_from([0.0, 0.01, 0.1])}))
        for _ in range(n_groups)]
    ranges = [[] for _ in range(n_groups)]
    for a, b in zip(bounds, bounds[1:]):
        ranges[draw(st.integers(0, n_groups - 1))].append((a, b))
    return [(r, o) for r, o in zip(ranges, options) if r]


DEVICE_RATES = dict(adam_elems_per_s=1e9, device_adam_elems_per_s=4e9, device_streamed_elems_per_s=2e9)


@st.composite
def device_setups(draw):
    """A valid set-up of ``setups`` with the gpu tier put in front (or not), its budget (fixed, or
    auto with a relocation after a step), the update side, the device chunk size and read-ahead:
    ``(setup, extra options, relocate)`` (helpers.device_config applies the options)."""
    setup = draw(setups(tier_mixes=TIER_MIXES, probe=False, max_numel=60_000))
    subgroups = partition(setup.numel, setup.options["subgroup_size"])
    slot, n = subgroups[0].state_bytes, len(subgroups)
    extra = dict(update_on=draw(st.sampled_from(["cpu", "device", "auto"])),
                 device_chunk_elems=draw(st.integers(1, setup.options["subgroup_size"] + 10)), **DEVICE_RATES)
    # Host-held device subgroups read ahead into up to n buffers (12 bytes an element holds any stored dtypes)
    extra["device_read_ahead_bytes"] = draw(st.integers(0, n)) * subgroups[0].numel * 12
    relocate = None
    if draw(st.booleans()):
        if draw(st.booleans()) and setup.tiers != ["host"] or "host" in setup.tiers:
            extra["gpu_budget_auto"] = draw(st.booleans())
        if not extra.get("gpu_budget_auto"):
            extra["gpu_budget_bytes"] = draw(st.integers(0, (n + 1) * slot))
        else:
            extra["gpu_margin_bytes"] = 0
            # (peak, capacity) after steps 1 and 2: promote some, then maybe hand some back
            relocate = [(0, draw(st.integers(0, n + 1)) * slot), (draw(st.integers(0, n)) * slot, n * slot)]
    return setup, extra, relocate
