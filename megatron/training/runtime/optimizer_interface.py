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
    """An optimizer whose state lives outside megatron-core's sharded state dict: streamed into
    ``iter_N/offload/`` beside it."""

    def save_offloaded_state(self, checkpoint_dir: str) -> int: ...
    # --async-save: the state snapshotted now, written by a thread once start()ed
    # (mlp_offload.BackgroundStateWrite)
    def start_offloaded_save(self, checkpoint_dir: str): ...
    # from the checkpoint's offload files, given by their index (checkpoint.saved_offload.SavedOffloadState)
    def load_offloaded_state(self, saved) -> None: ...
    def offloaded_state_bytes(self) -> int: ...


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
