"""Per-step telemetry: where the update's time went, what each tier moved, and the prediction."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List

from ..tiers.files import OpResult


@dataclass
class TierTraffic:
    read_bytes: int = 0
    write_bytes: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    token_wait_s: float = 0.0

    @property
    def read_gbps(self) -> float:
        return self.read_bytes / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    @property
    def write_gbps(self) -> float:
        return self.write_bytes / self.write_busy_s / 1e9 if self.write_busy_s else 0.0


class TrafficCounters:
    """Thread-safe running totals, fed by I/O completions; ``take()`` returns and resets them."""

    def __init__(self, tiers: List[str]):
        self._lock = threading.Lock()
        self._tiers = list(tiers)
        self._current = {t: TierTraffic() for t in tiers}

    def add(self, tier: str, kind: str, result: OpResult) -> None:
        with self._lock:
            c = self._current[tier]
            c.token_wait_s += result.token_wait_s
            if kind == "read":
                c.read_bytes += result.nbytes
                c.read_busy_s += result.busy_s
            else:
                c.write_bytes += result.nbytes
                c.write_busy_s += result.busy_s

    def take(self) -> Dict[str, TierTraffic]:
        with self._lock:
            taken = self._current
            self._current = {t: TierTraffic() for t in self._tiers}
            return taken


@dataclass
class StepRecord:
    """One optimizer step. I/O totals cover what completed since the previous record, so reads
    prefetched during forward/backward and writes finished behind the caller are counted too."""

    step: int
    skipped: bool = False
    update_s: float = 0.0
    read_wait_s: float = 0.0  # update blocked waiting for state to arrive
    convert_s: float = 0.0
    adam_s: float = 0.0
    callback_s: float = 0.0
    cache_hits: int = 0
    streamed: int = 0
    resident: int = 0
    predicted_update_s: float = 0.0
    device_s: float = 0.0  # queueing device updates and waiting for their copies
    cpu_updated: int = 0  # subgroups updated by the CPU / on the device this step
    device_updated: int = 0
    read_ahead: int = 0  # of the device's subgroups: those whose state was copied in before the step
    predicted_adam_s: float = 0.0  # the prediction's CPU share
    predicted_device_s: float = 0.0  # the prediction's device share
    # defer_device_wait: the previous step's device work, from queued to done (its update_s is then
    # only the host's share); 0 otherwise
    deferred_device_s: float = 0.0
    # defer_device_wait: the prediction's device share left queued past the step, and the share the
    # step itself waits for (the CPU's, the file tiers', streamed subgroups'); see predict_iteration
    predicted_deferred_s: float = 0.0
    predicted_deferred_in_hbm_s: float = 0.0
    predicted_serial_s: float = 0.0
    # Set by the caller: how long its stream waited for the previous step's deferred params, and
    # whether it settled this step's device work before going on (the next iteration then runs
    # without the update beside it: its compute alone can be measured)
    forward_wait_s: float = 0.0
    settled: bool = False
    tiers: Dict[str, TierTraffic] = field(default_factory=dict)

    def line(self) -> str:
        """One log fragment: measured vs predicted update, phases, per-tier bandwidth, cache."""
        parts = [
            f"update {self.update_s:.3f}s (pred {self.predicted_update_s:.3f}s)",
            f"adam {self.adam_s:.3f}s conv {self.convert_s:.3f}s wait {self.read_wait_s:.3f}s",
        ]
        if self.device_updated:
            parts.append(f"split cpu {self.cpu_updated}/device {self.device_updated} "
                         f"(cpu {self.adam_s + self.convert_s:.3f}s pred {self.predicted_adam_s:.3f}s, "
                         f"device waits {self.device_s:.3f}s pred {self.predicted_device_s:.3f}s)")
        if self.read_ahead:
            parts.append(f"read ahead {self.read_ahead}")
        for name, t in self.tiers.items():
            parts.append(
                f"{name} r {_size(t.read_bytes)}@{t.read_gbps:.2f}GB/s "
                f"w {_size(t.write_bytes)}@{t.write_gbps:.2f}GB/s"
            )
        if self.streamed:
            parts.append(f"cache hits {self.cache_hits}/{self.streamed}")
        return " | ".join(parts)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}{unit}"
    return f"{nbytes / 1e3:.1f}KB"
