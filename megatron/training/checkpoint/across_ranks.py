"""What a save or load tells once for all ranks: the slowest rank's figures, a line from rank 0."""

from __future__ import annotations

import torch


def model_device(model) -> torch.device:
    """Where collectives over figures run: NCCL reduces no CPU tensors."""
    return next(model[0].parameters()).device


def slowest_rank(figures, model) -> list:
    """Each figure's maximum over all ranks."""
    figures = torch.tensor(figures, dtype=torch.float64, device=model_device(model))
    torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
    return figures.tolist()


def print_rank0(line: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(line, flush=True)
