"""--offload-grads host: DDP's grad buffer in pinned host memory beside the params' (``host_params``). While the
layer-major step runs a layer's backward, the layer's ``main_grad`` are a zeroed device slot the backward sums
its micro-batches into, in the order the resident buffer would; once the layer's gradient is complete the slot
goes into the host buffer over the side stream (a copy, which leaves the same bits the resident buffer would
hold), and ``main_grad`` points there again. The params outside the layers keep a slot of their own from the
step's start until its gradients are complete.

Each param's gradient norm is taken from its slot before it leaves (``DEVICE_GRAD_NORM``, read by the
optimizer's clip instead of the host copy: the same kernel on the same bits as with the grads resident).
DDP's own gradient sync is left out (one data-parallel rank: nothing to reduce; its collective cannot take host
memory), so the check for NaN it does runs here instead, on those norms.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from megatron.training.model.device_slots import DeviceSlot, dtype_sizes, largest_sizes

DEVICE_GRAD_NORM = "device_grad_norm"  # the attribute a param's norm is left in until the optimizer takes it


def host_grads_refusal(params_in_host: bool, config, data_parallel: int) -> Optional[str]:
    """Why a run cannot keep its grads in host memory (one line), or None."""
    if not params_in_host:
        return "needs --offload-params host (the grads follow the params' layer slots)"
    if data_parallel != 1:
        return (f"data-parallel size 1 only so far (this run: {data_parallel}): the grads would be reduced across "
                "ranks from the device slots, which is not built")
    if config.fp16:
        return "not with --fp16 (the loss scale's check reads every grad: use --bf16)"
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        return "not with --sequence-parallel (its norm grads are reduced across tensor-parallel ranks on the GPU)"
    if config.num_moe_experts:
        return "not with MoE layers yet"
    return None


class HostGrads:
    """The grad side of ``HostParams`` (which calls it): ``collect(group, turn)`` before a group's backward,
    ``hand_out(group, turn)`` once its gradient is complete; ``turn``: which of the two layer slots, or None
    for the rest's own."""

    def __init__(self, groups: Dict[int, List[torch.nn.Parameter]], rest_group: int, device: torch.device,
                 stream: Optional["torch.cuda.Stream"]):
        self.groups = groups
        self.host = {g: [p.main_grad for p in params] for g, params in groups.items()}
        self.device = device
        self._stream = stream
        largest = largest_sizes(grads for g, grads in self.host.items() if g != rest_group)
        self._turns = [DeviceSlot(largest, device), DeviceSlot(largest, device)]
        self._rest = DeviceSlot(dtype_sizes(self.host[rest_group]), device)
        self.norms: List[torch.Tensor] = []

    def device_bytes(self) -> int:
        return sum(slot.nbytes for slot in (*self._turns, self._rest))

    def collect(self, group: int, turn: Optional[int]) -> None:
        slot = self._slot(turn)
        if slot.copied_out is not None:  # the slot's last gradients are out before it is zeroed
            torch.cuda.current_stream(self.device).wait_event(slot.copied_out)
        for param, view in zip(self.groups[group], slot.views(self.host[group])):
            view.zero_()
            param.main_grad = view

    def hand_out(self, group: int, turn: Optional[int]) -> None:
        slot = self._slot(turn)
        views = slot.views(self.host[group])
        for param, view in zip(self.groups[group], views):
            norm = torch.norm(view.float()).reshape(1)
            setattr(param, DEVICE_GRAD_NORM, norm)
            self.norms.append(norm)
        if self._stream is not None:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.device))
            self._stream.wait_event(computed)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for host, view in zip(self.host[group], views):
                host.copy_(view, non_blocking=self._stream is not None)
            if self._stream is not None:
                slot.copied_out = torch.cuda.Event()
                slot.copied_out.record(self._stream)
        for param, host in zip(self.groups[group], self.host[group]):
            param.main_grad = host

    def complete(self) -> None:
        """Every gradient is in host memory; NaN or inf in any stops the run here, as DDP's check would."""
        if self._stream is not None:
            self._stream.synchronize()
        norms, self.norms = self.norms, []
        if norms and not bool(torch.isfinite(torch.cat(norms)).all()):
            bad = next(i for i, n in enumerate(norms) if not bool(torch.isfinite(n).all()))
            raise RuntimeError(f"--offload-grads host: a gradient is NaN or inf (the {bad + 1}th one handed out "
                               f"this step)")

    def _slot(self, turn: Optional[int]) -> DeviceSlot:
        return self._rest if turn is None else self._turns[turn]
