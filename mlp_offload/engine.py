"""OffloadedAdamW: one rank's AdamW state held in host memory and file tiers, updated subgroup by
subgroup with reads prefetched ahead and writes behind.

Data flow: plan (perf_model) -> tiers (host memory, files) -> this engine. The caller (the
Megatron adapter, a test, a benchmark) copies low-precision gradients into ``grad_buffer`` and
calls ``step()``; each updated subgroup's fp32 parameters are handed to ``on_params_updated``.

Host buffers for streamed subgroups ("slots") move through these states:
  EMPTY/CLEAN -> READING (read in flight) -> READY (reserved for this step) -> updated ->
  WRITING (write in flight; reusable, a later read waits for it) or DIRTY (kept as cache for the
  reversed next step, whose first subgroups they are).
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from .config import HOST_TIER, OffloadConfig, OffloadConfigError, TierBandwidth
from .faults import fault_point
from .perf_model import (Placement, Prediction, measure_adam_rate, plan_placement, predict_update, probe_tier,
                         tokens_for)
from .schedule import StepSchedule, step_schedule
from .subgroups import FP32_BYTES, Subgroup, partition
from .telemetry import StepRecord, TrafficCounters
from .tiers.files import FileTier, TierIOError
from .tiers.host import HostMemory, check_budget_exists, check_host_memory
from .tiers.tokens import JobTokens, TierTokens
from .update import AdamKernel, fused_vector_width, convert_grads

log = logging.getLogger("mlp_offload")
PER_NODE = "mlp_offload_per_node"  # set on log records that say the same on every rank of a node
GiB = 1024**3

EMPTY, READING, READY, DIRTY, WRITING = "empty", "reading", "ready", "dirty", "writing"
_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (start, end) element range of the shard that belongs to one hyperparameter group
Range = Tuple[int, int]


class GradientSource(Protocol):
    """Delivers a subgroup's fp32 gradients, already unscaled and clipped, into ``out``."""

    def start(self, start: int, end: int, out: torch.Tensor, unscale: Optional[float],
              clip_coef: Optional[float]) -> None:
        """Begin filling ``out`` with the gradients of elements [start, end)."""

    def wait(self, start: int) -> None:
        """Return once the gradients started for ``start`` are in ``out``."""


class OffloadStateError(RuntimeError):
    """The engine cannot continue: an earlier I/O failed. The message says what was kept."""


@dataclass
class _StateViews:
    buf: torch.Tensor  # aligned uint8 buffer holding the three regions
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    fence: object = None  # returned by on_params_updated; synchronized before overwriting

    @classmethod
    def over(cls, buf: torch.Tensor, numel: int, region_bytes: int) -> "_StateViews":
        views = [buf[k * region_bytes: k * region_bytes + numel * FP32_BYTES].view(torch.float32) for k in range(3)]
        return cls(buf, *views)

    def extents(self, sg: Subgroup) -> List[Tuple[int, torch.Tensor]]:
        """Its three regions as (file offset, host bytes) pairs in the subgroup's own file layout."""
        region = self.buf.numel() // 3  # this buffer's region stride (its allocating size)
        return [(k * sg.region_bytes, self.buf[k * region: k * region + sg.region_bytes]) for k in range(3)]

    def sync_fence(self) -> None:
        if self.fence is not None:
            self.fence.synchronize()
            self.fence = None

    def narrow(self, numel: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.param[:numel], self.exp_avg[:numel], self.exp_avg_sq[:numel]


class _Slot:
    def __init__(self, index: int, views: _StateViews):
        self.index = index
        self.views = views
        self.holder: Optional[int] = None  # subgroup whose state is (or is arriving) here
        self.state = EMPTY
        self.future: Optional[Future] = None
        self.pending_write: Optional[Future] = None  # a hit's own write, to finish before its update
        self.age = 0  # when it last became reusable, for LRU eviction


class OffloadedAdamW:
    """AdamW over a flat fp32 shard whose state lives in host memory and file tiers.

    torch.optim-shaped: ``param_groups`` (dicts with lr, betas, eps, weight_decay; a scheduler may
    change them between steps), ``step()``, ``state_dict``-style streaming via
    ``iter_state()``/``load_state()``. ``params`` is the initial value of the shard (any dtype or
    device), or a function ``fill(start, end, out_fp32)`` with ``numel`` given; it is read once
    per subgroup, lazily, and not kept after the first step.

    Gradients come from ``grad_buffer`` (low precision, filled by the caller, converted here), or,
    with ``grad_source``, as fp32 straight into one of two scratch buffers (e.g. cast on the GPU and
    copied while the previous subgroup's Adam runs); then there is no ``grad_buffer``.

    ``token_store`` is the job's key-value store (a ``torch.distributed.Store``): needed where
    ``config.token_scope`` makes a tier's ranks take turns across the whole job.
    """

    def __init__(
        self,
        params: torch.Tensor,
        config: OffloadConfig,
        *,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        groups: Optional[Sequence[Tuple[Sequence[Range], dict]]] = None,
        grad_dtype: torch.dtype = torch.bfloat16,
        on_params_updated: Optional[Callable[[int, int, torch.Tensor], object]] = None,
        grad_source: Optional[GradientSource] = None,
        numel: Optional[int] = None,
        token_store=None,
    ):
        if callable(params):
            if numel is None:
                raise ValueError("numel is required when params is a fill function")
            self.numel = numel
        elif params.dim() != 1:
            raise ValueError(f"params must be a flat 1-D shard, got shape {tuple(params.shape)}")
        else:
            self.numel = params.numel()
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"gradient dtype must be one of {_GRAD_DTYPES}, got {grad_dtype}")
        self.config = config
        job_scoped = [t for t, scope in config.token_scope.items() if scope == "job"]
        if job_scoped and token_store is None:
            raise OffloadConfigError(f"token scope 'job' for {job_scoped} needs the job's key-value store "
                                     f"(token_store, e.g. torch.distributed's)")
        self.token_store = token_store
        self.on_params_updated = on_params_updated
        self.grad_source = grad_source
        self.adam = AdamKernel(config.adam_kernel, decoupled_weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.param_groups = self._build_groups(groups, defaults)
        self.subgroups = partition(self.numel, config.subgroup_size)
        self._segments = [self._segments_of(sg) for sg in self.subgroups]
        if config.adam_kernel == "fused" and any(span != (0, hi - lo) for segs in self._segments
                                                 for lo, hi, _, span in segs):
            fused_vector_width()  # measured now, with the other rates, not inside the first step
        self.steps_done = 0  # AdamW's step count (skipped steps do not count)
        self.closed = False
        self._tiers: Dict[str, FileTier] = {}
        self._counters = TrafficCounters(config.file_tiers)
        try:
            self._setup(params, grad_dtype)
        except BaseException:
            self.close()
            raise
        # Swap files go with the process even if the caller never closes the engine.
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- setup ---------------------------------------------------------------------------------
    def _setup(self, params: torch.Tensor, grad_dtype: torch.dtype) -> None:
        cfg = self.config
        check_budget_exists(cfg.host_budget_bytes, cfg.resolved_ranks_sharing_node())
        self.host = HostMemory(cfg.host_budget_bytes, cfg.pin_memory)
        run_id = cfg.resolved_run_id()
        for name in cfg.file_tiers:
            self._tiers[name] = FileTier(
                name, cfg.paths[name], run_id, cfg.rank, cfg.io_block_bytes, cfg.io_threads,
                op_threads=cfg.prefetch_depth + 2, use_odirect=cfg.use_odirect,
                verify_checksums=cfg.verify_checksums)
        self.rates = self._measure_rates()
        # Tokens after the probe: unless given, whether ranks take turns depends on what it saw.
        sharing = cfg.resolved_ranks_sharing_node()
        self.tokens_per_tier = {name: cfg.tokens_per_tier or tokens_for(self.rates[name], sharing)
                                for name in cfg.file_tiers}
        for name, tier in self._tiers.items():
            count = self.tokens_per_tier[name]
            tier.tokens = (JobTokens(cfg.paths[name], count, self.token_store) if self.token_scope(name) == "job"
                           else TierTokens(cfg.paths[name], count))
        free = {name: tier.free_bytes() for name, tier in self._tiers.items()}
        self.devices = {name: tier.device for name, tier in self._tiers.items()}
        self.placement: Placement = plan_placement(self.subgroups, cfg, self.rates, free, self.devices)
        self.prediction: Prediction = predict_update(
            self.subgroups, self.placement, self.rates, self.adam_rate, self.convert_rate, self.devices,
            ranks_sharing=sharing, tokens=self.tokens_per_tier)

        # Buffers: gradients (outside the state budget: the caller's gradient staging), one fp32
        # scratch for converted gradients, resident subgroups, and slots for streamed ones.
        largest = max(sg.numel for sg in self.subgroups)
        grad_bytes = (2 * largest * FP32_BYTES if self.grad_source is not None
                      else self.numel * grad_dtype.itemsize + largest * FP32_BYTES)
        check_host_memory(self.placement.host_state_bytes + grad_bytes, cfg.resolved_ranks_sharing_node())
        if self.grad_source is None:
            self.grad_buffer = self.host.allocate(self.numel * grad_dtype.itemsize, "gradient buffer",
                                                  counted=False).view(grad_dtype)
            self._grad_scratch = [torch.empty(largest, dtype=torch.float32)]
        else:
            self.grad_buffer = None  # two pinned fp32 buffers: one filling while the other is used
            self._grad_scratch = [self.host.allocate(largest * FP32_BYTES, "gradient scratch", counted=False)
                                  .view(torch.float32) for _ in range(2)]
        self._resident: Dict[int, _StateViews] = {}
        for i, tier in enumerate(self.placement.tier_of):
            if tier == HOST_TIER:
                sg = self.subgroups[i]
                views = _StateViews.over(self.host.allocate(sg.state_bytes, f"subgroup {i}"), sg.numel, sg.region_bytes)
                self._fill_params(params, sg, views.param[: sg.numel])
                views.exp_avg.zero_()
                views.exp_avg_sq.zero_()
                self._resident[i] = views
        slot_sg = max(self.subgroups, key=lambda sg: sg.numel)
        self._slots = [
            _Slot(k, _StateViews.over(self.host.allocate(slot_sg.state_bytes, f"pipeline buffer {k}"),
                                      slot_sg.numel, slot_sg.region_bytes))
            for k in range(self.placement.slots)
        ]
        self._slot_of: Dict[int, _Slot] = {}
        # Last write of each subgroup not yet known to be done: its next read must wait for it,
        # even when its buffer has since been reused for another subgroup.
        self._writes: Dict[int, Future] = {}
        # Streamed subgroups start "fresh": their first read copies from ``params`` and zeroes m, v.
        self._fresh = {i for i, t in enumerate(self.placement.tier_of) if t != HOST_TIER}
        self._source = params if self._fresh else None
        self._age = 0
        self._schedule = self._schedule_for(0)
        self._cursor = 0
        self._inflight = {name: 0 for name in self._tiers}
        self._failure: Optional[BaseException] = None
        self.log_placement()
        self.prefetch()

    def _measure_rates(self) -> Dict[str, TierBandwidth]:
        cfg = self.config
        rates: Dict[str, TierBandwidth] = {}
        for name, tier in self._tiers.items():
            if name in cfg.bandwidths:
                rates[name] = cfg.bandwidths[name]
            else:
                probe_buf = self.host.allocate(cfg.probe_bytes, "bandwidth probe", counted=False)
                rates[name] = probe_tier(tier, probe_buf, concurrency=cfg.prefetch_depth,
                                         ranks_sharing=cfg.resolved_ranks_sharing_node())
                del probe_buf
        size = min(max(sg.numel for sg in self.subgroups), 1 << 26)
        self.adam_rate = cfg.adam_elems_per_s or measure_adam_rate(
            lambda p, g, m, v, step: self.adam(p, g, m, v, step=step), numel=size)
        self.convert_rate = _measure_convert_rate(size)
        return rates

    def _build_groups(self, groups, defaults) -> List[dict]:
        if groups is None:
            return [dict(defaults, ranges=[(0, self.numel)])]
        result = []
        covered = []
        for ranges, options in groups:
            ranges = [(int(a), int(b)) for a, b in ranges]
            for a, b in ranges:
                if not 0 <= a < b <= self.numel:
                    raise ValueError(f"param-group range ({a}, {b}) is outside the shard of {self.numel}")
            covered.extend(ranges)
            result.append(dict(defaults, **options, ranges=ranges))
        covered.sort()
        for (a0, b0), (a1, b1) in zip(covered, covered[1:]):
            if a1 < b0:
                raise ValueError(f"param-group ranges overlap: ({a0}, {b0}) and ({a1}, {b1})")
        return result

    def _segments_of(self, sg: Subgroup) -> List[Tuple[int, int, int, Tuple[int, int]]]:
        """Its pieces as (local start, local end, group index, (offset in its range, range length)),
        in order; the span lets the fused kernel treat a cut range as one tensor."""
        segs = []
        for g, group in enumerate(self.param_groups):
            for a, b in group["ranges"]:
                lo, hi = max(a, sg.start), min(b, sg.end)
                if lo < hi:
                    segs.append((lo - sg.start, hi - sg.start, g, (lo - a, b - a)))
        return sorted(segs)

    def _schedule_for(self, step_index: int) -> StepSchedule:
        return step_schedule(step_index, self.placement.tier_of, self.placement.cache_slots,
                             self.config.cache_alternating)

    def describe_tiers(self) -> str:
        """The file tiers' rates and tokens: the same for every rank of a node (the probe is per
        host and path), so a job's launcher may print it once per node."""
        return ", ".join(
            f"{t} r {r.read_bps / 1e9:.2f} w {r.write_bps / 1e9:.2f}"
            + (f" r+w {r.mixed_bps / 1e9:.2f}" if r.mixed_bps else "")
            + (f" r+w with all ranks' streams {r.shared_mixed_bps / 1e9:.2f}" if r.shared_mixed_bps else "")
            + " GB/s" + ("" if self._tiers[t].odirect else " (buffered)")
            + f", {self.tokens_per_tier[t]} I/O token(s) per {self.token_scope(t)}" for t, r in self.rates.items())

    def log_placement(self) -> None:
        p, cfg = self.placement, self.config
        counts = {t: len(p.subgroups_on(t)) for t in [HOST_TIER] + cfg.file_tiers}
        if self.rates:
            log.info("offload tiers of this node: %s", self.describe_tiers(), extra={PER_NODE: True})
        log.info(
            "offload rank %d: %d params in %d subgroups; placement %s; %d host buffers (%d cache); "
            "host state %.2f GiB; adam %.2f Gelem/s; %s",
            cfg.rank, self.numel, len(self.subgroups), counts, p.slots, p.cache_slots,
            p.host_state_bytes / GiB, self.adam_rate / 1e9, self.prediction.describe())

    def token_scope(self, tier: str) -> str:
        return self.config.token_scope.get(tier, "node")

    # -- the update ----------------------------------------------------------------------------
    def step(self, *, unscale: Optional[float] = None, clip_coef: Optional[float] = None,
             skip: bool = False) -> StepRecord:
        """One AdamW step over the whole shard from the gradients in ``grad_buffer``.

        ``unscale`` (1/loss-scale) and ``clip_coef`` multiply the fp32 gradients in that order;
        ``skip`` (found inf/nan) leaves all state untouched.
        """
        self._check_usable()
        if skip:
            return StepRecord(step=self.steps_done, skipped=True, tiers=self._counters.take())
        t_start = time.perf_counter()
        sched = self._schedule
        step = self.steps_done + 1
        rec = StepRecord(step=step, streamed=len(sched.streamed), resident=len(self._resident),
                         predicted_update_s=self.prediction.update_s)
        halfway = sched.order[len(sched.order) // 2]
        source = self.grad_source
        if source is not None:
            first = self.subgroups[sched.order[0]]
            source.start(first.start, first.end, self._grad_scratch[0][: first.numel], unscale, clip_coef)
        try:
            for k, i in enumerate(sched.order):
                if i == halfway:
                    fault_point("update")
                sg = self.subgroups[i]
                if i in self._resident:
                    views = self._resident[i]
                    views.sync_fence()
                else:
                    views, hit = self._await_state(i, rec)
                    rec.cache_hits += hit
                t0 = time.perf_counter()
                if source is None:
                    grad = self._grad_scratch[0][: sg.numel]
                    convert_grads(self.grad_buffer[sg.start:sg.end], grad, unscale, clip_coef)
                else:
                    if k + 1 < len(sched.order):  # the next subgroup's grads arrive during this Adam
                        nxt = self.subgroups[sched.order[k + 1]]
                        source.start(nxt.start, nxt.end, self._grad_scratch[(k + 1) % 2][: nxt.numel],
                                     unscale, clip_coef)
                    source.wait(sg.start)
                    grad = self._grad_scratch[k % 2][: sg.numel]
                t1 = time.perf_counter()
                self._adam_subgroup(i, views, grad, step)
                t2 = time.perf_counter()
                if self.on_params_updated is not None:
                    views.fence = self.on_params_updated(sg.start, sg.end, views.param[: sg.numel])
                t3 = time.perf_counter()
                rec.convert_s += t1 - t0
                rec.adam_s += t2 - t1
                rec.callback_s += t3 - t2
                if i not in self._resident:
                    self._release_after_update(i, keep=i in sched.keep)
        except BaseException as err:
            self._failure = err
            raise
        self.steps_done = step
        self._schedule = self._schedule_for(self.steps_done)
        self._cursor = 0
        self._issue_reads()  # the next step's first reads run under the caller's forward/backward
        rec.update_s = time.perf_counter() - t_start
        rec.tiers = self._counters.take()
        return rec

    def _adam_subgroup(self, i: int, views: _StateViews, grad: torch.Tensor, step: int) -> None:
        param, exp_avg, exp_avg_sq = views.narrow(self.subgroups[i].numel)
        for lo, hi, g, span in self._segments[i]:
            group = self.param_groups[g]
            beta1, beta2 = group["betas"]
            self.adam(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], step=step,
                      lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], span=span)

    def prefetch(self) -> None:
        """Start reading the next step's first subgroups now (e.g. as forward begins)."""
        self._check_usable()
        self._issue_reads()

    def flush(self) -> None:
        """Wait until every write issued so far is on its tier (cached dirty ones stay in memory)."""
        for slot in self._slots:
            if slot.state == WRITING:
                self._wait_write(slot)
        for i, future in list(self._writes.items()):
            self._wait_future(i, future)
        self._writes.clear()

    # -- slots -----------------------------------------------------------------------------------
    def _issue_reads(self) -> None:
        """Issue reads in update order, up to ``prefetch_depth`` per tier, while buffers allow."""
        streamed = self._schedule.streamed
        while self._cursor < len(streamed):
            i = streamed[self._cursor]
            slot = self._slot_of.get(i)
            if slot is not None and slot.state in (READING, READY):
                self._cursor += 1  # already issued
                continue
            if slot is not None and slot.state in (DIRTY, WRITING, EMPTY):
                # Still in host memory from earlier (kept, or written but not yet reused): a hit.
                # A write still running must end before Adam changes the buffer, not now: waiting
                # here would put the last write-behind back into the update's critical path.
                slot.pending_write = slot.future if slot.state == WRITING else None
                slot.state = READY
                slot.future = None
                self._cursor += 1
                continue
            tier = self.placement.tier_of[i]
            if self._inflight[tier] >= self.config.prefetch_depth:
                return
            slot = self._reusable_slot()
            if slot is None:
                return
            self._start_read(i, slot)
            self._cursor += 1

    def _reusable_slot(self) -> Optional[_Slot]:
        candidates = [s for s in self._slots if s.state in (EMPTY, WRITING)]
        if not candidates:
            return None
        # Prefer buffers that are already free, then the longest-reusable (its write is oldest).
        return min(candidates, key=lambda s: (s.state != EMPTY or s.holder is not None, s.age))

    def _start_read(self, i: int, slot: _Slot) -> None:
        previous_write, previous_views = slot.future if slot.state == WRITING else None, slot.views
        previous_holder = slot.holder
        if slot.holder is not None:
            self._slot_of.pop(slot.holder, None)
        sg = self.subgroups[i]
        tier = self._tiers[self.placement.tier_of[i]]

        own_write = self._writes.pop(i, None)

        def buffer_free():
            # The buffer's last write must be done (if it failed, its data is still here and must
            # stay), and so must this subgroup's own last write (the file must be up to date).
            for j, write in ((previous_holder, previous_write), (i, own_write)):
                if write is not None:
                    try:
                        write.result()
                    except BaseException as err:
                        raise OffloadStateError(
                            f"writing subgroup {j} failed: {err}. Its state is still in host memory; "
                            f"the last checkpoint is intact") from err
            previous_views.sync_fence()

        if i in self._fresh:
            future = tier.submit(self._materialize, i, slot.views, buffer_free)
        else:
            future = tier.submit_read(_file_key(i), slot.views.extents(sg), before=buffer_free)
            future.add_done_callback(self._counted(tier.name, "read"))
        slot.holder, slot.state, slot.future = i, READING, future
        self._slot_of[i] = slot
        self._inflight[tier.name] += 1

    @staticmethod
    def _fill_params(source, sg: Subgroup, out: torch.Tensor) -> None:
        if callable(source):
            source(sg.start, sg.end, out)
        else:
            out.copy_(source[sg.start:sg.end])

    def _materialize(self, i: int, views: _StateViews, buffer_free: Callable):
        buffer_free()
        sg = self.subgroups[i]
        param, exp_avg, exp_avg_sq = views.narrow(sg.numel)
        self._fill_params(self._source, sg, param)
        exp_avg.zero_()
        exp_avg_sq.zero_()
        return None

    def _await_state(self, i: int, rec: StepRecord) -> Tuple[_StateViews, bool]:
        slot = self._slot_of.get(i)
        if slot is None or slot.state not in (READING, READY):
            self._issue_reads()
            slot = self._slot_of.get(i)
            if slot is None or slot.state not in (READING, READY):
                raise RuntimeError(f"internal: no buffer could be assigned to subgroup {i}")
        hit = slot.state == READY and slot.future is None
        if slot.pending_write is not None:
            t0 = time.perf_counter()
            self._wait_future(i, slot.pending_write)
            slot.pending_write = None
            rec.read_wait_s += time.perf_counter() - t0
        if slot.state == READING:
            t0 = time.perf_counter()
            try:
                slot.future.result()
            except BaseException as err:
                raise self._read_failed(i, err) from err
            rec.read_wait_s += time.perf_counter() - t0
            self._inflight[self.placement.tier_of[i]] -= 1
            self._fresh.discard(i)
            if not self._fresh:
                self._source = None  # every subgroup is materialized: drop the caller's tensor
        slot.state, slot.future = READY, None
        self._issue_reads()
        return slot.views, hit

    def _release_after_update(self, i: int, keep: bool) -> None:
        slot = self._slot_of[i]
        self._age += 1
        slot.age = self._age
        if keep:
            slot.state = DIRTY
            return
        tier = self._tiers[self.placement.tier_of[i]]
        slot.future = tier.submit_write(_file_key(i), slot.views.extents(self.subgroups[i]))
        slot.future.add_done_callback(self._counted(tier.name, "write"))
        slot.state = WRITING
        self._writes[i] = slot.future
        self._issue_reads()

    def _wait_write(self, slot: _Slot) -> None:
        self._wait_future(slot.holder, slot.future)
        slot.state, slot.future = EMPTY, None

    def _wait_future(self, i: int, future: Future) -> None:
        try:
            future.result()
        except BaseException as err:
            self._failure = err
            raise OffloadStateError(
                f"writing subgroup {i} failed: {err}. Its state is still in host memory; "
                f"the last checkpoint is intact") from err

    def _counted(self, tier: str, kind: str):
        def on_done(future: Future):
            if future.exception() is None:
                self._counters.add(tier, kind, future.result())
        return on_done

    def _read_failed(self, i: int, err: BaseException) -> BaseException:
        self._failure = err
        if isinstance(err, OffloadStateError):
            return err
        if isinstance(err, TierIOError):
            return OffloadStateError(f"subgroup {i}: {err}")
        return OffloadStateError(f"reading subgroup {i} from tier {self.placement.tier_of[i]} failed: {err}")

    def _check_usable(self) -> None:
        if self.closed:
            raise OffloadStateError("the offload engine is closed")
        if self._failure is not None:
            raise OffloadStateError(f"the offload engine stopped after an earlier error: {self._failure}")

    # -- whole-state access (checkpoints, tests) ------------------------------------------------
    def iter_state(self) -> Iterator[Tuple[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each subgroup's (param, exp_avg, exp_avg_sq), streamed one at a time from its tier.

        The tensors are valid until the next item is requested; nothing gathers the whole state.
        """
        self._check_usable()
        self.flush()
        scratch = None
        for i, sg in enumerate(self.subgroups):
            views = self._current_views(i)
            if views is None:
                if scratch is None:
                    scratch = self._scratch_views()
                views = scratch
                self._fill_from_tier(i, views)
            yield (sg, *views.narrow(sg.numel))

    def load_state(self, fill: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None],
                   steps_done: int) -> None:
        """Replace the whole state: ``fill`` writes each subgroup's three fp32 tensors in place."""
        self._check_usable()
        self.flush()
        for slot in self._slots:  # the in-memory copies are about to be stale
            if slot.state == READING:
                slot.future.result()
            slot.state, slot.future, slot.holder, slot.pending_write = EMPTY, None, None, None
        self._slot_of.clear()
        self._inflight = {name: 0 for name in self._tiers}
        scratch = None
        for i, sg in enumerate(self.subgroups):
            if i in self._resident:
                views = self._resident[i]
                fill(sg, *views.narrow(sg.numel))
                continue
            if scratch is None:
                scratch = self._scratch_views()
            fill(sg, *scratch.narrow(sg.numel))
            tier = self._tiers[self.placement.tier_of[i]]
            tier.submit_write(_file_key(i), scratch.extents(sg)).result()
        self._fresh.clear()
        self._source = None
        self.steps_done = steps_done
        self._schedule = self._schedule_for(steps_done)
        self._cursor = 0
        self._issue_reads()

    def modify_state(self, edit: Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        """Stream each subgroup's (param, exp_avg, exp_avg_sq) through ``edit``, which changes
        them in place; the result goes back where the subgroup lives."""
        self._check_usable()
        self.flush()
        scratch = None
        for i, sg in enumerate(self.subgroups):
            views = self._current_views(i)
            if views is not None:
                edit(sg, *views.narrow(sg.numel))  # host-resident or in a buffer: written later
                continue
            if scratch is None:
                scratch = self._scratch_views()
            self._fill_from_tier(i, scratch)
            edit(sg, *scratch.narrow(sg.numel))
            tier = self._tiers[self.placement.tier_of[i]]
            tier.submit_write(_file_key(i), scratch.extents(sg)).result()
            self._fresh.discard(i)
            stale = self._slot_of.pop(i, None)  # a clean copy left in a buffer is now out of date
            if stale is not None:
                stale.holder = None

    def _current_views(self, i: int) -> Optional[_StateViews]:
        if i in self._resident:
            return self._resident[i]
        slot = self._slot_of.get(i)
        if slot is not None and slot.state in (READING, READY, DIRTY):
            if slot.state == READING:
                slot.future.result()
                self._inflight[self.placement.tier_of[i]] -= 1
                self._fresh.discard(i)
                slot.state, slot.future = READY, None
            return slot.views
        return None

    def _fill_from_tier(self, i: int, views: _StateViews) -> None:
        if i in self._fresh:
            self._materialize(i, views, lambda: None)
        else:
            tier = self._tiers[self.placement.tier_of[i]]
            tier.submit_read(_file_key(i), views.extents(self.subgroups[i])).result()

    def _scratch_views(self) -> _StateViews:
        # Outside the budget on purpose: used only while saving or loading a checkpoint.
        sg = max(self.subgroups, key=lambda s: s.numel)
        return _StateViews.over(self.host.allocate(sg.state_bytes, "checkpoint buffer", counted=False),
                                sg.numel, sg.region_bytes)

    # -- teardown --------------------------------------------------------------------------------
    def close(self, remove_files: bool = True) -> None:
        """Finish in-flight I/O and remove this rank's files (on clean exit and handled errors)."""
        if self.closed:
            return
        self.closed = True
        for tier in self._tiers.values():
            tier.close(remove_files=remove_files)
            if tier.tokens is not None:
                tier.tokens.close()  # the last process of the node to leave removes the lock files
        if getattr(self, "host", None) is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # no copy may still read a buffer we unpin
            self.host.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_if_alive(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def _file_key(i: int) -> str:
    return f"sg{i:06d}.state"


def _measure_convert_rate(numel: int) -> float:
    """bf16 -> fp32 elements per second at the subgroup size (best of 3)."""
    src = torch.empty(numel, dtype=torch.bfloat16).fill_(0.5)
    dst = torch.empty(numel)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return numel / max(best, 1e-9)
