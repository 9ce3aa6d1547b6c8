"""This rank's pipeline stage for the layer-major step (``layer_major``): whether it runs the embedding and the
head, and its sends and receives of one micro-batch's hidden states or their gradients, through megatron-core's
``P2PCommunicator`` in the shapes its schedules use."""

from __future__ import annotations

from typing import Dict

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator


class PipelineStage:
    """This rank's pipeline stage: whether it runs the embedding (first) and the head (last), and its sends
    and receives of one micro-batch's hidden states or their gradients (megatron-core's own, in its shapes)."""

    def __init__(self, config, schedule_keywords: Dict[str, object]):
        """``schedule_keywords``: what the training hands megatron-core's schedule (``seq_length``,
        ``micro_batch_size``, ``decoder_seq_length``: the shape of what stages send)."""
        single = parallel_state.get_pipeline_model_parallel_world_size() == 1
        self.first = single or parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last = single or parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        if single:
            return
        self.p2p = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
        self.shape = schedules.get_tensor_shapes(
            seq_length=schedule_keywords.get("seq_length"), micro_batch_size=schedule_keywords.get("micro_batch_size"),
            decoder_seq_length=schedule_keywords.get("decoder_seq_length"),
            config=config, tp_group=parallel_state.get_tensor_model_parallel_group(),
            cp_group=parallel_state.get_context_parallel_group())[0]

    def receive_forward(self) -> torch.Tensor:
        return self.p2p.recv_forward(self.shape, is_first_stage=False)

    def send_forward(self, hidden: torch.Tensor) -> None:
        self.p2p.send_forward(hidden, is_last_stage=False)

    def receive_backward(self) -> torch.Tensor:
        return self.p2p.recv_backward(self.shape, is_last_stage=False)

    def send_backward(self, grad: torch.Tensor) -> None:
        self.p2p.send_backward(grad, is_first_stage=False)
