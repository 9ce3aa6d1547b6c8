"""Checkpoint save/load through megatron-core ``dist_checkpointing``, in Megatron-LM's torch_dist layout.

``SAVE/iter_0000005/`` (a dist_checkpointing directory) and ``SAVE/latest_checkpointed_iteration.txt``,
plus the completeness proof of checkpoint_integrity. The state dict has Megatron-LM's keys:
'args' (a Namespace; the data position in its consumed_train_samples), 'checkpoint_version' 3.0,
'iteration', 'model' ('model0', 'model1', ... with virtual pipeline chunks), 'optimizer'
(DistributedOptimizer ``dp_reshardable``), 'opt_param_scheduler', 'rng_state' (a ShardedObject
per (pp, tp) position holding the list of its data-parallel ranks' states, as upstream's
--data-parallel-random-init) and 'num_floating_point_operations_so_far'. So a Megatron-LM GPT
checkpoint loads here and a resumed run continues bit for bit. With offload, the optimizer's
Adam state is streamed beside it into ``iter_N/offload/`` (offload_files) and either form loads into
either kind of optimizer (optimizer_state, crossing).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core import dist_checkpointing, parallel_state

from megatron.training.checkpoint.async_save import (HostWeightsAside, check_nodes_hold, next_save_in_s,
                                                      reserve_host_copies, reserve_worker_staging, torch_dist_flush)
from megatron.training.checkpoint.integrity import NEWEST_ONLY, checkpoint_dir, non_persistent_root, part_bytes, retire
from megatron.training.checkpoint.load_plan import SAME_FORM, plan_load, resume_position, resume_root
from megatron.training.checkpoint.offload_files import (offloaded_state_bytes, offloaded_state_writes,
                                                        start_offloaded_save, write_offloaded_state)
from megatron.training.checkpoint.optimizer_state import OffloadedStateLoad, load_optimizer, optimizer_template
from megatron.training.checkpoint.save_agreement import (background_failure, begin_save, complete, fail_together,
                                                          forecast_saves, planned_saves, save_failure, write_digests)
from megatron.training.checkpoint.saved_args import args_to_save
from megatron.training.checkpoint.torch_dist_read_ahead import TorchDistReadAhead
from megatron.training.checkpoint.resume_check import ResumeCheck, SaveDigests
from megatron.training.checkpoint.state_dict import (all_data_parallel_rng_states, load_model, load_rng,
                                                     load_strategies, model_state, rng_sharded_object,
                                                     save_strategies, sharding_metadata)
from megatron.training.errors import UserError
from megatron.training.model.host_params import host_param_buffers
from megatron.training.runtime import io_priority
from megatron.training.runtime.checkpoint_lines import Phases, disk_rates, load_line, save_line
from megatron.training.runtime.concurrent import ConcurrentCall
from megatron.training.runtime.optimizer_interface import OffloadedOptimizerCheckpoint
from megatron.training.runtime.progress import gb_and_rate, print_rank0, reported_step, slowest_rank
from mlp_offload.checkpoint import CheckpointSaveError, human_bytes, read_flush_report, reserve_paced_staging
from mlp_offload import fault_point, tree_bytes


class _OurMarkerIsNotACorruptCheckpoint(logging.Filter):
    """dist_checkpointing warns "Overwriting old incomplete / corrupted checkpoint" whenever the
    directory is not empty, which it never is here: SAVE_IN_PROGRESS goes in first (see
    checkpoint_integrity), and anything else unfinished was removed before the save began."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Overwriting old incomplete / corrupted checkpoint")


logging.getLogger("megatron.core.dist_checkpointing.serialization").addFilter(_OurMarkerIsNotACorruptCheckpoint())


CHECKPOINT_VERSION = 3.0  # Megatron-LM's, for torch_dist checkpoints


def _state_to_save(args, model, optimizer, scheduler, iteration, consumed_samples) -> dict:
    metadata = sharding_metadata()
    state = {"args": args_to_save(args, consumed_samples), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    state.update(model_state(model, metadata))
    if not args.no_save_optim:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = rng_sharded_object(all_data_parallel_rng_states())
    state["num_floating_point_operations_so_far"] = getattr(args, "num_floating_point_operations_so_far", 0)
    return state


def reserve_async_save_memory(model, optimizer, args) -> None:
    """--async-save: pin the host memory its copies of the weights take now, at start-up, not while the
    first background save holds training (async_save.reserve_host_copies), and make the staging of the
    offloaded state's copies aside (mlp_offload.checkpoint.reserve_paced_staging), not beside the steps after the
    first save; a line says how much of each."""
    fully_parallel = args.ckpt_fully_parallel_save and parallel_state.get_data_parallel_world_size() > 1
    if args.checkpoint_worker is not None:
        print_rank0(reserve_worker_staging(args.checkpoint_worker, model_state(model, sharding_metadata()), fully_parallel))
        nbytes = 0  # the worker's staging is what the saves copy the weights into
    else:
        nbytes, seconds = reserve_host_copies(model_state(model, sharding_metadata()), fully_parallel)
    if nbytes:
        print_rank0(f"> --async-save: {human_bytes(nbytes)} of pinned host memory (rank 0) kept for the saves' copies "
                    f"of the weights, pinned in {seconds:.1f} s")
    shards = optimizer.shards if isinstance(optimizer, OffloadedOptimizerCheckpoint) and args.save else []
    started = time.perf_counter()
    staged = sum(reserve_paced_staging(shard.engine, args.save) for shard in shards)
    if staged:
        print_rank0(f"> --async-save: {human_bytes(staged)} of host memory (rank 0) kept for the saves' copies aside "
                    f"of the offloaded state held in memory, made in {time.perf_counter() - started:.1f} s")
    aside = _host_weights_aside(model)
    if aside is not None:  # the params in host memory: each save copies what it writes of them aside
        size = parallel_state.get_data_parallel_world_size() if fully_parallel else 1
        estimate = aside.bytes_written(model_state(model, sharding_metadata()), size)
        check_nodes_hold(estimate, "each save copies about this much of the params aside while the writer reads them")
        print_rank0(f"> --async-save: each save copies about {human_bytes(estimate)} (rank 0) of the params in host "
                    f"memory aside for the background writer, in pageable host memory until it has written them")


def save_checkpoint(iteration: int, trained, consumed_samples: int, args, background=None,
                    non_persistent: bool = False) -> str:
    """Save everything into ``root/iter_N`` (root: ``args.save``, as Megatron-LM's, or with ``non_persistent`` the
    directory of --non-persistent-ckpt-type global, which keeps its newest) and record it as the latest; see
    checkpoint_integrity for the order that makes a crash at any point leave the previous checkpoint as the one to
    resume. ``trained``: what training changes, its ``model`` (chunks), ``optimizer`` and ``scheduler``.

    Synchronously, the torch_dist files and the offloaded optimizer state are written side by side
    (the latter on a thread), so the disk never waits on one of them. With ``background``
    (async_save.BackgroundSaves, --async-save) the torch_dist files are written by a background
    process and the offloaded optimizer state by a thread, from a snapshot taken here
    (mlp_offload.snapshot); the checkpoint is completed in the finalize step."""
    root, retain_interval = _save_root(args, non_persistent)
    later = _planned_saves(args, iteration, non_persistent)  # for the space check's forecast
    if background is None:  # the start line only: _save_now's own line at the end gives the bytes and rates
        print_rank0(f"> saving {'non-persistent ' if non_persistent else ''}checkpoint at iteration {iteration} to "
                    f"{root} ...")
        return _save_now(iteration, trained, consumed_samples, args, root, retain_interval, later)
    model, optimizer, scheduler = trained.model, trained.optimizer, trained.scheduler
    path = checkpoint_dir(root, iteration)
    held_from = time.perf_counter()  # training waits from here, for the previous background save too
    background.finish()  # the previous background save is complete (or has failed) first
    started = time.perf_counter()
    save_optimizer = not args.no_save_optim
    if not begin_save(root, path, iteration, model, optimizer if save_optimizer else None, later, retain_interval):
        return path
    state_from = time.perf_counter()
    state = _state_to_save(args, model, optimizer, scheduler, iteration, consumed_samples)
    digests = None  # the resume check's record (--no-resume-check: none)
    if args.resume_check:
        digests = SaveDigests(model, optimizer if save_optimizer else None, iteration)
    engine_digests = digests.engines if digests is not None else None
    next_save = next_save_in_s(iteration, save_intervals(args), args.train_iters, background.iteration_s())
    torch_dist_from = time.perf_counter()
    request, failure, offload_write = None, None, None
    torch_dist_to = torch_dist_from
    aside = _host_weights_aside(model)  # --async-save only: the synchronous save (_save_now) copies nothing aside
    offloaded = save_optimizer and isinstance(optimizer, OffloadedOptimizerCheckpoint)  # a file per rank beside it
    try:
        request = dist_checkpointing.save(state, path, async_sharded_save=True,
                                          **save_strategies(args, aside.wrapping if aside is not None else None))
        torch_dist_to = time.perf_counter()  # its plan and its copy to host memory
        if offloaded:  # a snapshot, written once started
            offload_write = start_offloaded_save(optimizer.shards, model, path, engine_digests, next_save)
    except (CheckpointSaveError, OSError) as err:
        failure = save_failure(err, path)
    except UserError as err:  # the host memory cannot hold the params' copies (every rank raised it)
        failure = str(err)
    offload_to = time.perf_counter()
    try:
        fail_together(failure, root, path)  # before any background write starts: nothing to stop
    except UserError:
        if offload_write is not None:
            offload_write.cancel()
        raise
    on_written = _BackgroundCompletion(root, path, iteration, started, offload_write, model, digests)
    on_written.retain_interval = retain_interval
    shards = optimizer.shards if isinstance(optimizer, OffloadedOptimizerCheckpoint) else []
    on_written.flush = torch_dist_flush(shards, path, next_save)  # None: its fsyncs as megatron-core makes them
    background.schedule(request, on_written, offload_write, on_written.flush)
    fault_point("save-scheduled")
    done = time.perf_counter()
    # Where the hold went (consecutive parts: they add up to it), each on its slowest rank.
    copy_s, copied = (aside.copy_s, aside.copied_bytes) if aside is not None else (0.0, 0)
    parts = {"for the previous save to finish": started - held_from, "marking it begun": state_from - started,
             "the state dict": torch_dist_from - state_from,
             "copying the params in host memory aside": copy_s,
             "torch_dist's plan and copy to host": torch_dist_to - torch_dist_from - copy_s,
             "the offloaded state's snapshot": offload_to - torch_dist_to, "starting the writers": done - offload_to}
    held = slowest_rank([done - held_from, *parts.values(), copied], model)
    copied = held.pop()
    on_written.held_s, seconds = held[0], dict(zip(parts, held[1:]))
    previous = " (" + "; ".join(f"{sec:.2f} s of it {name}" for name, sec in seconds.items()
                                if sec >= 0.005 or name.startswith("for")) + ")"
    what = "its torch_dist files"
    if aside is not None:
        what += (f" (from {human_bytes(copied)} per rank of params in host memory copied aside in "
                 f"{seconds['copying the params in host memory aside']:.2f} s)")
    if offload_write is not None:
        what += f" and offloaded optimizer state ({human_bytes(offload_write.nbytes)} per rank)"
    print_rank0(f"> checkpoint at iteration {iteration}: training held {on_written.held_s:.2f} s{previous}; {what} "
                 f"are being written in the background to {path} (--async-save); torch_dist's writer process at "
                 f"nice 19 and the idle I/O priority, {io_priority.describe(path)}; "
                 f"{on_written.flush.describe() if on_written.flush else 'its fsyncs not paced (no file tier on its disk)'}")
    return path


def save_intervals(args) -> Tuple[Optional[int], Optional[int]]:
    """The intervals saves come at: --save-interval's and --non-persistent-save-interval's."""
    return args.save_interval, getattr(args, "non_persistent_save_interval", None)


def forecast_space(args, trained, iteration: int) -> None:
    """At start-up (every rank): one warning line where a save this run will make into --save (or the
    non-persistent directory) will not fit, before the first save (save_agreement.forecast_saves)."""
    if not args.save:
        return
    optimizer = None if args.no_save_optim else trained.optimizer
    for non_persistent in (False, True):
        root, retain_interval = _save_root(args, non_persistent)
        saves = _planned_saves(args, iteration, non_persistent)
        if root and saves:
            forecast_saves(root, saves, retain_interval, trained.model, optimizer)


def _planned_saves(args, iteration: int, non_persistent: bool) -> List[int]:
    """The run's saves into that directory after ``iteration`` (the training loop's rule: the non-persistent
    ones at their interval, the persistent ones at theirs and at the end of training)."""
    if non_persistent:
        interval = getattr(args, "non_persistent_save_interval", None)
        return planned_saves(iteration, interval, args.train_iters, at_end=False) if interval else []
    return planned_saves(iteration, args.save_interval, args.train_iters)


def _save_root(args, non_persistent: bool) -> Tuple[str, Optional[int]]:
    """(the directory a save goes into, the retain interval its retirement uses: None keeps every one)."""
    if non_persistent:
        return non_persistent_root(args, args.save), NEWEST_ONLY
    return args.save, getattr(args, "save_retain_interval", None)


def _save_now(iteration: int, trained, consumed_samples: int, args, root: str, retain_interval: Optional[int],
              later: Sequence[int]) -> str:
    """The synchronous save: torch_dist's files and each rank's offloaded state written at once; one
    line with the bytes, seconds and GB/s of each part and of the whole (runtime.checkpoint_lines)."""
    model, optimizer, scheduler = trained.model, trained.optimizer, trained.scheduler
    path = checkpoint_dir(root, iteration)
    phases = Phases()
    save_optimizer = not args.no_save_optim
    if not begin_save(root, path, iteration, model, optimizer if save_optimizer else None, later, retain_interval):
        return path
    phases.mark("marking it begun")
    state = _state_to_save(args, model, optimizer, scheduler, iteration, consumed_samples)
    phases.mark("the state dict")
    digests = None  # the resume check's record (--no-resume-check: none)
    if args.resume_check:
        digests = SaveDigests(model, optimizer if save_optimizer else None, iteration)
    phases.mark("the params' digests")
    offloaded = save_optimizer and isinstance(optimizer, OffloadedOptimizerCheckpoint)  # a file per rank beside it
    written, offload_s, torch_dist_s, failure, beside = 0, 0.0, 0.0, None, None
    try:
        if offloaded:  # written while torch_dist writes: the disk never waits on one
            writes = offloaded_state_writes(optimizer.shards, model, path, digests.engines if digests else None)
            beside = ConcurrentCall(write_offloaded_state, writes)
        dist_checkpointing.save(state, path, **save_strategies(args))
        torch_dist_s = time.perf_counter() - phases.last
        if beside is not None:
            written, offload_s = beside.result()
    except (CheckpointSaveError, OSError) as err:
        if beside is not None:
            beside.wait_quietly()  # it may still be writing into the directory the failure removes
        failure = save_failure(err, path)
    phases.mark("writes")
    if failure is None:
        failure = write_digests(digests, path)
    phases.mark("the resume check's record")
    fail_together(failure, root, path)
    phases.mark("agreeing")
    complete(root, path, iteration)
    phases.mark("the proof")
    if torch.distributed.get_rank() == 0:  # the tracker's writer: once it names this one
        retire(root, iteration, retain_interval)
    state_bytes = offloaded_state_bytes(optimizer.shards) if offloaded else 0
    figures = dict(phases.spans, torch_dist=torch_dist_s, offloaded=offload_s, whole=phases.total())
    figures["offloaded bytes"], figures["offloaded written"] = state_bytes, written
    names = list(figures)
    figures = dict(zip(names, slowest_rank([figures[name] for name in names], model)))
    if torch.distributed.get_rank() == 0:
        print(save_line(iteration, root, part_bytes(path), figures, disk_rates(path, optimizer)), flush=True)
    return path


def _host_weights_aside(model) -> Optional[HostWeightsAside]:
    """What copies the weights in host memory aside at an async save (--offload-params host), else None."""
    buffers = host_param_buffers(model)
    return HostWeightsAside(buffers) if buffers else None


class _BackgroundCompletion:
    """What the finalize step of a background save does once every rank's writers have ended: all
    ranks agree it succeeded, the proof and the tracker, and the line with what training paused."""

    def __init__(self, root: str, path: str, iteration: int, started: float, offload_write, model,
                 digests: Optional[SaveDigests]):
        self.root, self.path, self.iteration, self.started = root, path, iteration, started
        self.offload_write = offload_write  # mlp_offload.BackgroundStateWrite or None
        self.model = model
        self.digests = digests
        self.held_s = 0.0  # the save's own hold, the slowest rank's (set once the save returns)
        self.flush = None  # how torch_dist's writer paced its fsyncs (async_save.torch_dist_flush)
        self.retain_interval: Optional[int] = None  # --save-retain-interval: integrity.retire once complete

    def __call__(self, failure: Optional[str]) -> None:
        flushed = read_flush_report(self.flush.report_path) if self.flush is not None else None
        write = self.offload_write
        if failure is None and write is not None and write.failure is not None:
            failure = background_failure(write.failure, self.path)
        if failure is None:
            failure = write_digests(self.digests, self.path)
        fail_together(failure, self.root, self.path)
        total = complete(self.root, self.path, self.iteration)
        line = (f"> saved checkpoint at iteration {self.iteration} to {self.root} (finalized in the background): "
                f"{gb_and_rate(total, time.perf_counter() - self.started)} since the save began")
        if write is not None:
            nbytes, write_s, paused_s = slowest_rank([write.nbytes, write.write_s, write.paused_s], self.model)
            line += (f"; offloaded optimizer state {gb_and_rate(nbytes, write_s)} per rank written in the background; "
                     f"training paused {self.held_s + paused_s:.2f} s ({self.held_s:.2f} s at the save, "
                     f"{paused_s:.2f} s in the updates after it)")
        if flushed is not None:
            line += f"; torch_dist's writer: {flushed}"
        print_rank0(line)
        if torch.distributed.get_rank() == 0:  # the tracker's writer: once it names this one
            retire(self.root, self.iteration, self.retain_interval)


def resume(args, trained) -> Tuple[int, int]:
    """(iteration, consumed samples) the run starts at: (0, 0) without --load or with no checkpoint there yet, else
    those of the checkpoint loaded into ``trained`` (load_plan.resume_root says which); a line says which."""
    root = resume_root(args) if args.load else None
    if root is None:
        if args.load:
            print_rank0(f"> no checkpoint in {args.load} yet: starting from scratch")
        return 0, 0
    with reported_step(f"> loading checkpoint from {root}", print_rank0) as step:
        iteration, consumed = load_checkpoint(root, trained.model, trained.optimizer, trained.scheduler, args)
        if iteration and torch.distributed.get_rank() == 0:
            step.nbytes = tree_bytes(checkpoint_dir(root, iteration))
    print_rank0(f"> loaded checkpoint from {root} at iteration {iteration}" if iteration else
                f"> no complete checkpoint in {root}: starting from scratch")
    return iteration, consumed


def load_checkpoint(root: str, model, optimizer, scheduler, args):
    """Restore what the flags ask for; returns (iteration, consumed_samples), or (0, 0) when nothing
    is saved (and with --finetune, which loads the weights only).

    The plan first (which checkpoint, whether it loads here, what becomes of each kind of state),
    then one collective read of the torch_dist files for every kind kept there (the model, the
    optimizer in its own form, the RNG states), then each kind in turn: the optimizer's is one call
    (optimizer_state), whichever form it is in."""
    phases = Phases()
    plan = plan_load(root, optimizer, args)
    if plan is None:
        return 0, 0
    metadata = sharding_metadata()
    template = model_state(model, metadata)
    template.update(optimizer_template(plan, optimizer, template, metadata))
    if plan.rng:
        template["rng_state"] = rng_sharded_object(None)
    check = ResumeCheck(plan.path, model, enabled=args.resume_check)
    phases.mark("planning")
    offloaded = None
    if plan.optimizer == SAME_FORM and plan.run_offloaded:  # read beside torch_dist's files where it can
        offloaded = OffloadedStateLoad(plan, optimizer, model, check)
        offloaded.start()
    try:
        with TorchDistReadAhead(plan.path, enabled=args.ckpt_read_ahead) as read_ahead:  # ends with the read
            state = dist_checkpointing.load(template, plan.path, **load_strategies(args, plan.path))
        torch_dist_s = time.perf_counter() - phases.last
        load_model(model, state)
    except BaseException:
        if offloaded is not None:
            offloaded.wait_quietly()  # no engine is touched again while its fill runs
        raise
    load_optimizer(plan, optimizer, model, state, args, check, offloaded)
    phases.mark("reads")
    if plan.scheduler:
        scheduler.load_state_dict(plan.common["opt_param_scheduler"])
    if plan.rng:
        load_rng(state)
    check.finish(model, optimizer_loaded=plan.optimizer is not None)
    torch.distributed.barrier()
    phases.mark("after")
    _report_load(plan.path, model, optimizer, phases, torch_dist_s, offloaded, read_ahead)
    return resume_position(plan, args)


def _report_load(path: str, model, optimizer, phases: Phases, torch_dist_s: float, offloaded,
                 read_ahead: TorchDistReadAhead) -> None:
    """The load's line: each part's bytes and seconds, the slowest rank's (runtime.checkpoint_lines), and
    what rank 0's node read ahead of the torch_dist files."""
    figures = dict(phases.spans, torch_dist=torch_dist_s, whole=phases.total())
    figures["offloaded"] = offloaded.seconds if offloaded is not None else 0.0
    figures["offloaded bytes"] = offloaded.nbytes if offloaded is not None else 0
    names = list(figures)
    figures = dict(zip(names, slowest_rank([figures[name] for name in names], model)))
    if torch.distributed.get_rank() == 0:
        beside = offloaded is not None and offloaded.beside
        print(load_line(path, part_bytes(path), figures, disk_rates(path, optimizer), beside)
              + read_ahead.summary(), flush=True)
