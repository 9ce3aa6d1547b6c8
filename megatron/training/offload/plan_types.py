"""What a capacity plan is made of: the machine it plans for (its GPUs' memory, TFLOP/s and update rates)
and the plan it answers (``Plan``: where every byte goes, the predicted times, and its JSON for
``tools/plan_offload.py --json``). ``capacity_plan`` computes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mlp_offload import EnginePlan, GPU_TIER, HOST_TIER, TierBandwidth


@dataclass
class DeviceRates:
    """How fast a GPU updates optimizer state, as the engine's start-up line gives it (elements/s),
    and the host links its streamed update shares (``mlp_offload``'s ``streamed_elems_per_s``)."""

    resident_elems_per_s: float  # state held in device memory (the gpu tier)
    link_bps: float  # one GPU's host link, both directions together
    node_host_bps: Optional[float] = None  # the node's host memory bandwidth, all its GPUs' streams together
    streamed_elems_per_s: Optional[float] = None  # host state streamed through one GPU alone, measured
    cpu_beside_elems_per_s: Optional[float] = None  # CPU Adam while the device streams (measured side by side)
    streamed_beside_elems_per_s: Optional[float] = None  # the device's stream while the CPU updates


@dataclass
class Machine:
    nnodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    host_memory_bytes: int
    gpu_tflops: float  # sustained bf16 TFLOP/s per GPU for this model (from a short run's log)
    device_rates: Optional[DeviceRates] = None  # None: no update on the device is planned

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node


@dataclass
class Plan:
    fits: bool
    problems: List[str]
    params_total: int
    params_per_rank: int  # the largest pipeline stage's share on one model-parallel rank
    shard_numel: int  # this rank's optimizer state (elements): the dense shard plus the experts' shard
    gpu_bytes: Dict[str, int]
    host_bytes_per_node: Dict[str, int]
    tier_bytes_per_node: Dict[str, int]
    compute_s: float
    update_s: Optional[float]
    iteration_s: float
    bottleneck: str
    tokens_per_s: Dict[int, float] = field(default_factory=dict)  # global batch size -> tokens/s
    engines: Dict[str, EnginePlan] = field(default_factory=dict)  # "dense", and "experts" for an MoE model
    host_cache_gb: Optional[float] = None  # what --offload-host-cache-gb the plan used (given or chosen)
    params_active: int = 0  # of params_total, those one token uses (top-k routed experts)
    shard_numels: Dict[str, int] = field(default_factory=dict)  # per distributed optimizer
    tier_rates: Dict[str, TierBandwidth] = field(default_factory=dict)  # each file tier's, as planned with
    overlaps_forward: bool = False  # the iteration counts the update under the next forward
    param_copies_s: float = 0.0  # of update_s, what the copies of params (and grads) in host memory add to it
    checkpoint_bytes: Dict[str, int] = field(default_factory=dict)  # what one save writes, per part, the job's

    def placement_counts(self, kind: Optional[str] = None) -> Dict[str, int]:
        """Subgroups per tier, as the engine logs them at start-up (host first, then the file tiers),
        of one engine or summed over both."""
        engines = [self.engines[kind]] if kind else list(self.engines.values())
        tiers = [HOST_TIER, *self.tier_bytes_per_node]
        if any(e.placement.subgroups_on(GPU_TIER) for e in engines) or "optimizer_state_gpu_tier" in self.gpu_bytes:
            tiers.insert(0, GPU_TIER)
        return {t: sum(len(e.placement.subgroups_on(t)) for e in engines) for t in tiers}

    def engine_json(self, kind: str) -> dict:
        e = self.engines[kind]
        pred = e.prediction
        return {"optimizer_state_elements_per_rank": self.shard_numels[kind],
                "optimizer_state_bytes_per_rank": e.state_bytes, "subgroups": len(e.subgroups),
                "placement": self.placement_counts(kind), "tier_bytes_per_rank": dict(e.stored_bytes),
                "predicted_update_s": pred.update_s, "predicted_deferred_s": pred.deferred_s,
                "predicted_deferred_in_hbm_s": pred.deferred_in_hbm_s, "predicted_serial_s": pred.serial_s,
                "io_bytes_per_rank_per_step": {t: {"read": pred.read_bytes[t], "write": pred.write_bytes[t]}
                                               for t in pred.tier_s}}

    def as_json(self) -> dict:
        engines = list(self.engines.values())
        io = {}
        for e in engines:
            for t in e.prediction.tier_s:
                entry = io.setdefault(t, {"read": 0, "write": 0})
                entry["read"] += e.prediction.read_bytes[t]
                entry["write"] += e.prediction.write_bytes[t]
        return {
            "fits": self.fits, "problems": self.problems,
            "params_total": self.params_total, "params_active": self.params_active,
            "params_per_rank": self.params_per_rank,
            "optimizer_state_elements_per_rank": self.shard_numel,
            "optimizer_state_bytes_per_rank": sum(e.state_bytes for e in engines) if engines else None,
            "gpu_bytes_per_rank": self.gpu_bytes, "host_bytes_per_node": self.host_bytes_per_node,
            "tier_bytes_per_node": self.tier_bytes_per_node,
            "predicted_compute_s": self.compute_s, "predicted_update_s": self.update_s,
            "predicted_iteration_s": self.iteration_s, "overlaps_forward": self.overlaps_forward,
            "bottleneck": self.bottleneck,
            "tokens_per_s": {str(k): v for k, v in self.tokens_per_s.items()},
            "placement": self.placement_counts() if engines else None,
            "subgroups": sum(len(e.subgroups) for e in engines) if engines else None,
            "io_bytes_per_rank_per_step": io if engines else None,
            "engines": {k: self.engine_json(k) for k in self.engines} if engines else None,
            "offload_host_cache_gb": self.host_cache_gb,
            "checkpoint_bytes": self.checkpoint_bytes,
        }
