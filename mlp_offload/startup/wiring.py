"""An engine's parts, wired from its config: the update paths, the start-up's measuring and planning,
the gradient and scratch buffers, both update sides, the initial state, the pipeline, state access and
the step loop. Each is built once, complete, with what it needs; the engine holds them and adds
nothing after."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch

from ..config import OffloadConfig, OffloadConfigError
from ..gradients import GradientSource, HostGradients, ModelBuffers, gradient_host_bytes, scratch_buffers
from ..kernels.remainders import RemainderMaster
from ..kernels.update import AdamKernel, Fp32Working, fused_vector_width
from ..model_link import ModelLink
from ..pipeline import IoLog, SlotPipeline, StateViews
from ..plan.placement import CPU, DEVICE
from ..state_access import StateAccess
from ..step.context import SideInputs
from ..step.cpu_side import CpuKernel, CpuUpdate
from ..step.device_side import DeviceSide
from ..step.loop import AcrossSteps, EngineHooks, StepLoop
from ..step.read_ahead import ReadAhead, read_ahead_for
from ..step.update_paths import UpdatePaths, choose_update_paths
from ..subgroups.param_groups import Segment
from ..subgroups.blocks import SubgroupBlocks
from ..subgroups.partition import Subgroup, slot_subgroup
from ..tiers.base import ResidentTier, StreamedTier
from ..tiers.host import HostMemory, check_host_memory
from ..tiers.kinds import kind_of
from .initial_state import allocate_initial_state
from .measure import StartUp, start_up


@dataclass(frozen=True)
class EngineModel:
    """What an engine is given of the model and its shard: ``params`` (the shard's start value, or a
    fill function) of ``numel`` elements, the ``link`` to the model, the shard cut into ``subgroups`` and
    each one's param-group ``segments``, and the CPU's and the device's multi-pass Adam kernels."""
    params: object
    numel: int
    link: ModelLink
    subgroups: List[Subgroup]
    segments: List[List[Segment]]
    adam: AdamKernel
    device_adam: AdamKernel
    blocks: Optional[SubgroupBlocks] = None  # 8-bit moments: each subgroup's pieces with their blocks


@dataclass(frozen=True)
class EngineHolds:
    """What the engine owns while its parts are built: the file and memory ``tiers`` and ``memory``
    (filled here as they are made, so the engine closes them if a later part fails), where its I/O is
    recorded (``io``), the job's key-value store, and what the step loop asks of it (``hooks``)."""
    tiers: Dict[str, StreamedTier]
    memory: Dict[str, ResidentTier]
    io: IoLog
    token_store: object
    hooks: EngineHooks


@dataclass(frozen=True)
class EngineParts:
    """The parts an engine runs on, built complete by ``wire_engine``."""
    start: StartUp  # rates, placement, prediction; its rates price every later placement
    paths: UpdatePaths
    grad_buffer: Optional[torch.Tensor]  # the caller's low-precision gradients, when the engine converts them
    grad_source: GradientSource
    read_ahead: Optional[ReadAhead]
    pipeline: SlotPipeline
    state: StateAccess
    loop: StepLoop


def shard_numel(params, numel: Optional[int]) -> int:
    """Elements of the shard: of ``params`` (a flat tensor), or ``numel`` where ``params`` is a fill function."""
    if callable(params):
        if numel is None:
            raise ValueError("numel is required when params is a fill function")
        return numel
    if params.dim() != 1:
        raise ValueError(f"params must be a flat 1-D shard, got shape {tuple(params.shape)}")
    return params.numel()


def check_engine_inputs(cfg: OffloadConfig, link: ModelLink, token_store) -> None:
    """What the config asks of the engine's other arguments: the job's key-value store where a tier's
    ranks take turns across the job, the model's bf16 params where the master is kept as remainders."""
    job_scoped = [t for t, scope in cfg.token_scope.items() if scope == "job"]
    if job_scoped and token_store is None:
        raise OffloadConfigError(f"token scope 'job' for {job_scoped} needs the job's key-value store "
                                 f"(token_store, e.g. torch.distributed's)")
    if cfg.param_remainders and (link.param_high is None or link.on_params_updated is None):
        raise OffloadConfigError("param remainders (param_remainders) need the model's bf16 params: give "
                                 "param_high (where they are read) and on_params_updated (where they go)")


def wire_engine(cfg: OffloadConfig, model: EngineModel, holds: EngineHolds) -> EngineParts:
    subgroups, link = model.subgroups, model.link
    largest = max(sg.numel for sg in subgroups)
    largest_blocks = slot_subgroup(subgroups).blocks  # None without 8-bit moments
    if cfg.adam_kernel == "fused" and any(span != (0, hi - lo) for segs in model.segments for lo, hi, _, span in segs):
        fused_vector_width()  # measured now, with the other rates, not inside the first step
    # (without a grad source the engine makes a HostGradients below)
    sources_give_views = (link.on_params_updated is not None
                          and ModelBuffers.available(link.grad_source or HostGradients, link.param_high, cfg.device))
    paths = choose_update_paths(cfg, cfg.state_codecs, largest, model.adam, model.device_adam, sources_give_views,
                                largest_blocks)
    start = start_up(cfg, subgroups, paths, holds.tiers, holds.token_store, holds.memory)
    host, placement = start.host, start.placement

    # Buffers: gradients (outside the state budget: the caller's gradient staging), fp32 scratch
    # for converted gradients, resident subgroups, and slots for streamed ones.
    grad_bytes = gradient_host_bytes(model.numel, largest,
                                     None if link.grad_source is not None else link.grad_dtype.itemsize)
    working = Fp32Working(cfg.state_codecs, 0 if paths.cpu_one_pass else largest)  # one pass: none
    eight_bit_bytes = paths.cpu_eight_bit.working_bytes if paths.cpu_eight_bit is not None else 0
    # The CPU update's bf16 high halves of a remainders master: read in, updated, handed out.
    high_bytes = largest * 2 if cfg.param_remainders else 0
    check_host_memory({"optimizer cache": placement.host_state_bytes,
                       "gradient staging": grad_bytes + working.nbytes + eight_bit_bytes + high_bytes},
                      cfg.resolved_ranks_sharing_node(), dict(cfg.host_bytes_beside), bool(cfg.file_tiers))
    grad_buffer, grad_source = None, link.grad_source
    if grad_source is None:
        grad_buffer = host.allocate(model.numel * link.grad_dtype.itemsize, "gradient buffer",
                                    counted=False).view(link.grad_dtype)
        grad_source = HostGradients(grad_buffer)
    high = (host.allocate(high_bytes, "param high halves", counted=False).view(torch.bfloat16)
            if cfg.param_remainders else None)
    # The two update sides (step.context.UpdateSide), built complete with what they need.
    inputs = SideInputs(subgroups, model.segments, grad_source, link.on_params_updated,
                        link.param_high if cfg.param_remainders else None, holds.io.trace, model.blocks)
    cpu_side = CpuUpdate(inputs, CpuKernel(model.adam, working, paths.cpu_one_pass, paths.cpu_eight_bit),
                         scratch_buffers(not isinstance(grad_source, HostGradients), largest, host.allocate), high)
    read_ahead = read_ahead_for(cfg, paths.device_update, cfg.state_codecs, largest, len(subgroups), largest_blocks)
    device_side = None if paths.device_update is None else DeviceSide(
        inputs, paths.device_update, model.device_adam, lambda i: kind_of(placement.tier_of[i]).in_device_memory,
        read_ahead,
        ModelBuffers.of(grad_source, link.param_high, cfg.device) if paths.on_model_buffers else None,
        deferred=paths.deferred is not None)
    resident, buffers = allocate_initial_state(subgroups, placement, holds.memory, host, model.params)
    pipeline = SlotPipeline(subgroups, placement.tier_of, holds.tiers, buffers, cfg.prefetch_depth, model.params,
                            holds.io)
    master = (RemainderMaster(link.param_high, link.on_params_updated, largest)
              if cfg.param_remainders else None)
    state = StateAccess(subgroups, resident, pipeline, lambda: checkpoint_scratch(host, subgroups), master)
    sides = {CPU: cpu_side, **({DEVICE: device_side} if device_side is not None else {})}
    loop = StepLoop(subgroups, placement, sides, pipeline, resident, AcrossSteps(paths.deferred, read_ahead),
                    replace(holds.hooks, interleave=cfg.interleave_device_updates))
    return EngineParts(start, paths, grad_buffer, grad_source, read_ahead, pipeline, state, loop)


def checkpoint_scratch(host: HostMemory, subgroups: List[Subgroup]) -> StateViews:
    """A buffer for the largest subgroup's state. Outside the budget on purpose: used only while saving or
    loading a checkpoint."""
    sg = slot_subgroup(subgroups)
    return StateViews.over(host.allocate(sg.state_bytes, "checkpoint buffer", counted=False), sg)
