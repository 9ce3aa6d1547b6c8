"""Which layers of a mixture-of-experts model are MoE, and the aux losses its router records: pure
functions of the MoE flags, shared by their checks (``args.moe``) and the metrics (``metrics.moe``)."""

from __future__ import annotations

from typing import List, Union

# The aux-loss kinds megatron-core's router tracks, and the name each is logged under (as Megatron-LM).
TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def moe_layers(num_layers: int, freq: Union[int, List[int]]) -> List[int]:
    """1 where a layer is MoE, as megatron-core reads --moe-layer-freq."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


def tracked_losses(args) -> List[str]:
    """The names megatron-core's router records its aux losses under, in Megatron-LM's order."""
    if args.num_experts is None:
        return []
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = [TRACKED_LOSSES[t] for t in TRACKED_LOSSES if t in types]
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names
