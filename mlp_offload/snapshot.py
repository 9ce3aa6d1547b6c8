"""The engine's state at one moment, kept for a checkpoint writer while training goes on.

Taken between two updates (``StateAccess.snapshot``), at the cost of a flush of the writes behind
and a hard link per streamed subgroup. Each subgroup's state is read by the writer from one of two
places:

- its tier file, where that is current: the file gets a second name (``StreamedTier.link``) and the
  writer reads that; the next update's write of the subgroup goes to a new file, so the linked
  bytes never change and the update never waits for them.
- memory: subgroups resident in a memory tier (host, or device memory: copied to the host as
  the writer takes them), and streamed ones whose newest state is in a pipeline buffer
  (kept unwritten, or a hit of the next step). The next update changes these in place, so
  ``before_update(i)`` holds it back until the writer has subgroup ``i``: at once if the writer is
  done with it, else a copy goes into a staging buffer (at most ``staging_bytes`` of them, on
  demand) that the writer takes instead; with no staging left, the update waits for the writer.
  The writer takes the memory ones first, in the next update's order, so it runs ahead of the
  update for as long as it can. The time ``before_update`` takes is the pause training has.
  A writer paced over several steps (``checkpoint.pacing``) copies them aside itself first
  (``stage_ahead``), between two updates, so the update neither copies nor waits. The staging buffers
  outlive the snapshot (``KeptStaging``): the next save copies into memory already faulted in, not into
  memory mapped, faulted in and unmapped again at every save beside the steps after it.

The writer's threads read device memory on a stream of their own (``device_reads``), which starts
after the work the training's stream had queued when the snapshot was taken: on the training's
stream, each of the writer's copies would wait for the kernels queued before it and hold back the
ones queued after it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .config.offload_config import DEFAULT_SAVE_STAGING
from .pipeline import StateViews
from .subgroups.partition import Subgroup, slot_subgroup
from .tiers.no_fork import aligned_empty
from .tiers.to_host import copy_to_host, reserve as reserve_pinned_pair
from .tiers.base import StreamedTier

# What the writer has done with a memory subgroup.
PENDING, STAGING, STAGED, WRITING, DONE = "pending", "staging", "staged", "writing", "done"


class SnapshotCancelled(RuntimeError):
    """The snapshot was given up (the engine closes, the run fails) before the writer finished."""


@dataclass
class TierCopy:
    tier: StreamedTier
    key: str  # the name the writer reads: the link, or the live file for a save nothing overtakes
    linked: bool  # a link of the snapshot's own, removed once read


@dataclass(frozen=True)
class SnapshotSources:
    """Where the writer reads each subgroup: ``memory``, the views of those held in memory (the update
    is held back until the writer has them), ``on_tier``, a tier's copy of the others."""
    memory: Dict[int, StateViews]
    on_tier: Dict[int, TierCopy]


class KeptStaging:
    """Staging buffers kept from one save's snapshot to the next (of one size: the largest subgroup's state)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: List[torch.Tensor] = []

    def take(self, nbytes: int) -> Tuple[torch.Tensor, bool]:
        """A buffer of ``nbytes``, and whether it is new (none of that size kept)."""
        with self._lock:
            if self._buffers and self._buffers[-1].numel() == nbytes:
                return self._buffers.pop(), False
        return aligned_empty(nbytes), True

    def keep(self, buffers: List[torch.Tensor]) -> None:
        if not buffers:
            return
        with self._lock:
            # another size (a new partition) replaces what was kept: the old ones would never be taken again
            self._buffers = [b for b in self._buffers if b.numel() == buffers[0].numel()] + buffers

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._buffers)


class StateSnapshot:
    def __init__(self, subgroups: List[Subgroup], steps_done: int, sources: SnapshotSources,
                 update_order: List[int], staging_bytes: Optional[int], kept: Optional[KeptStaging] = None):
        self.subgroups = subgroups
        self.codecs = subgroups[0].codecs  # the stored formats (state_formats), every subgroup's
        self.numel = subgroups[-1].end
        self.shard_params = None  # where the shard's params lie (8-bit moments' blocks; set for a file's writer)
        self.steps_done = steps_done
        memory, on_tier = sources.memory, sources.on_tier
        self.memory, self.on_tier = memory, on_tier
        # The writer's order: what the next update will change in place first, then the files.
        self.order = [i for i in update_order if i in memory] + sorted(on_tier)
        self.largest = slot_subgroup(subgroups)
        self._cond = threading.Condition()
        self._progress = {i: PENDING for i in memory}
        self._staged: Dict[int, StateViews] = {}
        self._spare: List[StateViews] = []
        if staging_bytes is None:  # none configured (OffloadConfig.save_staging_bytes)
            staging_bytes = DEFAULT_SAVE_STAGING
        self._staging_free = staging_bytes // self.largest.state_bytes  # buffers still allowed
        self._staging_made = 0
        self._kept = kept if kept is not None else KeptStaging()
        self._made: List[torch.Tensor] = []  # every staging buffer taken, kept again at the release
        self.staging_new = 0  # staging buffers made for this snapshot (not kept from the last)
        self.kept_bytes = self._kept.nbytes  # the staging kept for it (made at an earlier save or at start-up)
        self.paused_s = 0.0  # what before_update cost the update
        self.writer_waits = 0  # times an update waited for the writer (not for a copy): none within the staging
        self.cancelled = threading.Event()
        self.released = threading.Event()
        self._writer_started = False
        self._device_ready = _queued_work_event(memory)  # what the writer's device reads start after

    # -- the update's side ----------------------------------------------------------------------
    def before_update(self, i: int) -> None:
        """Return once the update may change subgroup ``i`` in place."""
        if i not in self._progress or self.released.is_set():
            return
        started = time.perf_counter()
        self._copy_aside(i, wait=True, copy=torch.Tensor.copy_)  # the training thread's own: nothing to stay out of
        self.paused_s += time.perf_counter() - started

    def _copy_aside(self, i: int, wait: bool, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> bool:
        """Subgroup ``i`` into a staging buffer unless the writer has it or is done with it; where no
        staging is left, wait for the writer (``wait``) or return False. ``copy(dst, src)``: the writer's thread
        goes through ``copy_to_host``, which keeps its device reads from holding the training thread back."""
        with self._cond:
            while self._progress[i] not in (DONE, STAGED):
                if self._progress[i] == PENDING and (self._spare or self._staging_free > 0):
                    self._progress[i] = STAGING
                    stage = self._spare.pop() if self._spare else self._new_staging_buffer()
                    break
                if self._progress[i] == PENDING and not wait:
                    return False
                if self._progress[i] != STAGING:  # held back by the writer itself, not by a copy under way
                    self.writer_waits += 1
                self._cond.wait()
            else:
                return True
        sg = self.subgroups[i]
        for dst, src in zip(stage.narrow(sg), self.memory[i].narrow(sg)):
            copy(dst, src)
        with self._cond:
            self._staged[i] = stage
            self._progress[i] = STAGED
            self._cond.notify_all()
        return True

    def _new_staging_buffer(self) -> StateViews:
        self._staging_free -= 1
        self._staging_made += 1
        buffer, new = self._kept.take(self.largest.state_bytes)
        self.staging_new += new
        self._made.append(buffer)
        return StateViews.over(buffer, self.largest)

    @property
    def staging_bytes(self) -> int:
        """The staging buffers allowed in all (taken only as needed)."""
        with self._cond:
            return (self._staging_free + self._staging_made) * self.largest.state_bytes

    def allow_staging(self, nbytes: int) -> None:
        """Raise the staging allowed to ``nbytes`` in all (a paced writer takes several steps)."""
        with self._cond:
            self._staging_free = max(self._staging_free, nbytes // self.largest.state_bytes - self._staging_made)

    # -- the writer's side ----------------------------------------------------------------------
    @contextmanager
    def device_reads(self) -> Iterator[None]:
        """Where a writer's thread reads the device-held state: on a stream of its own that starts after
        the snapshot's moment, synchronized on leaving (whoever changes the state next finds the reads
        done). Without state on a GPU: nothing."""
        if self._device_ready is None:
            yield
            return
        stream = torch.cuda.Stream(self._device_ready.device)
        stream.wait_event(self._device_ready.event)
        with torch.cuda.stream(stream):
            try:
                yield
            finally:
                stream.synchronize()

    def take(self, i: int) -> StateViews:
        """Memory subgroup ``i``'s state for the writer: its staged copy, or the live buffer, which
        the update leaves alone until ``done_with(i)``."""
        with self._cond:
            while self._progress[i] == STAGING:
                self._cond.wait()
            if self._progress[i] == STAGED:
                return self._staged[i]
            self._progress[i] = WRITING
            return self.memory[i]

    def stage_ahead(self) -> int:
        """The writer copies the subgroups held in memory aside now, in the update's order, while the
        staging allows (a writer paced over several steps: the updates then find their copies made);
        returns the bytes copied."""
        copied = 0
        for i in self.order:
            if i not in self._progress:
                continue  # read from a tier file: the updates never change it
            self.check_cancelled()
            with self._cond:
                pending = self._progress[i] == PENDING
            if not self._copy_aside(i, wait=False, copy=copy_to_host):
                break
            copied += self.subgroups[i].state_bytes if pending else 0
        return copied

    def done_with(self, i: int) -> None:
        if i in self.on_tier:
            copy = self.on_tier.pop(i)
            if copy.linked:
                copy.tier.forget(copy.key)
            return
        with self._cond:
            stage = self._staged.pop(i, None)
            if stage is not None:
                self._spare.append(stage)
            self._progress[i] = DONE
            self._cond.notify_all()

    def writer_starts(self) -> None:
        with self._cond:
            self._writer_started = True

    def cancel(self) -> None:
        """Give the snapshot up: its writer stops at its next check and releases it (or, where no
        writer has started, it is released now); returns once released."""
        with self._cond:
            self.cancelled.set()
            orphan = not self._writer_started
        if orphan:
            self.release()
        self.released.wait()

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise SnapshotCancelled("the background checkpoint write was cancelled")

    def release(self) -> None:
        """The writer has finished (or failed): nothing is held back any more; links and staging go."""
        for copy in self.on_tier.values():
            if copy.linked:
                copy.tier.forget(copy.key)
        self.on_tier = {}
        with self._cond:
            self._progress = {i: DONE for i in self._progress}
            self._staged.clear()
            self._spare.clear()
            made, self._made = self._made, []
            self._cond.notify_all()
        self._kept.keep(made)
        self.released.set()


@dataclass(frozen=True)
class _DeviceMoment:
    device: torch.device
    event: "torch.cuda.Event"


def _queued_work_event(memory: Dict[int, StateViews]) -> Optional[_DeviceMoment]:
    """An event after the work the current stream has queued, where some of ``memory`` is on a GPU."""
    device = next((v.buf.device for v in memory.values() if v.buf.is_cuda), None)
    if device is None:
        return None
    reserve_pinned_pair(device)  # before the event: the writer's copies then find their pinned pair made
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return _DeviceMoment(device, event)
