"""What a launched rank script (hf_forward.py, layer_major_ranks.py) needs before it builds a model:
pretrain_gpt.py's own provider and steps, and the process group on the CPU (gloo, cpu_compat) or on
this rank's GPU (nccl)."""

import importlib.util
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def pretrain_gpt():
    """pretrain_gpt.py as a module (its model_provider and forward_step), without running it."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_of_rank", REPO / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def join(device: str) -> torch.device:
    """Join the launch's process group on ``device`` ("cpu" or "cuda"); returns this rank's device."""
    from megatron.training.runtime import cpu_compat

    cpu_compat.define_missing_te_names()
    if device == "cpu":
        cpu_compat.apply()
        torch.distributed.init_process_group("gloo")
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl")
    return torch.device("cuda", torch.cuda.current_device())
