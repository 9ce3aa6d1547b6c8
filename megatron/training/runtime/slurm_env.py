"""torch.distributed's variables from SLURM's, for ``srun python pretrain_gpt.py`` without torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for
each worker. ``srun -n N python ...`` starts the N processes itself and sets only SLURM's
variables; without this, each of them ran alone (DP=1) on the same default port (EADDRINUSE).
As Megatron-LM users expect, the missing ones are derived here: ranks from SLURM_PROCID,
SLURM_NTASKS and SLURM_LOCALID, the master from the step's first host, and a port from the job and
step ids, so two steps or jobs sharing a node do not collide. Variables that are already set win.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Dict, List, Mapping, MutableMapping, Optional

from megatron.training.errors import UserError

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
# Below Linux's ephemeral range (32768-60999), where connecting sockets take their ports.
PORT_BASE, PORT_JOBS, PORT_STEPS = 10000, 1250, 16


def node_key() -> tuple:
    """What tells this rank's node apart: the launcher's node rank (torchrun's GROUP_RANK, srun's
    SLURM_NODEID: two launches on one host are two nodes to it) and the host name."""
    return os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "")), socket.gethostname()


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[007-009,012],login1`` -> ``gpu007``."""
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not match or not match.group(1):
        raise ValueError(nodelist)
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    if not first.isdigit():
        raise ValueError(nodelist)
    return prefix + first  # the digits as written: zero padding is part of the name


def tasks_per_node(spec: str) -> List[int]:
    """Expand SLURM's ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    counts: List[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(spec)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def job_port(job_id: int, step_id: int) -> int:
    """A port for the job step's rendezvous: distinct for PORT_STEPS steps of one job and for jobs
    whose ids differ by less than PORT_JOBS, so jobs sharing a node do not take each other's."""
    return PORT_BASE + (job_id % PORT_JOBS) * PORT_STEPS + step_id % PORT_STEPS


def launched_by_srun(environ: Mapping[str, str]) -> bool:
    """A task of an srun job step (the batch script itself has no step id: it is one process)."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ


def torch_env_from_slurm(environ: Mapping[str, str]) -> Dict[str, str]:
    """The torch.distributed variables that ``environ`` lacks, derived from SLURM's; {} when the
    process was not started by srun or torchrun's variables are there already."""
    if "RANK" in environ and "WORLD_SIZE" in environ or not launched_by_srun(environ):
        return {}
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS")
    if not 0 <= rank < world:
        raise UserError(f"SLURM_PROCID={rank}: not below the step's {world} tasks (SLURM_NTASKS)")
    derived = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(_int(environ, "SLURM_LOCALID")),
               "LOCAL_WORLD_SIZE": str(_local_tasks(environ)),
               "MASTER_ADDR": _master_host(environ),
               "MASTER_PORT": str(job_port(_int(environ, "SLURM_JOB_ID"), _int(environ, "SLURM_STEP_ID")))}
    return {k: v for k, v in derived.items() if k not in environ}


def apply(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Fill in what srun did not set; returns a line describing it (None when nothing was derived).
    A single process started without any launcher gets a free port, so two such runs on one
    machine do not collide either."""
    environ = os.environ if environ is None else environ
    derived = torch_env_from_slurm(environ)
    environ.update(derived)
    if derived:
        return (f"> torch.distributed from SLURM (srun without torchrun): job {environ['SLURM_JOB_ID']} "
                f"step {environ['SLURM_STEP_ID']}, {environ['WORLD_SIZE']} tasks, "
                f"{environ['LOCAL_WORLD_SIZE']} on this node, master {environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        environ.setdefault("MASTER_ADDR", "127.0.0.1")
        environ.setdefault("MASTER_PORT", str(_free_port()))
    return None


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise UserError(f"{name}: not set, but SLURM_PROCID is (srun without torchrun needs SLURM_PROCID, "
                        f"SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST, SLURM_JOB_ID, SLURM_STEP_ID)")
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{name}={value!r}: not a whole number") from None
    if number < 0:
        raise UserError(f"{name}={value!r}: negative")
    return number


def _master_host(environ: Mapping[str, str]) -> str:
    name = next((n for n in NODELIST_VARS if environ.get(n)), None)
    if name is None:
        raise UserError("SLURM_NODELIST: not set, but SLURM_PROCID is; it names the host of rank 0")
    try:
        return first_host(environ[name])
    except ValueError:
        raise UserError(f"{name}={environ[name]!r}: not a SLURM host list") from None


def _local_tasks(environ: Mapping[str, str]) -> int:
    name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ else "SLURM_TASKS_PER_NODE"
    if name not in environ:
        return _int(environ, "SLURM_NTASKS_PER_NODE")
    try:
        counts = tasks_per_node(environ[name])
    except ValueError:
        raise UserError(f"{name}={environ[name]!r}: not a SLURM task count list such as 4(x2),3") from None
    if len(set(counts)) == 1:
        return counts[0]
    node = _int(environ, "SLURM_NODEID")
    if node >= len(counts):
        raise UserError(f"SLURM_NODEID={node}: {name}={environ[name]!r} lists {len(counts)} nodes")
    return counts[node]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
