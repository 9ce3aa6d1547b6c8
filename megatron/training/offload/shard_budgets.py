"""Each distributed optimizer's engine config, where a mixture-of-experts model has two (dense over
data parallelism, experts over expert-data parallelism): the training's and the planner's one rule."""

from __future__ import annotations

import dataclasses
from typing import Dict

from mlp_offload import OffloadConfig


def config_for_kind(config: OffloadConfig, kind: str, numels: Dict[str, int]) -> OffloadConfig:
    """``numels``: each engine's optimizer-state elements on this rank, dense first. The host budget
    is shared by them (the dense engine takes what rounding leaves), a fixed gpu tier likewise, and the
    experts' engine gets its own swap namespace (a run id of its own: namespaces are per rank) and
    trace file."""
    if len(numels) == 1:
        return config
    total, budget = max(1, sum(numels.values())), config.host_budget_bytes
    shares = {k: None if budget is None else budget * n // total for k, n in numels.items()}
    if budget is not None:
        first = next(iter(numels))
        shares[first] += budget - sum(shares.values())
    gpu = config.gpu_budget_bytes
    gpu_share = None if gpu is None else gpu * numels[kind] // total
    if kind == "dense":
        return dataclasses.replace(config, host_budget_bytes=shares[kind], gpu_budget_bytes=gpu_share)
    return dataclasses.replace(config, run_id=f"{config.resolved_run_id()}.{kind}", host_budget_bytes=shares[kind],
                               gpu_budget_bytes=gpu_share,
                               trace_path=None if not config.trace_path else f"{config.trace_path}.{kind}")
