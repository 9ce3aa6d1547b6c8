"""What every rank of a save agrees on, through collectives: that it begins (rank 0 marks it in progress, the file
system has room for it), whether any rank's part failed (then all stop with one line and the unfinished directory
goes), and that it is complete (rank 0's proof, then the tracker). ``checkpointing`` runs a save through these.
The space check also forecasts: where a later save of the run will not fit (its saves by the training loop's
rule, its checkpoints on the disk at once as ``--save-retain-interval`` retires them), one warning line says
which, at start-up and at a save where it changes; the planner (tools/plan_offload.py) counts with it too."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state

from megatron.training.checkpoint import integrity
from megatron.training.checkpoint.offload_files import offloaded_state_bytes
from megatron.training.checkpoint.resume_check import SaveDigests
from megatron.training.errors import UserError
from megatron.training.runtime.optimizer_interface import OffloadedOptimizerCheckpoint
from megatron.training.runtime.progress import model_device
from mlp_offload import fault_point
from mlp_offload.checkpoint import CheckpointSaveError, free_bytes, human_bytes

# What a file system says when the user must act (space, quota, permissions, a vanished or failing disk).
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO}


def save_failure(err: BaseException, path: str) -> str:
    """A failed write of this rank as one line; anything but the file system's doing is a bug."""
    rank = torch.distributed.get_rank()
    if isinstance(err, CheckpointSaveError):
        return f"rank {rank}: {err}"
    if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        return f"rank {rank}: {path}: {err.strerror or err}"
    raise err


def write_digests(digests: Optional[SaveDigests], path: str) -> Optional[str]:
    """This rank's record of the save for the resume check, once its writers are done; a failure as one line."""
    if digests is None:
        return None
    try:
        digests.write(path)
    except OSError as err:
        return save_failure(err, path)
    return None


def begin_save(root: str, path: str, iteration: int, model, optimizer, later: Sequence[int] = (),
               retain_interval: Optional[int] = None) -> bool:
    """Mark ``path`` in progress and check the space; False where a complete one is there already. ``later``:
    the run's saves into ``root`` after this one, kept as ``retain_interval`` keeps them (``integrity.retire``):
    where one of them will not fit, a warning says which, once."""
    decision = [None]
    if torch.distributed.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        needed, lines = integrity.clear_for_save(root, iteration)
        for line in lines:
            print(f"> {line}", flush=True)
        if needed:
            integrity.mark_in_progress(path)
        decision = [needed]
    torch.distributed.broadcast_object_list(decision, src=0)
    if decision[0]:
        _check_free_space(root, path, iteration, model, optimizer, later, retain_interval)
    return decision[0]


def complete(root: str, path: str, iteration: int) -> int:
    """After every rank's files: rank 0 writes the proof, then the tracker. Returns the bytes (rank 0)."""
    fault_point("save-complete")
    total = 0
    if torch.distributed.get_rank() == 0:
        total = integrity.mark_complete(path, iteration)
    fault_point("save-tracker")
    if torch.distributed.get_rank() == 0:
        integrity.write_tracker(root, iteration)
    return total


def background_failure(err: BaseException, path: str) -> str:
    """The writer thread's failure as one line: every rank stops with it (a bug too, not only the
    file system, since the thread cannot raise into training)."""
    try:
        return save_failure(err, path)
    except BaseException:
        return (f"rank {torch.distributed.get_rank()}: writing the offloaded optimizer state failed: "
                f"{type(err).__name__}: {err}")


def _check_free_space(root: str, path: str, iteration: int, model, optimizer, later: Sequence[int],
                      retain_interval: Optional[int]) -> None:
    """Refuse before writing anything when the file system cannot hold the checkpoint; warn (once per
    forecast) where a later save of the run will not fit."""
    needed = _checkpoint_bytes(model, optimizer)
    verdict = [None]
    if torch.distributed.get_rank() == 0:
        free = free_bytes(root)
        if needed > free:
            shutil.rmtree(path)  # holds only its in-progress marker
            verdict = [f"--save {root}: the checkpoint of iteration {iteration} needs about "
                       f"{human_bytes(needed)}, but only {human_bytes(free)} are free there; nothing was "
                       f"written and the previous checkpoints are untouched: free space or use another --save"]
        else:
            warn_of_refusal(root, [iteration, *later], retain_interval, needed, free, f"before the save at {iteration}")
    torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UserError(verdict[0])


def forecast_saves(root: str, saves: Sequence[int], retain_interval: Optional[int], model, optimizer) -> None:
    """At start-up (every rank calls it): the warning a save gives where a later one will not fit, before the
    first save, from the checkpoint's size and the space free now."""
    needed = _checkpoint_bytes(model, optimizer)
    if torch.distributed.get_rank() == 0:
        warn_of_refusal(root, saves, retain_interval, needed, free_bytes(root), "at start-up", afresh=True)


def _checkpoint_bytes(model, optimizer) -> float:
    """The bytes a checkpoint takes, all ranks' together (a collective)."""
    needed = torch.tensor([_bytes_this_rank_saves(model, optimizer)], dtype=torch.float64, device=model_device(model))
    torch.distributed.all_reduce(needed)  # on the model's device: NCCL reduces no CPU tensors
    return needed.item()


def _bytes_this_rank_saves(model, optimizer) -> int:
    """Model weights once per data-parallel replica group; optimizer state once per shard."""
    numel = sum(p.numel() for chunk in model for p in chunk.parameters())
    weights = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    first_replica = parallel_state.get_data_parallel_rank() == 0
    if optimizer is None:  # --no-save-optim
        return weights * first_replica
    if isinstance(optimizer, OffloadedOptimizerCheckpoint):
        return weights * first_replica + offloaded_state_bytes(optimizer.shards)
    # megatron-core's distributed optimizer: fp32 master, exp_avg and exp_avg_sq of this rank's shard
    return weights * first_replica + 12 * numel // parallel_state.get_data_parallel_world_size()


def fail_together(failure: Optional[str], root: str, path: str) -> None:
    """Every rank learns whether any rank's part of the save failed; then all stop with its message."""
    failures = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failure)
    first = next((f for f in failures if f), None)
    if first is None:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # still marked in progress: provably incomplete
    torch.distributed.barrier()
    raise UserError(f"--save {root}: {first}; the unfinished {path} was removed and the previous checkpoints are "
                    f"untouched")


# -- the forecast: the space a run's saves will need (said at start-up and at each save; the planner counts with it)
def planned_saves(iteration: int, interval: Optional[int], train_iters: Optional[int],
                  at_end: bool = True) -> List[int]:
    """The iterations of a run's saves into one directory after ``iteration``: every multiple of ``interval``
    (where set) up to ``train_iters``, and with ``at_end`` the end of training's own (the training loop's rule)."""
    if not train_iters:
        return []
    later = list(range((iteration // interval + 1) * interval, train_iters + 1, interval)) if interval else []
    ends = at_end and train_iters > iteration and not (interval and train_iters % interval == 0)
    return later + [train_iters] if ends else later


def checkpoints_on_disk(saves: Sequence[int], retain_interval: Optional[int]) -> List[int]:
    """For each of ``saves`` (a run's saves into one directory, ascending), how many of the run's checkpoints
    are there while it is written, itself included: those ``retain_interval`` keeps (None: all of them) and
    the newest before it, which retires only once it is complete."""
    counts, kept = [], []  # kept: this run's checkpoints on the disk when the next save begins
    for it in saves:
        counts.append(len(kept) + 1)
        kept = [k for k in kept if integrity.retained(k, retain_interval)] + [it]
    return counts


def first_refused_save(saves: Sequence[int], retain_interval: Optional[int], checkpoint_bytes: float,
                       free_bytes: float) -> Optional[int]:
    """The first of ``saves`` whose checkpoint the space check will refuse, where ``free_bytes`` are free
    before the first, each checkpoint takes ``checkpoint_bytes`` and nothing else writes there
    (``checkpoints_on_disk``). Earlier runs' checkpoints are outside ``free_bytes`` already (their retiring
    only adds room). None where every one fits."""
    counts = checkpoints_on_disk(saves, retain_interval)
    return next((it for it, n in zip(saves, counts) if checkpoint_bytes * n > free_bytes), None)


_forecasts_said: Dict[str, int] = {}  # per directory, the refused save last warned of


def warn_of_refusal(root: str, saves: Sequence[int], retain_interval: Optional[int], checkpoint_bytes: float,
                    free: int, when: str, afresh: bool = False) -> None:
    """One warning line (rank 0) where one of ``saves`` into ``root`` will be refused for space, unless the same
    was said for ``root`` already (``afresh``: a run's start-up, whatever an earlier run of the process said)."""
    if afresh:
        _forecasts_said.pop(root, None)
    refused = first_refused_save(saves, retain_interval, checkpoint_bytes, free)
    if refused is None or _forecasts_said.get(root) == refused:
        return
    _forecasts_said[root] = refused
    if retain_interval is None:
        kept, advice = "every one kept", "; --save-retain-interval N keeps only those at multiples of N and the newest"
    elif retain_interval == integrity.NEWEST_ONLY:
        kept, advice = "the newest kept", ""
    else:
        kept, advice = f"those at multiples of --save-retain-interval {retain_interval} and the newest kept", ""
    print(f"> warning: --save {root}: the save at iteration {refused} will be refused for space: about "
          f"{human_bytes(checkpoint_bytes)} a checkpoint ({kept}) and {human_bytes(free)} free {when}, if nothing "
          f"else writes there; free space or use another --save before then{advice}", flush=True)
