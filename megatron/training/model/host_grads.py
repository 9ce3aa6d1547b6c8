"""--offload-grads host: DDP's grad buffer in pinned host memory beside the params' (``host_params``). While the
layer-major step runs a layer's backward, the layer's ``main_grad`` are a zeroed device slot the backward sums
its micro-batches into, in the order the resident buffer would; once the layer's gradient is complete the slot
goes into the host buffer over the side stream (a copy, which leaves the same bits the resident buffer would
hold), and ``main_grad`` points there again. The params outside the layers keep a slot of their own from the
step's start until its gradients are complete.

Before it leaves, the slot goes through what DDP's gradient sync does to the buffer (``GradReduction``): scaled by
the bucket's factor and summed (or averaged) over the bucket's data-parallel group, on the device (NCCL reduces no
host memory). MoE experts' params have buckets of their own, summed over the expert-data-parallel group with their
own factor; a layer's slot holds its dense params first and its experts' after, so each kind is one piece of it
and one collective over its group. DDP reduce-scatters whole buckets; this all-reduces each layer's slot: the same
sum of the same two values at data-parallel size 2, and above it the same up to the order of the sum. Each
param's gradient norm over the elements this rank's shard updates is taken there too (``DEVICE_GRAD_NORM``, read
by the optimizer's clip instead of the host copy: the same kernel on the same bits as with the grads resident).
DDP's own sync is left out (its collective cannot take host memory), so the check for NaN it does runs here
instead, on those norms.

After the data-parallel sum comes what megatron-core's finalize does next: the gradients of the norms under
sequence parallelism (each tensor-parallel rank's covers its part of the sequence) and of the query and key norms
(its heads) summed over the tensor-parallel ranks; the finalize then finds them hidden (``finalizing``), so none
is summed twice. Two ranks' sum is the same bits in either order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron.training.model.device_slots import DeviceSlot, dtype_sizes, largest_sizes

DEVICE_GRAD_NORM = "device_grad_norm"  # the attribute a param's norm is left in until the optimizer takes it


def host_grads_refusal(params_in_host: bool, config, tied_across_stages: bool = False) -> Optional[str]:
    """Why a run cannot keep its grads in host memory (one line), or None. ``tied_across_stages``: the embedding
    and output layer share a weight on two pipeline stages (its grads are summed across them by a collective)."""
    if not params_in_host:
        return "needs --offload-params host (the grads follow the params' layer slots)"
    if tied_across_stages:
        return ("not with the embedding tied to the output layer across pipeline stages (their gradients are summed "
                "between the stages in host memory): add --untie-embeddings-and-output-weights")
    if config.fp16:
        return "not with --fp16 (the loss scale's check reads every grad: use --bf16)"
    if config.calculate_per_token_loss:
        return ("not with --calculate-per-token-loss: the grads are divided by the step's token count after they "
                "have left the GPU, and their norms were taken before")
    return None


def summed_across_tensor_parallel(config, name: str, param: torch.nn.Parameter) -> bool:
    """Whether megatron-core's finalize sums this param's gradient over the tensor-parallel ranks (its rule)."""
    if not param.requires_grad or getattr(param, "average_gradients_across_tp_domain", False):
        return False
    return bool(config.sequence_parallel and getattr(param, "sequence_parallel", False)) or \
        bool(config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))


def tied_across_stages(args) -> bool:
    """Whether the embedding and the output layer share a weight that lives on two pipeline stages."""
    return args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights


@dataclass
class GradReduction:
    """What DDP's gradient sync does to each param's gradient, for its device slot: scaled by its bucket's factor,
    reduced with ``op`` over its bucket's group (``data_parallel_group``: the data-parallel group of a dense param,
    the expert-data-parallel group of an expert's; None: one rank), and the flattened elements [lo, hi) this rank's
    shard updates (whose norm the clip takes); then, for the params in ``tensor_parallel``, the finalize's sum over
    ``tensor_parallel_group``. Params it does not name: factor 1, whole, one rank (a test's)."""

    factor: Dict[int, float] = field(default_factory=dict)
    owned: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    data_parallel_group: Dict[int, object] = field(default_factory=dict)
    op: object = None
    tensor_parallel: Set[int] = field(default_factory=set)
    tensor_parallel_group: Optional[object] = None

    @classmethod
    def of_chunk(cls, chunk) -> "GradReduction":
        """From a DDP chunk's buffers and bucket groups (megatron-core's own factors, groups and shards)."""
        reduction = cls()
        sharded = chunk.ddp_config.use_distributed_optimizer
        if sharded and chunk.ddp_config.num_distributed_optimizer_instances > 1:
            raise ValueError("--offload-grads host: one distributed-optimizer instance only")
        for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if sharded:  # reduce-scattered: each rank's shard of every bucket
                group = bucket_group.intra_distributed_optimizer_instance_group
                size, rank = bucket_group.intra_distributed_optimizer_instance_size, group.rank()
            else:  # all-reduced: every rank holds the whole
                group, size, rank = bucket_group.data_parallel_group, 1, 0
            for bucket in bucket_group.buckets:
                shard = bucket.grad_data.numel() // size
                lo, hi = bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard
                index_map = next(b.param_index_map for b in chunk.buffers + chunk.expert_parallel_buffers
                                 if bucket in b.buckets)
                for param in bucket.params:
                    start, end, _ = index_map[param]
                    first, last = max(start, lo), min(end, hi)
                    reduction.owned[id(param)] = (first - start, last - start) if first < last else (0, 0)
                    reduction.factor[id(param)] = bucket.gradient_scaling_factor
                    reduction.data_parallel_group[id(param)] = group if group.size() > 1 else None
        average = chunk.ddp_config.average_in_collective
        reduction.op = torch.distributed.ReduceOp.AVG if average else torch.distributed.ReduceOp.SUM
        tp_group = parallel_state.get_tensor_model_parallel_group()  # the finalize's, as training calls it
        if tp_group.size() > 1:
            config = get_model_config(chunk)
            reduction.tensor_parallel = {id(p) for name, p in chunk.named_parameters()
                                         if summed_across_tensor_parallel(config, name, p)}
            reduction.tensor_parallel_group = tp_group
        return reduction

    def groups_of(self, params: List[torch.nn.Parameter]) -> List[Optional[object]]:
        """Each param's data-parallel group (None: one rank, nothing to sum)."""
        return [self.data_parallel_group.get(id(param)) for param in params]

    def reduce(self, params: List[torch.nn.Parameter], views: List[torch.Tensor], runs: List[tuple]) -> None:
        """DDP's scaling of ``params``' gradients in ``views``, then their sum over their groups: one collective
        per (group, flat piece of the slot) of ``runs`` (``DeviceSlot.runs`` keyed by ``groups_of``)."""
        for param, view in zip(params, views):
            factor = self.factor.get(id(param), 1.0)
            if factor != 1.0:
                view.mul_(factor)
        for group, flat in runs:
            if group is not None:
                torch.distributed.all_reduce(flat, op=self.op, group=group)
        summed = [view for param, view in zip(params, views) if id(param) in self.tensor_parallel]
        for dtype in {view.dtype for view in summed}:  # one collective per dtype, as the finalize coalesces
            same = [view for view in summed if view.dtype == dtype]
            flat = torch.cat([view.reshape(-1) for view in same])
            torch.distributed.all_reduce(flat, group=self.tensor_parallel_group)
            for view, part in zip(same, flat.split([view.numel() for view in same])):
                view.copy_(part.view_as(view))

    def owned_part(self, param: torch.nn.Parameter, view: torch.Tensor) -> torch.Tensor:
        lo, hi = self.owned.get(id(param), (0, view.numel()))
        return view.reshape(-1)[lo:hi]


class HostGrads:
    """The grad side of ``HostParams`` (which calls it): ``collect(group, turn)`` before a group's backward,
    ``hand_out(group, turn)`` once its gradient is complete; ``turn``: which of the two layer slots, or None
    for the rest's own."""

    def __init__(self, groups: Dict[int, List[torch.nn.Parameter]], rest_group: int, device: torch.device,
                 stream: Optional["torch.cuda.Stream"], reduction: Optional[GradReduction] = None):
        self.groups = groups
        self.reduction = reduction or GradReduction()
        self.host = {g: [p.main_grad for p in params] for g, params in groups.items()}
        self.device = device
        self._stream = stream
        largest = largest_sizes(grads for g, grads in self.host.items() if g != rest_group)
        self._turns = [DeviceSlot(largest, device), DeviceSlot(largest, device)]
        self._rest = DeviceSlot(dtype_sizes(self.host[rest_group]), device)
        self.norms: List[torch.Tensor] = []

    def device_bytes(self) -> int:
        return sum(slot.nbytes for slot in (*self._turns, self._rest))

    def collect(self, group: int, turn: Optional[int], resume: bool = False) -> None:
        """``group``'s grads into the slot: zeros, or with ``resume`` what earlier passes of the step summed
        (in the same dtype, so the sum goes on as in one buffer)."""
        slot = self._slot(turn)
        if slot.copied_out is not None:  # the slot's last gradients are out before it is zeroed
            torch.cuda.current_stream(self.device).wait_event(slot.copied_out)
        if resume and self._stream is not None:  # the earlier pass's copy out of these grads has landed
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for param, view, host in zip(self.groups[group], slot.views(self.host[group]), self.host[group]):
            if resume:
                view.copy_(host)
            else:
                view.zero_()
            param.main_grad = view

    def hand_out(self, group: int, turn: Optional[int], complete: bool = True) -> None:
        """``group``'s grads out of the slot into host memory: a partial sum, or once ``complete`` reduced as DDP
        would and their norms taken first."""
        slot = self._slot(turn)
        views = slot.views(self.host[group])
        if complete:
            self._reduced(group, slot, views)
        self._copy_out(group, slot, views)

    def _reduced(self, group: int, slot, views: List[torch.Tensor]) -> None:
        params = self.groups[group]
        self.reduction.reduce(params, views, slot.runs(self.host[group], self.reduction.groups_of(params)))
        for param, view in zip(self.groups[group], views):
            norm = torch.norm(self.reduction.owned_part(param, view).float()).reshape(1)
            setattr(param, DEVICE_GRAD_NORM, norm)
            self.norms.append(norm)

    def _copy_out(self, group: int, slot, views: List[torch.Tensor]) -> None:
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

    @contextlib.contextmanager
    def finalizing(self, chunk):
        """megatron-core's finalize of grads reduced here: DDP's sync left out, and the grads summed over the
        tensor-parallel ranks hidden from it (a ``main_grad`` of None, which it skips) so it sums none again."""
        hidden = [p for params in self.groups.values() for p in params if id(p) in self.reduction.tensor_parallel]
        grads = [p.main_grad for p in hidden]
        chunk.finish_grad_sync = lambda *args, **kwargs: None  # (an instance attribute over DDP's method)
        for param in hidden:
            param.main_grad = None
        try:
            yield
        finally:
            del chunk.finish_grad_sync
            for param, grad in zip(hidden, grads):
                param.main_grad = grad

    def _slot(self, turn: Optional[int]) -> DeviceSlot:
        return self._rest if turn is None else self._turns[turn]
