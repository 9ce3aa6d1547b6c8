"""The configurations the planner tries for one global batch size (``tools/plan_offload.py
--recommend``): recompute granularity, micro-batch size, the gpu tier (auto or none), with full recompute
on a GPU the params resident or in host memory (the layer-major step's: alone, with the layer inputs, with the
grads and the layer inputs; in one pass over the step's micro-batches, or in halves or quarters), and, with
``--layouts``, the tensor x
pipeline parallel sizes, each as the user's flags with those few changed,
and the compute time each would take at the TFLOP/s the user measured with their own recompute setting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron.training.offload.options import (ACTIVATIONS_IN_HOST, GPU_CACHE_FLAG, GRADS_IN_HOST, PARAMS_IN_HOST,
                                               layer_major_flags)
from mlp_offload import GPU_TIER, kind_of

RECOMPUTE = {  # name -> the flags that ask for it
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
    "none": [],
}
_RECOMPUTE_FLAGS = {"--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
                    "--recompute-activations": 0}
_GPU_TIER_FLAGS = {GPU_CACHE_FLAG: 1, "--offload-tiers": 1}
_LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1}
GROUP_FLAG = "--offload-microbatch-group"
_HOST_FLAGS = {**{flag.split()[0]: 1 for flag in (PARAMS_IN_HOST, GRADS_IN_HOST, ACTIVATIONS_IN_HOST)}, GROUP_FLAG: 1}
# What the layer-major step can keep in host memory, as candidates try it: each set with the flags asking for it
# (the layer inputs alone buy nothing over megatron-core's schedule, which keeps one micro-batch's).
IN_HOST = {(): [], ("params",): PARAMS_IN_HOST.split(),
           ("params", "layer inputs"): PARAMS_IN_HOST.split() + ACTIVATIONS_IN_HOST.split(),
           ("params", "grads", "layer inputs"): (PARAMS_IN_HOST.split() + GRADS_IN_HOST.split()
                                                 + ACTIVATIONS_IN_HOST.split())}
MICRO_BATCH_SIZES = (1, 2, 4, 8)


AS_GIVEN = "as given"  # the gpu tier left as the user's flags have it


@dataclass(frozen=True)
class Candidate:
    recompute: str  # a key of RECOMPUTE
    micro_batch_size: int
    gpu_tier: str  # "auto", "none", or AS_GIVEN (no offload, or no tier below the gpu to fall back on)
    layout: Optional[Tuple[int, int]] = None  # (TP, PP); None: as given
    in_host: Tuple[str, ...] = ()  # a key of IN_HOST (full recompute only)
    group: Optional[int] = None  # with a layer-major set: micro-batches per pass (None: the step's all)

    def describe(self) -> str:
        parts = [f"recompute {self.recompute}", f"micro-batch {self.micro_batch_size}"]
        if self.layout:
            parts.insert(0, f"TP {self.layout[0]} x PP {self.layout[1]}")
        if self.gpu_tier != AS_GIVEN:
            parts.append("gpu tier auto" if self.gpu_tier == "auto" else "no gpu tier")
        if self.in_host:
            parts.append(f"{', '.join(self.in_host[:-1]) + ' and ' if len(self.in_host) > 1 else ''}"
                         f"{self.in_host[-1]} in host memory")
        if self.group:
            parts.append(f"in passes of {self.group} micro-batch{'es' if self.group > 1 else ''}")
        return ", ".join(parts)


def recompute_work(granularity: Optional[str], method: Optional[str] = None, num_layers: Optional[int] = None,
                   layers_per_stage: int = 1) -> float:
    """Device work per iteration relative to no recompute, in forward passes (backward = 2): full
    recompute runs each recomputed layer's forward again (4 instead of 3; ``block`` only its first
    ``num_layers`` per stage); selective recomputes only the attention core, counted as nothing here."""
    if granularity != "full":
        return 1.0
    share = 1.0 if method != "block" else min(1.0, (num_layers or 0) / max(1, layers_per_stage))
    return 1.0 + share / 3.0


def without(flags: Sequence[str], names: dict) -> List[str]:
    """``flags`` less each flag of ``names`` (flag -> how many values follow it), in either form
    (``--flag value`` or ``--flag=value``)."""
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
            continue
        name = f.split("=", 1)[0]
        if name in names:
            skip = names[name] if "=" not in f else 0
            continue
        out.append(f)
    return out


def candidates(micro_batches_per_dp: int, tiers: Optional[Sequence[str]], on_gpu: bool,
               layout: Optional[Tuple[int, int]] = None) -> List[Candidate]:
    """Every recompute setting x micro-batch size dividing the global batch's share of a data-parallel
    rank x (where the run offloads on a GPU) the gpu tier auto or none, and with full recompute the params
    resident or in host memory, at one layout."""
    sizes = [m for m in MICRO_BATCH_SIZES if micro_batches_per_dp % m == 0]
    below = [t for t in tiers or () if not kind_of(t).in_device_memory]
    tier_options = ["auto", "none"] if below and on_gpu else [AS_GIVEN]
    where = {r: list(IN_HOST) if r == "full" and tiers and on_gpu else [()] for r in RECOMPUTE}
    return [Candidate(r, m, g, layout, host, group) for r in RECOMPUTE for m in sizes for g in tier_options
            for host in where[r] for group in pass_sizes(micro_batches_per_dp // m, host)]


def pass_sizes(micro_batches: int, in_host: Tuple[str, ...]) -> List[Optional[int]]:
    """The passes a layer-major candidate tries: the whole step, halves and quarters (where they divide it)."""
    if not in_host:
        return [None]
    return [None] + [micro_batches // k for k in (2, 4) if micro_batches % k == 0 and micro_batches // k >= 1]


def in_host_of(args) -> Tuple[str, ...]:
    """What the flags as given keep in host memory, as a key of IN_HOST (or another set no candidate has)."""
    asked = layer_major_flags(args)
    return tuple(name for name, key in (("params", "params_in_host"), ("grads", "grads_in_host"),
                                        ("layer inputs", "inputs_in_host")) if asked[key])


def layouts(world: int, gpus_per_node: int, num_layers: int) -> List[Tuple[int, int]]:
    """Every (TP, PP) the world holds: TP within one node (its all-reduces stay on the node's links),
    PP dividing the layers; TP x PP divides the world (the rest is data parallel)."""
    return [(t, p) for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0
            for p in range(1, world // t + 1) if world % (t * p) == 0 and num_layers % p == 0]


def own_flags(c: Candidate, tiers: Optional[Sequence[str]]) -> List[str]:
    """The flags that make the candidate what it is."""
    out = RECOMPUTE[c.recompute] + ["--micro-batch-size", str(c.micro_batch_size)]
    if c.layout:
        out += ["--tensor-model-parallel-size", str(c.layout[0]), "--pipeline-model-parallel-size", str(c.layout[1])]
    out += IN_HOST[c.in_host]
    if c.group:
        out += [GROUP_FLAG, str(c.group)]
    if c.gpu_tier != AS_GIVEN:
        below = [t for t in tiers if not kind_of(t).in_device_memory]
        out += ["--offload-tiers", ",".join(([GPU_TIER] if c.gpu_tier == "auto" else []) + below)]
        if c.gpu_tier == "auto":
            out += [GPU_CACHE_FLAG, "auto"]
    return out


def candidate_flags(flags: Sequence[str], tiers: Optional[Sequence[str]], c: Candidate,
                    global_batch_size: int) -> List[str]:
    """The user's flags with the candidate's recompute, micro-batch size and gpu tier in place of theirs,
    at the run's global batch size (without the flag, it would follow the micro-batch size)."""
    replaced = {**_RECOMPUTE_FLAGS, **_HOST_FLAGS, "--micro-batch-size": 1, "--global-batch-size": 1,
                **(_GPU_TIER_FLAGS if c.gpu_tier != AS_GIVEN else {}), **(_LAYOUT_FLAGS if c.layout else {})}
    return without(flags, replaced) + own_flags(c, tiers) + ["--global-batch-size", str(global_batch_size)]
