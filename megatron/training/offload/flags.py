"""The ``--offload-*`` flags and the engine's ``OffloadConfig`` fields: one table, both ways.

The engine names its config fields in errors (``host_budget_bytes=4194304``, ``paths['nvme']``);
``in_flags`` rewrites such a message in the flags a user of ``pretrain_gpt.py`` typed, values in
the flags' units. ``config_from_args`` builds the config from the flags.
"""

from __future__ import annotations

import re

from megatron.training.model.precision_aware import state_dtypes
from mlp_offload import OffloadConfig, parse_bandwidths

# field -> (flag, bytes per flag unit); flags that switch a feature off map to the field they clear
FLAG_OF_FIELD = {
    "host_budget_bytes": ("--offload-host-cache-gb", 1 << 30),
    "subgroup_size": ("--offload-subgroup-size", 1),
    "prefetch_depth": ("--offload-prefetch-depth", 1),
    "tokens_per_tier": ("--offload-tokens-per-tier", 1),
    "io_block_bytes": ("--offload-io-block-mb", 1 << 20),
    "io_threads": ("--offload-io-threads", 1),
    "probe_bytes": ("--offload-probe-mb", 1 << 20),
    "adam_kernel": ("--offload-adam-kernel", 1),
    "use_odirect": ("--offload-no-odirect", 1),
    "verify_checksums": ("--offload-no-checksums", 1),
    "cache_alternating": ("--offload-no-cache", 1),
    "save_staging_bytes": ("--offload-save-staging-gb", 1 << 30),
}
_FIELD = re.compile(r"\b(" + "|".join(FLAG_OF_FIELD) + r")\b(?:=(-?[0-9][0-9.e+]*))?")
_PATH = re.compile(r"paths\[['\"]([A-Za-z0-9_]+)['\"]\]")
_BANDWIDTHS = re.compile(r"\bbandwidths(?= '|:)")
_TOKEN_SCOPE = re.compile(r"token_scope\[['\"]([A-Za-z0-9_]+)['\"]\]")
GiB = 1 << 30


def in_flags(message: str) -> str:
    """An engine message with config field names replaced by the flags that set them."""
    def field(match):
        flag, scale = FLAG_OF_FIELD[match.group(1)]
        if match.group(2) is None:
            return flag
        return f"{flag} {float(match.group(2)) / scale:g}"

    message = _PATH.sub(r"--offload-\1-path", message)
    message = _BANDWIDTHS.sub("--offload-bandwidths", message)
    message = _TOKEN_SCOPE.sub(r"--offload-token-scope \1", message)
    return _FIELD.sub(field, message)


def config_from_args(args, rank: int) -> OffloadConfig:
    """The engine's config from the ``--offload-*`` flags (checked by OffloadConfig itself)."""
    budget = None if args.offload_host_cache_gb is None else int(args.offload_host_cache_gb * GiB)
    return OffloadConfig(
        tiers=list(args.offload_tiers),
        paths=dict(args.offload_paths),
        host_budget_bytes=budget,
        subgroup_size=args.offload_subgroup_size,
        prefetch_depth=args.offload_prefetch_depth,
        tokens_per_tier=args.offload_tokens_per_tier,
        token_scope=dict(args.offload_token_scope),
        io_block_bytes=args.offload_io_block_mb << 20,
        io_threads=args.offload_io_threads,
        use_odirect=not args.offload_no_odirect,
        verify_checksums=not args.offload_no_checksums,
        cache_alternating=not args.offload_no_cache,
        bandwidths=parse_bandwidths(args.offload_bandwidths or ""),
        adam_kernel=args.offload_adam_kernel,
        probe_bytes=args.offload_probe_mb << 20,
        save_staging_bytes=int(args.offload_save_staging_gb * GiB),
        rank=rank,
        trace_path=per_rank_path(args.offload_trace, rank),
        state_dtypes=state_dtypes(args),
    )


def per_rank_path(template, rank: int):
    """A per-rank output file: '{rank}' in ``template`` is replaced; without it only rank 0 writes
    (the other ranks would overwrite one file), so the others get None."""
    if not template:
        return None
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None
