"""OffloadedAdamW: one rank's AdamW state held in host memory and file tiers, updated subgroup by
subgroup with reads prefetched ahead and writes behind.

Data flow: plan (rates -> placement -> prediction) -> tiers (host memory, files) -> this engine. The caller (the
Megatron adapter, a test, a benchmark) copies low-precision gradients into ``grad_buffer`` (or
gives a ``GradientSource``) and calls ``step()``; each updated subgroup's master parameters (in their stored dtype) are
handed to ``on_params_updated``. The engine is the torch-shaped front and wires the pieces:
``step.loop`` (one step over the subgroups), ``pipeline`` (slots streaming the file-backed
subgroups), ``schedule`` (the per-step traffic model), ``step.cpu_side`` and ``step.device_side`` (each
side's share of a step), ``state_access`` (checkpoints), ``gradients``, ``param_groups`` and
``update`` (the Adam kernels).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from types import MappingProxyType
from typing import Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch

from .config import GPU_TIER, OffloadConfig, OffloadConfigError
from .step.context import SideInputs
from .step.cpu_side import CpuKernel, CpuUpdate
from .step.deferred import DeferredWork
from .step.device_side import DeviceSide
from .step.update_paths import choose_update_paths
from .gradients import GradientSource, HostGradients, ModelBuffers, gradient_host_bytes, scratch_buffers
from .model_link import ModelLink
from .param_groups import Range, adamw_options, build_groups, segments_of
from .plan.placement import CPU, DEVICE, Placement
from .plan.prediction import Prediction
from .startup import describe_device_rates, describe_tiers, start_up
from .initial_state import allocate_initial_state
from .pipeline import IoLog, OffloadStateError, SlotPipeline, StateViews
from .step.read_ahead import read_ahead_for
from .relocation import Relocation
from .kernels.remainders import RemainderMaster
from .plan.schedule import StepSchedule, step_schedule
from .snapshot import StateSnapshot
from .state_access import StateAccess
from .state_formats import bytes_per_param, describe as describe_formats
from .step.loop import AcrossSteps, EngineHooks, StepLoop
from .subgroups import Subgroup, partition
from .telemetry import StepRecord, TrafficCounters
from .tiers.base import ResidentTier, StreamedTier
from .tiers.host import check_host_memory
from .trace import Trace, open_trace
from .kernels.update import AdamKernel, Fp32Working, fused_vector_width
from .units import GiB

log = logging.getLogger("mlp_offload")
PER_NODE = "mlp_offload_per_node"  # set on log records that say the same on every rank of a node
__all__ = ["OffloadedAdamW", "OffloadStateError", "GradientSource", "ModelLink"]


class OffloadedAdamW:
    """AdamW over a flat fp32 shard whose state lives in host memory and file tiers.

    torch.optim-shaped: ``param_groups`` (dicts with lr, betas, eps, weight_decay; a scheduler may
    change them between steps), ``step()``, ``state_dict``-style streaming via
    ``iter_state()``/``load_state()``. ``params`` is the initial value of the shard (any dtype or
    device), or a function ``fill(start, end, out_fp32)`` with ``numel`` given; it is read once
    per subgroup, lazily, and not kept after the first step.

    ``adamw``: AdamW's hyperparameters as torch.optim.AdamW names them (lr, betas, eps, weight_decay;
    and decoupled_weight_decay, ``param_groups.ADAMW_OPTIONS``), the defaults of every group in ``groups``.

    What the engine is given of the model is its ``model`` (``ModelLink``). Gradients come from
    ``grad_buffer`` (``model.grad_dtype``, filled by the caller, converted here), or, with
    ``model.grad_source``, as fp32 straight into one of two scratch buffers (e.g. cast on the GPU and
    copied while the previous subgroup's Adam runs); then there is no ``grad_buffer``.

    With ``config.param_remainders`` the master is stored as int16 remainders of the model's bf16
    params, read per subgroup from ``model.param_high``; ``model.on_params_updated`` then gets the
    updated bf16 params (what the model must hold), and the initial master is taken as the model's
    (``params`` rounded half away; remainders of zero for bf16 values).

    ``token_store`` is the job's key-value store (a ``torch.distributed.Store``): needed where
    ``config.token_scope`` makes a tier's ranks take turns across the whole job.
    """

    def __init__(self, params: torch.Tensor, config: OffloadConfig, *,
                 groups: Optional[Sequence[Tuple[Sequence[Range], dict]]] = None, numel: Optional[int] = None,
                 model: ModelLink = ModelLink(), token_store=None, **adamw):
        defaults, decoupled_weight_decay = adamw_options(adamw)
        on_params_updated, param_high, grad_source = model.on_params_updated, model.param_high, model.grad_source
        if callable(params):
            if numel is None:
                raise ValueError("numel is required when params is a fill function")
            self.numel = numel
        elif params.dim() != 1:
            raise ValueError(f"params must be a flat 1-D shard, got shape {tuple(params.shape)}")
        else:
            self.numel = params.numel()
        self.config = config
        job_scoped = [t for t, scope in config.token_scope.items() if scope == "job"]
        if job_scoped and token_store is None:
            raise OffloadConfigError(f"token scope 'job' for {job_scoped} needs the job's key-value store "
                                     f"(token_store, e.g. torch.distributed's)")
        self.token_store = token_store
        self.on_params_updated = on_params_updated
        # The model's bf16 params: the masters' high halves where they are stored as remainders
        # (also read to load a checkpoint stored so into an engine that is not).
        self.param_high = param_high
        if config.param_remainders and (param_high is None or on_params_updated is None):
            raise OffloadConfigError("param remainders (param_remainders) need the model's bf16 params: give "
                                     "param_high (where they are read) and on_params_updated (where they go)")
        self.adam = AdamKernel(config.adam_kernel, decoupled_weight_decay)
        self.device_adam = AdamKernel(config.resolved_device_adam_kernel, decoupled_weight_decay)
        self.param_groups = build_groups(groups, defaults, self.numel)
        self.state_codecs = config.state_codecs  # how each state tensor is stored (state_formats)
        self.subgroups = partition(self.numel, config.subgroup_size, self.state_codecs)
        self._segments = [segments_of(sg, self.param_groups) for sg in self.subgroups]
        if config.adam_kernel == "fused" and any(span != (0, hi - lo) for segs in self._segments
                                                 for lo, hi, _, span in segs):
            fused_vector_width()  # measured now, with the other rates, not inside the first step
        self.steps_done = 0  # AdamW's step count (skipped steps do not count)
        self.closed = False
        self._snapshot: Optional[StateSnapshot] = None  # being written while the engine steps on
        self._deferred: Optional[DeferredWork] = None  # defer_device_wait: what a step left queued
        self._read_ahead = None  # step.read_ahead.ReadAhead with device_read_ahead_bytes
        self._tiers: Dict[str, StreamedTier] = {}  # file tiers, by name
        self.memory: Dict[str, ResidentTier] = {}  # memory tiers, by name, fastest first
        self._counters = TrafficCounters(config.file_tiers)
        self.trace: Optional[Trace] = open_trace(config.trace_path, config.rank)
        try:
            self._setup(params, model.grad_dtype, grad_source)
        except BaseException:
            self.close()
            raise
        # Swap files go with the process even if the caller never closes the engine.
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- setup ---------------------------------------------------------------------------------
    def _setup(self, params: torch.Tensor, grad_dtype: torch.dtype, grad_source: Optional[GradientSource]) -> None:
        cfg = self.config
        largest = max(sg.numel for sg in self.subgroups)
        # (without a grad source the engine makes a HostGradients below)
        sources_give_views = (self.on_params_updated is not None
                              and ModelBuffers.available(grad_source or HostGradients, self.param_high, cfg.device))
        paths = choose_update_paths(cfg, self.state_codecs, largest, self.adam, self.device_adam, sources_give_views)
        self._device_update, self._deferred = paths.device_update, paths.deferred
        self._cpu_one_pass, self.cpu_one_pass_how = paths.cpu_one_pass, paths.cpu_one_pass_how
        on_model = paths.on_model_buffers
        plan = start_up(cfg, self.subgroups, paths, self._tiers, self.token_store, self.memory)
        self.host, self.rates, self.tokens_per_tier = plan.host, plan.rates, plan.tokens_per_tier
        self.adam_rate, self.convert_rate, self.devices = plan.adam_rate, plan.convert_rate, plan.devices
        self.update_rates = plan.update_rates
        self._start_up = plan  # its rates price every later placement (repredict)
        self.placement: Placement = plan.placement
        self.prediction: Prediction = plan.prediction

        # Buffers: gradients (outside the state budget: the caller's gradient staging), fp32 scratch
        # for converted gradients, resident subgroups, and slots for streamed ones.
        grad_bytes = gradient_host_bytes(self.numel, largest, None if grad_source is not None else grad_dtype.itemsize)
        working = Fp32Working(self.state_codecs, 0 if self._cpu_one_pass else largest)  # one pass: none
        # The CPU update's bf16 high halves of a remainders master: read in, updated, handed out.
        high_bytes = largest * 2 if cfg.param_remainders else 0
        check_host_memory({"optimizer cache": self.placement.host_state_bytes,
                           "gradient staging": grad_bytes + working.nbytes + high_bytes},
                          cfg.resolved_ranks_sharing_node(), dict(cfg.host_bytes_beside), bool(cfg.file_tiers))
        self.grad_buffer = None  # the caller's low-precision gradients, when the engine converts them
        if grad_source is None:
            self.grad_buffer = self.host.allocate(self.numel * grad_dtype.itemsize, "gradient buffer",
                                                  counted=False).view(grad_dtype)
            grad_source = HostGradients(self.grad_buffer)
        self.grad_source = grad_source
        high = (self.host.allocate(high_bytes, "param high halves", counted=False).view(torch.bfloat16)
                if cfg.param_remainders else None)
        # The two update sides (step.context.UpdateSide), built complete with what they need.
        inputs = SideInputs(self.subgroups, self._segments, grad_source, self.on_params_updated,
                            self.param_high if cfg.param_remainders else None, self.trace)
        self._cpu_side = CpuUpdate(
            inputs, CpuKernel(self.adam, working, self._cpu_one_pass),
            scratch_buffers(not isinstance(grad_source, HostGradients), largest, self.host.allocate), high)
        self._read_ahead = read_ahead_for(cfg, self._device_update, self.state_codecs, largest,
                                          len(self.subgroups))
        self._device_side = None if self._device_update is None else DeviceSide(
            inputs, self._device_update, self.device_adam, lambda i: self.placement.tier_of[i] == GPU_TIER,
            self._read_ahead, ModelBuffers.of(grad_source, self.param_high, cfg.device) if on_model else None,
            deferred=self._deferred is not None)
        self._resident, buffers = allocate_initial_state(self.subgroups, self.placement, self.memory, self.host,
                                                         params)
        self._pipeline = SlotPipeline(self.subgroups, self.placement.tier_of, self._tiers, buffers,
                                      cfg.prefetch_depth, params, IoLog(self._counters, self.trace))
        master = (RemainderMaster(self.param_high, self.on_params_updated, largest)
                  if cfg.param_remainders else None)
        self._state = StateAccess(self.subgroups, self._resident, self._pipeline, self._scratch_views, master)
        self._relocation = Relocation(self)
        sides = {CPU: self._cpu_side, **({DEVICE: self._device_side} if self._device_side is not None else {})}
        self._loop = StepLoop(self.subgroups, self.placement, sides, self._pipeline, self._resident,
                              AcrossSteps(self._deferred, self._read_ahead),
                              EngineHooks(lambda: self.prediction, self._guard_snapshot))
        self.log_placement()
        self._pipeline.begin(self._schedule_for(0))

    def _schedule_for(self, step_index: int) -> StepSchedule:
        return step_schedule(step_index, self.placement.tier_of, self.placement.slots, self.placement.cache_slots,
                             self.config.cache_alternating)

    def describe_tiers(self) -> str:
        """The file tiers' rates and tokens: the same for every rank of a node (the probe is per
        host and path), so a job's launcher may print it once per node."""
        return describe_tiers(self.rates, self._tiers, self.tokens_per_tier, self.config)

    def state_bytes_per_tier(self) -> Dict[str, int]:
        """Bytes of optimizer state each tier holds: a memory tier what its budget is charged (host:
        its resident subgroups and the streaming buffers), a file tier its subgroups' files."""
        held = dict(self.placement.resident_bytes)
        for tier in self.config.file_tiers:
            held[tier] = sum(self.subgroups[i].state_bytes for i in self.placement.subgroups_on(tier))
        return held

    def log_placement(self) -> None:
        p, cfg = self.placement, self.config
        counts = {t: len(p.subgroups_on(t)) for t in [*self.memory, *cfg.file_tiers]}
        if self.rates:
            log.info("offload tiers of this node: %s", self.describe_tiers(), extra={PER_NODE: True})
        log.info(
            "offload rank %d: %d params in %d subgroups; placement %s; %d host buffers (%d cache); "
            "state per memory tier %s; state %.1f B/param (%s); adam %.2f Gelem/s (CPU %s)%s; %s",
            cfg.rank, self.numel, len(self.subgroups), counts, p.slots, p.cache_slots,
            ", ".join(f"{t} {b / GiB:.2f} GiB" for t, b in p.resident_bytes.items()),
            bytes_per_param(self.state_codecs), describe_formats(self.state_codecs), self.adam_rate / 1e9,
            self.cpu_one_pass_how,
            describe_device_rates(self.update_rates, self._device_update, self._read_ahead, cfg),
            self.prediction.describe())

    # -- the update ----------------------------------------------------------------------------
    def step(self, *, unscale: Optional[float] = None, clip_coef: Optional[float] = None,
             skip: bool = False) -> StepRecord:
        """One AdamW step over the whole shard from the gradient source (``grad_buffer`` by default).

        ``unscale`` (1/loss-scale) and ``clip_coef`` multiply the fp32 gradients in that order;
        ``skip`` (found inf/nan) leaves all state untouched.
        """
        self._check_usable()
        # The last deferred step's copies out may still run: its fences go to the loop, which waits only
        # where it touches that state (the host does not wait for the whole update here).
        written = self._deferred.release() if self._deferred is not None else {}
        if skip:
            return StepRecord(step=self.steps_done, skipped=True, tiers=self._counters.take())
        t_start = time.perf_counter()
        rec = self._loop.run(self.steps_done + 1, unscale, clip_coef, self.param_groups, written)
        self.steps_done = rec.step
        self._pipeline.begin(self._schedule_for(rec.step))  # its first reads run under forward/backward
        if self._deferred is None:
            self._loop.read_next_step_ahead({})  # the copies in run under the next forward and backward
        rec.update_s = time.perf_counter() - t_start
        rec.tiers = self._counters.take()
        self._relocation.observe_step(rec)  # the update split, re-chosen from what this step measured
        return rec

    def _guard_snapshot(self, i: int) -> None:
        """Before subgroup ``i``'s update: the snapshot's writer may still need its state as it is."""
        if self._snapshot is not None:
            self._snapshot.before_update(i)

    def params_ready(self, i: int):
        """The event after which subgroup ``i``'s params from the last step are in the caller's hands
        (on the device's compute stream), or None where the step left none pending (CPU-updated, or
        not deferred: the caller's stream then already follows the whole update)."""
        return self._deferred.need(i) if self._deferred is not None else None

    def _drop_read_ahead(self) -> None:
        """The host state may change outside a step: no copy read ahead of it stays."""
        if self._read_ahead is not None:
            self._read_ahead.drop()

    def queue_deferred(self) -> None:
        """Queue what the last deferred step left unqueued (subgroups no forward asked for); the
        caller's stream then follows the update's reads of the gradients. Nothing waits on the host."""
        if self._deferred is not None:
            self._deferred.queue_rest()

    def settle(self) -> None:
        """Wait for the device work a deferred step left queued (its state in memory is then the
        updated state); a no-op otherwise."""
        if self._deferred is not None:
            self._deferred.settle()

    # -- placement changes while it lives (relocation decides, these carry it out) ------------------
    @property
    def file_tiers(self) -> Mapping[str, StreamedTier]:
        """The file tiers by name (read only)."""
        return MappingProxyType(self._tiers)

    def repredict(self, update_rates=None) -> None:
        """The prediction for today's placement and split, at the start-up's rates or ``update_rates``."""
        self.prediction = self._start_up.predict(self.subgroups, self.placement, update_rates)

    def restart_reads(self) -> None:
        """The next step's reads, begun anew for today's placement."""
        self._drop_read_ahead()
        self._pipeline.begin(self._schedule_for(self.steps_done))

    def move_state(self, moves: Dict[int, str]) -> None:
        """Each subgroup in ``moves`` to its new tier, state and all (between steps, settled)."""
        self._drop_read_ahead()
        self._state.move(moves, self.placement.tier_of, self.memory, self._tiers)

    # -- the device tier's size (auto) ---------------------------------------------------------
    def observe_device_memory(self, peak_bytes: int, capacity_bytes: int) -> Optional[str]:
        """With ``gpu_budget_auto``: the device's real peak since the last call and the most this
        process could hold (free plus its own reserve). Promotes subgroups into the spare memory
        beyond the margin, or hands some back to lower tiers where it fell under it; returns what
        it did (also logged), None if nothing changed. Between steps only."""
        if not self.config.gpu_budget_auto:
            return None
        self._check_usable()
        self.wait_for_snapshot()
        # No settle() here: it would make a deferred step's caller wait for the whole update after
        # every step; the relocation settles only where it moves something.
        return self._relocation.fit_device(peak_bytes, capacity_bytes)

    def prefetch(self) -> None:
        """Start reading the next step's first subgroups now (e.g. as forward begins)."""
        self._check_usable()
        self._pipeline.issue_reads()

    def flush(self) -> None:
        """Wait until every write issued so far is on its tier (cached dirty ones stay in memory)."""
        self.settle()
        self._pipeline.flush()

    def _check_usable(self) -> None:
        if self.closed:
            raise OffloadStateError("the offload engine is closed")
        failure = getattr(self, "_pipeline", None) and self._pipeline.failure
        if failure:
            raise OffloadStateError(f"the offload engine stopped after an earlier error: {failure}")

    # -- whole-state access (checkpoints, tests) ------------------------------------------------
    def iter_state(self) -> Iterator[Tuple[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each subgroup's (param, exp_avg, exp_avg_sq), streamed one at a time from its tier.

        The tensors are valid until the next item is requested; nothing gathers the whole state.
        They are in their stored dtypes; a master stored as remainders is given as fp32 (merged
        with the model's params).
        """
        self._check_usable()
        self.settle()
        yield from self._state.iter_state()

    def load_state(self, fill: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None],
                   steps_done: int, stored: bool = False) -> None:
        """Replace the whole state: ``fill`` writes each subgroup's three tensors in place, in their
        stored dtypes (it may copy any dtype in: ``copy_`` converts). A master stored as remainders
        is given as fp32 and split after (the model's params set from it), or, with ``stored``, as
        its int16 remainders (the model's params then are the ones saved with them)."""
        self._check_usable()
        self.settle()
        self.wait_for_snapshot()
        self._drop_read_ahead()
        self._state.load_state(fill, stored)
        self.steps_done = steps_done
        self._pipeline.begin(self._schedule_for(steps_done))

    def modify_state(self, edit: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        """Stream each subgroup's (param, exp_avg, exp_avg_sq) through ``edit``, which changes
        them in place; the result goes back where the subgroup lives."""
        self._check_usable()
        self.settle()
        self.wait_for_snapshot()
        self._drop_read_ahead()
        self._state.modify_state(edit)

    def snapshot(self, link_files: bool = True, staging_bytes: Optional[int] = None) -> StateSnapshot:
        """The state as it is now, for a checkpoint writer (see ``snapshot``): cheap, and unchanged by
        later steps where ``link_files``; steps wait in ``before_update`` only for what the writer
        still needs from memory. One at a time; the writer must ``release()`` it."""
        self._check_usable()
        self.settle()
        self.wait_for_snapshot()
        staging = self.config.save_staging_bytes if staging_bytes is None else staging_bytes
        self._snapshot = self._state.snapshot(self.steps_done, link_files, staging)
        return self._snapshot

    def wait_for_snapshot(self) -> None:
        """Until the last snapshot's writer has released it."""
        if self._snapshot is not None:
            self._snapshot.released.wait()
            self._snapshot = None

    def _scratch_views(self) -> StateViews:
        # Outside the budget on purpose: used only while saving or loading a checkpoint.
        sg = max(self.subgroups, key=lambda s: s.numel)
        return StateViews.over(self.host.allocate(sg.state_bytes, "checkpoint buffer", counted=False),
                               sg)

    # -- teardown --------------------------------------------------------------------------------
    def close(self, remove_files: bool = True) -> None:
        """Finish in-flight I/O and remove this rank's files (on clean exit and handled errors)."""
        if self.closed:
            return
        self.closed = True
        if self._snapshot is not None:  # its writer stops and removes its partial file
            self._snapshot.cancel()
        for tier in self._tiers.values():
            tier.close(remove_files=remove_files)  # its tokens too (the node's last user removes them)
        if self.trace is not None:
            self.trace.save()  # after the tiers closed: their last writes are in it
        if self._deferred is not None:
            self._deferred.forget()  # the synchronize below covers it
        if self.memory:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # no copy may still read a buffer we unpin
            for memory in self.memory.values():
                memory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_if_alive(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()
