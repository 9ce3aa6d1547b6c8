"""The engine's ``OffloadConfig`` from the ``--offload-*`` flags (``config_from_args``); the way
back, an engine message in flag names, is ``errors.in_flags``. The environment is read here, never
in the engine: the run id of the swap namespaces, the ranks sharing this node and this rank's place
among them, and the node-local lock directory (``MLP_OFFLOAD_LOCK_DIR``)."""

from __future__ import annotations

import os

from megatron.training.model.precision_aware import param_remainders, state_dtypes
from megatron.training.errors import UPDATE_ON_OF_FLAG
from mlp_offload import GiB, MiB, OffloadConfig, parse_bandwidths



def config_from_args(args, rank: int) -> OffloadConfig:
    """The engine's config from the ``--offload-*`` flags (checked by OffloadConfig itself)."""
    budget = None if args.offload_host_cache_gb is None else int(args.offload_host_cache_gb * GiB)
    gpu = getattr(args, "offload_gpu_cache_gb", None)
    update = getattr(args, "offload_update", None) or "cpu"  # as --offload-update spells it
    return OffloadConfig(
        tiers=list(args.offload_tiers),
        paths=dict(args.offload_paths),
        host_budget_bytes=budget,
        gpu_budget_bytes=None if gpu in (None, "auto") else int(gpu * GiB),
        gpu_budget_auto=gpu == "auto",
        gpu_margin_bytes=int(getattr(args, "offload_gpu_margin_gb", 4.0) * GiB),
        update_on=UPDATE_ON_OF_FLAG.get(update, update),
        subgroup_size=args.offload_subgroup_size,
        prefetch_depth=args.offload_prefetch_depth,
        tokens_per_tier=args.offload_tokens_per_tier,
        token_scope=dict(args.offload_token_scope),
        io_block_bytes=args.offload_io_block_mb * MiB,
        io_threads=args.offload_io_threads,
        use_odirect=not args.offload_no_odirect,
        verify_checksums=not args.offload_no_checksums,
        cache_alternating=not args.offload_no_cache,
        device_one_pass=not getattr(args, "offload_no_one_pass_update", False),
        device_model_buffers=not getattr(args, "offload_no_update_in_model_buffers", False),
        defer_device_wait=bool(getattr(args, "offload_overlap_forward", False)),
        interleave_device_updates=not getattr(args, "offload_no_interleave", False),
        cpu_share_subgroups=getattr(args, "offload_cpu_share", None),
        device_read_ahead_bytes=int(getattr(args, "offload_read_ahead_gb", 0.0) * GiB),
        cpu_one_pass=not getattr(args, "offload_no_cpu_one_pass", False),
        bandwidths=parse_bandwidths(args.offload_bandwidths or ""),
        adam_kernel=args.offload_adam_kernel,
        probe_bytes=args.offload_probe_mb * MiB,
        save_staging_bytes=int(args.offload_save_staging_gb * GiB),
        rank=rank,
        trace_path=per_rank_path(args.offload_trace, rank),
        state_dtypes=state_dtypes(args),
        param_remainders=param_remainders(args),
        run_id=job_run_id(),
        ranks_sharing_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        lock_dir=os.environ.get("MLP_OFFLOAD_LOCK_DIR") or None,
    )


def job_run_id():
    """The swap namespaces' run id: MLP_OFFLOAD_RUN_ID, else SLURM's job and step
    (``<job>.<step>``, ``<job>.batch`` in the batch script: two steps of one allocation must not
    share a namespace), else torchrun's run id; None (one per process) without any."""
    for var in ("MLP_OFFLOAD_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            if var == "SLURM_JOB_ID":
                value += "." + os.environ.get("SLURM_STEP_ID", "batch")
            return "".join(c if c.isalnum() or c in "-_." else "_" for c in value)
    return None


def per_rank_path(template, rank: int):
    """A per-rank output file: '{rank}' in ``template`` is replaced; without it only rank 0 writes
    (the other ranks would overwrite one file), so the others get None."""
    if not template:
        return None
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None
