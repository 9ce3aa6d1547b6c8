"""User errors: one line per job, naming the flag or path and the numbers; tracebacks only for bugs.

``UserError`` is what our layer raises for a bad flag, path, budget, placement, space or checkpoint;
the engine's own start-up and data errors count as user errors too. ``reported_once()`` wraps a
rank's whole run: on a user error it prints ``error: <message>`` once for the whole job (the first
rank to claim the job-wide slot in torch.distributed's store prints, the others stay quiet) and
exits with status 2. ``MLP_OFFLOAD_TRACEBACK=1`` re-raises instead, with the full traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys

from mlp_offload import (HostMemoryError, OffloadConfigError, OffloadStateError, PlacementError, TierDataError,
                         TierIOError, TierPathError)
from mlp_offload.checkpoint import CheckpointDataError, CheckpointSaveError
from mlp_offload.tiers.housekeeping import NamespaceInUseError

EXIT_USER_ERROR = 2


class UserError(RuntimeError):
    """Bad input or environment: the message says which flag or path, and what to change."""


USER_ERRORS = (UserError, OffloadConfigError, PlacementError, TierPathError, TierIOError, TierDataError,
               HostMemoryError, NamespaceInUseError, CheckpointDataError, CheckpointSaveError, OffloadStateError)


def _first_to_report() -> bool:
    """True for exactly one rank of the job: the first to ask (atomic add in the job's store)."""
    import torch

    if not torch.distributed.is_initialized():
        # Before the process group exists every rank runs the same checks on the same flags
        # (srun's tasks may not have a RANK yet: an error in deriving it from SLURM's variables).
        return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store().add("mlp_offload/user_error_reported", 1) == 1
    except Exception:  # no reachable store (its host is gone): say it here rather than not at all
        return True


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
        from megatron.training.offload_flags import in_flags

        report(in_flags(str(err)))  # the engine names its config fields; the user typed flags
        raise SystemExit(EXIT_USER_ERROR) from None
