"""Will a run fit, where does every byte go, and how long will an iteration take: the plan behind
``tools/plan_offload.py``, from ``pretrain_gpt.py``'s own flags and a description of the machine.

Parameters per rank come from ``model.sizes`` (the same ``TransformerConfig`` the training builds;
a mixture-of-experts model's dense part and routed experts apart, each optimizer's shard over its own
data-parallel group);
the optimizer state's placement and the update time from the engine's own planning
(``mlp_offload.plan.capacity``); compute time from Megatron-LM's FLOP count at a sustained TFLOP/s
per GPU. Activation memory is an estimate (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", 2022; ``activation_memory``); everything else is counted.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional

from mlp_offload import PlacementError, UpdateRates, streamed_elems_per_s
from mlp_offload import first_forward_share, predict_iteration
from mlp_offload import EnginePlan, MeasuredRates, plan_engine
from mlp_offload import STATE_TENSORS, FP32_BYTES, GPU_TIER, bytes_per_param
from mlp_offload import HostMemoryError, check_host_memory
from mlp_offload import GiB

from megatron.training.runtime.host_memory import PROCESS_BYTES_CPU, PROCESS_BYTES_GPU, beside_engine

from megatron.training.model.flops import GptShape, flops_per_iteration
from megatron.training.model.sizes import StageParams, active_params, model_params, stage_params
from megatron.training.offload.activation_memory import (activation_bytes, backward_workspace_bytes,
                                                         layer_major_activation_bytes, microbatches_in_flight)
from megatron.training.offload.gpu_tier_start import starting_gpu_tier_bytes
from megatron.training.offload.shard_budgets import check_host_split, config_for_kind
from megatron.training.offload.plan_types import Machine, Plan
from megatron.training.errors import UserError
from megatron.training.offload.options import (GPU_CACHE_FLAG, GRADS_IN_HOST, PARAMS_IN_HOST, grads_in_host_memory,
                                               in_flags, layer_major_flags, params_in_host_memory)
from megatron.training.offload.params_streaming import (StreamedParams, streamed_compute_seconds, streamed_params,
                                                        streamed_params_refusal, update_copies)

# CUDA context, cuBLAS workspaces, kernels: device memory torch's allocator cannot reach (what the
# gpu tier auto lines of the GPU runs showed it could reach: docs/benchmarks.md).
CUDA_RESERVE_BYTES = int(3.5 * GiB)
HOST_SHARE = 0.8  # of a node's memory, what optimizer state may take (the rest: OS, data loaders, pinning)


def gradient_itemsize(args) -> int:
    """Bytes per element of megatron-core's gradient buffer, as ``training.build_model`` configures its
    DDP: fp32 (main_grad) unless the grads are reduced in 16 bits (fp16, or bf16 with --grad-reduce-in-bf16)."""
    return 2 if args.fp16 or (args.bf16 and getattr(args, "grad_reduce_in_bf16", False)) else 4


def update_rates_for(offload_config, machine: Machine, adam_elems_per_s: float,
                     convert_elems_per_s: float) -> Optional[UpdateRates]:
    """The engine's update rates on one of the machine's GPUs for this state: the streamed rate
    bounded by the GPU's link and its share of the node's host bandwidth (the node's ranks stream
    at once), the side-by-side rates scaled alike. None without device rates (no device update)."""
    d = machine.device_rates
    if d is None:
        return None
    state_bytes = bytes_per_param(offload_config.state_codecs)
    alone = streamed_elems_per_s(state_bytes, d.link_bps, 1, None, d.streamed_elems_per_s)
    streamed = streamed_elems_per_s(state_bytes, d.link_bps, machine.gpus_per_node, d.node_host_bps,
                                    d.streamed_elems_per_s)
    beside = d.streamed_beside_elems_per_s and d.streamed_beside_elems_per_s * streamed / alone
    return UpdateRates(1 / (1 / adam_elems_per_s + 1 / convert_elems_per_s), device_resident=d.resident_elems_per_s,
                       device_streamed=streamed, cpu_shared=d.cpu_beside_elems_per_s, streamed_shared=beside)


def host_grad_itemsize(args) -> Optional[int]:
    """Bytes per gradient element in the engine's host buffer on a CPU run (as build_model's DDP
    keeps them: bf16 reduced in fp32 unless --grad-reduce-in-bf16); None on a GPU."""
    return gradient_itemsize(args) if getattr(args, "device", None) == "cpu" else None


def suggested_host_cache_gb(machine: Machine, ranks_per_node: int, subgroup_size: int, beside_bytes: int = 0) -> float:
    """The largest per-rank host budget the node holds beside the gradient scratch, in whole GB: its share of
    what the node has left beside ``beside_bytes`` (per node: the params, grads and layer inputs a plan put in host
    memory)."""
    scratch = 2 * subgroup_size * FP32_BYTES
    per_rank = max(0, machine.host_memory_bytes - beside_bytes) * HOST_SHARE / ranks_per_node - scratch
    return max(0.0, float(int(per_rank / GiB)))


def host_beside_state(plan: "Plan") -> int:
    """What a plan put of the model in a node's host memory: params, grads, layer inputs (the processes, data
    workers and the OS are in the share the suggestion leaves)."""
    return sum(v for k, v in plan.host_bytes_per_node.items() if k.startswith("host_"))


@dataclass(frozen=True)
class RankShards:
    """One rank of the largest pipeline stage: its parameters, and the optimizer state of each of
    megatron-core's distributed optimizers: dense over data parallelism (world / (TP x PP)); with
    EP > 1 the routed experts have their own, over expert-data parallelism (world / (EP x ETP x PP));
    with EP 1 megatron-core keeps them with the dense parameters."""

    params: int
    shards: Dict[str, int]  # each optimizer's state elements on this rank, dense first


def rank_shards(stages: List[StageParams], cfg, world: int) -> RankShards:
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    ep = cfg.expert_model_parallel_size or 1
    dp = world // (tp * pp)
    edp = world // (ep * (cfg.expert_tensor_parallel_size or tp) * pp)

    def shards(s: StageParams) -> Dict[str, int]:
        split = {"dense": s.dense, "experts": s.experts} if ep > 1 and s.experts else {"dense": s.params}
        return {k: -(-n // (dp if k == "dense" else edp)) for k, n in split.items()}

    stage = max(stages, key=lambda s: (sum(shards(s).values()), s.params))
    return RankShards(stage.params, shards(stage))


def gpu_tier_hint(gpu: Dict[str, int], machine: Machine, offload_config) -> str:
    """Where a fixed gpu tier is what overflows the GPU: the size that fits, or auto."""
    tier = gpu.get("optimizer_state_gpu_tier", 0)
    if not tier or offload_config is None or offload_config.gpu_budget_auto:
        return ""
    fits = (machine.gpu_memory_bytes - (sum(gpu.values()) - tier)) / GiB
    if fits <= 0:
        return ""
    return f"; {GPU_CACHE_FLAG} {fits:.1f} fits (or auto)"


@dataclass(frozen=True)
class AutoGpuRoom:
    """An auto gpu tier's device memory: ``spare_bytes``, what the training's peak leaves its steps;
    ``start_bytes``, where it starts (``gpu_tier_start``; 0 with two engines)."""
    spare_bytes: int = 0
    start_bytes: int = 0


@dataclass
class PlannedEngines:
    engines: Dict[str, EnginePlan]  # each engine as its steps find it
    at_start: Dict[str, EnginePlan]  # each engine as it starts
    problems: List[str]


def plan_engines(args, machine: Machine, offload_config, ranks: RankShards, measured: MeasuredRates,
                 capacity_bytes: Dict[str, int], gpu_room: AutoGpuRoom = AutoGpuRoom()) -> PlannedEngines:
    """One engine per distributed optimizer, as the training builds them (``shard_budgets``); the
    experts' engine gets the file tiers' space the dense one leaves, and with an auto gpu tier the
    spare device memory (``gpu_room.spare_bytes``) the dense one leaves. Each engine as it starts
    (``at_start``): an auto gpu tier starts at ``gpu_room.start_bytes``, so host memory and disk hold
    more then. ``measured``: the file tiers' and the CPU's rates (the device's come from ``machine``)."""
    planned = PlannedEngines({}, {}, [])
    engines, at_start, problems = planned.engines, planned.at_start, planned.problems
    gpu_spare_bytes = gpu_room.spare_bytes
    space = dict(capacity_bytes)
    update_rates = update_rates_for(offload_config, machine, measured.adam_elems_per_s, measured.convert_elems_per_s)
    try:
        check_host_split(offload_config, ranks.shards)  # the training's refusal, before either engine
    except UserError as err:
        problems.append(str(err))
        return planned
    for kind, shard in ranks.shards.items():
        config = config_for_kind(offload_config, kind, ranks.shards)
        plan = functools.partial(plan_engine, shard, config, dataclasses.replace(measured, update=update_rates),
                                 space, machine.gpus_per_node, host_grad_itemsize(args))
        try:
            at_start[kind] = (plan(gpu_budget_bytes=gpu_room.start_bytes)
                              if config.gpu_budget_auto and gpu_room.start_bytes else plan())
            engines[kind] = plan(gpu_budget_bytes=gpu_spare_bytes) if config.gpu_budget_auto else at_start[kind]
        except PlacementError as err:
            problems.append(in_flags(str(err)))
            break
        gpu_spare_bytes = max(0, gpu_spare_bytes - engines[kind].stored_bytes.get(GPU_TIER, 0))
        for t in offload_config.file_tiers:  # what the engine holds there at start-up, or later if more
            held = max(engines[kind].stored_bytes[t], at_start[kind].stored_bytes[t])
            space[t] = max(0, space[t] - machine.gpus_per_node * held)
    return planned


def starting_gpu_tier(args, cfg, machine: Machine, offload_config, gpu: Dict[str, int], engines: int,
                      data_parallel: int) -> int:
    """Where the training starts an auto gpu tier (``offload.factory``: one engine on a GPU, from the
    device memory the model and its gradient buffers leave free); 0 where it starts empty."""
    if not offload_config.gpu_budget_auto or engines != 1 or machine.device_rates is None:
        return 0
    free = machine.gpu_memory_bytes - gpu["cuda_reserve"] - gpu["parameters"] - gpu["gradients"]
    return starting_gpu_tier_bytes(args, cfg, free, offload_config.gpu_margin_bytes, data_parallel)


def overlaps_forward(args, cfg, machine: Machine) -> bool:
    """--offload-overlap-forward where the training runs it: at one data-parallel rank (dense and
    expert), and above it with --overlap-param-gather outside the interleaved pipeline (else refused)."""
    if not getattr(args, "offload_overlap_forward", False):
        return False
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    expert_ranks = (cfg.expert_model_parallel_size or 1) * (cfg.expert_tensor_parallel_size or tp)
    one_rank = machine.world == tp * pp and (cfg.num_moe_experts is None or machine.world == expert_ranks * pp)
    interleaved = (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1
    return one_rank or (bool(getattr(args, "overlap_param_gather", False)) and not interleaved)


def iteration_seconds(compute_s: float, engines: Dict[str, EnginePlan], overlap: bool, micro_batches: int,
                      recompute_full: bool) -> float:
    """The engine's own iteration model (``predict_iteration``): the update in series, or with the
    overlap its deferred device share under the next step's first forward. The step updates the
    engines one after the other (the dense one first), so their shares add up."""
    preds = [e.prediction for e in engines.values()]
    update_s = sum(p.update_s for p in preds)
    if not overlap:
        return compute_s + update_s
    return predict_iteration(compute_s, update_s, sum(p.deferred_s for p in preds), sum(p.serial_s for p in preds),
                             compute_s * first_forward_share(micro_batches, recompute_full),
                             sum(p.deferred_in_hbm_s for p in preds))


def ddp_build_peak_problems(streamed: StreamedParams, machine: Machine) -> List[str]:
    """Start-up with the params in host memory (``host_params.ddp_with_params_in_host_memory``): the model moves
    to host memory, then DDP copies each param into its buffer (host memory committed as it is written, each old
    copy freed after it, pinned in place after the last: ``runtime.host_memory.pin_in_place``), so the node holds
    the params once, and the grads with them, before the engine takes any host memory."""
    process = PROCESS_BYTES_GPU
    peak = machine.gpus_per_node * (streamed.host_bytes + streamed.grad_host_bytes + process)
    if peak <= machine.host_memory_bytes:
        return []
    return [f"host memory at start-up: {machine.gpus_per_node} rank(s) x ({streamed.host_bytes / GiB:.1f} GiB of "
            f"params" + (f" + {streamed.grad_host_bytes / GiB:.1f} GiB of grads" if streamed.grad_host_bytes else "")
            + f" + {process / GiB:.1f} GiB the process) = {peak / GiB:.1f} GiB, more than the node's "
            f"{machine.host_memory_bytes / GiB:.1f} GiB: fewer params per rank (tensor or pipeline parallel)"]


def make_plan(args, cfg, machine: Machine, offload_config, measured: MeasuredRates, capacity_bytes: Dict[str, int],
              batch_sizes: List[int]) -> Plan:
    """The whole plan. ``offload_config`` is None for a run without ``--offload-tiers``; ``measured``:
    the file tiers' and the CPU's rates."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    vp = cfg.virtual_pipeline_model_parallel_size
    dp = machine.world // (tp * pp)
    stages = stage_params(cfg, args.padded_vocab_size, args.max_position_embeddings,
                          args.position_embedding_type, not args.untie_embeddings_and_output_weights)
    ranks = rank_shards(stages, cfg, machine.world)
    per_rank = ranks.params
    shard = sum(ranks.shards.values())
    problems: List[str] = []
    param_bytes = 2 if (args.bf16 or args.fp16) else 4
    microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    asked = layer_major_flags(args)
    layer_major = asked["inputs_in_host"] or asked["params_in_host"] or asked["grads_in_host"]
    grads_host = grads_in_host_memory(args)
    streamed = (streamed_params(cfg, per_rank, param_bytes, gradient_itemsize(args) if grads_host else 0)
                if params_in_host_memory(args) or grads_host else None)
    if streamed is not None:
        refusal = streamed_params_refusal(cfg, args, params_in_host_memory(args), grads_host)
        if refusal:
            problems.append(f"{GRADS_IN_HOST if grads_host else PARAMS_IN_HOST}: {refusal}")
        problems += ddp_build_peak_problems(streamed, machine)
    gpu = {"parameters": streamed.device_bytes if streamed else per_rank * param_bytes,
           "gradients": streamed.grad_device_bytes if streamed and grads_host else per_rank * gradient_itemsize(args),
           "activations": activation_bytes(args, cfg, microbatches_in_flight(pp, vp, microbatches)),
           "backward_workspace": backward_workspace_bytes(args, cfg),
           "cuda_reserve": CUDA_RESERVE_BYTES}
    activations_in_host = 0
    if layer_major:  # every micro-batch of the step at once, layer by layer
        # (in passes of a group of micro-batches, one group's at a time)
        gpu["activations"], activations_in_host = layer_major_activation_bytes(
            args, cfg, min(asked["group"] or microbatches, microbatches), asked["inputs_in_host"])
    engines: Dict[str, EnginePlan] = {}
    tiers_per_node: Dict[str, int] = {}
    host_per_node: Dict[str, int] = {}
    if offload_config is None:
        # Adam's two moments, and fp32 master weights where the model trains in 16 bits.
        state = (len(STATE_TENSORS) - (0 if args.bf16 or args.fp16 else 1)) * FP32_BYTES
        gpu["optimizer_state"] = (shard if args.use_distributed_optimizer else per_rank) * state
    else:
        # fp32 gradient staging and the update's copy-back, one per engine
        gpu["offload_staging"] = sum(3 * min(n, offload_config.subgroup_size) * FP32_BYTES
                                     for n in ranks.shards.values())
        # The auto gpu tier fills what the training's own peak leaves beyond the margin, as its steps find it.
        spare = max(0, machine.gpu_memory_bytes - sum(gpu.values()) - offload_config.gpu_margin_bytes)
        room = AutoGpuRoom(spare, starting_gpu_tier(args, cfg, machine, offload_config, gpu, len(ranks.shards), dp))
        planned = plan_engines(args, machine, offload_config, ranks, measured, capacity_bytes, room)
        engines, at_start = planned.engines, planned.at_start
        problems += planned.problems
        if GPU_TIER in offload_config.tiers:
            gpu["optimizer_state_gpu_tier"] = sum(e.stored_bytes.get(GPU_TIER, 0) for e in engines.values())
        if len(engines) == len(ranks.shards):
            # Pinned at start-up, before an auto gpu tier takes any of it: the start-up's host state counts.
            cache = sum(max(e.placement.host_state_bytes, at_start[k].placement.host_state_bytes)
                        for k, e in engines.items())
            staging = sum(e.host_bytes - e.placement.host_state_bytes for e in engines.values())
            host_per_node["optimizer_state"] = machine.gpus_per_node * cache
            host_per_node["gradient_scratch"] = machine.gpus_per_node * staging
            # Every other host consumer the start-up guard counts: the ranks' processes, their workers.
            process = PROCESS_BYTES_GPU if host_grad_itemsize(args) is None else PROCESS_BYTES_CPU
            beside = beside_engine(getattr(args, "num_workers", 0), process)
            if streamed is not None:
                beside["host params"] = streamed.host_bytes  # pinned before the engine starts
                if streamed.grad_host_bytes:
                    beside["host grads"] = streamed.grad_host_bytes
            if activations_in_host:
                beside["host activations"] = activations_in_host  # each layer's inputs, every micro-batch's
            host_per_node.update({f"{k.replace(' ', '_')}": machine.gpus_per_node * v for k, v in beside.items()})
            try:  # the guard's own check, against the node's memory: DOES NOT FIT where it would refuse
                check_host_memory({"optimizer cache": cache, "gradient staging": staging},
                                  machine.gpus_per_node, beside, bool(offload_config.file_tiers),
                                  (machine.host_memory_bytes, "the node's memory"))
            except HostMemoryError as err:
                problems.append(in_flags(str(err)))
            tiers_per_node = {t: machine.gpus_per_node * sum(max(e.stored_bytes[t], at_start[k].stored_bytes[t])
                                                             for k, e in engines.items())
                              for t in offload_config.file_tiers}
        else:
            engines = {}
    gpu_total = sum(gpu.values())
    if gpu_total > machine.gpu_memory_bytes:
        problems.append(f"GPU memory: {gpu_total / GiB:.1f} GiB per rank needed "
                        f"({', '.join(f'{k} {v / GiB:.1f}' for k, v in gpu.items())}), "
                        f"{machine.gpu_memory_bytes / GiB:.1f} GiB per GPU"
                        + gpu_tier_hint(gpu, machine, offload_config))
    host_total = sum(host_per_node.values())
    # The start-up guard's own check (above) decides where the engines were planned: a stricter rule
    # here would refuse runs the guard admits and that train.
    if not engines and host_total > machine.host_memory_bytes * HOST_SHARE:
        problems.append(f"host memory: {host_total / GiB:.1f} GiB per node for optimizer state and scratch, more than "
                        f"{HOST_SHARE:.0%} of the node's {machine.host_memory_bytes / GiB:.1f} GiB")

    shape = GptShape.from_config(cfg, args.seq_length, args.padded_vocab_size)

    link = machine.device_rates.link_bps / 2 if machine.device_rates else None  # one direction

    def compute_seconds(global_batch: int) -> float:
        m = global_batch // (args.micro_batch_size * dp)
        # 1F1B: the pipeline fills and drains once per step; V chunks per rank make that V times shorter. The
        # layer-major step runs its stages one after the other (GPipe's order without its overlap).
        bubble = pp if layer_major else 1 + (pp - 1) / (max(m, 1) * (vp or 1))
        seconds = flops_per_iteration(shape, global_batch) / machine.world / (machine.gpu_tflops * 1e12) * bubble
        passes = -(-m // min(asked["group"] or m, max(m, 1))) if layer_major else 1
        return streamed_compute_seconds(seconds, streamed, link, passes) if streamed and link else seconds

    copies_s = 0.0
    if streamed is not None and link and engines:
        cpu, device = (sum(getattr(e.prediction, f"{side}_subgroups") for e in engines.values())
                       for side in ("cpu", "device"))
        copies = update_copies(streamed, link, device / max(1, cpu + device), offload_config.param_remainders)
        copies_s = copies.added_to(sum(e.prediction.update_s for e in engines.values()))

    def iteration(global_batch: int) -> float:
        return copies_s + iteration_seconds(compute_seconds(global_batch), engines, overlap,
                                            global_batch // (args.micro_batch_size * dp),
                                            args.recompute_granularity == "full")

    overlap = overlaps_forward(args, cfg, machine)
    compute_s = compute_seconds(args.global_batch_size)
    update_s = copies_s + sum(e.prediction.update_s for e in engines.values()) if engines else None
    iteration_s = iteration(args.global_batch_size)
    parts = {"compute": compute_s, **({"param copies in the update": copies_s} if copies_s else {})}
    for e in engines.values():
        parts["cpu adam"] = parts.get("cpu adam", 0.0) + e.prediction.adam_s
        parts["gpu update"] = parts.get("gpu update", 0.0) + e.prediction.device_s
        for t, seconds in e.prediction.tier_s.items():
            parts[f"{t} I/O"] = parts.get(f"{t} I/O", 0.0) + e.prediction.ranks_sharing * seconds
    bottleneck = max(parts, key=parts.get)
    tokens = {g: g * args.seq_length / iteration(g) for g in batch_sizes}
    expert_ranks = (cfg.expert_model_parallel_size or 1) * (cfg.expert_tensor_parallel_size or tp)
    total = model_params(stages, tp, expert_ranks)
    # What a save writes: the weights once (torch_dist's files), each rank's optimizer state (its offload file, or
    # megatron-core's fp32 master and moments in torch_dist's: once per data-parallel group where not sharded over
    # it), as the largest stage's rank holds it.
    if engines:
        state_bytes = machine.world * sum(e.state_bytes for e in engines.values())
    else:
        holders = machine.world if args.use_distributed_optimizer else machine.world // dp
        state_bytes = holders * gpu.get("optimizer_state", 0)
    checkpoint = {"weights": total * param_bytes, "optimizer state": state_bytes}
    return Plan(not problems, problems, total, per_rank, shard, gpu, host_per_node, tiers_per_node, compute_s,
                update_s, iteration_s, bottleneck, tokens, engines, params_active=active_params(cfg, total),
                shard_numels=dict(ranks.shards), overlaps_forward=overlap, param_copies_s=copies_s,
                checkpoint_bytes=checkpoint)
