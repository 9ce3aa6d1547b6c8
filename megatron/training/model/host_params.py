"""--offload-params host: the model's 16-bit params live in pinned host memory (DDP's param buffer is made
there) and come to the GPU only while the layer-major step uses them: the embedding, final norm and output
layer for the whole step, each transformer layer for its forward over the step's micro-batches and again for
its recompute and backward, the next layer's copy running on a side stream while this one computes. The GPU
holds two layers' params instead of every layer's. The grads stay in DDP's device buffer, where the backward
accumulates them and the offload engine reads them; the engine writes each step's updated params into the
host buffer, and the next step copies them in again. On a CPU run the same copies go from one host tensor to
another (the CPU twin of this path).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from megatron.training.model.device_slots import DeviceSlot, dtype_sizes, largest_sizes
from megatron.training.model.host_grads import GradReduction, HostGrads
from megatron.training.runtime.core_private import param_buffers_in_host_memory
from megatron.training.runtime.progress import print_rank0
from mlp_offload import GiB



def host_params_refusal(args) -> Optional[str]:
    """Why a run with these flags cannot keep its params in host memory (one line), or None."""
    if getattr(args, "offload_overlap_forward", False):
        return ("not with --offload-overlap-forward: a layer's params are copied in before the update under "
                "the forward has written them")
    if getattr(args, "overlap_grad_reduce", False):
        return ("not with --overlap-grad-reduce: DDP's per-param hooks, which start each bucket's reduce, are left "
                "behind when a layer's params move into their device slot (the gradients are reduced after the "
                "backward instead)")
    return None


def placed_in_host_memory(chunk) -> bool:
    """Whether ``ddp_with_params_in_host_memory`` placed this chunk's params (on a CPU run too: its twin)."""
    return getattr(chunk, "compute_device", None) is not None


# Elements of one piece of a gather or broadcast through the device (NCCL moves device memory only).
STAGING_ELEMENTS = 32 * 2**20


def gather_params_through(chunks, device: torch.device) -> None:
    """DDP's all-gather of the updated params (each data-parallel rank updated its own shard of every bucket)
    for param buffers in host memory: each bucket's shards piece by piece through one device buffer, into the
    same places megatron-core's gather fills in a device buffer."""
    for chunk in chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                shards = bucket.param_data.view(size, -1)  # (the bucket is padded to a multiple of the size)
                width = shards.shape[1]
                piece = max(1, min(width, STAGING_ELEMENTS // size))
                staging = torch.empty(size * piece, dtype=shards.dtype, device=device)
                for lo in range(0, width, piece):
                    hi = min(width, lo + piece)
                    out = staging[: size * (hi - lo)].view(size, hi - lo)
                    out[rank].copy_(shards[rank, lo:hi])
                    torch.distributed.all_gather_into_tensor(out.view(-1), out[rank],
                                                             group=group.intra_distributed_optimizer_instance_group)
                    shards[:, lo:hi].copy_(out)


def gather_params(chunks, force_sync: bool = False) -> None:
    """DDP's all-gather of the params each data-parallel rank updated: megatron-core's own for params on the
    device; through the device for params in host memory (NCCL gathers device memory only, even at size 1)."""
    if placed_in_host_memory(chunks[0]):
        gather_params_through(chunks, chunks[0].compute_device)
    else:
        for chunk in chunks:
            chunk.start_param_sync(force_sync=force_sync)  # dense and expert buckets both


def broadcast_params_through(chunks, device: torch.device) -> None:
    """DDP's broadcast of the params from the first data-parallel rank (``broadcast_params``), for params in
    host memory: each through the device."""
    for chunk in chunks:
        for param in chunk.module.parameters():
            group = chunk.expt_dp_group if is_expert_param(param) else chunk.dp_cp_group
            if group.size() == 1:
                continue
            staged = param.data.to(device)
            torch.distributed.broadcast(staged, src=torch.distributed.get_global_rank(group, 0), group=group)
            param.data.copy_(staged)


def check_buffers_placed(chunks, device: torch.device, grads_in_host: bool) -> None:
    """Every param buffer in host memory and every grad buffer on ``device`` (or in host memory with
    ``grads_in_host``): a megatron-core that builds its buffers otherwise than ``param_buffers_in_host_memory``
    expects fails here, not in the first step."""
    grads_at = torch.device("cpu") if grads_in_host else device
    for chunk in chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            if buffer.param_data is None or buffer.param_data.device.type != "cpu" \
                    or buffer.grad_data.device != grads_at:
                raise RuntimeError("--offload-params host: megatron-core's DDP did not build its buffers where "
                                   "asked (megatron-core 0.16.1 does)")


def move_all_but_params(module: torch.nn.Module, device: torch.device) -> None:
    """The module's buffers (rotary tables, masks) to ``device``; its params stay DDP's host views."""
    for sub in module.modules():
        for name, value in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, value.to(device))


def _into_main_grad(param: torch.nn.Parameter) -> None:
    """DDP's backward hook, again: a param whose data moved to another device gets a new gradient
    accumulator from autograd, without the hook DDP put on the old one. Whichever of the two runs first
    adds the grad into ``main_grad`` and clears it, so the other finds nothing (a CPU run keeps DDP's)."""
    if param.grad is not None and (not getattr(param, "grad_added_to_main_grad", False)
                                   or getattr(param, "zero_out_wgrad", False)):
        param.main_grad.add_(param.grad.data)
    param.grad = None


def decoder_of(chunk):
    """The decoder block of the GPTModel inside DDP and Float16Module wrappers."""
    module = chunk
    while not hasattr(module, "decoder"):
        module = module.module
    return module.decoder


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Whether DDP reduces the param's gradient over the expert-data-parallel group (megatron-core marks them)."""
    return not getattr(param, "allreduce", True)


REST = -1  # the group of params outside the transformer layers (embedding, final norm, output layer)


class HostParams:
    """``layer_major.LayerResidency`` for params in host memory: two device slots the layers take turns in
    (the one running, the next in the step's order copied in beside it) and one for the rest, held from
    ``step_started`` to ``step_ended``. A slot's copy waits for the compute that last used the slot."""

    def __init__(self, layers: List[List[torch.nn.Parameter]], rest: List[torch.nn.Parameter], device: torch.device,
                 grads_in_host: bool = False, reduction: Optional[GradReduction] = None):
        self.groups = {index: params for index, params in enumerate(layers)}
        self.groups[REST] = rest
        self.host = {index: [p.data for p in params] for index, params in self.groups.items()}
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        largest = largest_sizes(layers)
        self._turns = [DeviceSlot(largest, device), DeviceSlot(largest, device)]
        self._rest = DeviceSlot(dtype_sizes(rest), device)
        self._order: List[int] = []
        self._visits: List[tuple] = []  # (layer, in its backward, pass) in the step's order
        self._passes = self._pass = 0
        self._at = 0
        self.copies = 0  # groups copied in, for tests and the log
        for params in self.groups.values():
            for param in params:
                param.register_post_accumulate_grad_hook(_into_main_grad)
        # --offload-grads host: each group's main_grad in a device slot during its backward (host_grads)
        self.grads = HostGrads(self.groups, REST, device, self._stream, reduction) if grads_in_host else None

    def finalizing(self, chunk):
        """megatron-core's finalize as it is, or leaving out what the grads in host memory had from their slots."""
        return self.grads.finalizing(chunk) if self.grads is not None else contextlib.nullcontext()

    @classmethod
    def of_chunk(cls, chunk, device: torch.device, grads_in_host: bool = False) -> "HostParams":
        # A layer's dense params first, its experts' after: each kind's grads one piece of the slot, summed over
        # its own data-parallel group (the experts' over expert-data-parallel ranks) in one collective
        layers = [sorted(layer.parameters(), key=is_expert_param) for layer in decoder_of(chunk).layers]
        inside = {id(p) for params in layers for p in params}
        return cls(layers, [p for p in chunk.parameters() if id(p) not in inside], device, grads_in_host,
                   GradReduction.of_chunk(chunk) if grads_in_host else None)

    def device_bytes(self) -> int:
        slots = sum(slot.nbytes for slot in (*self._turns, self._rest))
        return slots + (self.grads.device_bytes() if self.grads is not None else 0)

    # -- the layer-major step's calls ---------------------------------------------------------------
    def step_started(self, backward: bool, passes: int = 1) -> None:
        """The step's order of layers (forward, then backward where it has one; once per pass over a group of
        micro-batches); what the slots held is stale (an update has changed the host params since)."""
        count = len(self.groups) - 1
        one_pass = [(i, False) for i in range(count)] + ([(i, True) for i in reversed(range(count))] if backward
                                                         else [])
        self._visits = [(layer, in_backward, p) for p in range(passes) for layer, in_backward in one_pass]
        self._order = [layer for layer, _, _ in self._visits]
        self._passes = passes
        self._at = 0
        for slot in (*self._turns, self._rest):
            slot.holds = None
        self._fill(self._rest, REST)
        self._use(self._rest, REST)
        if self.grads is not None and backward:
            self.grads.collect(REST, None)
        if self._order:
            self._fill(self._turns[0], self._order[0])

    def bring_in(self, layer: int) -> None:
        slot = self._slot_of(layer)
        if slot is None:  # not prefetched (a step that skipped ahead): copied now
            slot = self._free_slot(layer)
            self._fill(slot, layer)
        self._use(slot, layer)
        _, in_backward, self._pass = self._visits[self._at]
        if self.grads is not None and in_backward:  # (after the first pass, on from what the passes before summed)
            self.grads.collect(layer, self._turns.index(slot), resume=self._pass > 0)
        self._at += 1
        upcoming = next((i for i in self._order[self._at:] if i != layer), None)
        if upcoming is not None and self._slot_of(upcoming) is None:
            self._fill(self._free_slot(layer), upcoming)

    def release(self, layer: int, after_backward: bool) -> None:
        slot = self._slot_of(layer)
        if self.grads is not None and after_backward:
            self.grads.hand_out(layer, self._turns.index(slot), complete=self._pass == self._passes - 1)
        self._put_back(slot, layer)

    def grads_complete(self) -> None:
        """The step's last gradient is made (before DDP's sync would run)."""
        if self.grads is not None:
            self.grads.hand_out(REST, None)
            self.grads.complete()

    def step_ended(self) -> None:
        self._put_back(self._rest, REST)
        if self._stream is not None:
            self._stream.synchronize()  # no copy still reads the host params the update is about to write

    # -- slots ------------------------------------------------------------------------------------------
    def _slot_of(self, layer: int) -> Optional[DeviceSlot]:
        return next((slot for slot in self._turns if slot.holds == layer), None)

    def _free_slot(self, keep: int) -> DeviceSlot:
        return next(slot for slot in self._turns if slot.holds != keep)

    def _fill(self, slot: DeviceSlot, group: int) -> None:
        with self._side_stream(slot):
            for view, host in zip(slot.views(self.groups[group]), self.host[group]):
                view.copy_(host, non_blocking=self._stream is not None)
            if self._stream is not None:
                slot.copied_in = torch.cuda.Event()
                slot.copied_in.record(self._stream)
        slot.holds = group
        self.copies += 1

    def _use(self, slot: DeviceSlot, group: int) -> None:
        if slot.copied_in is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied_in)
        for param, view in zip(self.groups[group], slot.views(self.groups[group])):
            param.data = view

    def _put_back(self, slot: DeviceSlot, group: int) -> None:
        for param, host in zip(self.groups[group], self.host[group]):
            param.data = host
        if self._stream is not None:
            slot.used = torch.cuda.Event()
            slot.used.record(torch.cuda.current_stream(self.device))

    def _side_stream(self, slot: DeviceSlot):
        if self._stream is None:
            return contextlib.nullcontext()
        if slot.used is not None:
            self._stream.wait_event(slot.used)  # the compute that read the slot last is done
        return torch.cuda.stream(self._stream)


def buffer_bytes_in_host_memory(chunks) -> int:
    """What DDP's param and grad buffers of ``chunks`` hold in host memory (--offload-params/--offload-grads host)."""
    buffers = [b for chunk in chunks for b in list(getattr(chunk, "buffers", []))
               + list(getattr(chunk, "expert_parallel_buffers", []))]
    return sum(data.numel() * data.element_size() for b in buffers for data in (b.param_data, b.grad_data)
               if data is not None and data.device.type == "cpu")


def host_param_buffers(chunks) -> List[torch.Tensor]:
    """DDP's param buffers that ``ddp_with_params_in_host_memory`` put in host memory (none otherwise)."""
    return [b.param_data for chunk in chunks if placed_in_host_memory(chunk)
            for b in chunk.buffers + chunk.expert_parallel_buffers if b.param_data is not None]


def ddp_with_params_in_host_memory(chunks, ddp: Callable, device: torch.device, grads_in_host: bool):
    """Each chunk wrapped by ``ddp(chunk, index)`` with DDP's param buffer (and with ``grads_in_host`` its grad
    buffer) in host memory, the params the first data-parallel rank's (broadcast through the device); the rest
    of each chunk on the device, each chunk told where it computes (``compute_device``: its buffers no longer
    say). Rank 0 prints the start-up line saying where the params (and grads) are."""
    on_cuda = any(p.is_cuda for chunk in chunks for p in chunk.parameters())
    for chunk in chunks:
        chunk.cpu()  # DDP copies them into its buffer: in host memory they never take the device's
    if on_cuda:
        torch.cuda.empty_cache()
    with param_buffers_in_host_memory(pin=device.type == "cuda", grads_too=grads_in_host):
        chunks = [ddp(chunk, i) for i, chunk in enumerate(chunks)]
    check_buffers_placed(chunks, device, grads_in_host)
    for chunk in chunks:
        move_all_but_params(chunk, device)
        chunk.compute_device = device
    broadcast_params_through(chunks, device)
    buffers = [b for chunk in chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    params = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    pinned = device.type == "cuda" and all(b.param_data.is_pinned() for b in buffers)
    where = f"{'pinned ' if pinned else ''}host memory"
    grads_line = (f", {grads / GiB:.2f} GiB of grads there too (--offload-grads host)" if grads_in_host else "")
    print_rank0(f"> params: {params / GiB:.2f} GiB in {where} (--offload-params host){grads_line}; the GPU holds two "
                f"layers' and those outside the layers (embedding, output layer) while a step runs (rank 0's figures)")
    return chunks
