"""One call on a thread of its own, beside the caller's work, on the caller's GPU: a checkpoint's
offloaded state written while torch_dist writes, or read while torch_dist reads."""

from __future__ import annotations

import threading
import time

import torch


class ConcurrentCall:
    """``fn(*args)`` started now on a thread; ``result()``: what it returned and its seconds, or
    what it raised, re-raised on the caller's thread."""

    def __init__(self, fn, *args):
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._outcome: tuple = (None, 0.0, None)
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="mlp-offload-beside", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        started = time.perf_counter()
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            self._outcome = (fn(*args), time.perf_counter() - started, None)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread, which decides
            self._outcome = (None, 0.0, err)

    def result(self):
        self._thread.join()
        value, seconds, err = self._outcome
        if err is not None:
            raise err
        return value, seconds

    def wait_quietly(self) -> None:
        self._thread.join()
