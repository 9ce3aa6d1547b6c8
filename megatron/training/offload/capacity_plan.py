"""Will a run fit, where does every byte go, and how long will an iteration take: the plan behind
``tools/plan_offload.py``, from ``pretrain_gpt.py``'s own flags and a description of the machine.

Parameters per rank come from ``model_size`` (the same ``TransformerConfig`` the training builds);
the optimizer state's placement and the update time from the engine's own planning
(``mlp_offload.capacity``); compute time from Megatron-LM's FLOP count at a sustained TFLOP/s
per GPU. Activation memory is an estimate (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", 2022); everything else is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mlp_offload import PlacementError, TierBandwidth
from mlp_offload.capacity import EnginePlan, plan_engine
from mlp_offload.subgroups import STATE_TENSORS, FP32_BYTES

from megatron.training.model.flops import DenseGptShape, flops_per_iteration
from megatron.training.model.sizes import model_params, stage_params
from megatron.training.errors import in_flags

GB = 1e9
GiB = 1 << 30
CUDA_RESERVE_BYTES = 2 * GiB  # CUDA context, cuBLAS workspaces, allocator fragmentation
HOST_SHARE = 0.8  # of a node's memory, what optimizer state may take (the rest: OS, data loaders, pinning)


@dataclass
class Machine:
    nnodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    host_memory_bytes: int
    gpu_tflops: float  # sustained bf16 TFLOP/s per GPU for this model (from a short run's log)

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node


@dataclass
class Plan:
    fits: bool
    problems: List[str]
    params_total: int
    params_per_rank: int  # the largest pipeline stage's share on one tensor-parallel rank
    shard_numel: int  # this rank's share of the optimizer state (elements), data parallelism included
    gpu_bytes: Dict[str, int]
    host_bytes_per_node: Dict[str, int]
    tier_bytes_per_node: Dict[str, int]
    compute_s: float
    update_s: Optional[float]
    iteration_s: float
    bottleneck: str
    tokens_per_s: Dict[int, float] = field(default_factory=dict)  # global batch size -> tokens/s
    engine: Optional[EnginePlan] = None
    host_cache_gb: Optional[float] = None  # what --offload-host-cache-gb the plan used (given or chosen)

    def placement_counts(self) -> Dict[str, int]:
        """Subgroups per tier, as the engine logs them at start-up (host first, then the file tiers)."""
        return {t: len(self.engine.placement.subgroups_on(t)) for t in ["host", *self.tier_bytes_per_node]}

    def as_json(self) -> dict:
        pred = self.engine.prediction if self.engine else None
        return {
            "fits": self.fits, "problems": self.problems,
            "params_total": self.params_total, "params_per_rank": self.params_per_rank,
            "optimizer_state_elements_per_rank": self.shard_numel,
            "optimizer_state_bytes_per_rank": self.engine.state_bytes if self.engine else None,
            "gpu_bytes_per_rank": self.gpu_bytes, "host_bytes_per_node": self.host_bytes_per_node,
            "tier_bytes_per_node": self.tier_bytes_per_node,
            "predicted_compute_s": self.compute_s, "predicted_update_s": self.update_s,
            "predicted_iteration_s": self.iteration_s, "bottleneck": self.bottleneck,
            "tokens_per_s": {str(k): v for k, v in self.tokens_per_s.items()},
            "placement": None if not self.engine else self.placement_counts(),
            "subgroups": None if not self.engine else len(self.engine.subgroups),
            "io_bytes_per_rank_per_step": None if not pred else {
                t: {"read": pred.read_bytes[t], "write": pred.write_bytes[t]} for t in pred.tier_s},
            "offload_host_cache_gb": self.host_cache_gb,
        }


def activation_bytes(args, cfg, microbatches_in_flight: int) -> int:
    """Activations one rank of the first pipeline stage keeps (the stage that holds the most
    micro-batches under 1F1B), by Korthikanti et al.'s per-layer counts for 16-bit training,
    plus the fp32 logits of the last stage when it is also the first."""
    s, b, h, a = args.seq_length, args.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t = cfg.tensor_model_parallel_size
    layers = cfg.num_layers // cfg.pipeline_model_parallel_size
    scores = 5 * a * s / h / t  # attention scores and softmax: gone with selective recompute
    if cfg.recompute_granularity == "full":
        kept = 2 * s * b * h / (t if cfg.sequence_parallel else 1)  # each layer's input only
        per_layer_full = s * b * h * (34 / t + scores) if cfg.sequence_parallel else s * b * h * (10 + 24 / t + scores)
        per_microbatch = layers * kept + per_layer_full
    else:
        if cfg.recompute_granularity == "selective":
            scores = 0.0
        per_layer = s * b * h * (34 / t + scores) if cfg.sequence_parallel else s * b * h * (10 + 24 / t + scores)
        per_microbatch = layers * per_layer
    total = per_microbatch * microbatches_in_flight
    if cfg.pipeline_model_parallel_size == 1:
        total += s * b * args.padded_vocab_size / t * FP32_BYTES
    return int(total)


def microbatches_in_flight(pp: int, vp: Optional[int], microbatches: int) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: PP under 1F1B (fewer
    where the step has fewer); with V chunks per rank the interleaved schedule's longer warm-up
    holds ceil((1 + (PP-1)/(PP*V)) * PP), as Megatron-LM's memory estimate counts it."""
    if not vp:
        return min(pp, microbatches)
    return math.ceil((1 + (pp - 1) / (pp * vp)) * pp)


def suggested_host_cache_gb(machine: Machine, ranks_per_node: int, subgroup_size: int) -> float:
    """The largest per-rank host budget the node holds beside the gradient scratch, in whole GB."""
    scratch = 2 * subgroup_size * FP32_BYTES
    per_rank = machine.host_memory_bytes * HOST_SHARE / ranks_per_node - scratch
    return max(0.0, float(int(per_rank / GiB)))


def make_plan(args, cfg, machine: Machine, offload_config, rates: Dict[str, TierBandwidth],
              capacity_bytes: Dict[str, int], adam_elems_per_s: float, convert_elems_per_s: float,
              batch_sizes: List[int]) -> Plan:
    """The whole plan. ``offload_config`` is None for a run without ``--offload-tiers``."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    vp = cfg.virtual_pipeline_model_parallel_size
    dp = machine.world // (tp * pp)
    stages = stage_params(cfg, args.padded_vocab_size, args.max_position_embeddings,
                          args.position_embedding_type, not args.untie_embeddings_and_output_weights)
    per_rank = max(s.params for s in stages)
    shard = -(-per_rank // dp)
    problems: List[str] = []
    param_bytes = 2 if (args.bf16 or args.fp16) else 4
    microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    gpu = {"parameters": per_rank * param_bytes,
           "gradients": per_rank * (2 if args.fp16 else 4),  # bf16 gradients are reduced in fp32
           "activations": activation_bytes(args, cfg, microbatches_in_flight(pp, vp, microbatches)),
           "cuda_reserve": CUDA_RESERVE_BYTES}
    engine: Optional[EnginePlan] = None
    tiers_per_node: Dict[str, int] = {}
    host_per_node: Dict[str, int] = {}
    if offload_config is None:
        # Adam's two moments, and fp32 master weights where the model trains in 16 bits.
        state = (len(STATE_TENSORS) - (0 if args.bf16 or args.fp16 else 1)) * FP32_BYTES
        gpu["optimizer_state"] = (shard if args.use_distributed_optimizer else per_rank) * state
    else:
        try:
            engine = plan_engine(shard, offload_config, rates, capacity_bytes, adam_elems_per_s,
                                 convert_elems_per_s, machine.gpus_per_node)
        except PlacementError as err:
            problems.append(in_flags(str(err)))
        largest = min(shard, offload_config.subgroup_size)
        gpu["offload_staging"] = 3 * largest * FP32_BYTES  # fp32 gradient staging and the update's copy-back
        if engine is not None:
            host_per_node["optimizer_state"] = machine.gpus_per_node * engine.placement.host_state_bytes
            host_per_node["gradient_scratch"] = machine.gpus_per_node * (engine.host_bytes
                                                                         - engine.placement.host_state_bytes)
            tiers_per_node = {t: machine.gpus_per_node * engine.stored_bytes[t] for t in offload_config.file_tiers}
    gpu_total = sum(gpu.values())
    if gpu_total > machine.gpu_memory_bytes:
        problems.append(f"GPU memory: {gpu_total / GiB:.1f} GiB per rank needed "
                        f"({', '.join(f'{k} {v / GiB:.1f}' for k, v in gpu.items())}), "
                        f"{machine.gpu_memory_bytes / GiB:.1f} GiB per GPU")
    host_total = sum(host_per_node.values())
    if host_total > machine.host_memory_bytes * HOST_SHARE:
        problems.append(f"host memory: {host_total / GiB:.1f} GiB per node for optimizer state and scratch, more than "
                        f"{HOST_SHARE:.0%} of the node's {machine.host_memory_bytes / GiB:.1f} GiB")

    def compute_seconds(global_batch: int) -> float:
        m = global_batch // (args.micro_batch_size * dp)
        # 1F1B: the pipeline fills and drains once per step; V chunks per rank make that V times shorter
        bubble = 1 + (pp - 1) / (max(m, 1) * (vp or 1))
        flops = flops_per_iteration(DenseGptShape.from_config(cfg, args.seq_length, args.padded_vocab_size), global_batch)
        return flops / machine.world / (machine.gpu_tflops * 1e12) * bubble

    compute_s = compute_seconds(args.global_batch_size)
    update_s = engine.prediction.update_s if engine else None
    iteration_s = compute_s + (update_s or 0.0)
    parts = {"compute": compute_s}
    if engine:
        pred = engine.prediction
        parts["cpu adam"] = pred.adam_s
        parts.update({f"{t} I/O": pred.ranks_sharing * s for t, s in pred.tier_s.items()})
    bottleneck = max(parts, key=parts.get)
    tokens = {g: g * args.seq_length / (compute_seconds(g) + (update_s or 0.0)) for g in batch_sizes}
    return Plan(not problems, problems, model_params(stages, tp), per_rank, shard, gpu, host_per_node,
                tiers_per_node, compute_s, update_s, iteration_s, bottleneck, tokens, engine)
