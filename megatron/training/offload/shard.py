"""One of megatron-core's distributed optimizers, offloaded: its shard, engine and grad scaler.

megatron-core builds one DistributedOptimizer for the dense parameters, sharded over the
data-parallel group, and, for a mixture-of-experts model, a second for the expert parameters,
sharded over the expert-data-parallel group (``get_megatron_optimizer``: a ChainedOptimizer of the
two). An ``OffloadShard`` is one of them with the engine as its backend; the facade
(``offload/optimizer.py``) chains them as megatron-core chains its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.module import param_is_not_shared

from megatron.training.offload.copy_back import CopyBack
from megatron.training.offload.params_streaming import update_with_copies_s
from megatron.training.offload.device_gradients import DeviceGradients, EventFence
from megatron.training.model.host_grads import DEVICE_GRAD_NORM
from megatron.training.offload.param_high import ModelParamHigh, ModelParamHighInPlace
from megatron.training.offload.shard_layout import ShardLayout
from megatron.training.runtime.core_private import optimizer_group_ranges
from mlp_offload import ModelLink
from mlp_offload import ModelParamsAsMaster, OffloadConfig, OffloadedAdamW

ShardKind = Literal["dense", "experts"]  # which of megatron-core's distributed optimizers


@dataclass
class ShardGroups:
    """What megatron-core's ``_get_param_groups_and_buffers`` gives for one optimizer, and its group."""

    kind: ShardKind
    param_groups: List[dict]
    buffers: Dict[int, list]
    dp_group: object  # the group the optimizer state is sharded over

    @property
    def params_bf16(self) -> bool:
        """Whether every param buffer this shard holds a piece of is bf16."""
        return all(buffer.param_data.dtype == torch.bfloat16 for buffers in self.buffers.values()
                   for buffer in buffers if buffer.buckets)


def grad_scaler_for(config: OptimizerConfig):
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
    return None


class OffloadShard:
    """One distributed optimizer's shard in an engine; each has its own grad scaler, as each of
    megatron-core's chained optimizers has."""

    def __init__(self, config: OptimizerConfig, offload_config: OffloadConfig, groups: ShardGroups, token_store=None):
        self.config = config
        self.kind = groups.kind
        self.dp_group = groups.dp_group
        self.layout = ShardLayout(groups.buffers, self.dp_group.rank(), self.dp_group.size())
        # The update's device is the model's (offload_config.device): with --offload-params host the params are in
        # host memory, with --offload-grads host the grads too.
        self.device = torch.device(offload_config.device)
        self.params_on_host = self.layout.pieces[0].buffer.param_data.device != self.device
        self.grad_scaler = grad_scaler_for(config)
        self.norm_params, engine_groups = self._ordered_groups(groups.param_groups)
        self._cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream() if self._cuda else None
        self.copy_back = CopyBack(self.copy_stream)  # (with the params in host memory)
        largest = min(offload_config.subgroup_size, self.layout.numel)
        # The master params cross PCIe in their stored dtype (a CPU-side cast would cost the update's time);
        # with remainders, the bf16 params themselves.
        master_dtype = (torch.bfloat16 if offload_config.param_remainders
                        else offload_config.state_codecs[0].storage_dtype)
        self._staging = torch.empty(largest, dtype=master_dtype, device=self.device) if self._cuda else None
        # On a GPU, grads are cast to fp32 there and copied per subgroup as the update needs them;
        # on CPU they go through the engine's low-precision host buffer (the CPU twin of that path).
        self._device_grads = DeviceGradients(self.layout, self.copy_stream, largest) if self._cuda else None
        self.engine = OffloadedAdamW(
            ModelParamsAsMaster(self._fill_initial_params), offload_config, numel=self.layout.numel,
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=config.weight_decay, groups=engine_groups, token_store=token_store,
            model=ModelLink(grad_dtype=self.layout.pieces[0].buffer.grad_dtype,
                            on_params_updated=self._copy_params_to_device, grad_source=self._device_grads,
                            param_high=(ModelParamHigh if self.params_on_host else ModelParamHighInPlace)(
                                self.layout, self.copy_stream),
                            param_segments=self.layout.param_segments()))

    def price_update_copies(self, record, link_bytes_per_s: float) -> None:
        """With the params in host memory: ``record``'s predicted update with their copies across the link (and
        the grads', where they are in host memory too), which the engine does not see."""
        if not self.params_on_host:
            return
        buffer = self.layout.pieces[0].buffer
        grad_itemsize = buffer.grad_data.element_size() if buffer.grad_data.device.type == "cpu" else 0
        updated = record.cpu_updated + record.device_updated
        record.predicted_update_s = update_with_copies_s(
            record.predicted_update_s, self.layout.numel * buffer.param_data.element_size(),
            self.layout.numel * grad_itemsize, link_bytes_per_s, record.device_updated / updated if updated else 0.0,
            self.engine.config.param_remainders)

    def zero_grads_after_read(self) -> None:
        """The update zeroes each piece of the model's grads once it has read it (with the update under
        the next forward, nothing else zeroes them before the next backward); a CPU run has no device grads."""
        if self._device_grads is not None:
            self._device_grads.zero_after_read = True

    def _ordered_groups(self, param_groups: List[dict]):
        """Engine groups (flat ranges + hyperparameters) and the params in megatron-core's order.

        The order is the one its DistributedOptimizer gives its inner optimizer (fp32 params of a
        group first, then the 16-bit ones), so the grad norm sums in the same order.
        """
        _, group_ranges = optimizer_group_ranges(param_groups, self.layout.gbuf_ranges)
        ordered, engine_groups = [], []
        for group, group_range in zip(param_groups, group_ranges):
            params = group_range["params"]
            params = [p for p in params if p.dtype == torch.float32] + [p for p in params if p.dtype != torch.float32]
            ordered.extend(params)
            ranges = self.layout.flat_ranges(params)
            options = {k: v for k, v in group.items() if k != "params"}
            options.setdefault("lr", self.config.lr)
            options.setdefault("weight_decay", self.config.weight_decay)
            if ranges:
                engine_groups.append((ranges, options))
        return ordered, engine_groups

    def _fill_initial_params(self, start: int, end: int, out: torch.Tensor) -> None:
        # The fp32 master copy starts as the model's (bf16) params, as in megatron-core (stored as
        # remainders: zeros, the model's params being the high halves).
        for lo, hi, view in self.layout.views(start, end, "param"):
            out[lo - start: hi - start].copy_(view)

    def reload_model_params(self) -> None:
        def from_model(sg, param, exp_avg, exp_avg_sq):
            self._fill_initial_params(sg.start, sg.end, param)

        self.engine.modify_state(from_model)

    # -- the step, in the facade's order ---------------------------------------------------------
    def inv_scale(self) -> Optional[float]:
        return None if self.grad_scaler is None else float(self.grad_scaler.inv_scale.item())

    def grads_to_host(self) -> None:
        if self._cuda:
            # The engine pulls each subgroup's grads itself (DeviceGradients), after backward's work.
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            return
        host = self.engine.grad_buffer
        for lo, hi, view in self.layout.views(0, self.layout.numel, "grad"):
            host[lo:hi].copy_(view)
            if self.engine.config.defer_device_wait:  # the loop leaves zeroing to the update (CPU twin)
                view.zero_()

    def grad_norms(self, inv_scale: Optional[float]):
        """Per-param fp32 grad norms in megatron-core's order; any inf/nan (for fp16)."""
        norms, found_inf = [], False
        tp_group = parallel_state.get_tensor_model_parallel_group()  # megatron-core's optimizers' tp_group
        for param in self.norm_params:
            start, end = self.layout.param_flat_range[param]
            pieces = [view.float() for _, _, view in self.layout.views(start, end, "grad")]
            grad = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            if inv_scale is not None:
                grad.mul_(inv_scale)
                found_inf = found_inf or not bool(torch.isfinite(grad).all())
            if param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param, tp_group):
                # --offload-grads host: the norm taken on the device before the grad left it (host_grads)
                norm = vars(param).pop(DEVICE_GRAD_NORM, None)
                norms.append(norm if norm is not None and inv_scale is None else torch.norm(grad).reshape(1))
        return norms, found_inf

    def zero_grads(self) -> None:
        """Zero this shard's grads (a skipped step, whose update read none of them)."""
        for _, _, view in self.layout.views(0, self.layout.numel, "grad"):
            view.zero_()

    def zero_unowned_grads(self) -> None:
        """Zero the grads other ranks reduce (the update zeroes only this rank's shard as it reads it)."""
        for view in self.layout.unowned_grads():
            view.zero_()

    def subgroups_of(self, param) -> List[int]:
        """The engine's subgroups holding (this rank's part of) ``param``."""
        return self.subgroups_in(*self.layout.param_flat_range[param])

    def subgroups_in(self, start: int, end: int) -> List[int]:
        """The engine's subgroups overlapping flat elements [start, end)."""
        return [i for i, sg in enumerate(self.engine.subgroups) if sg.start < end and start < sg.end]

    def _copy_params_to_device(self, start: int, end: int, params: torch.Tensor):
        # Updated on the device (resident or streamed; always on a CPU run): cast in place, in the
        # engine's stream order. With remainders ``params`` are the bf16 params already.
        if self.params_on_host and params.is_cuda:  # back into host memory beside the next piece's update
            self.copy_back.put(params, [(view, lo - start, hi - start)
                                        for lo, hi, view in self.layout.views(start, end, "param")])
            return None
        if not self._cuda or params.device == self.device or self.params_on_host:
            for lo, hi, view in self.layout.views(start, end, "param"):
                view.copy_(params[lo - start: hi - start])
            return None
        with torch.cuda.stream(self.copy_stream):
            staging = self._staging[: end - start]
            staging.copy_(params, non_blocking=True)  # the stored dtype over PCIe, cast on the GPU
            for lo, hi, view in self.layout.views(start, end, "param"):
                view.copy_(staging[lo - start: hi - start])
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return EventFence(event)
