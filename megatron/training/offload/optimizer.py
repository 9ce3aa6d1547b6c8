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

import logging
import time

from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.optimizer_config import OptimizerConfig

from megatron.training.errors import UserError
from megatron.training.model.host_params import gather_params, placed_in_host_memory
from megatron.training.offload import tier_growth
from megatron.training.offload.overlap_choice import OverlapChoice
from megatron.training.runtime.host_memory import measured_link_bytes_per_s
from megatron.training.offload.shard import OffloadShard, ShardGroups
from megatron.training.offload.shard_budgets import check_host_split, config_for_kind
from megatron.training.runtime.optimizer_interface import (HoldsResources, OffloadedOptimizerCheckpoint,
                                                           ReportsIteration, TrainingOptimizer)
from mlp_offload import GPU_TIER, OffloadConfig, first_forward_share

log = logging.getLogger("mlp_offload")

# --offload-overlap-forward: the first steps wait for their device work (the gpu tier settles in
# meanwhile); the iteration after one of them measures the compute alone.
SETTLED_STEPS = 3


class OffloadDistributedOptimizer(TrainingOptimizer, OffloadedOptimizerCheckpoint, ReportsIteration, HoldsResources):
    """The MegatronOptimizer interface the training loop uses, over one engine per distributed
    optimizer megatron-core would build: the dense parameters' and, with experts, theirs (chained
    as its ChainedOptimizer chains them: one grad norm over both, one clip coefficient)."""

    def __init__(self, config: OptimizerConfig, offload_config: OffloadConfig, model_chunks,
                 shard_groups: List[ShardGroups], token_store=None):
        self.config = config
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        # The group megatron-core reduces grad statistics over for its distributed optimizers (both).
        self.grad_stats_parallel_group = parallel_state.get_intra_distributed_optimizer_instance_group()
        self.data_parallel = max(g.dp_group.size() for g in shard_groups)
        if offload_config.defer_device_wait and self.data_parallel > 1:
            _check_gathered_overlap(self.ddp_config, self.data_parallel, len(model_chunks))
        self.overlap_forward = offload_config.defer_device_wait
        numels = shard_numels(shard_groups)
        check_host_split(offload_config, numels)  # one line for both engines, before either starts
        # Each engine's config in one step: its share of the budgets, and remainders only where its
        # params are all bf16 (they complete a bf16 param).
        self.shards = [OffloadShard(config, config_for_kind(offload_config, groups.kind, numels, param_remainders=(
                           offload_config.param_remainders and groups.params_bf16)), groups, token_store)
                       for groups in shard_groups]
        first = self.shards[0]
        # The first (dense) shard's, as megatron-core's ChainedOptimizer answers with its first.
        self.layout, self.engine, self.grad_scaler, self.device = first.layout, first.engine, first.grad_scaler, first.device
        self._cuda = self.device.type == "cuda"
        # The params' copies in the update, which the engines do not see, join their predictions at this rate.
        self._link_bps = (measured_link_bytes_per_s(self.device) if any(s.params_on_host for s in self.shards)
                          else None)
        if self._link_bps:
            log.info("host link: %.1f GB/s one way, measured; the update's copies of the params in host memory "
                     "are predicted at it", self._link_bps / 1e9)
        # (peak, capacity) bytes of the device since the last call, for --offload-gpu-cache-gb auto: CUDA's
        # figures on a GPU; on a CPU run none unless a test sets a stand-in.
        self.device_memory_figures: Optional[Callable[[], Tuple[int, int]]] = (
            _cuda_memory_figures if self._cuda else None)
        self.last_record = None
        self.is_stub_optimizer = False
        self._stalls = []  # (start, end) events around each forward wait for deferred params
        self._deferred_steps = 0
        self._overlap_choice = OverlapChoice()
        self._last_start: Optional[float] = None  # the last step's start
        self._settled_update_s: Optional[float] = None  # the last settled step's update (settle included)
        if self.overlap_forward:
            for shard in self.shards:
                shard.zero_grads_after_read()
            self._gate_forward_on_updated_params()
            log.info("--offload-overlap-forward: the update runs under the next forward; each layer waits "
                     "for its own params")

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        if self.overlap_forward:
            now = time.perf_counter()
            line = self._overlap_choice.step_started(now)
            if line:
                log.info(line)
            if self._deferred_steps == SETTLED_STEPS and self._settled_update_s is not None:
                self._hide_under_forward(now - self._last_start - self._settled_update_s)
                self._settled_update_s = None  # once (a skipped step here would time nothing new)
            self._last_start = now
            # a subgroup no forward asked for (an expert without tokens) is queued now: the norms below
            # must not read its unzeroed grads (they follow its reads on the device; the copies out of the
            # update's state may still run: the engine's step waits only where it touches that state)
            for shard in self.shards:
                shard.engine.queue_deferred()
        inv_scales = [shard.inv_scale() for shard in self.shards]
        norms, found_any = [], False
        for shard, inv_scale in zip(self.shards, inv_scales):  # megatron-core's prepare_grads, one by one
            shard_norms, found_inf = shard.grad_norms(inv_scale)
            norms += shard_norms
            if shard.grad_scaler is not None:
                found = torch.tensor([float(found_inf)], device=self.device)
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                             group=self.grad_stats_parallel_group)
                found_inf = bool(found.item())
                shard.grad_scaler.update(found_inf)
                found_any = found_any or found_inf
        if self.overlap_forward:  # the norms have read theirs; the update zeroes this rank's shard only
            for shard in self.shards:
                shard.zero_unowned_grads()
        if found_any:
            self.last_record = [shard.engine.step(skip=True) for shard in self.shards][0]
            if self.overlap_forward:
                self._overlap_choice.step_ended(None)  # no update: the next iteration times neither way
            if self.overlap_forward:  # the training loop left the zeroing to an update that did not run
                for shard in self.shards:
                    shard.zero_grads()
            return False, None, None
        # After the norms: the update's grad reads (and, with the overlap, its zeroing) come after theirs.
        for shard in self.shards:
            shard.grads_to_host()
        grad_norm, clip_coef = 0.0, None
        if self.config.clip_grad > 0.0:
            # One norm over every shard's grads, as megatron-core's ChainedOptimizer (shared stats group).
            grad_norm = get_grad_norm_fp32(norms, grad_stats_parallel_group=self.grad_stats_parallel_group)
            coef = self.config.clip_grad / (grad_norm + 1.0e-6)
            clip_coef = coef if coef < 1.0 else None
        # A step the overlap waits for (its first steps, or the overlap turned off) runs in a step in series'
        # order: the in-HBM updates beside the streamed ones, not behind them in the next forward's order.
        settles = self.overlap_forward and (self._deferred_steps < SETTLED_STEPS or not self._overlap_choice.overlap_on)
        records = [shard.engine.step(unscale=inv_scale, clip_coef=clip_coef, in_series=settles)
                   for shard, inv_scale in zip(self.shards, inv_scales)]
        if self._link_bps:
            for shard, record in zip(self.shards, records):
                shard.price_update_copies(record, self._link_bps)
        self.last_record = records[0]
        if self.overlap_forward:
            self._after_deferred_step(records[0], settles)
        if self._cuda:
            for shard in self.shards:
                torch.cuda.current_stream().wait_stream(shard.copy_stream)
                if shard.params_on_host:  # read next from the host (saves) or on another stream (the layers' copies)
                    shard.copy_back.wait()
        auto = [shard.engine for shard in self.shards if shard.engine.config.gpu_budget_auto]
        if auto and self.device_memory_figures is not None:
            if share_device_memory(auto, *self.device_memory_figures()) and self._cuda:
                # The allocator's cached blocks back to the driver: NCCL allocates outside it, lazily, and can
                # find nothing left after the tier grew (tier_growth.py)
                torch.cuda.empty_cache()
        if placed_in_host_memory(self.model_chunks[0]) or (
                not self.ddp_config.overlap_param_gather and not self.overlap_forward):
            # (with the overlap: at data-parallel size 1 each rank's params are its own already; above it
            # megatron-core's forward hooks gather each bucket once the gate saw its update done)
            gather_params(self.model_chunks)
        return True, grad_norm, None  # no zeros counted (--log-num-zeros-in-grad is megatron-core's)

    def _after_deferred_step(self, record, settles: bool) -> None:
        """The forward's wait for the last deferred params, into ``record``; and in the first
        ``SETTLED_STEPS`` steps (while the gpu tier settles in) the device's work is waited for here,
        so the next iteration's compute runs alone once: the iteration prediction's compute time."""
        stalls, self._stalls = self._stalls, []
        if stalls:
            stalls[-1][1].synchronize()  # the forward's, long done
        record.forward_wait_s = sum(start.elapsed_time(end) for start, end in stalls) / 1000.0
        self._deferred_steps += 1
        if settles:
            t0 = time.perf_counter()
            for shard in self.shards:
                shard.engine.settle()
            record.update_s += time.perf_counter() - t0
            record.settled = True
            self._settled_update_s = record.update_s
            if self._deferred_steps > SETTLED_STEPS:  # the overlap was turned off: predicted in series too
                record.predicted_deferred_s = record.predicted_deferred_in_hbm_s = 0.0
        self._overlap_choice.step_ended(record.settled)

    def _hide_under_forward(self, compute_s: float) -> None:
        """Once, at the first step that leaves its update under the next forward: ``compute_s``, the
        iteration after the last settled step less that step's update (the compute alone), tells
        each engine how much of its device work the first micro-batch's forward hides, and the
        engines re-choose the CPU's share of the host-held state for it (logged where it changes)."""
        micro_batches = get_num_microbatches()
        recompute_full = getattr(getattr(self.model_chunks[0], "config", None), "recompute_granularity", None) == "full"
        hidden_s = max(0.0, compute_s) * first_forward_share(micro_batches, recompute_full)
        for shard in self.shards:
            shard.engine.hide_under_forward(hidden_s)

    def _gate_forward_on_updated_params(self) -> None:
        """A forward pre-hook on every module holding params: the caller's stream waits for the events
        of the subgroups holding them (the deferred update's order is the forward's), so layer k's
        forward starts as soon as layer k's params are updated. Recomputed forwards wait on events long done.
        Above one data-parallel rank the params come from megatron-core's per-bucket all-gather, which
        DDP's own pre-hook (run after this one) starts for the module's bucket group and the next: the
        wait is then for this rank's shard of both groups' buckets, before either all-gather is issued."""
        shard_of = {param: shard for shard in self.shards for param in shard.layout.param_flat_range}
        bucket_owner = {bucket: shard for shard in self.shards for bucket in shard.layout.bucket_flat}

        def subgroups_needed(chunk, params):
            if self.data_parallel == 1:
                return {(id(shard_of[p].engine), i) for p in params if p in shard_of for i in shard_of[p].subgroups_of(p)}
            needed = set()
            for group in {chunk.param_to_bucket_group[p] for p in params if p in chunk.param_to_bucket_group}:
                for gathered in (group, group.next_param_gather_bucket_group):
                    for bucket in gathered.buckets if gathered is not None else ():
                        shard = bucket_owner[bucket]
                        needed |= {(id(shard.engine), i) for i in shard.subgroups_in(*shard.layout.bucket_flat[bucket])}
            return needed

        def gate(needs):
            def wait_for_params(module, _inputs):
                for engine, i in needs:
                    event = engine.params_ready(i)
                    if event is not None and self._cuda and not event.query():
                        stream = torch.cuda.current_stream()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record(stream)
                        stream.wait_event(event)
                        end.record(stream)
                        self._stalls.append((start, end))
            return wait_for_params
        engines = {id(shard.engine): shard.engine for shard in self.shards}
        for chunk in self.model_chunks:
            for module in chunk.modules():
                # (all its params: above data-parallel size 1, one held wholly by another rank still
                # starts a gather of buckets holding this rank's shard)
                needs = sorted(subgroups_needed(chunk, list(module.parameters(recurse=False))))
                if needs:  # before DDP's own hook, which issues the all-gathers
                    module.register_forward_pre_hook(gate([(engines[e], i) for e, i in needs]), prepend=True)

    @property
    def zeroes_grads_itself(self) -> bool:
        """Whether the step zeroes the grads as its update reads them (the training loop must not)."""
        return self.overlap_forward

    # -- the rest of the MegatronOptimizer interface ------------------------------------------
    @property
    def param_groups(self):
        # Every shard's, dense first: the LR scheduler sets each group's rate (ChainedOptimizer's view).
        return [group for shard in self.shards for group in shard.engine.param_groups]

    def zero_grad(self, set_to_none: bool = True):
        pass  # grads live in DDP's buffer, zeroed by the training loop

    def get_loss_scale(self):
        if self.grad_scaler is None:
            return torch.tensor([1.0], dtype=torch.float32, device=self.device)
        return self.grad_scaler.scale

    def scale_loss(self, loss):
        return self.get_loss_scale() * loss

    def reload_model_params(self, state_dict=None):
        for shard in self.shards:
            shard.reload_model_params()

    # -- checkpoints: metadata through dist_checkpointing; checkpointing streams the engines' state
    # beside it from ``shards`` (OffloadedOptimizerCheckpoint)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, **unused):
        # The same on every rank: common (non-sharded) state, so it loads under any layout.
        scalers = [shard.grad_scaler.state_dict() if shard.grad_scaler else None for shard in self.shards]
        return {"offload_meta": {"steps_done": self.engine.steps_done, "grad_scaler": scalers[0],
                                 "grad_scalers": scalers}}

    def load_state_dict(self, state_dict):
        meta = state_dict["offload_meta"]
        scalers = meta["grad_scalers"]
        for shard, scaler in zip(self.shards, scalers):
            if shard.grad_scaler is not None and scaler:
                shard.grad_scaler.load_state_dict(scaler)

    def state_dict(self):
        raise NotImplementedError("the offloaded optimizer saves through sharded_state_dict() and its shards' "
                                  "engines (checkpoint/offload_files.py)")

    def last_step_record(self):
        return self.last_record  # the dense engine's (its telemetry); the experts' engine logs its own

    def state_bytes_per_tier(self) -> dict:
        total: dict = {}
        for shard in self.shards:
            for tier, nbytes in shard.engine.state_bytes_per_tier().items():
                total[tier] = total.get(tier, 0) + nbytes
        return total

    def close(self):
        for shard in self.shards:
            shard.engine.close()


def _check_gathered_overlap(ddp_config, data_parallel: int, chunks: int) -> None:
    """Above one data-parallel rank each bucket's all-gather must follow that bucket's update: the
    overlap hooks into megatron-core's per-bucket gather in the forward, which its schedule for the
    interleaved pipeline replaces by gathering whole model chunks up front."""
    if not ddp_config.overlap_param_gather:
        raise UserError(f"--offload-overlap-forward at data-parallel size {data_parallel} needs "
                        f"--overlap-param-gather (each bucket's param all-gather follows its own update, in the forward)")
    if chunks > 1:
        raise UserError(f"--offload-overlap-forward at data-parallel size {data_parallel}: not with the interleaved "
                        f"pipeline ({chunks} model chunks, whose params its schedule gathers before their forward)")


def shard_numels(every: List[ShardGroups]) -> Dict[str, int]:
    """The optimizer state each shard holds on this rank (what ``shard_budgets`` splits budgets by):
    its buckets' share over its own data-parallel group (DP for the dense one, expert-DP for experts)."""
    return {g.kind: sum(bucket.grad_data.numel() // g.dp_group.size() for buffers in g.buffers.values()
                        for buffer in buffers for bucket in buffer.buckets) for g in every}


def share_device_memory(engines, peak: int, capacity: int) -> bool:
    """Auto gpu tiers of one device (dense and experts) fitted in turn: what one engine moves in or
    hands back counts in the peak the next sees, so two never take the same spare memory. Whether a tier grew."""
    grew = False
    for engine in engines:
        before = engine.state_bytes_per_tier().get(GPU_TIER, 0)
        engine.observe_device_memory(peak, capacity)
        after = engine.state_bytes_per_tier().get(GPU_TIER, 0)
        peak += after - before
        grew = grew or after > before
        tier_growth.observed(before, after, capacity - peak, engine.config.gpu_margin_bytes)
    return grew


def _cuda_memory_figures() -> Tuple[int, int]:
    """The peak of memory in use since the last call, and the most this process could hold (what is
    free on the device plus what its allocator reserves already); the peak is reset for the next.
    In use, not reserved: blocks freed by handing subgroups back stay in the allocator's reserve,
    so a reserved peak would never fall and each step would hand back more."""
    peak = torch.cuda.max_memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    capacity = free + torch.cuda.memory_reserved()
    tier_growth.allocator_figures(torch.cuda.max_memory_reserved(), peak)  # said where the tier grows next
    torch.cuda.reset_peak_memory_stats()
    return peak, capacity
