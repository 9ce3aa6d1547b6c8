"""Launch pretrain_gpt.py under torchrun on CPU and read back its --loss-log.

Reused by the offload tests: ``run_pretrain(tmp_path, extra_args)`` -> list of loss records.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain_gpt.py"
LAUNCH_MARKER = "MLP_OFFLOAD_TEST_LAUNCH"  # environment variable: which launch a process belongs to
LAUNCH_LOG = "MLP_OFFLOAD_TEST_LAUNCH_LOG"  # tests/conftest.py: one line per launch (test, seconds)
SURVIVOR_GRACE_S = 2.0
STACKS_OF = "--- threads of"
STACK_DUMP_WAIT_S = 1.0  # a hung launch's ranks print their stacks, one after another, before they are killed

# The layouts of 2 ranks the end-to-end tests train with (test_pretrain_cpu, test_offload_cpu).
LAYOUTS = {
    "dp2": ["--num-workers", "2"],  # Megatron-LM's default (the tiny model's flags say 0)
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}

# A tiny model every TP/PP test can split: 4 layers, 4 heads, 8 micro-batches per step at DP=1.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--bf16", "--device", "cpu", "--seed", "1234",
    # Not Megatron-LM's defaults: the offload tests compare against megatron-core's distributed
    # optimizer, and every iteration's line is printed; loading stays in the rank.
    "--use-distributed-optimizer", "--log-interval", "1", "--num-workers", "0",
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
        returncode, output = run_and_clean_up(cmd, run_env, timeout, tmp_path / f"{Path(loss_log).stem}.out")
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


def run_and_clean_up(cmd, env, timeout: float, out_path: Path):
    """Run ``cmd`` with its output in a file; afterwards no process it started may be alive."""
    return run_group([(cmd, env)], timeout, out_path)


def run_group(commands: Sequence[Tuple[Sequence[str], Dict[str, str]]], timeout: float, out_path: Path):
    """Run (command, environment) pairs at once, as the nodes or srun tasks of one job, their output
    in one file; returns the first non-zero exit status (else 0) and the output. Afterwards no
    process any of them started may be alive.

    Every process of the launch inherits a marker in its environment, so it is found even when
    orphaned: torchrun puts each rank in a session of its own, and a killed rank's children are
    reparented to init. Survivors are killed, then reported as a failure."""
    launch_id = uuid.uuid4().hex
    started, cpu_before = time.monotonic(), _children_cpu_s()
    shown = "\n".join(" ".join(map(str, cmd)) for cmd, _ in commands)
    with open(out_path, "w") as out:
        procs = [subprocess.Popen(list(cmd), cwd=REPO, env={**env, LAUNCH_MARKER: launch_id}, stdout=out,
                                  stderr=subprocess.STDOUT) for cmd, env in commands]
        returncodes = None  # stays None on a timeout
        deadline = time.monotonic() + timeout
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                returncodes = [proc.wait(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
        finally:
            if returncodes is None:
                _dump_rank_stacks(launch_id, out)
            survivors = [] if returncodes is None else _survivors(launch_id)
            for pid, _ in processes_of_launch(launch_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
    _log_launch(time.monotonic() - started, _children_cpu_s() - cpu_before)
    output = out_path.read_text()
    if returncodes is None:
        stacks = _stack_dumps(output)
        raise PretrainFailed(f"timed out after {timeout} s: {shown}\n{output[-6000:]}\n"
                             f"every rank's threads when it timed out (SIGQUIT):\n{stacks[-12000:]}")
    returncode = next((code for code in returncodes if code), 0)
    if survivors:
        listing = "\n".join(f"  pid {pid}: {cmdline}" for pid, cmdline in survivors)
        raise PretrainFailed(f"{len(survivors)} process(es) outlived the run (exit {returncode}), "
                             f"killed now:\n{listing}\n{shown}\n{output[-3000:]}")
    return returncode, output


def _dump_rank_stacks(launch_id: str, out) -> None:
    """A hung launch: its ranks (and their forked writers) print every thread's stack before they
    are killed (SIGQUIT, megatron/training/runtime/signals.py). torchrun and spawned helpers would
    just die of SIGQUIT, so only processes running pretrain_gpt.py itself get it."""
    for pid, cmdline in processes_of_launch(launch_id):
        if str(PRETRAIN) in cmdline and "torch.distributed.run" not in cmdline:
            out.write(f"{STACKS_OF} pid {pid} (parent {_parent_pid(pid)}):\n")
            out.flush()  # the processes write to the same open file, after this line
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)
            time.sleep(STACK_DUMP_WAIT_S)  # one at a time: their lines would interleave


def _parent_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[1]
    except OSError:
        return "?"


def _stack_dumps(output: str) -> str:
    """The faulthandler dumps in ``output``: from each "Thread 0x..." / "Current thread" header on."""
    lines, keep = [], False
    for line in output.splitlines():
        if line.startswith((STACKS_OF, "Thread 0x", "Current thread 0x")):
            keep = True
        elif keep and not line.startswith("  "):
            keep = False
        if keep:
            lines.append(line)
    return "\n".join(lines) or "(none printed)"


def _children_cpu_s() -> float:
    """CPU seconds of the finished child processes (and theirs): a launch's cost that other load
    on the machine does not inflate the way it does the wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _log_launch(wall_s: float, cpu_s: float) -> None:
    if os.environ.get(LAUNCH_LOG):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").replace("\t", " ")
        with open(os.environ[LAUNCH_LOG], "a") as f:
            f.write(f"{test}\t{wall_s:.2f}\t{cpu_s:.2f}\n")


def processes_of_launch(launch_id: str) -> List[Tuple[int, str]]:
    """(pid, command line) of the live processes whose environment has LAUNCH_MARKER=launch_id."""
    marker = f"{LAUNCH_MARKER}={launch_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):  # a zombie's is empty
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:300]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(entry.name), cmdline))
    return found


def _survivors(launch_id: str) -> List[Tuple[int, str]]:
    """The processes of a finished launch still alive after SURVIVOR_GRACE_S: a killed rank's
    children need a moment (PDEATHSIG, then the resource tracker sees its pipe close)."""
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    while (alive := processes_of_launch(launch_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def losses(records: List[Dict]) -> List[float]:
    return [r["loss"] for r in records]
