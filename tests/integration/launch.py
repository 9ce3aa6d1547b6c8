"""Launch pretrain_gpt.py under torchrun on CPU and read back its --loss-log.

Reused by the offload tests: ``run_pretrain(tmp_path, extra_args)`` -> list of loss records.

``run_pretrain`` forks its ranks through ``warm_ranks`` (from a server that imported torch and
megatron-core once) rather than torchrun, unless the test asks for torchrun or
MLP_OFFLOAD_TEST_LAUNCHER=torchrun (the thorough profile sets it: every launch through torchrun).
The tests of signals, several nodes and srun, one crash case a day, the async-save kill and one run
of the conversion tool keep torchrun: what torchrun does around a rank, or a user's launch, is what
they check.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain_gpt.py"
WARM_RANKS = Path(__file__).resolve().parent / "warm_ranks.py"
LAUNCHER = "MLP_OFFLOAD_TEST_LAUNCHER"  # "torchrun": every launch through torchrun
WARM_SERVER_START_S = 300.0
LAUNCH_MARKER = "MLP_OFFLOAD_TEST_LAUNCH"  # environment variable: which launch a process belongs to
LAUNCH_LOG = "MLP_OFFLOAD_TEST_LAUNCH_LOG"  # tests/conftest.py: one line per launch (test, seconds)
SURVIVOR_GRACE_S = 2.0
# torchrun's own report of a failed rank: its traceback (indented frames only) ending in
# ChildFailedError, then its summary between two rules (the failures, the root cause).
TORCHRUN_REPORT = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)*"
                             r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:.*\n"
                             r"=+\n(?:.*\n)*?=+$", re.M)
STACKS_OF = "--- threads of"
STACK_DUMP_WAIT_S = 1.0  # a hung launch's ranks print their stacks, one after another, before they are killed

# The layouts of 2 ranks the end-to-end tests train with (test_pretrain_cpu, test_offload_cpu).
LAYOUTS = {
    "dp2": ["--num-workers", "2"],  # Megatron-LM's default (the tiny model's flags say 0)
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}

# A tiny model every TP/PP test can split: 4 layers, 4 heads, 4 micro-batches per step at DP=1.
# Sequences of 32 tokens: a step's time on CPU goes mostly to bf16 matmuls (no native bf16 on
# CI's CPUs), in proportion to the tokens; 64 took 1.6x as long and proved nothing more.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--bf16", "--device", "cpu", "--seed", "1234",
    # Not Megatron-LM's defaults: the offload tests compare against megatron-core's distributed
    # optimizer, and every iteration's line is printed; loading stays in the rank.
    "--use-distributed-optimizer", "--log-interval", "1", "--num-workers", "0",
]
TINY_SEQ = int(TINY_MODEL[TINY_MODEL.index("--seq-length") + 1])


class PretrainFailed(AssertionError):
    pass


# Test launches' rendezvous ports: above the job ports megatron/training/runtime/slurm_env.job_port gives (not
# imported: it loads torch; test_srun_without_torchrun checks the bound), below the kernel's ephemeral range, which
# every outgoing connection (gloo's among them) draws from: a port found free here is not taken by another process
# before the launch binds it. Each pytest-xdist worker has its own share.
TEST_PORTS = (30000, 32768)


def free_port() -> int:
    lo, hi = _port_share()
    if lo < hi:
        for port in random.sample(range(lo, hi), min(200, hi - lo)):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no share outside the ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_share() -> Tuple[int, int]:
    """This worker's part of TEST_PORTS, cut where the kernel's ephemeral range begins."""
    lo, hi = TEST_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 0, 0
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    size = max(0, hi - lo) // max(1, workers)
    return lo + index * size, lo + (index + 1) * size


def read_loss_log(path: os.PathLike) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_pretrain(tmp_path: os.PathLike, extra_args: Sequence[str], nproc: int = 2, *,
                 train_iters: int = 10, loss_log: Optional[os.PathLike] = None,
                 model_args: Sequence[str] = TINY_MODEL, mock_data: bool = True,
                 timeout: float = 240, env: Optional[Dict[str, str]] = None,
                 expect_success: bool = True, torchrun: bool = False) -> List[Dict]:
    """Run ``pretrain_gpt.py`` with ``nproc`` CPU processes; return the loss-log records.

    ``loss_log`` defaults to a fresh file under ``tmp_path``; pass the same path to a resumed
    run to get the whole history in one file. On failure the combined output is in the message.
    ``torchrun``: launch through torchrun, not warm_ranks (see above): where the test is about
    what happens around a rank that dies.
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if loss_log is None:
        loss_log = tmp_path / f"loss-{len(list(tmp_path.glob('loss-*.jsonl')))}.jsonl"
    run_env = pretrain_env(env)
    warm = not torchrun
    for _attempt in range(3):
        # free_port() can lose a race with another process before torchrun binds it: retry then.
        cmd = pretrain_command(extra_args, nproc, train_iters, loss_log, model_args, mock_data, warm=warm)
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
                     model_args: Sequence[str] = TINY_MODEL, mock_data: bool = True, warm: bool = False,
                     script: os.PathLike = PRETRAIN) -> List[str]:
    """The command of a launch of ``script`` (pretrain_gpt.py or a test's variant of it): through
    warm_ranks where ``warm`` (and MLP_OFFLOAD_TEST_LAUNCHER is not torchrun), else torchrun."""
    args = [*model_args, "--train-iters", str(train_iters), "--loss-log", str(loss_log),
            *(["--mock-data"] if mock_data else []), *extra_args]
    return launch_command(args, nproc, warm=warm, script=script)


def launch_command(args: Sequence[str], nproc: int, *, warm: bool, script: os.PathLike = PRETRAIN) -> List[str]:
    """The command that runs ``script args`` as ``nproc`` ranks: warm or through torchrun (see above)."""
    if warm and os.environ.get(LAUNCHER, "warm") != "torchrun":
        server = warm_server()
        pid_file = os.path.join(server.directory, f"launch-{uuid.uuid4().hex}.pid")
        return [sys.executable, str(WARM_RANKS), "launch", server.socket, pid_file, str(nproc),
                str(free_port()), str(script), "--", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args]


def tool_module(name: str):
    """tools/NAME.py as a module: its checks and main() run in this process."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def run_conversion(tool_args: Sequence[str], out_path: Path, timeout: float = 300) -> Tuple[int, str]:
    """tools/convert_offload_checkpoint.py ``tool_args``: the tool's own checks and the arguments it
    gives pretrain_gpt.py (its plan_conversion), launched warm; (exit status, output). A refusal is
    the tool's SystemExit. The tool's own torchrun launch is test_checkpoint_crossing_cpu's."""
    nproc, args, message = tool_module("convert_offload_checkpoint").plan_conversion(list(tool_args))
    code, output = run_and_clean_up(launch_command(args, nproc, warm=True), pretrain_env(), timeout, out_path)
    return code, f"{message}\n{output}"


class WarmServer:
    """warm_ranks' server for this test process: started on first use, stopped at exit."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="mlp_offload_warm_")
        self.socket = os.path.join(self.directory, "server.sock")
        self.log = os.path.join(self.directory, "server.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(WARM_RANKS), "serve", self.socket], cwd=REPO,
                                         env=pretrain_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        ready = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(WARM_SERVER_START_S)
        if ready != ["ready\n"]:
            self.stop()
            raise PretrainFailed(f"warm_ranks server did not start: {open(self.log).read()[-3000:]}")
        atexit.register(self.stop)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


_warm_server: Optional[WarmServer] = None


def warm_server() -> WarmServer:
    global _warm_server
    if _warm_server is None or _warm_server.proc.poll() is not None:
        _warm_server = WarmServer()
    return _warm_server


def _warm_pid_file(cmd: Sequence[str]) -> Optional[str]:
    """The pid file of a warm_ranks launch command (its leader's pid, then the ranks' CPU seconds)."""
    return str(cmd[4]) if len(cmd) > 4 and str(cmd[1]) == str(WARM_RANKS) and cmd[2] == "launch" else None


def _read_pid_file(path: Optional[str]) -> Tuple[Optional[int], float]:
    try:
        lines = Path(path).read_text().split() if path else []
    except FileNotFoundError:
        lines = []
    return (int(lines[0]) if lines else None), (float(lines[1]) if len(lines) > 1 else 0.0)


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
    pid_files = [f for f in (_warm_pid_file(cmd) for cmd, _ in commands) if f]
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
                _dump_rank_stacks(launch_id, pid_files, out)
            survivors = [] if returncodes is None else _survivors(launch_id, pid_files)
            for pid, _ in processes_of_launch(launch_id, pid_files):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
    warm_cpu_s = sum(_read_pid_file(f)[1] for f in pid_files)  # ranks that are not our children
    for f in pid_files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    _log_launch(time.monotonic() - started, _children_cpu_s() - cpu_before + warm_cpu_s, "warm" if pid_files else "torchrun")
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


def _dump_rank_stacks(launch_id: str, pid_files: Sequence[str], out) -> None:
    """A hung launch: its ranks (and their forked writers) print every thread's stack before they
    are killed (SIGQUIT, megatron/training/runtime/signals.py). torchrun, tools and spawned helpers
    would just die of SIGQUIT, so only the children of torchrun or of a warm leader, and theirs,
    get it (never a spawned multiprocessing helper)."""
    processes = dict(processes_of_launch(launch_id, pid_files))
    leaders = {_read_pid_file(f)[0] for f in pid_files}

    def is_rank(pid: int) -> bool:
        parent = parent_pid(pid)
        return (parent in leaders or "torch.distributed.run" in processes.get(parent, "")
                or (parent in processes and is_rank(parent)))

    for pid, cmdline in processes.items():
        if "multiprocessing" not in cmdline and is_rank(pid):
            out.write(f"{STACKS_OF} pid {pid} (parent {parent_pid(pid)}): {cmdline[:120]}\n")
            out.flush()  # the processes write to the same open file, after this line
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)
            time.sleep(STACK_DUMP_WAIT_S)  # one at a time: their lines would interleave


def parent_pid(pid: int) -> Optional[int]:
    """The parent of a live process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _stack_dumps(output: str) -> str:
    """The SIGQUIT dumps in ``output`` (megatron/training/runtime/signals.py's ``print_stacks``): from each
    "[rank N] SIGQUIT..." or "Thread 0x..." header on."""
    lines, keep = [], False
    for line in output.splitlines():
        if line.startswith((STACKS_OF, "Thread 0x")) or (line.startswith("[rank ") and "SIGQUIT" in line):
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


def _log_launch(wall_s: float, cpu_s: float, launcher: str) -> None:
    if os.environ.get(LAUNCH_LOG):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").replace("\t", " ")
        with open(os.environ[LAUNCH_LOG], "a") as f:
            f.write(f"{test}\t{wall_s:.2f}\t{cpu_s:.2f}\t{launcher}\n")


def processes_of_launch(launch_id: str, pid_files: Sequence[str] = ()) -> List[Tuple[int, str]]:
    """(pid, command line) of the live processes whose environment has LAUNCH_MARKER=launch_id, and
    of warm launches (``pid_files``) their leader and its descendants (forked processes keep the
    server's environment; the leader is their subreaper, so orphans stay under it)."""
    marker = f"{LAUNCH_MARKER}={launch_id}".encode()
    leaders = {pid for pid in (_read_pid_file(f)[0] for f in pid_files) if pid is not None}
    parents, found = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        parents[pid] = parent_pid(pid)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = marker in f.read().split(b"\0")  # a zombie's is empty
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:300]
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if not cmdline:
            continue  # a zombie: nothing left to kill or report
        found[pid] = (marked, cmdline)
    def under_a_leader(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid in leaders:
                return True
            seen.add(pid)
            pid = parents.get(pid) or 0
        return False
    return [(pid, cmdline) for pid, (marked, cmdline) in found.items() if marked or under_a_leader(pid)]


def _survivors(launch_id: str, pid_files: Sequence[str]) -> List[Tuple[int, str]]:
    """The processes of a finished launch still alive after SURVIVOR_GRACE_S: a killed rank's
    children need a moment (PDEATHSIG, then the resource tracker sees its pipe close). A warm
    launch's leader waits for its orphans, so it is never one itself."""
    leaders = {_read_pid_file(f)[0] for f in pid_files}
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    while True:
        alive = [(pid, cmd) for pid, cmd in processes_of_launch(launch_id, pid_files) if pid not in leaders]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def ranks_output(output: str) -> str:
    """A launch's output without torchrun's own report of a failed rank (under warm_ranks there is
    none): what is left is what the ranks printed, where a bad flag's one line must show once and no
    traceback at all."""
    return TORCHRUN_REPORT.sub("", output)


def losses(records: List[Dict]) -> List[float]:
    return [r["loss"] for r in records]
