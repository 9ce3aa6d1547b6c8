"""Building the offload optimizer from the ``--offload-*`` flags: the engine's config, built once with
what only the start-up knows (the device, the host memory beside the engine, an auto gpu tier's
start), its log and CPU threads; the flags and environment are read here, not in the engine. (Its
telemetry file is one of the metrics sinks: megatron.training.metrics.sinks.)"""

from __future__ import annotations

import logging
import os
from typing import List

import torch
from megatron.core import parallel_state
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from megatron.training.errors import UserError
from megatron.training.offload.optimizer import OffloadDistributedOptimizer
from megatron.training.offload.shard import ShardGroups
from megatron.training.model.host_params import buffer_bytes_in_host_memory, host_param_buffers
from megatron.training.offload.job_facts import PerNodeByRank0
from megatron.training.offload.flags import config_from_args
from megatron.training.offload.gpu_tier_start import starting_gpu_tier_bytes
from megatron.training.offload.options import GPU_START_FLAG, config_fields, in_flags
from megatron.training.runtime.core_private import param_groups_and_buffers
from megatron.training.runtime.host_memory import PROCESS_BYTES_GPU, measured_beside_engine
from megatron.training.runtime.progress import model_device
from mlp_offload import GiB, OffloadConfig

log = logging.getLogger("mlp_offload")


def get_offload_optimizer(args, model_chunks, config: OptimizerConfig) -> OffloadDistributedOptimizer:
    _show_engine_log()
    if not config.use_distributed_optimizer:
        raise UserError("--offload-tiers requires the distributed optimizer (--use-distributed-optimizer)")
    _set_cpu_threads(args, model_chunks)
    groups = shard_groups(model_chunks, config)
    device = model_device(model_chunks)  # home of the gpu tier and device updates (the CPU twin on CPU)
    offload_config = config_from_args(args, rank=_rank(), device=str(device),
                                      host_bytes_beside=measured_beside_engine(
                                          args.num_workers, process_at_its_peak(
                                              model_chunks, device, async_save_copy_bytes(args, model_chunks))),
                                      **_starting_gpu_tier(args, model_chunks, groups, device))
    return OffloadDistributedOptimizer(config, offload_config, model_chunks, groups,
                                       token_store=job_store(offload_config))


def process_at_its_peak(model_chunks, device, save_copies: int = 0) -> int:
    """On a GPU: the model's buffers in host memory (--offload-params/--offload-grads host), what a save copies
    aside of them (``save_copies``) and the process's peak beside them, which its first steps reach after this
    start-up (0 on a CPU run: measured is right)."""
    if device.type != "cuda":
        return 0
    return buffer_bytes_in_host_memory(model_chunks) + save_copies + PROCESS_BYTES_GPU


def async_save_copy_bytes(args, model_chunks) -> int:
    """About what an --async-save copies aside on this rank of the params in host memory (async_save's
    HostWeightsAside): a share of them under fully parallel saves, else all on the first data-parallel rank."""
    if not getattr(args, "async_save", False):
        return 0
    nbytes = sum(b.numel() * b.element_size() for b in host_param_buffers(model_chunks))
    size = parallel_state.get_data_parallel_world_size()
    if args.ckpt_fully_parallel_save and size > 1:
        return nbytes // size
    return nbytes if parallel_state.get_data_parallel_rank() == 0 else 0


def _starting_gpu_tier(args, model_chunks, groups: List[ShardGroups], device) -> dict:
    """An auto gpu tier's start (gpu_tier_start) as the config's ``gpu_budget_bytes``; one engine only
    (with experts, two engines share the device: they start empty and learn it)."""
    if args.offload_gpu_cache_gb != "auto" or device.type != "cuda" or len(groups) != 1:
        return {}
    # free on the device plus what torch's allocator caches unused (the model's initialisation leaves
    # much of its memory there: free alone misses it)
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    margin = config_fields(args)["gpu_margin_bytes"]
    start = starting_gpu_tier_bytes(args, model_chunks[0].config, free, margin, groups[0].dp_group.size())
    if not start:
        return {}
    how = (f"as {GPU_START_FLAG} says" if args.offload_gpu_start_gb is not None else
           "half of what the activation estimate and the margin leave")
    log.info("gpu tier auto: starts at %.2f GiB, %s of the %.2f GiB free; learnt from the measured peak after "
             "iteration 1", start / GiB, how, free / GiB)
    return {"gpu_budget_bytes": start}


def shard_groups(model_chunks, config: OptimizerConfig) -> List[ShardGroups]:
    """The distributed optimizers megatron-core's get_megatron_optimizer builds, as parameter groups,
    buffers and the group each is sharded over: the dense parameters over the data-parallel group
    and, where this rank holds experts, theirs over the expert-data-parallel group."""
    found = []
    for kind, expert, buffer_name, group in (
            ("dense", False, "buffers", parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                                             partial_data_parallel=True)),
            ("experts", True, "expert_parallel_buffers",
             parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True))):
        param_groups, buffers = param_groups_and_buffers(
            model_chunks, config, lambda g, expert=expert: g["is_expert_parallel"] == expert, buffer_name)
        if param_groups:
            found.append(ShardGroups(kind, param_groups, buffers, group))
    return found


def job_store(config: OffloadConfig):
    """The job's key-value store, for I/O tokens taken across nodes (--offload-token-scope T=job)."""
    if "job" not in config.token_scope.values():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _show_engine_log() -> None:
    """The engine reports placement, rates and prediction at INFO: show them, tagged by rank."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[offload rank {_rank()}] %(levelname)s %(message)s"))
        handler.addFilter(PerNodeByRank0())  # rank 0 prints every node's once (job_facts.report)
        handler.addFilter(_FlagsNotFields())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class _FlagsNotFields(logging.Filter):
    """The engine's warnings name config fields; the user of pretrain_gpt.py typed flags."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = in_flags(record.getMessage()), None
        return True


def _set_cpu_threads(args, model_chunks) -> None:
    # torchrun sets OMP_NUM_THREADS=1, which would starve the CPU Adam; on a GPU node give each
    # local rank its share of the cores unless told otherwise.
    threads = args.offload_cpu_threads
    if threads is None and model_device(model_chunks).type == "cuda":
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if threads:
        torch.set_num_threads(threads)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
