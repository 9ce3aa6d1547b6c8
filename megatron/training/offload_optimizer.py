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

import glob
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer import _get_param_groups_and_buffers
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.module import param_is_not_shared

from mlp_offload import OffloadConfig, OffloadedAdamW
from mlp_offload.checkpoint import (CheckpointDataError, RangeReader, load_engine_state, read_footer, save_engine_state,
                                    state_file_bytes)
from megatron.training.errors import UserError
from megatron.training.offload_flags import config_from_args
from megatron.training.job_facts import PerNodeByRank0

log = logging.getLogger("mlp_offload")
GiB = 1024**3


def offload_config_from_args(args) -> OffloadConfig:
    """The engine's config from the ``--offload-*`` flags."""
    return config_from_args(args, rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)


def _job_store(config: OffloadConfig):
    """The job's key-value store, for I/O tokens taken across nodes (--offload-token-scope T=job)."""
    if "job" not in config.token_scope.values():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _show_engine_log() -> None:
    """The engine reports placement, rates and prediction at INFO: show them, tagged by rank."""
    if not log.handlers:
        handler = logging.StreamHandler()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        handler.setFormatter(logging.Formatter(f"[offload rank {rank}] %(levelname)s %(message)s"))
        handler.addFilter(PerNodeByRank0())  # rank 0 prints every node's once (job_facts.report)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def get_offload_optimizer(args, model_chunks, config: OptimizerConfig) -> "OffloadDistributedOptimizer":
    _show_engine_log()
    if not config.use_distributed_optimizer:
        raise UserError("--offload-tiers requires the distributed optimizer (--use-distributed-optimizer)")
    _set_cpu_threads(args, model_chunks)
    param_groups, buffers = _get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=config, config_overrides=None,
        filter_fn=lambda g: not g["is_expert_parallel"], buffer_name="buffers")
    optimizer = OffloadDistributedOptimizer(config, offload_config_from_args(args), model_chunks, param_groups, buffers)
    optimizer.telemetry_path = _telemetry_path(args.offload_telemetry_log)
    return optimizer


def _telemetry_path(template: Optional[str]) -> Optional[str]:
    if not template:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None


def _set_cpu_threads(args, model_chunks) -> None:
    # torchrun sets OMP_NUM_THREADS=1, which would starve the CPU Adam; on a GPU node give each
    # local rank its share of the cores unless told otherwise.
    threads = args.offload_cpu_threads
    if threads is None and next(model_chunks[0].parameters()).is_cuda:
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if threads:
        torch.set_num_threads(threads)


@dataclass
class _Piece:
    """This rank's shard of one DDP bucket: a contiguous range of one buffer."""

    buffer: object  # megatron-core _ParamAndGradBuffer
    buffer_start: int
    flat_start: int  # where it begins in the engine's flat index space
    numel: int


class ShardLayout:
    """The engine's flat index space laid over this rank's bucket shards, in buffer order."""

    def __init__(self, per_model_buffers: Dict[int, list], dp_rank: int, dp_size: int):
        self.pieces: List[_Piece] = []
        self.gbuf_ranges = []  # megatron-core's own range maps, same order as its optimizer
        self.param_flat_range: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        self.param_slice: Dict[torch.nn.Parameter, int] = {}  # where this rank's piece starts in the param
        flat = 0
        for buffers in per_model_buffers.values():
            for buffer in buffers:
                range_map = DistributedOptimizer._build_gbuf_range_map(buffer)
                self.gbuf_ranges.append(range_map)
                (bucket_maps,) = range_map.values()
                for bucket, bucket_map in zip(buffer.buckets, bucket_maps):
                    shard = bucket.grad_data.numel() // dp_size
                    piece = _Piece(buffer, bucket.offset + dp_rank * shard, flat, shard)
                    self.pieces.append(piece)
                    for param, ranges in bucket_map["param_map"].items():
                        world = ranges["gbuf_world"]
                        start = flat + world.start - piece.buffer_start
                        self.param_flat_range[param] = (start, start + world.size)
                        self.param_slice[param] = ranges["param"].start
                    flat += shard
        self.numel = flat

    def views(self, start: int, end: int, kind: str):
        """(flat_start, flat_end, device view) for the pieces overlapping [start, end)."""
        for p in self.pieces:
            lo, hi = max(start, p.flat_start), min(end, p.flat_start + p.numel)
            if lo < hi:
                data = p.buffer.param_data if kind == "param" else p.buffer.grad_data
                offset = p.buffer_start + lo - p.flat_start
                yield lo, hi, data[offset: offset + hi - lo]


class DeviceGradients:
    """The engine's gradient source on a GPU: per subgroup, cast the bf16/fp16 grad shard to fp32
    on the device (with the loss unscale and clip factors: fp32 multiplies round the same on GPU
    and CPU), then copy it into the engine's pinned scratch, on a side stream, so the copy of the
    next subgroup runs while the CPU does Adam on this one. The CPU does no conversion."""

    def __init__(self, layout: ShardLayout, stream, largest: int):
        self.layout = layout
        self.stream = stream
        self.staging = [torch.empty(largest, dtype=torch.float32, device=stream.device) for _ in range(2)]
        self.events: Dict[int, object] = {}
        self._turn = 0

    def start(self, start: int, end: int, out: torch.Tensor, unscale, clip_coef) -> None:
        buf = self.staging[self._turn % 2][: end - start]
        self._turn += 1
        with torch.cuda.stream(self.stream):
            for lo, hi, view in self.layout.views(start, end, "grad"):
                buf[lo - start: hi - start].copy_(view)
            for factor in (unscale, clip_coef):
                if factor is not None and factor != 1.0:
                    buf.mul_(factor)
            out.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[start] = event

    def wait(self, start: int) -> None:
        self.events.pop(start).synchronize()


class _EventFence:
    """What the engine waits on before reusing a host buffer that a copy still reads."""

    def __init__(self, event):
        self.event = event

    def synchronize(self):
        self.event.synchronize()


class OffloadDistributedOptimizer:
    """The MegatronOptimizer interface the training loop uses, over an OffloadedAdamW engine."""

    def __init__(self, config: OptimizerConfig, offload_config: OffloadConfig, model_chunks,
                 param_groups: List[dict], per_model_buffers: Dict[int, list]):
        self.config = config
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # The group megatron-core reduces grad statistics over for its distributed optimizer.
        self.grad_stats_parallel_group = parallel_state.get_intra_distributed_optimizer_instance_group()
        self.layout = ShardLayout(per_model_buffers, self.dp_group.rank(), self.dp_group.size())
        # Stable names, so a checkpoint can be resharded onto another data-parallel size.
        self.param_names = {param: f"{i}.{name}" for i, chunk in enumerate(model_chunks)
                            for name, param in chunk.named_parameters()}
        first_buffer = self.layout.pieces[0].buffer
        self.device = first_buffer.param_data.device
        self.grad_scaler = self._grad_scaler(config)
        self._norm_params, engine_groups = self._ordered_groups(param_groups)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream() if self._cuda else None
        largest = min(offload_config.subgroup_size, self.layout.numel)
        self._staging = torch.empty(largest, dtype=torch.float32, device=self.device) if self._cuda else None
        # On a GPU, grads are cast to fp32 there and copied per subgroup as the update needs them;
        # on CPU they go through the engine's low-precision host buffer (the CPU twin of that path).
        self._device_grads = DeviceGradients(self.layout, self._copy_stream, largest) if self._cuda else None
        self.engine = OffloadedAdamW(
            self._fill_initial_params, offload_config, numel=self.layout.numel,
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=config.weight_decay, groups=engine_groups,
            grad_dtype=first_buffer.grad_dtype, on_params_updated=self._copy_params_to_device,
            grad_source=self._device_grads, token_store=_job_store(offload_config))
        self.last_record = None
        self.telemetry_path: Optional[str] = None
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
            ranges = _merge([self.layout.param_flat_range[p] for p in params])
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
        self._write_telemetry()
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._copy_stream)
        if not self.ddp_config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return True, grad_norm, 0

    def _write_telemetry(self) -> None:
        if self.telemetry_path:
            record = asdict(self.last_record)
            with open(self.telemetry_path, "a") as f:
                f.write(json.dumps(record) + "\n")

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
            staging.copy_(params, non_blocking=True)  # fp32 over PCIe, cast on the GPU
            for lo, hi, view in self.layout.views(start, end, "param"):
                view.copy_(staging[lo - start: hi - start])
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return _EventFence(event)

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
        """Stream this rank's state into ``checkpoint_dir/offload/`` (a file per rank); returns its bytes."""
        path = self._state_path(checkpoint_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pieces = [[self.param_names[p], self.layout.param_slice[p], b - a, a]
                  for p, (a, b) in self.layout.param_flat_range.items()]
        return save_engine_state(self.engine, path, metadata={"dp_size": self.dp_group.size(), "params": pieces})

    def offloaded_state_bytes(self) -> int:
        return state_file_bytes(self.engine.numel)

    def load_offloaded_state(self, checkpoint_dir: str) -> None:
        path = self._state_path(checkpoint_dir)
        same_dp = os.path.exists(path) and read_footer(path)["metadata"].get("dp_size") == self.dp_group.size()
        if same_dp:
            load_engine_state(self.engine, path)
        else:
            self._load_resharded(checkpoint_dir)
        expected = getattr(self, "_expected_steps", None)
        if expected is not None and expected != self.engine.steps_done:
            raise CheckpointDataError(f"offloaded state in {checkpoint_dir} is at step {self.engine.steps_done}, "
                               f"the checkpoint's metadata says {expected}")

    def _load_resharded(self, checkpoint_dir: str) -> None:
        """Fill this rank's shard from the files of another data-parallel size (same TP and PP):
        each parameter slice is read from whichever old ranks held it."""
        _, (p, t, _) = _rank_coordinates()
        pattern = os.path.join(checkpoint_dir, "offload", f"pp{p:03d}_tp{t:03d}_dp*.offload")
        files = sorted(glob.glob(pattern))
        if not files:
            raise CheckpointDataError(f"{checkpoint_dir}: no offloaded optimizer state for pp={p} tp={t} ({pattern})")
        footers = [read_footer(f) for f in files]
        old_dp = footers[0]["metadata"].get("dp_size")
        if old_dp != len(files) or any(f["metadata"].get("dp_size") != old_dp for f in footers):
            raise CheckpointDataError(f"{checkpoint_dir}: found {len(files)} offload files for pp={p} tp={t}, "
                                      f"their data-parallel size says {old_dp}: the checkpoint is incomplete")
        steps = {f["steps_done"] for f in footers}
        if len(steps) != 1:
            raise CheckpointDataError(f"{checkpoint_dir}: offload files disagree on the step count {sorted(steps)}")
        readers = [RangeReader(f, footer["subgroups"]) for f, footer in zip(files, footers)]
        held = {}  # param name -> [(param offset, length, file flat offset, reader)]
        for path, reader, footer in zip(files, readers, footers):
            for name, offset, length, flat in _param_slices(path, footer):
                held.setdefault(name, []).append((offset, length, flat, reader))
        mine = sorted((a, b, self.layout.param_slice[param], self.param_names[param])
                      for param, (a, b) in self.layout.param_flat_range.items())

        def fill(sg, *outs):
            for out in outs:
                out.zero_()  # bucket padding holds no parameter
            for a, b, offset, name in mine:
                lo, hi = max(a, sg.start), min(b, sg.end)
                if lo >= hi:
                    continue
                want, want_end, filled = offset + lo - a, offset + hi - a, 0
                for old_offset, length, flat, reader in held.get(name, []):
                    x, y = max(want, old_offset), min(want_end, old_offset + length)
                    if x < y:
                        dst = lo - sg.start + (x - want)
                        for k, out in enumerate(outs):
                            reader.read(k, flat + x - old_offset, flat + y - old_offset, out[dst: dst + y - x])
                        filled += y - x
                if filled != want_end - want:
                    raise CheckpointDataError(f"{checkpoint_dir}: elements {want}..{want_end} of {name} are "
                                              f"in no offload file (another model or TP/PP layout?)")

        try:
            self.engine.load_state(fill, steps_done=steps.pop())
        finally:
            for reader in readers:
                reader.close()
        if torch.distributed.get_rank() == 0:
            log.info("offloaded state resharded from data-parallel size %d to %d", old_dp, self.dp_group.size())

    @staticmethod
    def _state_path(checkpoint_dir: str) -> str:
        (pp, tp, dp), (p, t, d) = _rank_coordinates()
        return os.path.join(checkpoint_dir, "offload", f"pp{p:03d}_tp{t:03d}_dp{d:03d}.offload")

    def log_line(self) -> str:
        return self.last_record.line() if self.last_record is not None else ""

    def close(self):
        self.engine.close()


def _rank_coordinates():
    """(pp, tp, dp) sizes and this rank's (pp, tp, dp) position."""
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return shape, offset


def _param_slices(path: str, footer: dict):
    """The footer's per-parameter slices, each checked to lie inside the file's elements."""
    slices = footer["metadata"].get("params")
    if not isinstance(slices, list):
        raise CheckpointDataError(f"{path}: no per-parameter slice table: it cannot be resharded")
    for entry in slices:
        ok = (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
              and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[1:]))
        if not ok or entry[1] < 0 or entry[2] <= 0 or entry[3] < 0 or entry[3] + entry[2] > footer["numel"]:
            raise CheckpointDataError(f"{path}: slice table entry {str(entry)[:80]} lies outside the file's "
                                      f"{footer['numel']} elements; the file was not used")
    return slices


def _merge(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    merged: List[Tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged
