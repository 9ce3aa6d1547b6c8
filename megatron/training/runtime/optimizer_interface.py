"""What the training loop and checkpointing ask of an optimizer, declared once.

Every optimizer ``build_optimizer`` returns has megatron-core's MegatronOptimizer interface
(``TrainingOptimizer``): megatron-core's own by inheritance, the offload facade by implementing it.
What only the offload facade has is declared here as protocols, which it names as its bases;
callers ask ``isinstance`` instead of probing attributes.
"""

from __future__ import annotations

from typing import List, Protocol, runtime_checkable

import torch


class TrainingOptimizer(Protocol):
    """The part of MegatronOptimizer that the loop, the LR scheduler and checkpointing use."""

    @property
    def param_groups(self) -> List[dict]: ...
    def step(self): ...  # (update_successful, grad_norm, num_zeros_in_grad)
    def zero_grad(self, set_to_none: bool = True): ...
    def get_loss_scale(self) -> torch.Tensor: ...
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs) -> dict: ...
    def load_state_dict(self, state_dict) -> None: ...


@runtime_checkable
class OffloadedOptimizerCheckpoint(Protocol):
    """An optimizer whose state lives outside megatron-core's sharded state dict, in offload engines
    that checkpointing streams into ``iter_N/offload/`` beside it and back, through the engine's face.
    It hands in its shards, one per distributed optimizer megatron-core would build, each with its
    ``kind`` ("dense" or "experts"), ``engine``, ``layout`` (the engine's flat index space over the
    shard's parameters), ``dp_group`` (what the state is sharded over) and ``grad_scaler``."""

    shards: list


@runtime_checkable
class ReportsIteration(Protocol):
    """An optimizer with figures of its own in each iteration's metrics record: the engine's
    record of the last step (mlp_offload.StepRecord), and the state bytes per tier."""

    def last_step_record(self): ...
    def state_bytes_per_tier(self) -> dict: ...


@runtime_checkable
class HoldsResources(Protocol):
    """An optimizer holding threads, files or memory to release when the run ends."""

    def close(self) -> None: ...
