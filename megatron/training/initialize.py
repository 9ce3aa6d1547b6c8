"""Process-group, model-parallel and RNG initialization."""

from __future__ import annotations

import os
import random
import signal
from datetime import timedelta

import numpy as np
import torch

from megatron.training.args import moe as arguments_moe
from megatron.training.data import batch_schedule
from megatron.training.runtime import child_processes, determinism, slurm_env
from megatron.training.runtime.checkpoint_worker import StandingWorker
from megatron.training.errors import UserError
from megatron.training.runtime.signals import SigtermWatcher


def select_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device: cuda requested but no CUDA device is available")
        local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= visible:
            if visible != 1:
                raise UserError(f"--device cuda: LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
            local_rank = 0  # SLURM bound this task to its own GPU (--gpus-per-task), the only one it sees
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_process_group(device: torch.device, timeout_minutes: int) -> None:
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


def set_seeds(seed: int, device: torch.device) -> None:
    """Seed python/numpy/torch per pipeline stage and megatron-core's TP RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    # Different pipeline stages hold different layers; give each its own stream, as Megatron-LM does.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU this seeds the CPU generator through cpu_compat's redirection.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize(args) -> torch.device:
    """Set up everything before the model is built; returns the compute device."""
    # Before the device: srun's tasks learn their LOCAL_RANK here. A process without torchrun or
    # srun still needs a (size-1) group for megatron-core.
    from_slurm = slurm_env.apply()
    determinism.apply(args)  # before CUDA and NCCL read their environment
    device = select_device(args.device)
    args.device_resolved = device.type
    args.sigterm_watcher = SigtermWatcher(save_on=signal.Signals[args.exit_signal] if args.exit_signal_handler else None)
    from megatron.training.runtime import cpu_compat

    cpu_compat.define_missing_te_names()
    if device.type == "cpu":
        cpu_compat.apply()
    child_processes.die_with_rank(start_results_queue=bool(args.save))
    # Forked before the process group's threads and the model: a fork shares only start-up's pages.
    args.checkpoint_worker = (StandingWorker.start(pin=device.type == "cuda") if args.use_persistent_ckpt_worker
                              else None)
    _init_process_group(device, args.distributed_timeout_minutes)

    from megatron.core import parallel_state

    world = torch.distributed.get_world_size()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise UserError(f"--tensor-model-parallel-size/--pipeline-model-parallel-size: "
                         f"TP*PP={tp * pp} does not divide the world size {world}")
    arguments_moe.check_world(args, world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    args.rank = torch.distributed.get_rank()
    if from_slurm and args.rank == 0:
        print(from_slurm, flush=True)
    args.world_size = world
    args.data_parallel_size = world // (tp * pp)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise UserError(f"--global-batch-size: {args.global_batch_size} is not a multiple "
                         f"of micro-batch-size x data-parallel-size = {per_step}")
    batch_schedule.init(args)  # --rampup-batch-size, --train-samples
    set_seeds(args.seed, device)
    return device
