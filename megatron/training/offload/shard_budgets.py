"""Each distributed optimizer's engine config, where a mixture-of-experts model has two (dense over
data parallelism, experts over expert-data parallelism): the training's and the planner's one rule."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

from mlp_offload import GiB, OffloadConfig, min_host_budget_bytes

from megatron.training.errors import UserError
from megatron.training.offload.options import HOST_CACHE_FLAG, flag_figure


def host_shares(budget: int, numels: Dict[str, int]) -> Dict[str, int]:
    """``budget`` bytes shared by state elements, the first engine (dense) taking what rounding leaves."""
    total = max(1, sum(numels.values()))
    shares = {k: budget * n // total for k, n in numels.items()}
    shares[next(iter(numels))] += budget - sum(shares.values())
    return shares


def gpu_share_of(config: OffloadConfig, kind: str, numels: Dict[str, int]) -> Optional[int]:
    """A fixed gpu tier shared by state elements (None: the config's own, unbounded or learnt)."""
    gpu = config.gpu_budget_bytes
    return None if gpu is None else gpu * numels[kind] // max(1, sum(numels.values()))


def config_for_kind(config: OffloadConfig, kind: str, numels: Dict[str, int], **shard_facts) -> OffloadConfig:
    """One engine's config from the rank's, in one step. ``numels``: each engine's optimizer-state
    elements on this rank, dense first. The host budget is shared by them (``host_shares``), a fixed
    gpu tier likewise, and the experts' engine gets its own swap namespace (a run id of its own:
    namespaces are per rank) and trace file. ``shard_facts``: fields the engine's shard decides
    (``param_remainders``)."""
    changes = dict(shard_facts)
    if len(numels) > 1:
        budget = config.host_budget_bytes
        changes.update(host_budget_bytes=None if budget is None else host_shares(budget, numels)[kind],
                       gpu_budget_bytes=gpu_share_of(config, kind, numels))
        if kind != "dense":
            changes.update(run_id=f"{config.resolved_run_id()}.{kind}",
                           trace_path=None if not config.trace_path else f"{config.trace_path}.{kind}")
    changes = {name: value for name, value in changes.items() if getattr(config, name) != value}
    return dataclasses.replace(config, **changes) if changes else config


def check_host_split(config: OffloadConfig, numels: Dict[str, int]) -> None:
    """Refuse, before either engine starts, a host budget whose share is below one engine's minimum:
    one line naming the budget as the flag gave it, its split, and the least budget that starts both
    (each engine alone would name only its own share, a value nobody typed)."""
    budget = config.host_budget_bytes
    if len(numels) == 1 or budget is None:
        return
    numels = {k: n for k, n in numels.items() if n > 0}  # an engine without state needs no host memory
    shares = host_shares(budget, numels)
    # Not from config_for_kind: a host-only share of 0 bytes is no config at all.
    floors = {k: min_host_budget_bytes(n, config, gpu_share_of(config, k, numels)) for k, n in numels.items()}
    if all(shares[k] >= floors[k] for k in numels):
        return
    total = sum(numels.values())
    # Each engine's share of this is at least its minimum (the dense one's rounding only adds).
    least = max(-(-floors[k] * total // n) for k, n in numels.items())
    split = " / ".join(f"{k} {share_and_need(shares[k], floors[k], n)}" for k, n in numels.items())
    other = "lower --offload-subgroup-size" if config.file_tiers else "add a file tier"
    raise UserError(f"{HOST_CACHE_FLAG} {flag_figure(budget, GiB)} is too small for the {' and '.join(numels)} "
                    f"engines together: split by optimizer state elements it gives {split}; {HOST_CACHE_FLAG} "
                    f"{gib_at_least(least)} starts both (or {other})")


def share_and_need(share: int, need: int, numel: int) -> str:
    """One engine's share of the budget and its minimum in GiB, to 3 significant digits, or as many
    more as show a share below its minimum as less (not "0.000557 GiB ..., needs 0.000557")."""
    digits = 3
    while share < need and f"{share / GiB:.{digits}g}" == f"{need / GiB:.{digits}g}" and digits < 12:
        digits += 1
    return f"{share / GiB:.{digits}g} GiB ({numel} elements, needs {need / GiB:.{digits}g})"


def gib_at_least(nbytes: int, digits: int = 4) -> str:
    """The shortest GiB figure of ``digits`` significant digits that the flag reads as at least
    ``nbytes`` (it keeps ``int(value * GiB)`` bytes): rounded up, never down."""
    exact = nbytes / GiB
    decimals = max(0, digits - 1 - math.floor(math.log10(exact)))
    step = 10 ** -decimals
    value = math.ceil(exact / step) * step
    while int(float(f"{value:.{decimals}f}") * GiB) < nbytes:  # float rounding in the product
        value += step
    return f"{value:.{decimals}f}"
