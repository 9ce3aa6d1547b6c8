"""The engine's ``OffloadConfig``, built once per rank (``config_from_args``): the ``--offload-*``
flags through their table (``options``), the precision-aware optimizer's dtypes, the job's environment
and what only the start-up knows. The environment is read here, never in the engine: the run id of
the swap namespaces, the ranks sharing this node and this rank's place among them, and the node-local
lock directory (``MLP_OFFLOAD_LOCK_DIR``). The way back, an engine message in flag names, is
``options.in_flags``."""

from __future__ import annotations

import os

from megatron.training.model.precision_aware import param_remainders, state_dtypes
from megatron.training.offload.options import config_fields
from mlp_offload import OffloadConfig


def config_from_args(args, rank: int, **known_later) -> OffloadConfig:
    """The engine's config from the flags and the environment, checked by OffloadConfig itself.
    ``known_later``: fields only the start-up knows (the device, the host memory beside the engine,
    an auto gpu tier's start), given here so that the config is built once, complete."""
    fields = config_fields(args)
    fields.update(trace_path=per_rank_path(fields.get("trace_path"), rank), state_dtypes=state_dtypes(args),
                  param_remainders=param_remainders(args), rank=rank, run_id=job_run_id(),
                  ranks_sharing_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                  lock_dir=os.environ.get("MLP_OFFLOAD_LOCK_DIR") or None,
                  hold_update_split=bool(getattr(args, "deterministic_mode", False)))
    return OffloadConfig(**{**fields, **known_later})


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
