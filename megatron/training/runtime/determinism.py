"""``--deterministic-mode``: the same command gives the same bits, run after run and across a resume.

With Megatron-LM's meaning: torch's deterministic algorithms (an op without a deterministic kernel
stops the run in one line rather than differing silently), cuBLAS with a fixed workspace, one NCCL
algorithm for every reduction, megatron-core's deterministic code paths (``TransformerConfig.
deterministic_mode``: the embedding's lookup), and torch's SDPA limited to its kernels whose backward
is deterministic there (flash, memory-efficient, math; never cuDNN's). The update split between the
CPU and the GPU is held at its start-up choice (the steps' timings would move it; both sides give the
same bits, so this keeps the work, not only the result, repeatable).

Environment variables are set before CUDA and NCCL start, where the user has not set them; a value
the user set that breaks determinism is refused in one line.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megatron.training.errors import UserError

# cuBLAS picks its kernels per workspace; a fixed one makes them repeatable (CUDA's documented values).
CUBLAS_WORKSPACES = (":4096:8", ":16:8")
# NCCL's reduction order is fixed per algorithm; left to choose, it may change algorithm between calls.
NCCL_ALGOS = ("Ring", "Tree")


def apply(args) -> None:
    """Before the device and the process group exist: the environment and torch's switches."""
    if not getattr(args, "deterministic_mode", False):
        return
    from megatron.training.errors import explain_failures_with

    explain_failures_with(explain_nondeterministic_op)
    _set_env("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACES)
    _set_env("NCCL_ALGO", NCCL_ALGOS)
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # transformer-engine, where installed
    torch.use_deterministic_algorithms(True)
    # Filling every new tensor with NaN would cost minutes on the tiers' pinned buffers and changes no
    # result of a correct program (it exposes reads of unset memory, which the tests are for).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _set_env(name: str, allowed) -> None:
    value = os.environ.get(name)
    if value is None:
        os.environ[name] = allowed[0]
    elif value not in allowed:
        raise UserError(f"--deterministic-mode: {name}={value} is set; it needs one of {', '.join(allowed)} "
                        f"(or unset: {allowed[0]})")


def describe(args) -> str:
    """The start-up line of what the mode set (empty without it)."""
    if not getattr(args, "deterministic_mode", False):
        return ""
    return (f"> deterministic mode: torch deterministic algorithms, CUBLAS_WORKSPACE_CONFIG="
            f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, NCCL_ALGO={os.environ.get('NCCL_ALGO')}, "
            f"SDPA without cuDNN, the update split held at its start-up choice")


def sdpa_backends(deterministic: bool):
    """A context for one SDPA call: under the mode, the kernels with a deterministic backward."""
    if not deterministic or not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def explain_nondeterministic_op(err: BaseException):
    """torch's error for an op that has no deterministic kernel, as one line (None for other errors);
    registered with ``errors.explain_failures_with``."""
    text = str(err)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(" does not have")[0].strip().splitlines()[-1]
    return (f"--deterministic-mode: {op} has no deterministic implementation on this device; run without "
            f"--deterministic-mode (a resume is still checked against the saved state's digest)")
