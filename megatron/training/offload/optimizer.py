"""megatron-core's distributed optimizer with the mlp_offload engine as its backend.

What stays as megatron-core does it: DDP's param-and-grad buffers (bf16 params and grads on the
device), the reduce-scatter of grads and all-gather of params, param groups and their shard
ranges (its DistributedOptimizer's own range builders), the LR scheduler's view of
``param_groups``, grad-norm clipping and fp16 loss scaling. What changes: the fp32 master shard
and Adam state live in the engine (host memory and file tiers), never on the device.

Per step: grads of this rank's shard are copied device->host per subgroup, in the engine's update
order, on a side stream; the grad norm (and, for fp16, the inf/nan check) is computed on the
device; the engine updates subgroup by subgroup, each updated subgroup's params are copied back
into the device param buffer; then megatron-core's param all-gather runs as usual.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.module import param_is_not_shared

from megatron.training.offload.device_gradients import DeviceGradients, EventFence
from megatron.training.checkpoint.offloaded_state import OffloadedStateFiles
from megatron.training.runtime.optimizer_interface import (HoldsResources, OffloadedOptimizerCheckpoint,
                                                           ReportsIteration, TrainingOptimizer)
from megatron.training.offload.shard_layout import ShardLayout
from mlp_offload import OffloadConfig, OffloadedAdamW
from mlp_offload.state_dtypes import torch_dtypes


class OffloadDistributedOptimizer(TrainingOptimizer, OffloadedOptimizerCheckpoint, ReportsIteration, HoldsResources):
    """The MegatronOptimizer interface the training loop uses, over an OffloadedAdamW engine."""

    def __init__(self, config: OptimizerConfig, offload_config: OffloadConfig, model_chunks,
                 param_groups: List[dict], per_model_buffers: Dict[int, list], token_store=None):
        self.config = config
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # The group megatron-core reduces grad statistics over for its distributed optimizer.
        self.grad_stats_parallel_group = parallel_state.get_intra_distributed_optimizer_instance_group()
        self.layout = ShardLayout(per_model_buffers, self.dp_group.rank(), self.dp_group.size())
        first_buffer = self.layout.pieces[0].buffer
        self.device = first_buffer.param_data.device
        self.grad_scaler = self._grad_scaler(config)
        self._norm_params, engine_groups = self._ordered_groups(param_groups)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream() if self._cuda else None
        largest = min(offload_config.subgroup_size, self.layout.numel)
        # The master params cross PCIe in their stored dtype (a CPU-side cast would cost the update's time).
        master_dtype = torch_dtypes(offload_config.state_dtypes)[0]
        self._staging = torch.empty(largest, dtype=master_dtype, device=self.device) if self._cuda else None
        # On a GPU, grads are cast to fp32 there and copied per subgroup as the update needs them;
        # on CPU they go through the engine's low-precision host buffer (the CPU twin of that path).
        self._device_grads = DeviceGradients(self.layout, self._copy_stream, largest) if self._cuda else None
        self.engine = OffloadedAdamW(
            self._fill_initial_params, offload_config, numel=self.layout.numel,
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=config.weight_decay, groups=engine_groups,
            grad_dtype=first_buffer.grad_dtype, on_params_updated=self._copy_params_to_device,
            grad_source=self._device_grads, token_store=token_store)
        self.state_files = OffloadedStateFiles(self.engine, self.layout, model_chunks, self.dp_group.size())
        self._expected_steps: Optional[int] = None  # the step count of the checkpoint being loaded
        self.last_record = None
        self.is_stub_optimizer = False

    # -- set-up helpers ----------------------------------------------------------------------
    @staticmethod
    def _grad_scaler(config: OptimizerConfig):
        if config.loss_scale:
            return ConstantGradScaler(config.loss_scale)
        if config.fp16:
            return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                     growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
        return None

    def _ordered_groups(self, param_groups: List[dict]):
        """Engine groups (flat ranges + hyperparameters) and the params in megatron-core's order.

        The order is the one its DistributedOptimizer gives its inner optimizer (fp32 params of a
        group first, then the 16-bit ones), so the grad norm sums in the same order.
        """
        _, group_ranges = DistributedOptimizer._build_optimizer_group_ranges(param_groups, self.layout.gbuf_ranges)
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
        # The fp32 master copy starts as the model's (bf16) params, as in megatron-core.
        for lo, hi, view in self.layout.views(start, end, "param"):
            out[lo - start: hi - start].copy_(view)

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        inv_scale = None
        if self.grad_scaler is not None:
            inv_scale = float(self.grad_scaler.inv_scale.item())
        self._grads_to_host()
        norms, found_inf = self._grad_norms(inv_scale)
        if self.grad_scaler is not None:
            found = torch.tensor([float(found_inf)], device=self.device)
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                         group=self.grad_stats_parallel_group)
            found_inf = bool(found.item())
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.last_record = self.engine.step(skip=True)
                return False, None, None
        grad_norm, clip_coef = 0.0, None
        if self.config.clip_grad > 0.0:
            grad_norm = get_grad_norm_fp32(norms, grad_stats_parallel_group=self.grad_stats_parallel_group)
            coef = self.config.clip_grad / (grad_norm + 1.0e-6)
            clip_coef = coef if coef < 1.0 else None
        self.last_record = self.engine.step(unscale=inv_scale, clip_coef=clip_coef)
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._copy_stream)
        if not self.ddp_config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return True, grad_norm, None  # no zeros counted (--log-num-zeros-in-grad is megatron-core's)

    def _grad_norms(self, inv_scale: Optional[float]):
        """Per-param fp32 grad norms in megatron-core's order; any inf/nan (for fp16)."""
        norms, found_inf = [], False
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for param in self._norm_params:
            start, end = self.layout.param_flat_range[param]
            pieces = [view.float() for _, _, view in self.layout.views(start, end, "grad")]
            grad = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            if inv_scale is not None:
                grad.mul_(inv_scale)
                found_inf = found_inf or not bool(torch.isfinite(grad).all())
            if param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param, tp_group):
                norms.append(torch.norm(grad).reshape(1))
        return norms, found_inf

    def _grads_to_host(self) -> None:
        if self._cuda:
            # The engine pulls each subgroup's grads itself (DeviceGradients), after backward's work.
            self._copy_stream.wait_stream(torch.cuda.current_stream())
            return
        host = self.engine.grad_buffer
        for lo, hi, view in self.layout.views(0, self.layout.numel, "grad"):
            host[lo:hi].copy_(view)

    def _copy_params_to_device(self, start: int, end: int, params: torch.Tensor):
        if not self._cuda:
            for lo, hi, view in self.layout.views(start, end, "param"):
                view.copy_(params[lo - start: hi - start])
            return None
        with torch.cuda.stream(self._copy_stream):
            staging = self._staging[: end - start]
            staging.copy_(params, non_blocking=True)  # the stored dtype over PCIe, cast on the GPU
            for lo, hi, view in self.layout.views(start, end, "param"):
                view.copy_(staging[lo - start: hi - start])
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return EventFence(event)

    # -- the rest of the MegatronOptimizer interface ------------------------------------------
    @property
    def param_groups(self):
        return self.engine.param_groups

    def zero_grad(self, set_to_none: bool = True):
        pass  # grads live in DDP's buffer, zeroed by the training loop

    def get_loss_scale(self):
        if self.grad_scaler is None:
            return torch.tensor([1.0], dtype=torch.float32, device=self.device)
        return self.grad_scaler.scale

    def scale_loss(self, loss):
        return self.get_loss_scale() * loss

    def reload_model_params(self, state_dict=None):
        def from_model(sg, param, exp_avg, exp_avg_sq):
            self._fill_initial_params(sg.start, sg.end, param)

        self.engine.modify_state(from_model)

    # -- checkpoints: metadata through dist_checkpointing, the state streamed beside it ----------
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, **unused):
        # The same on every rank: common (non-sharded) state, so it loads under any layout.
        return {"offload_meta": {"steps_done": self.engine.steps_done,
                                 "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None}}

    def load_state_dict(self, state_dict):
        meta = state_dict["offload_meta"]
        if self.grad_scaler is not None and meta.get("grad_scaler"):
            self.grad_scaler.load_state_dict(meta["grad_scaler"])
        self._expected_steps = meta["steps_done"]

    def state_dict(self):
        raise NotImplementedError("the offloaded optimizer saves through sharded_state_dict() and save_offloaded_state()")

    def save_offloaded_state(self, checkpoint_dir: str) -> int:
        return self.state_files.save(checkpoint_dir)

    def start_offloaded_save(self, checkpoint_dir: str):
        return self.state_files.start_save(checkpoint_dir)

    def offloaded_state_bytes(self) -> int:
        return self.state_files.nbytes()

    def load_offloaded_state(self, checkpoint_dir: str) -> None:
        self.state_files.load(checkpoint_dir, self._expected_steps)

    def last_step_record(self):
        return self.last_record

    def state_bytes_per_tier(self) -> dict:
        return self.engine.state_bytes_per_tier()

    def close(self):
        self.engine.close()

