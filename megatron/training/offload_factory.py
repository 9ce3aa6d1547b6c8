"""Building the offload optimizer from the ``--offload-*`` flags: the engine's config, its log,
CPU threads and telemetry file; the flags and environment are read here, not in the engine."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from megatron.core.optimizer import _get_param_groups_and_buffers
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from megatron.training.errors import UserError
from megatron.training.offload_optimizer import OffloadDistributedOptimizer
from mlp_offload import OffloadConfig, parse_bandwidths

log = logging.getLogger("mlp_offload")
GiB = 1024**3


def get_offload_optimizer(args, model_chunks, config: OptimizerConfig) -> OffloadDistributedOptimizer:
    _show_engine_log()
    if not config.use_distributed_optimizer:
        raise UserError("--offload-tiers requires the distributed optimizer (--use-distributed-optimizer)")
    _set_cpu_threads(args, model_chunks)
    param_groups, buffers = _get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=config, config_overrides=None,
        filter_fn=lambda g: not g["is_expert_parallel"], buffer_name="buffers")
    return OffloadDistributedOptimizer(config, offload_config_from_args(args), model_chunks, param_groups, buffers,
                                       telemetry_path=_telemetry_path(args.offload_telemetry_log))


def offload_config_from_args(args) -> OffloadConfig:
    """The engine's config from the ``--offload-*`` flags."""
    budget = None if args.offload_host_cache_gb is None else int(args.offload_host_cache_gb * GiB)
    return OffloadConfig(
        tiers=list(args.offload_tiers),
        paths=dict(args.offload_paths),
        host_budget_bytes=budget,
        subgroup_size=args.offload_subgroup_size,
        prefetch_depth=args.offload_prefetch_depth,
        tokens_per_tier=args.offload_tokens_per_tier,
        io_block_bytes=args.offload_io_block_mb << 20,
        io_threads=args.offload_io_threads,
        use_odirect=not args.offload_no_odirect,
        verify_checksums=not args.offload_no_checksums,
        cache_alternating=not args.offload_no_cache,
        bandwidths=parse_bandwidths(args.offload_bandwidths or ""),
        adam_kernel=args.offload_adam_kernel,
        probe_bytes=args.offload_probe_mb << 20,
        rank=_rank(),
    )


def _show_engine_log() -> None:
    """The engine reports placement, rates and prediction at INFO: show them, tagged by rank."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[offload rank {_rank()}] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _telemetry_path(template: Optional[str]) -> Optional[str]:
    if not template:
        return None
    rank = _rank()
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None


def _set_cpu_threads(args, model_chunks) -> None:
    # torchrun sets OMP_NUM_THREADS=1, which would starve the CPU Adam; on a GPU node give each
    # local rank its share of the cores unless told otherwise.
    threads = args.offload_cpu_threads
    if threads is None and next(model_chunks[0].parameters()).is_cuda:
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if threads:
        torch.set_num_threads(threads)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
