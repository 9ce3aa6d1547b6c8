"""Host-held subgroups that the device updates, copied into device buffers before their step.

A streamed device update moves each subgroup's state in and out over the host link while the
forward and backward before it leave that link idle. ``ReadAhead`` copies the first subgroups of the
next step's device order in during that time (into buffers of its own, in the stored dtypes), so that
their update waits only for its Adam and its copies out. The host memory stays the state's home: a
read-ahead copy is taken after the subgroup's last write to it (``written``) and is dropped where the
state may change outside a step (a checkpoint load, a move between tiers). Nothing of the numbers
changes: the update reads the same bytes, only earlier.

Copies run on the device update's copy-in stream; a buffer is reused only after the copy out of the
update that read it (``returned``). On a CPU run the streams are stand-ins and the copies run at once
(the CPU twin the tests exercise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..config import OffloadConfigError
from ..state_formats import StateCodec, state_bytes
from .device_side import Streams


@dataclass
class PreRead:
    """A subgroup's state read ahead: device tensors in the stored dtypes, the event after which
    they hold it, and the buffer to give back."""
    tensors: List[torch.Tensor]
    arrived: object
    slot: int


class ReadAhead:
    def __init__(self, streams: Streams, codecs: Sequence[StateCodec], device, slots: int, largest: int,
                 largest_blocks: Optional[int] = None):
        self.streams = streams
        self.largest = largest
        self._buffers = [[c.empty(largest, device, blocks=largest_blocks) for c in codecs] for _ in range(slots)]
        self._free_after: List[object] = [None] * slots  # per buffer: the copy out of its last update
        self._released: List[int] = list(range(slots))  # buffers in the order their last copy out was queued
        self._held: Dict[int, Tuple[int, object, List[int]]] = {}  # subgroup -> (buffer, arrival, sizes)

    @property
    def slots(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for buffers in self._buffers for t in buffers)

    @property
    def held(self) -> List[int]:
        return list(self._held)

    def _free_slots(self) -> List[int]:
        """Buffers holding no copy read ahead, the one whose last copy out was queued first, first."""
        in_use = {slot for slot, _, _ in self._held.values()}
        return [k for k in self._released if k not in in_use]

    def _copy_in(self, slot: int, host: Sequence[torch.Tensor], written) -> object:
        s = self.streams
        if any(h.numel() > b.numel() for h, b in zip(host, self._buffers[slot])):
            raise ValueError(f"{host[0].numel()} elements are more than a read-ahead buffer's {self.largest}")
        self._released.remove(slot)
        self._released.append(slot)  # (until it is given back: last in line)
        with s.on(s.copy_in):
            s.wait(s.copy_in, self._free_after[slot])
            s.wait(s.copy_in, written)
            for dev, src in zip(self._buffers[slot], host):
                dev[:src.numel()].copy_(src, non_blocking=True)
            return s.record(s.copy_in)

    def issue(self, picks: Sequence[Tuple[int, Sequence[torch.Tensor], object]]) -> None:
        """Copy in ``(subgroup, host tensors, written)`` in order while buffers are free; ``written``
        is the event of the last copy that wrote those host tensors (None: nothing pending)."""
        for (i, host, written), slot in zip([p for p in picks if p[0] not in self._held], self._free_slots()):
            self._held[i] = (slot, self._copy_in(slot, host, written), [h.numel() for h in host])

    def stream_in(self, host: Sequence[torch.Tensor], written=None) -> Optional[PreRead]:
        """A subgroup not read ahead, copied in now through a free buffer (the buffers are then the
        streamed update's ring: a copy in waits only for the copy out that last used its buffer, not
        for every copy out queued before it); None where every buffer holds a copy read ahead."""
        free = self._free_slots()
        if not free:
            return None
        sizes = [h.numel() for h in host]
        return PreRead([t[:n] for t, n in zip(self._buffers[free[0]], sizes)], self._copy_in(free[0], host, written),
                       free[0])

    def take(self, i: int) -> Optional[PreRead]:
        """Subgroup ``i``'s copy, where one was read ahead (then no longer held)."""
        entry = self._held.pop(i, None)
        if entry is None:
            return None
        slot, arrived, sizes = entry
        return PreRead([t[:n] for t, n in zip(self._buffers[slot], sizes)], arrived, slot)

    def returned(self, pre: PreRead, copied_out) -> None:
        """The update that read ``pre`` queued its copy out: the buffer is free after ``copied_out``."""
        self._free_after[pre.slot] = copied_out
        self._released.remove(pre.slot)
        self._released.append(pre.slot)

    def keep_only(self, wanted: Sequence[int]) -> None:
        """Forget copies of subgroups not in ``wanted`` (the step no longer updates them on the
        device from host memory)."""
        wanted = set(wanted)
        for i in [i for i in self._held if i not in wanted]:
            self.drop(i)

    def drop(self, i: Optional[int] = None) -> None:
        """Forget subgroup ``i``'s copy (all, without ``i``): its host state may change. A copy still
        running into the buffer finishes before the buffer's next copy (one stream)."""
        for k in ([i] if i is not None else list(self._held)):
            entry = self._held.pop(k, None)
            if entry is not None:
                slot, arrived, _ = entry
                self._free_after[slot] = arrived


def read_ahead_for(config, device_update, codecs: Sequence[StateCodec], largest: int,
                   count: int, largest_blocks: Optional[int] = None) -> Optional[ReadAhead]:
    """The engine's read-ahead: as many whole subgroups of its largest size as
    ``config.device_read_ahead_bytes`` holds, at most its ``count`` subgroups; None without a device
    update or without the bytes."""
    if device_update is None or not config.device_read_ahead_bytes:
        return None
    per_subgroup = state_bytes(codecs, largest, largest_blocks)  # one subgroup's stored state, whole
    slots = config.device_read_ahead_bytes // per_subgroup
    if slots < 1:
        raise OffloadConfigError(
            f"device read-ahead device_read_ahead_bytes={config.device_read_ahead_bytes} holds no subgroup: one "
            f"subgroup's stored state takes {per_subgroup / 2**30:.3f} GiB ({largest} elements); give 0 or at least that")
    return ReadAhead(device_update.streams, codecs, device_update.device, min(slots, count), largest, largest_blocks)
