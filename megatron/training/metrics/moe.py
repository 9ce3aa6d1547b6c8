"""The MoE auxiliary losses of an iteration, as Megatron-LM logs them.

megatron-core's router records each MoE layer's aux losses (load balancing, z-loss) in its tracker as
the forward runs; Megatron-LM's ``training_log`` reduces the tracker across ranks, scales it by
1/micro-batches, averages over the MoE layers and clears it, every iteration. ``aux_losses`` does
that through megatron-core's own ``track_moe_metrics`` (a collective: every rank calls it).
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron.training.model.moe import moe_layers, tracked_losses


def aux_losses(args) -> Dict[str, float]:
    """{name: mean over MoE layers} of this iteration, plus ``moe/<name>_layer_<i>`` per layer with
    --moe-per-layer-logging (for TensorBoard and W&B only, as upstream). Empty for a dense model."""
    names = tracked_losses(args)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    per_layer = {}
    if args.moe_per_layer_logging:  # read before track_moe_metrics clears the tracker
        tracker = get_moe_layer_wise_logging_tracker()
    totals: Dict[str, object] = {}
    track_moe_metrics(loss_scale=1.0 / args.num_microbatches, iteration=0, total_loss_dict=totals,
                      force_initialize=True, track_names=names, num_layers=args.num_layers,
                      moe_layer_freq=args.moe_layer_freq, per_layer_logging=False)
    if args.moe_per_layer_logging:
        per_layer = {f"moe/{name}_layer_{i}": float(v) for name in names
                     for i, v in enumerate(tracker.get(name, {}).get("values", [])) if moe_layers(
                         args.num_layers, args.moe_layer_freq)[i]}
    return {**{name: float(totals[name]) for name in names if name in totals}, **per_layer}


def moe_summary(args, config, total_params: int, world: int) -> str:
    """The start-up line of an MoE model: its experts, their parallel grid and the parameters one
    token uses (the throughput figures count the same top-k experts, ``model.flops``)."""
    from megatron.training.model.sizes import active_params

    pattern = moe_layers(args.num_layers, args.moe_layer_freq)
    ep, etp, pp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    active = active_params(config, total_params)
    return (f"> mixture of experts: {args.num_experts} experts, top-{args.moe_router_topk}, in {sum(pattern)} of "
            f"{args.num_layers} layers | EP={ep} ETP={etp} expert-DP={world // (ep * etp * pp)} | "
            f"active parameters per token: {active} ({100 * active / total_params:.1f}% of {total_params})")


def experts_line(model_chunks) -> Optional[str]:
    """The start-up line naming the module megatron-core built for this rank's experts (SequentialMLP,
    GroupedMLP or TEGroupedMLP: which kernels run them), None where this rank's stage has no MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                kind = type(module.experts)
                return (f"> experts module: {kind.__module__}.{kind.__name__}, "
                        f"{module.num_local_experts} local experts per rank")
    return None
