"""The tiers' fields of ``OffloadConfig`` checked together: the tier list, each file tier's directory, the host
budget beside them, the given bandwidths (made ``TierBandwidth``s) and the I/O token scopes."""

from __future__ import annotations

from typing import Dict, List

from ..tiers.kinds import HOST_MEMORY
from .bandwidth import TierBandwidth
from .checks import OffloadConfigError, is_int

HOST_TIER = HOST_MEMORY.name
TOKEN_SCOPES = ("node", "job")


def check_tier_fields(cfg) -> None:
    """The tiers' fields of ``cfg`` (an ``OffloadConfig`` whose ``tiers`` is a list) against each other."""
    if not cfg.tiers:
        raise OffloadConfigError(f"offload tiers: the list is empty; name at least one tier, e.g. {HOST_TIER!r}")
    if len(set(cfg.tiers)) != len(cfg.tiers):
        raise OffloadConfigError(f"offload tiers: {cfg.tiers} names a tier twice")
    for name in cfg.tiers:
        if not name.replace("_", "").isalnum():
            raise OffloadConfigError(f"offload tiers: tier name {name!r} must be alphanumeric")
    for name in cfg.file_tiers:
        if name not in cfg.paths or not cfg.paths[name]:
            raise OffloadConfigError(
                f"offload tier {name!r} has no directory: give its path "
                f"(paths[{name!r}])"
            )
    extra = set(cfg.paths) - set(cfg.file_tiers)
    if extra:
        name = sorted(extra)[0]
        raise OffloadConfigError(
            f"paths[{name!r}] is given, but {name!r} is not a file tier of the offload tiers {cfg.tiers}"
        )
    if cfg.has_host and cfg.file_tiers and cfg.host_budget_bytes is None:
        raise OffloadConfigError(
            "offload tiers mix host memory with file tiers but no host budget is set: "
            "give host_budget_bytes (the host memory this rank may use for optimizer state)"
        )
    budget = cfg.host_budget_bytes
    if budget is not None and not is_int(budget):
        raise OffloadConfigError(
            f"host budget (host_budget_bytes) must be a whole number of bytes "
            f"or None, got {budget!r}")
    if not cfg.file_tiers and budget is not None and budget <= 0:
        raise OffloadConfigError(
            f"host-only offload needs a positive host budget (host_budget_bytes), or none at all; got {budget}")
    if budget is not None and budget < 0:
        raise OffloadConfigError(f"host budget (host_budget_bytes) must be >= 0 bytes, got {budget}")
    for name, bw in list(cfg.bandwidths.items()):
        if name not in cfg.file_tiers:
            raise OffloadConfigError(f"bandwidths: {name!r} is not a file tier of the offload tiers {cfg.tiers}")
        if isinstance(bw, (tuple, list)):
            try:
                cfg.bandwidths[name] = TierBandwidth(*bw)
            except OffloadConfigError as err:
                raise OffloadConfigError(f"bandwidths[{name!r}] = {bw!r}: {err}") from None
    _check_token_scope(cfg.token_scope, cfg.file_tiers)


TOKEN_SCOPES = ("node", "job")


def _check_token_scope(scope: Dict[str, str], file_tiers: List[str]) -> None:
    for name, value in scope.items():
        if name not in file_tiers:
            raise OffloadConfigError(f"token_scope[{name!r}] is given, but {name!r} is not a file tier")
        if value not in TOKEN_SCOPES:
            raise OffloadConfigError(f"token_scope[{name!r}] must be 'node' or 'job', got {value!r}")
