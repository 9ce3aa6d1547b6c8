"""Progress of long set-up and checkpoint steps: a line as each starts and one as it ends, with
its size in GB and rate in GB/s, so a job that seems stuck shows what it is moving and how fast."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Optional

GB = 1e9


def gb_and_rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / GB:.3f} GB in {seconds:.1f} s ({nbytes / GB / max(seconds, 1e-9):.2f} GB/s)"


class Step:
    """What a step moved, told when known (often only at its end)."""

    def __init__(self):
        self.nbytes: Optional[float] = None


@contextmanager
def reported_step(what: str, say: Callable[[str], None], size_bytes: Optional[float] = None):
    """``say`` a line at the start (with the size when known) and one at the end with size and rate."""
    step = Step()
    step.nbytes = size_bytes
    size = f" ({size_bytes / GB:.3f} GB)" if size_bytes else ""
    say(f"{what}{size} ...")
    started = time.perf_counter()
    yield step
    seconds = time.perf_counter() - started
    moved = gb_and_rate(step.nbytes, seconds) if step.nbytes is not None else f"in {seconds:.1f} s"
    say(f"{what}: done, {moved}")


def directory_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # removed meanwhile (a temporary file)
                pass
    return total
