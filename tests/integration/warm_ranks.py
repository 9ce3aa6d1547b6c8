"""Test launches without the start-up: rank processes forked from a server that has imported torch,
megatron-core and the training layer once, instead of torchrun starting interpreters that import
them again (on the 2-core CI machine about 14 of a small launch's 20 s of CPU).

- ``python warm_ranks.py serve SOCKET``: imports what a CPU rank imports (``pretrain_gpt.py``'s
  imports, its ``--device cpu`` choices included), prints ``ready``, then forks a leader per request.
- ``python warm_ranks.py launch SOCKET PIDFILE NPROC MASTER_PORT SCRIPT -- ARGS...``: what a test runs
  in torchrun's place (launch.run_group); SCRIPT is ``pretrain_gpt.py`` or a test's variant of it. It passes its environment, working directory and stdout to the
  server, writes the leader's pid and, at the end, the ranks' CPU seconds into PIDFILE (for
  launch.processes_of_launch and the launch log), and exits with the launch's status.

The leader does what torchrun does for one node: hosts the job's store on MASTER_PORT (as
torchrun's agent does), sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE, starts each rank in a session of its own running
the script as ``__main__``, and when a rank fails, SIGTERMs the others' process groups,
SIGKILLing them after TERMINATE_GRACE_S; its status is 1 if any rank failed. It is a child
subreaper, so the children of a killed rank stay in its tree, where the tests look for survivors.
What torchrun itself does (its signal forwarding, its agent's store, restarts, several nodes) is
tested through torchrun: launch.py uses this only where a test asks for nothing of it.

Standard library only at module level: the client mode must start in milliseconds.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain_gpt.py"
TERMINATE_GRACE_S = 30.0  # torchrun's wait between its SIGTERM and SIGKILL
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


# -- the server ---------------------------------------------------------------------------------
def serve(socket_path: str) -> None:
    sys.argv = [str(PRETRAIN), "--device", "cpu"]  # what lean_imports decides by, as a CPU test rank
    sys.path.insert(0, str(REPO))
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_gpt_imports", PRETRAIN)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its module level: lean imports, torch
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  what the model provider imports
    import megatron.training.data.datasets  # noqa: F401
    import megatron.training.training  # noqa: F401
    import torch._dynamo  # noqa: F401  torch.optim's first optimizer imports it (megatron-core's optimizer: 1 s)

    assert threading.active_count() == 1, "the server must not start threads: its forks would lack them"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        request, fds = _receive_request(conn)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            os._exit(_lead(conn, request, fds[0]))
        conn.close()
        for fd in fds:
            os.close(fd)
        _reap_finished_leaders()


def _receive_request(conn: socket.socket):
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, new_fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
        if not chunk:
            raise ConnectionError("the launch client went away mid-request")
        data += chunk
        fds += new_fds
    return json.loads(data), fds


def _reap_finished_leaders() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


# -- a leader: torchrun's part for one launch ---------------------------------------------------
def _lead(conn: socket.socket, request: dict, out_fd: int) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _send(conn, {"leader": os.getpid()})
    nproc = request["nproc"]
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(request, rank, nproc, out_fd)  # never returns
        ranks[pid] = rank
    try:
        store = _agent_store(request["master_port"], nproc)  # after the forks: its thread stays here
    except Exception as err:  # the port was taken meanwhile: launch.run_pretrain retries on this text
        os.write(out_fd, f"warm_ranks leader: the agent store failed: {err}\n".encode())
        _signal_groups(ranks, signal.SIGKILL)
        store = None
    os.close(out_fd)
    status = _wait_for_ranks(ranks) if store is not None else 1
    del store
    usage = os.times()
    _send(conn, {"exit": status, "cpu_s": usage.children_user + usage.children_system})
    conn.close()
    while True:  # orphans of the ranks (we are their subreaper) until none is left
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return 0


def _agent_store(port: int, nproc: int):
    """The store torchrun's agent hosts on MASTER_PORT before its workers start: the ranks' process
    group is made on it (TORCHELASTIC_USE_AGENT_STORE), and a flag error is printed once through
    it (megatron/training/errors.py)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, nproc, is_master=True, timeout=timedelta(seconds=300),
                    wait_for_workers=False)


def _wait_for_ranks(ranks: dict) -> int:
    """Every rank's end; after the first failure the others are stopped as torchrun stops them."""
    running, failed, kill_at = set(ranks), False, None
    while running:
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                _signal_groups(running, signal.SIGKILL)
                kill_at = None
            time.sleep(0.02)
            continue
        if pid not in running:
            continue  # an orphan of a rank, reaped
        running.discard(pid)
        if os.waitstatus_to_exitcode(wait_status) != 0 and not failed:
            failed = True
            _signal_groups(running, signal.SIGTERM)
            kill_at = time.monotonic() + TERMINATE_GRACE_S
    return 1 if failed else 0


def _signal_groups(pids, signum) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass


def _run_rank(request: dict, rank: int, nproc: int, out_fd: int) -> None:
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                       "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(request["master_port"]),
                       "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
    sys.argv = [request["script"], *request["args"]]
    code = 1
    try:
        import runpy

        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # What the interpreter's exit would do: join the non-daemon threads, run atexit (the
        # checkpoint writers' Manager stops there, logging flushes), flush.
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


# -- the client: what a test runs in torchrun's place --------------------------------------------
def launch(socket_path: str, pid_file: str, nproc: int, master_port: int, script: str, args) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    request = {"nproc": nproc, "master_port": master_port, "script": os.path.abspath(script), "args": list(args),
               "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [sys.stdout.fileno()])
    replies = conn.makefile("r")
    leader = json.loads(replies.readline())["leader"]
    Path(pid_file).write_text(f"{leader}\n")
    line = replies.readline()
    if not line:
        print(f"warm_ranks: leader {leader} ended without a status", file=sys.stderr, flush=True)
        return 1
    done = json.loads(line)
    Path(pid_file).write_text(f"{leader}\n{done['cpu_s']:.2f}\n")
    return done["exit"]


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "launch":
        split = sys.argv.index("--")
        sock, pid_file, nproc, port, script = sys.argv[2:split]
        sys.exit(launch(sock, pid_file, int(nproc), int(port), script, sys.argv[split + 1:]))
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | launch SOCKET PIDFILE NPROC MASTER_PORT SCRIPT -- ARGS...")
