"""Node-wide I/O tokens: exclusion between processes, no deadlock when a holder dies."""

import os
import signal
import time

import pytest

from mlp_offload.tiers.tokens import TierTokens

from . import proc_workers

ctx = proc_workers.context()


def test_other_process_waits_for_the_token(tmp_path):
    ready = ctx.Event()
    holder = ctx.Process(target=proc_workers.hold_token, args=(str(tmp_path), str(tmp_path / "locks"), ready, 1.0))
    holder.start()
    try:
        assert ready.wait(60)
        tokens = TierTokens(str(tmp_path), 1, lock_root=str(tmp_path / "locks"))
        waited = tokens.acquire()
        tokens.release()
        assert waited > 0.3  # the holder kept it about a second after signalling
    finally:
        holder.join(60)


def test_killed_holder_does_not_block_others(tmp_path):
    ready = ctx.Event()
    holder = ctx.Process(target=proc_workers.hold_token, args=(str(tmp_path), str(tmp_path / "locks"), ready, 600))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    tokens = TierTokens(str(tmp_path), 1, lock_root=str(tmp_path / "locks"))
    start = time.perf_counter()
    tokens.acquire()
    tokens.release()
    assert time.perf_counter() - start < 5


def test_two_tokens_admit_two_holders(tmp_path):
    a = TierTokens(str(tmp_path), 2, lock_root=str(tmp_path / "locks"))
    b = TierTokens(str(tmp_path), 2, lock_root=str(tmp_path / "locks"))  # a second "process"
    assert a.acquire() < 0.5
    start = time.perf_counter()
    b.acquire()
    assert time.perf_counter() - start < 0.5
    a.release()
    b.release()


def test_threads_of_one_process_share_its_token(tmp_path):
    tokens = TierTokens(str(tmp_path), 1, lock_root=str(tmp_path / "locks"))
    tokens.acquire()
    assert tokens.acquire() == 0.0  # nested: no self-deadlock
    tokens.release()
    tokens.release()
    with pytest.raises(RuntimeError, match="released more often"):
        tokens.release()


def test_ranks_sharing_one_path_stay_correct(tmp_path):
    """Three 'ranks' of one node update their shards on one path under one token."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=proc_workers.engine_matches_adamw,
                         args=(str(tmp_path), str(tmp_path / "locks"), rank, 4, queue)) for rank in range(3)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [r[:2] for r in results] == [(0, True), (1, True), (2, True)]
    assert not (tmp_path / "mlp_offload").exists()  # every rank removed its files
    assert os.listdir(tmp_path / "locks") == []  # and the last one the node's lock files


def test_eight_ranks_two_paths_with_a_killed_token_holder(tmp_path):
    """Seven ranks stream state through two shared paths while an eighth holds both tokens and
    is SIGKILLed: all seven finish, each bit-identical to torch AdamW; nobody deadlocks."""
    nvme, pfs, locks = str(tmp_path / "nvme"), str(tmp_path / "pfs"), str(tmp_path / "locks")
    os.makedirs(nvme)
    os.makedirs(pfs)
    ready = ctx.Event()
    hog = ctx.Process(target=proc_workers.hold_tokens_then_block, args=([nvme, pfs], locks, ready))
    hog.start()
    assert ready.wait(60)
    queue, started = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=proc_workers.engine_matches_adamw,
                         args=(nvme, locks, rank, 5, queue, pfs, started)) for rank in range(7)]
    for p in procs:
        p.start()
    for _ in procs:
        started.get(timeout=120)
    time.sleep(1.0)  # every rank is now stepping, its first writes queued behind the hog's tokens
    os.kill(hog.pid, signal.SIGKILL)
    hog.join(60)
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [r[:2] for r in results] == [(rank, True) for rank in range(7)]
    assert max(r[2] for r in results) > 0.5  # someone really waited for the hog's tokens
    for path in (nvme, pfs):
        assert not os.path.exists(os.path.join(path, "mlp_offload", "shared"))
    assert os.listdir(locks) == []  # the killed hog's lock files too, by the last rank to leave


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory"), FileExistsError(17, "File exists")])
def test_joining_while_the_last_user_removes_the_parent_retries(tmp_path, monkeypatch, error):
    """makedirs creates the per-user parent, then the path's directory; the last user leaving may remove the
    parent in between (a fresh-clone CI run of test_cluster_scope saw FileNotFoundError there), or the
    directory between makedirs' mkdir, which found it, and its isdir check, which no longer does (a later
    fresh-clone run saw FileExistsError there): join again."""
    from mlp_offload.tiers import tokens

    real, raised = os.makedirs, []

    def parent_gone_once(path, exist_ok=False):
        if not raised and os.path.basename(path) == tokens.path_key(str(tmp_path / "tier")):
            raised.append(path)
            raise error
        return real(path, exist_ok=exist_ok)
    monkeypatch.setattr(tokens.os, "makedirs", parent_gone_once)
    with tokens.LockDir(str(tmp_path / "tier"), lock_root=str(tmp_path / "locks")) as lock_dir:
        assert raised == [lock_dir.path] and os.path.isdir(lock_dir.path)
