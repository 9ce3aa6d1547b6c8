"""User errors: one line per job, naming the flag or path and the numbers; tracebacks only for bugs.

``UserError`` is what our layer raises for a bad flag, path, budget, placement, space or checkpoint;
the engine's own start-up and data errors count as user errors too. ``reported_once()`` wraps a
rank's whole run: on a user error it prints ``error: <message>`` once for the whole job (the first
rank to claim the job-wide slot in torch.distributed's store prints, the others stay quiet) and
exits with status 2. ``MLP_OFFLOAD_TRACEBACK=1`` re-raises instead, with the full traceback.

The engine names its config fields in errors (``host_budget_bytes=4194304``, ``paths['nvme']``); the
flags' table (``offload.options``) registers ``in_flags`` here (``translate_messages_with``), which
rewrites such a message in the flags a user of ``pretrain_gpt.py`` typed, values in the flags' units.
The flags' value types (``positive_int``, ``fraction``, ...) live in ``flag_types``, re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import sys

from mlp_offload import (HostMemoryError, OffloadConfigError, OffloadStateError, PlacementError, TierDataError,
                         TierIOError, TierPathError)
from mlp_offload.checkpoint import CheckpointDataError, CheckpointSaveError
from mlp_offload import NamespaceInUseError

from megatron.training.flag_types import (finite, fraction, non_negative_float, non_negative_int,  # noqa: F401
                                          positive_float, positive_int)

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
        report(_translated(str(err)))  # the engine names its config fields; the user typed flags
        raise SystemExit(EXIT_USER_ERROR) from None
    except Exception as err:  # a failure a layer above can name the flag for (``explain_failures_with``)
        line = next((said for said in (hint(err) for hint in _FAILURE_HINTS) if said), None)
        if line is None or os.environ.get("MLP_OFFLOAD_TRACEBACK"):
            raise
        report(line)
        raise SystemExit(EXIT_USER_ERROR) from None


_FAILURE_HINTS = []  # (exception) -> one line naming the flag that avoids it, or None
_TRANSLATORS = []  # (message) -> the message in the flags the user typed


def translate_messages_with(translate) -> None:
    """``translate(message)``: a user error's message in the words the user typed (the flags' table
    registers its ``in_flags``, so that this bottom layer imports no layer above it)."""
    if translate not in _TRANSLATORS:
        _TRANSLATORS.append(translate)


def _translated(message: str) -> str:
    for translate in _TRANSLATORS:
        message = translate(message)
    return message


def explain_failures_with(hint) -> None:
    """``hint(err)``: the line for a failure that is no user error as raised (NCCL's, say) where the layer
    that registers it knows which flag avoids it; None where it does not. Registered once per process."""
    if hint not in _FAILURE_HINTS:
        _FAILURE_HINTS.append(hint)
