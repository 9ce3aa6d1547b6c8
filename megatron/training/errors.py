"""User errors: one line per job, naming the flag or path and the numbers; tracebacks only for bugs.

``UserError`` is what our layer raises for a bad flag, path, budget, placement, space or checkpoint;
the engine's own start-up and data errors count as user errors too. ``reported_once()`` wraps a
rank's whole run: on a user error it prints ``error: <message>`` once for the whole job (the first
rank to claim the job-wide slot in torch.distributed's store prints, the others stay quiet) and
exits with status 2. ``MLP_OFFLOAD_TRACEBACK=1`` re-raises instead, with the full traceback.

The engine names its config fields in errors (``host_budget_bytes=4194304``, ``paths['nvme']``);
``in_flags`` rewrites such a message in the flags a user of ``pretrain_gpt.py`` typed, values in the
flags' units. The flags' value types (``positive_int``, ``fraction``, ...) refuse a bad value with a
message argparse puts after the flag's name (``argument --lr: must be >= 0, got -1``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys

from mlp_offload import (HostMemoryError, OffloadConfigError, OffloadStateError, PlacementError, TierDataError,
                         TierIOError, TierPathError)
from mlp_offload.checkpoint import CheckpointDataError, CheckpointSaveError
from mlp_offload import DEVICE_MEMORY, HOST_MEMORY, GiB, MiB, NamespaceInUseError

EXIT_USER_ERROR = 2


class UserError(RuntimeError):
    """Bad input or environment: the message says which flag or path, and what to change."""


USER_ERRORS = (UserError, OffloadConfigError, PlacementError, TierPathError, TierIOError, TierDataError,
               HostMemoryError, NamespaceInUseError, CheckpointDataError, CheckpointSaveError, OffloadStateError)


REPORTED_KEY = "mlp_offload/user_error_reported"


def _agent_store():
    """torchrun's own store (its agent hosts it before any rank starts), or None outside torchrun.

    Ranks reach it before the process group exists, so a flag error raised on every rank still
    prints once: without it rank 0 alone would print, and torchrun kills rank 0 as soon as a
    faster rank exits with the same error, before rank 0's line is out."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=10))


def _first_to_report() -> bool:
    """True for exactly one rank of the job: the first to ask (atomic add in the job's store)."""
    import torch

    try:
        if torch.distributed.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store().add(REPORTED_KEY, 1) == 1
        store = _agent_store()
        if store is not None:  # one key per restart: torchrun's store outlives a restarted worker group
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return store.add(f"{REPORTED_KEY}/{restart}", 1) == 1
    except Exception:  # no reachable store (its host is gone): say it here rather than not at all
        return True
    # srun's tasks without torchrun, before the process group: every rank runs the same checks on
    # the same flags and srun does not kill the others at the first exit, so rank 0 speaks for all.
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def report(message: str) -> None:
    if _first_to_report():
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def reported_once():
    try:
        yield
    except USER_ERRORS as err:
        if os.environ.get("MLP_OFFLOAD_TRACEBACK"):
            raise
        report(in_flags(str(err)))  # the engine names its config fields; the user typed flags
        raise SystemExit(EXIT_USER_ERROR) from None
    except Exception as err:  # a failure a layer above can name the flag for (``explain_failures_with``)
        line = next((said for said in (hint(err) for hint in _FAILURE_HINTS) if said), None)
        if line is None or os.environ.get("MLP_OFFLOAD_TRACEBACK"):
            raise
        report(line)
        raise SystemExit(EXIT_USER_ERROR) from None


_FAILURE_HINTS = []  # (exception) -> one line naming the flag that avoids it, or None


def explain_failures_with(hint) -> None:
    """``hint(err)``: the line for a failure that is no user error as raised (NCCL's, say) where the layer
    that registers it knows which flag avoids it; None where it does not. Registered once per process."""
    if hint not in _FAILURE_HINTS:
        _FAILURE_HINTS.append(hint)


# The flags a user types per memory tier kind (the one place they are spelled; args.offload declares
# them), and --offload-update's values with the engine's update_on each gives.
HOST_CACHE_FLAG = "--offload-host-cache-gb"
GPU_CACHE_FLAG = "--offload-gpu-cache-gb"
GPU_START_FLAG = "--offload-gpu-start-gb"
GPU_MARGIN_FLAG = "--offload-gpu-margin-gb"
UPDATE_ON_OF_FLAG = {"auto": "auto", "cpu": "cpu", "gpu": "device"}

# field -> (flag, bytes per flag unit); flags that switch a feature off map to the field they clear
FLAG_OF_FIELD = {
    HOST_MEMORY.budget_field: (HOST_CACHE_FLAG, GiB),
    DEVICE_MEMORY.budget_field: (GPU_CACHE_FLAG, GiB),
    "gpu_budget_auto": (f"{GPU_CACHE_FLAG} auto", 1),
    "gpu_margin_bytes": (GPU_MARGIN_FLAG, GiB),
    "device_read_ahead_bytes": ("--offload-read-ahead-gb", GiB),
    "update_on": ("--offload-update", 1),
    "cpu_share_subgroups": ("--offload-cpu-share", 1),
    "defer_device_wait": ("--offload-overlap-forward", 1),
    "subgroup_size": ("--offload-subgroup-size", 1),
    "prefetch_depth": ("--offload-prefetch-depth", 1),
    "tokens_per_tier": ("--offload-tokens-per-tier", 1),
    "io_block_bytes": ("--offload-io-block-mb", MiB),
    "io_threads": ("--offload-io-threads", 1),
    "probe_bytes": ("--offload-probe-mb", MiB),
    "adam_kernel": ("--offload-adam-kernel", 1),
    "use_odirect": ("--offload-no-odirect", 1),
    "verify_checksums": ("--offload-no-checksums", 1),
    "cache_alternating": ("--offload-no-cache", 1),
    "save_staging_bytes": ("--offload-save-staging-gb", GiB),
    "param_remainders": ("--no-store-param-remainders", 1),
}
_FIELD = re.compile(r"\b(" + "|".join(FLAG_OF_FIELD) + r")\b(?:=(-?[0-9][0-9.e+]*))?")
_PATH = re.compile(r"paths\[['\"]([A-Za-z0-9_]+)['\"]\]")
_BANDWIDTHS = re.compile(r"\bbandwidths(?= '|:)")
_TOKEN_SCOPE = re.compile(r"token_scope\[['\"]([A-Za-z0-9_]+)['\"]\]")


def in_flags(message: str) -> str:
    """An engine message with config field names replaced by the flags that set them."""
    def field(match):
        flag, scale = FLAG_OF_FIELD[match.group(1)]
        if match.group(2) is None:
            return flag
        return f"{flag} {flag_figure(float(match.group(2)), scale)}"

    message = _PATH.sub(r"--offload-\1-path", message)
    message = _BANDWIDTHS.sub("--offload-bandwidths", message)
    message = _TOKEN_SCOPE.sub(r"--offload-token-scope \1", message)
    return _FIELD.sub(field, message)


def flag_figure(value: float, scale: int) -> str:
    """``value`` in a flag's unit of ``scale`` bytes, as the user typed it: the shortest figure of up to
    6 significant digits that the flag reads back as ``value`` (it keeps ``int(figure * scale)``:
    --offload-host-cache-gb 0.001 is 1073741 bytes, which ``:g`` shows as 0.000999999); else ``:g``."""
    if scale != 1 and value == int(value):
        for digits in range(1, 7):
            figure = f"{value / scale:.{digits}g}"
            if int(float(figure) * scale) == value:
                return figure
    return f"{value / scale:g}"


# value types of command-line flags
def finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value
