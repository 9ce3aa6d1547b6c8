"""What is per node, per job and per file system on a cluster: run ids per job step, the probe
cache per host without locks on the tier's file system, lock directories removed by the last
user, and I/O tokens taken across the job's nodes (job scope)."""

import fcntl
import json
import os
import socket

import pytest
import torch

from mlp_offload.plan import probe_cache
from mlp_offload.plan.rates import probe_tier
from mlp_offload.tiers.files import FileIo, FileTier, TierOwner
from mlp_offload.tiers.host import HostMemory
from mlp_offload.tiers.tokens import JobTokens, JobTokensStalled, TierTokens, path_key

from megatron.training.args.arguments import parse_args
from megatron.training.offload.flags import config_from_args, job_run_id

from . import proc_workers

ctx = proc_workers.context()


def test_two_steps_of_one_allocation_get_their_own_namespaces(monkeypatch):
    monkeypatch.delenv("MLP_OFFLOAD_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    ids = []
    for step in ("0", "1"):
        monkeypatch.setenv("SLURM_STEP_ID", step)
        ids.append(job_run_id())
    monkeypatch.delenv("SLURM_STEP_ID")
    ids.append(job_run_id())  # python run by the batch script itself
    assert ids == ["777.0", "777.1", "777.batch"]


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu",
         "--offload-tiers", "host"]


@pytest.mark.parametrize("env, lock_dir, local_rank", [
    ({}, None, 0), ({"MLP_OFFLOAD_LOCK_DIR": "/var/locks", "LOCAL_RANK": "3"}, "/var/locks", 3),
    ({"MLP_OFFLOAD_LOCK_DIR": "", "LOCAL_RANK": "0"}, None, 0)])
def test_the_adapter_reads_the_environment_into_the_config(monkeypatch, env, lock_dir, local_rank):
    """The engine reads no environment (tests/unit/test_layout.py): its lock directory and local
    rank come from the adapter, which reads MLP_OFFLOAD_LOCK_DIR and LOCAL_RANK."""
    for var in ("MLP_OFFLOAD_LOCK_DIR", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    cfg = config_from_args(parse_args(FLAGS), rank=0)
    assert (cfg.lock_dir, cfg.local_rank) == (lock_dir, local_rank)


def _probe(root, lock_root=None):
    tier = FileTier("pfs", str(root), TierOwner("probe", 0), FileIo(64 * 1024, 2, op_threads=4), lock_root=lock_root)
    try:
        return probe_tier(tier, HostMemory(None, pin=False).allocate(4 << 20, "probe", counted=False))
    finally:
        tier.close()


def test_probe_cache_is_per_host_and_needs_no_lock_on_the_tier(tmp_path, monkeypatch):
    # Another node measured this shared path (absurdly fast): its figure is not ours.
    _probe(tmp_path)  # writes this host's cache with the exact signature
    mine = probe_cache.path_for(str(tmp_path))
    other = probe_cache.path_for(str(tmp_path), host="othernode")
    with open(mine) as f:
        data = json.load(f)
    data.update(read_bps=1e15, write_bps=1e15, mixed_bps=1e15)
    with open(other, "w") as f:
        json.dump(data, f)
    os.unlink(mine)
    # flock on the tier's file system fails (as where a parallel file system has none).
    real_flock = fcntl.flock

    def no_flock_on_tier(fd, op):
        target = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if target.startswith(str(tmp_path) + os.sep) and "locks" not in target:
            raise OSError(37, "No locks available")
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", no_flock_on_tier)
    rate = _probe(tmp_path, str(tmp_path / "locks"))
    assert rate.read_bps < 1e15  # measured here, not the other node's number
    assert os.path.exists(mine) and probe_cache.read(other, {}).read_bps == 1e15  # left as it was
    assert _probe(tmp_path, str(tmp_path / "locks")) == rate  # this host's cache serves this host
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(mine), os.path.basename(other), "locks"])
    assert os.listdir(tmp_path / "locks") == []  # the probe's node-local lock directory is gone


def test_lock_directory_goes_with_its_last_user(tmp_path):
    locks = tmp_path / "locks"
    a = TierTokens(str(tmp_path), 2, lock_root=str(locks))
    b = TierTokens(str(tmp_path), 2, lock_root=str(locks))
    a.close()
    assert os.path.isdir(b.lock_dir)  # b still uses it
    b.close()
    assert os.listdir(locks) == []


def _run_turns(tmp_path, store_port, procs=4, rounds=40):
    errors = ctx.Queue()
    (tmp_path / "marker").mkdir()
    workers = [ctx.Process(target=proc_workers.take_turns,
                           args=(str(tmp_path), str(tmp_path / "locks"), store_port, rounds,
                                 str(tmp_path / "marker"), errors)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    assert errors.empty(), errors.get()


def test_tokens_exclude_while_users_come_and_go(tmp_path):
    """Processes join and leave the path's lock directory over and over (each leaving may remove
    it): one token still admits one holder at a time, and the directory is gone at the end."""
    _run_turns(tmp_path, None)
    assert os.listdir(tmp_path / "locks") == []


def _store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), port


def test_job_tokens_exclude_across_processes(tmp_path):
    store, port = _store()
    _run_turns(tmp_path, port)
    assert store.add(f"mlp_offload/tokens/{path_key(str(tmp_path))}", 0) == 0  # every token given back


def test_job_token_held_by_a_dead_rank_is_an_error_not_a_hang(tmp_path):
    store, _ = _store()
    gone = JobTokens(str(tmp_path), 1, store)
    gone.acquire()  # and never released, as by a rank that died holding it
    waiting = JobTokens(str(tmp_path), 1, store, stall_s=0.5)
    with pytest.raises(JobTokensStalled, match=str(tmp_path)):
        waiting.acquire()


def test_job_scope_is_checked_when_the_engine_is_built(tmp_path):
    from mlp_offload import OffloadConfigError, OffloadedAdamW

    from .helpers import fast_config

    with pytest.raises(OffloadConfigError, match="'ssd'"):
        fast_config(tmp_path, tiers=["nvme"], token_scope={"ssd": "job"})
    with pytest.raises(OffloadConfigError, match="'cluster'"):
        fast_config(tmp_path, tiers=["nvme"], token_scope={"nvme": "cluster"})
    with pytest.raises(OffloadConfigError, match="token_store"):
        OffloadedAdamW(torch.zeros(1000), fast_config(tmp_path, tiers=["nvme"], token_scope={"nvme": "job"}))
    store, _ = _store()
    with OffloadedAdamW(torch.zeros(30_000), fast_config(tmp_path, tiers=["nvme"], token_scope={"nvme": "job"}),
                        token_store=store) as eng:
        assert isinstance(eng.file_tiers["nvme"].tokens, JobTokens)
        eng.grad_buffer.fill_(1)
        eng.step()
        eng.step()
        eng.flush()  # writes run behind the step: the token is given back once they are done
        assert store.add(f"mlp_offload/tokens/{path_key(str(tmp_path / 'nvme'))}/released", 0) > 0
