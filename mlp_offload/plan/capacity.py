"""The engine's plan for a shard it has not built: placement, bytes per tier and the predicted update,
from rates and capacities alone. Nothing is probed, allocated or written, so a cluster can be planned
from a laptop; the engine itself runs the same ``plan_placement`` and ``predict_update`` at start-up
(``startup.start_up``), so what is planned here is what the engine will do with the same numbers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..config import OffloadConfig
from .placement import Placement, UpdateRates, plan_placement, tokens_for
from .prediction import MeasuredRates, NodeSharing, Prediction, predict_update
from .split import settled_sides
from ..gradients import gradient_host_bytes
from ..subgroups.partition import Subgroup, partition
from ..kernels.update import Fp32Working


@dataclass
class EnginePlan:
    subgroups: List[Subgroup]
    placement: Placement
    prediction: Prediction
    tokens_per_tier: Dict[str, int]
    stored_bytes: Dict[str, int]  # per tier: this rank's state kept there between steps
    host_bytes: int  # this rank's host memory: resident state, pipeline/cache buffers, gradient scratch

    @property
    def state_bytes(self) -> int:
        return sum(sg.state_bytes for sg in self.subgroups)


def plan_engine(numel: int, config: OffloadConfig, measured: MeasuredRates, capacity_bytes: Dict[str, int],
                ranks_per_node: int, host_grad_itemsize: Optional[int] = None,
                gpu_budget_bytes: Optional[int] = None) -> EnginePlan:
    """Plan one rank's shard of ``numel`` elements at the ``measured`` rates; ``capacity_bytes`` is each
    file tier's space as the node's ``ranks_per_node`` ranks share it. Raises ``PlacementError`` where it does not fit.
    ``host_grad_itemsize``: the gradients' bytes per element where they come through host memory
    (a CPU run); None where a GPU converts and sends them per subgroup. ``gpu_budget_bytes``: the
    device tier's size where the config's is learnt (``gpu_budget_auto``): the spare device memory
    its steps would find. With the device's rates in ``measured.update`` and ``update_on`` "auto",
    the split is the one the steps settle on (``split.settled_sides``), not the start-up's."""
    config = dataclasses.replace(config, ranks_sharing_node=ranks_per_node)
    subgroups = partition(numel, config.subgroup_size, config.state_codecs)
    rates = measured.tiers
    update_rates = measured.update or UpdateRates(1 / (1 / measured.adam_elems_per_s + 1 / measured.convert_elems_per_s))
    placement = plan_placement(subgroups, config, rates, capacity_bytes, update_rates=update_rates,
                               gpu_budget_bytes=gpu_budget_bytes)
    interleaved = host_grad_itemsize is None and config.interleave_device_updates  # a GPU's order (plan.device_share)
    if config.update_on == "auto" and update_rates.device_streamed:
        placement.update_on = settled_sides([sg.numel for sg in subgroups], placement.tier_of, update_rates,
                                            interleaved)
    tokens = {t: config.tokens_per_tier or tokens_for(rates[t], ranks_per_node) for t in config.file_tiers}
    prediction = predict_update(subgroups, placement, dataclasses.replace(measured, update=update_rates),
                                NodeSharing(None, ranks_per_node, tokens), config.cache_alternating,
                                interleaved)
    stored = {t: sum(subgroups[i].state_bytes for i in placement.subgroups_on(t)) for t in config.file_tiers}
    stored = {**placement.resident_bytes, **stored}
    largest = max(sg.numel for sg in subgroups)
    host = (placement.host_state_bytes + gradient_host_bytes(numel, largest, host_grad_itemsize)
            + Fp32Working.planned_bytes(config.state_codecs, largest)
            + (largest * 2 if config.param_remainders else 0))  # the CPU update's bf16 params
    return EnginePlan(subgroups, placement, prediction, tokens, stored, host)
