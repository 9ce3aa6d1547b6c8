"""Launch pretrain_gpt.py under torchrun on CPU and read back its --loss-log.

Reused by the offload tests: ``run_pretrain(tmp_path, extra_args)`` -> list of loss records.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain_gpt.py"

# A tiny model every TP/PP test can split: 4 layers, 4 heads, 8 micro-batches per step at DP=1.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--bf16", "--device", "cpu", "--seed", "1234",
]


class PretrainFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_loss_log(path: os.PathLike) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_pretrain(tmp_path: os.PathLike, extra_args: Sequence[str], nproc: int = 2, *,
                 train_iters: int = 10, loss_log: Optional[os.PathLike] = None,
                 model_args: Sequence[str] = TINY_MODEL, mock_data: bool = True,
                 timeout: float = 240, env: Optional[Dict[str, str]] = None,
                 expect_success: bool = True) -> List[Dict]:
    """Run ``pretrain_gpt.py`` with ``nproc`` CPU processes; return the loss-log records.

    ``loss_log`` defaults to a fresh file under ``tmp_path``; pass the same path to a resumed
    run to get the whole history in one file. On failure the combined output is in the message.
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if loss_log is None:
        loss_log = tmp_path / f"loss-{len(list(tmp_path.glob('loss-*.jsonl')))}.jsonl"
    run_env = pretrain_env(env)
    for _attempt in range(3):
        # free_port() can lose a race with another process before torchrun binds it: retry then.
        cmd = pretrain_command(extra_args, nproc, train_iters, loss_log, model_args, mock_data)
        returncode, output = _run_in_own_session(cmd, run_env, timeout, tmp_path / f"{Path(loss_log).stem}.out")
        if not (returncode != 0 and "EADDRINUSE" in output and "server socket has failed" in output):
            break
    if expect_success and returncode != 0:
        raise PretrainFailed(f"exit {returncode}: {' '.join(cmd)}\n{output[-6000:]}")
    if not expect_success:
        return [{"returncode": returncode, "output": output}]
    return read_loss_log(loss_log)


def pretrain_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    run_env = dict(os.environ)
    run_env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), run_env.get("PYTHONPATH")]))})
    run_env.update(env or {})
    return run_env


def pretrain_command(extra_args: Sequence[str], nproc: int, train_iters: int, loss_log: os.PathLike,
                     model_args: Sequence[str] = TINY_MODEL, mock_data: bool = True) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(PRETRAIN),
            *model_args, "--train-iters", str(train_iters), "--loss-log", str(loss_log),
            *(["--mock-data"] if mock_data else []), *extra_args]


def _run_in_own_session(cmd, env, timeout: float, out_path: Path):
    """Run ``cmd`` in a new session with its output in a file; afterwards kill what is left of the
    session. A rank killed by a fault test orphans helper processes (megatron-core's checkpoint
    writer starts a multiprocessing Manager): they must neither outlive the test nor hold a pipe."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    output = out_path.read_text()
    if returncode is None:
        raise PretrainFailed(f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-6000:]}")
    return returncode, output


def losses(records: List[Dict]) -> List[float]:
    return [r["loss"] for r in records]
