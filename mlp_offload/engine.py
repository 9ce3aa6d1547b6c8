"""OffloadedAdamW: one rank's AdamW state held in host memory and file tiers, updated subgroup by
subgroup with reads prefetched ahead and writes behind.

Data flow: plan (rates -> placement -> prediction) -> tiers (host memory, files) -> this engine. The caller (the
Megatron adapter, a test, a benchmark) copies low-precision gradients into ``grad_buffer`` (or gives a
``GradientSource``) and calls ``step()``; each updated subgroup's master parameters (in their stored dtype) are
handed to ``on_params_updated``. The engine is the torch-shaped front over the parts ``startup.wiring`` builds
from its config: ``step.loop`` (one step over the subgroups), ``pipeline`` (slots streaming the file-backed
subgroups), ``state_access`` (checkpoints); it applies what ``relocation`` plans.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from types import MappingProxyType
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .config import OffloadConfig
from .gradients import GradientSource
from .model_link import ModelLink
from .pipeline import IoLog, OffloadStateError
from .plan.schedule import StepSchedule, step_schedule
from .relocation import Relocation, RelocationPlan, TierRoom
from .snapshot import StateSnapshot
from .startup.measure import describe_placement, describe_tiers
from .startup.wiring import EngineHolds, EngineModel, check_engine_inputs, shard_numel, wire_engine
from .step.loop import EngineHooks
from .step.read_ahead import ReadAhead
from .step.update_paths import UpdatePaths
from .subgroups.param_groups import Range, adamw_options, build_groups
from .subgroups.cut import cut_shard
from .subgroups.partition import Subgroup
from .telemetry.traffic import StepRecord, TierTraffic, TrafficCounters
from .telemetry.trace import Trace, open_trace
from .tiers.base import ResidentTier, StreamedTier
from .kernels.update import AdamKernel

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

    ``adamw``: AdamW's hyperparameters as torch.optim.AdamW names them (lr, betas, eps, weight_decay; and
    decoupled_weight_decay, ``subgroups.param_groups.ADAMW_OPTIONS``), the defaults of every group in ``groups``.

    What the engine is given of the model is its ``model`` (``ModelLink``: where the gradients come
    from, ``grad_buffer`` or a source; where updated params go; a remainders master's high halves).

    ``token_store`` is the job's key-value store (a ``torch.distributed.Store``): needed where
    ``config.token_scope`` makes a tier's ranks take turns across the whole job.
    """

    def __init__(self, params: torch.Tensor, config: OffloadConfig, *,
                 groups: Optional[Sequence[Tuple[Sequence[Range], dict]]] = None, numel: Optional[int] = None,
                 model: ModelLink = ModelLink(), token_store=None, **adamw):
        defaults, decoupled_weight_decay = adamw_options(adamw)
        self.numel = shard_numel(params, numel)
        check_engine_inputs(config, model, token_store)
        self.config, self.token_store, self.on_params_updated = config, token_store, model.on_params_updated
        # The model's bf16 params: a remainders master's high halves (also read to load such a checkpoint)
        self.param_high = model.param_high
        self.adam = AdamKernel(config.adam_kernel, decoupled_weight_decay)
        self.device_adam = AdamKernel(config.resolved_device_adam_kernel, decoupled_weight_decay)
        self.param_groups = build_groups(groups, defaults, self.numel)
        self.state_codecs = config.state_codecs  # how each state tensor is stored (state_formats)
        self.subgroups, self._segments, self.blocks = cut_shard(  # (8-bit moments: blocks, else None)
            self.numel, config.subgroup_size, self.state_codecs, self.param_groups, model.param_segments)
        self.steps_done = 0  # AdamW's step count (skipped steps do not count)
        self.closed = False
        self._snapshot: Optional[StateSnapshot] = None  # being written while the engine steps on
        self._deferred = None  # step.deferred.DeferredWork with defer_device_wait: what a step left queued
        self._tiers: Dict[str, StreamedTier] = {}  # file tiers, by name
        self.memory: Dict[str, ResidentTier] = {}  # memory tiers, by name, fastest first
        self._counters = TrafficCounters(config.file_tiers)
        self.trace: Optional[Trace] = open_trace(config.trace_path, config.rank)
        try:
            self._setup(params, model)
        except BaseException:
            self.close()
            raise
        # Swap files go with the process even if the caller never closes the engine.
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- setup ---------------------------------------------------------------------------------
    def _setup(self, params, model: ModelLink) -> None:
        parts = wire_engine(self.config, EngineModel(params, self.numel, model, self.subgroups, self._segments,
                                                     self.adam, self.device_adam, self.blocks),
                            EngineHolds(self._tiers, self.memory, IoLog(self._counters, self.trace), self.token_store,
                                        EngineHooks(lambda: self.prediction, self._guard_snapshot)))
        start, paths = parts.start, parts.paths
        self._start_up = start  # its rates price every later placement
        self.host, self.rates, self.devices = start.host, start.rates, start.devices
        self.tokens_per_tier = start.tokens_per_tier
        self.adam_rate, self.convert_rate, self.update_rates = start.adam_rate, start.convert_rate, start.update_rates
        self.placement, self.prediction = start.placement, start.prediction  # both change as it relocates
        self._paths, self.cpu_one_pass_how, self._deferred = paths, paths.cpu_one_pass_how, paths.deferred
        self.grad_buffer, self.grad_source, self._read_ahead = parts.grad_buffer, parts.grad_source, parts.read_ahead
        self._pipeline, self._state, self._loop = parts.pipeline, parts.state, parts.loop
        self._relocation = Relocation(self.subgroups, self.config, self.update_rates, paths.device_type, start.rates)
        self.log_placement()
        self._pipeline.begin(self._schedule_for(0))

    def _schedule_for(self, step_index: int) -> StepSchedule:
        return step_schedule(step_index, self.placement.tier_of, self.placement.slots, self.placement.cache_slots,
                             self.config.cache_alternating)

    def describe_tiers(self) -> str:
        """The file tiers' rates and tokens: the same for every rank of a node (the probe is per host and
        path), so a job's launcher may print it once per node."""
        return describe_tiers(self.rates, self._tiers, self.tokens_per_tier, self.config)

    def state_bytes_per_tier(self) -> Dict[str, int]:
        """Bytes of optimizer state each tier holds: a memory tier what its budget is charged (host:
        its resident subgroups and the streaming buffers), a file tier its subgroups' files."""
        return self.placement.state_bytes_per_tier(self.subgroups, self.config.file_tiers)

    def log_placement(self) -> None:
        """The placement, its rates and prediction, in the start-up's log line (the node's tiers first)."""
        if self.rates:
            log.info("offload tiers of this node: %s", self.describe_tiers(), extra={PER_NODE: True})
        log.info(describe_placement(self.config, self.subgroups, self._start_up, self._paths, self._read_ahead))

    # -- the update ----------------------------------------------------------------------------
    def step(self, *, unscale: Optional[float] = None, clip_coef: Optional[float] = None, skip: bool = False,
             in_series: bool = False) -> StepRecord:
        """One AdamW step over the whole shard from the gradient source (``grad_buffer`` by default).
        ``unscale`` (1/loss-scale) and ``clip_coef`` multiply the fp32 gradients in that order; ``skip`` (found
        inf/nan) leaves all state untouched; ``in_series``: a deferred step the caller waits for (``settle``)."""
        self._check_usable()
        # The last deferred step's copies out may still run: its fences go to the loop, which waits only
        # where it touches that state (the host does not wait for the whole update here).
        written = self._deferred.release() if self._deferred is not None else {}
        if skip:
            return StepRecord(step=self.steps_done, skipped=True, tiers=self._counters.take())
        t_start = time.perf_counter()
        rec = self._loop.run(self.steps_done + 1, unscale, clip_coef, self.param_groups, written, in_series)
        self.steps_done = rec.step
        self._pipeline.begin(self._schedule_for(rec.step))  # its first reads run under forward/backward
        if self._deferred is None:
            self._loop.read_next_step_ahead({})  # the copies in run under the next forward and backward
        rec.update_s = time.perf_counter() - t_start
        rec.tiers = self._counters.take()
        self._apply(self._relocation.after_step(rec, self.placement, self.prediction))  # from what the step showed
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
        """Wait for the device work a deferred step left queued (its state in memory is then updated); else a no-op."""
        if self._deferred is not None:
            self._deferred.settle()

    # -- what it runs, for callers and tests (read only) ----------------------------------------
    @property
    def file_tiers(self) -> Mapping[str, StreamedTier]:
        """The file tiers by name."""
        return MappingProxyType(self._tiers)

    @property
    def update_paths(self) -> UpdatePaths:
        """The update paths it runs (``step.update_paths``): CPU one-pass kernel, device update, deferred work."""
        return self._paths

    @property
    def read_ahead(self) -> Optional[ReadAhead]:
        """The device's read-ahead buffers (``device_read_ahead_bytes``), or None."""
        return self._read_ahead

    @property
    def schedule(self) -> StepSchedule:
        """The traffic plan (``plan.schedule``) of the step the pipeline reads for now."""
        return self._pipeline.schedule

    def update_order(self, in_series: bool = False) -> List[int]:
        """The order the next step updates its subgroups in (an asynchronous side's held ones first)."""
        return self._loop.held_first_order(self._pipeline.schedule, in_series)

    def take_traffic(self) -> Dict[str, TierTraffic]:
        """Each file tier's traffic since the last step's record took it (e.g. reads finished at close)."""
        return self._counters.take()

    # -- the device tier's size (auto) ---------------------------------------------------------
    def observe_device_memory(self, peak_bytes: int, capacity_bytes: int) -> Optional[str]:
        """With ``gpu_budget_auto``: the device's real peak since the last call and the most this process could
        hold (free plus its own reserve). Promotes subgroups into the spare memory beyond the margin, or hands
        some back to lower tiers where it fell under it; what it did (also logged), None if nothing. Between steps."""
        if not self.config.gpu_budget_auto:
            return None
        self._check_usable()
        self.wait_for_snapshot()
        # No settle() here: a deferred step's caller would wait for the whole update after every step.
        room = TierRoom.of(self.memory, self._tiers, self.config.has_host)
        return self._apply(self._relocation.fit_device(peak_bytes, capacity_bytes, self.placement, room))

    def hide_under_forward(self, hidden_s: float) -> Optional[str]:
        """Deferred: the next forward hides ``hidden_s`` s of the device's work; the CPU's share re-chosen for it."""
        return self._apply(self._relocation.hide_under_forward(hidden_s, self.placement))

    def _apply(self, plan: Optional[RelocationPlan]) -> Optional[str]:
        """Carry out a relocation's plan (between steps; None: none); the line saying what changed, also logged."""
        if plan is None:
            return None
        if plan.moves:
            self.settle()  # a deferred step's subgroups must be updated before they move
            self._drop_read_ahead()
            self._state.move(plan.moves, self.placement.tier_of, self.memory, self._tiers)
        if plan.resident_bytes is not None:
            self.placement.resident_bytes.update(plan.resident_bytes)
        self.placement.update_on = plan.update_on
        self.prediction = self._start_up.predict(self.subgroups, self.placement, plan.update_rates, plan.tier_rates)
        if plan.moves:  # the next step's reads, begun anew for the new placement
            self._pipeline.begin(self._schedule_for(self.steps_done))
        what = f"{plan.what}; {self.prediction.describe()}"
        log.info(what)
        return what

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
        """Each subgroup's (param, exp_avg, exp_avg_sq), one at a time from its tier, valid until the next is
        requested (nothing gathers the whole state), in their stored dtypes; a remainders master as fp32 (merged)."""
        self._check_usable()
        self.settle()
        yield from self._state.iter_state()

    def load_state(self, fill: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None], steps_done: int,
                   stored: bool = False, adopt=None, read_adopted=None) -> None:
        """Replace the whole state: ``fill`` writes each subgroup's three tensors in place, in their stored
        dtypes (``copy_`` converts any). A master stored as remainders is given as fp32 and split after (the
        model's params set from it), or, with ``stored``, as its int16 remainders (the model's params then are
        the ones saved with them). ``adopt``, ``read_adopted``: see ``StateAccess.load_state``."""
        self._quiesce()
        self._state.load_state(fill, stored, adopt, read_adopted)
        self.steps_done = steps_done
        self._pipeline.begin(self._schedule_for(steps_done))

    def modify_state(self, edit: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        """Each subgroup's (param, exp_avg, exp_avg_sq) through ``edit``, in place, back where it lives."""
        self._quiesce()
        self._state.modify_state(edit)

    def _quiesce(self) -> None:
        """Before the state changes outside a step: no device work, writer or read-ahead copy may hold it."""
        self._check_usable()
        self.settle()
        self.wait_for_snapshot()
        self._drop_read_ahead()

    def snapshot(self, link_files: bool = True, staging_bytes: Optional[int] = None) -> StateSnapshot:
        """The state as it is now, for a checkpoint writer (see ``snapshot``): cheap, and unchanged by later steps
        where ``link_files``; steps wait in ``before_update`` only for what the writer still needs from memory.
        One at a time; the writer must ``release()`` it."""
        self._check_usable()
        self.settle()
        self.wait_for_snapshot()
        staging = self.config.save_staging_bytes if staging_bytes is None else staging_bytes
        self._snapshot = self._state.snapshot(self.steps_done, link_files, staging)
        return self._snapshot

    def reserve_save_staging(self, room: int) -> int:
        """The snapshots' staging for the memory-held state (``room`` bytes at most) made now and kept; its bytes."""
        return self._state.reserve_staging(min(self._state.memory_held_bytes, room))

    def wait_for_snapshot(self) -> None:
        """Until the last snapshot's writer has released it."""
        if self._snapshot is not None:
            self._snapshot.released.wait()
            self._snapshot = None

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
