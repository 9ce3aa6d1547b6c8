"""Swap-file namespaces: claimed with an owner record, dead owners recognised, live ones respected."""

import json
import logging
import os
import subprocess
import sys

import pytest

from mlp_offload import OffloadConfig
from mlp_offload.tiers.factory import file_tier
from mlp_offload.tiers.housekeeping import NamespaceInUseError, claim, owner_alive, owner_record, scan


def _fake_namespace(root, run_id, rank, owner):
    path = root / "mlp_offload" / run_id / f"rank{rank:05d}"
    path.mkdir(parents=True)
    (path / "sg000000.state").write_bytes(b"x" * 4096)
    if owner is not None:
        (path / "OWNER.json").write_text(json.dumps(owner))
    return path


def test_claim_writes_an_owner_record(tmp_path):
    path = claim(str(tmp_path), "run", 3, "--offload-nvme-path")
    owner = json.loads(open(os.path.join(path, "OWNER.json")).read())
    assert owner["pid"] == os.getpid() and owner_alive(owner) is True
    assert claim(str(tmp_path), "run", 3, "--offload-nvme-path") == path  # our own: fine


def test_live_owner_is_never_displaced(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = owner_record()
        record.update(pid=other.pid, start_ticks=None)
        _fake_namespace(tmp_path, "run", 0, record)
        with pytest.raises(NamespaceInUseError, match="in use by another process with the same run id"):
            claim(str(tmp_path), "run", 0, "--offload-nvme-path")
    finally:
        other.kill()
        other.wait()


def test_dead_owner_is_cleared_and_others_reported(tmp_path, caplog):
    record = owner_record()
    record.update(pid=2**22 + 12345)  # no such process
    ours = _fake_namespace(tmp_path, "run", 0, record)
    _fake_namespace(tmp_path, "old-run", 1, record)
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        path = claim(str(tmp_path), "run", 0, "--offload-nvme-path")
    assert path == str(ours) and not (ours / "sg000000.state").exists()  # never reused
    text = caplog.text
    assert "removing stale offload files of a dead run" in text
    assert "1 stale offload namespace(s) of dead runs" in text and "old-run" in text


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_only_the_nodes_first_rank_lists_stale_namespaces(tmp_path, caplog, local_rank):
    """The config's local_rank (the adapter's LOCAL_RANK) decides who reports; every rank clears its own."""
    record = owner_record()
    record.update(pid=2**22 + 12345)  # no such process
    ours = _fake_namespace(tmp_path, "run", local_rank, record)
    _fake_namespace(tmp_path, "old-run", 7, record)
    cfg = OffloadConfig(tiers=["nvme"], paths={"nvme": str(tmp_path)}, run_id="run", rank=local_rank,
                        local_rank=local_rank, bandwidths={"nvme": (1e9, 1e9)})
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        tier = file_tier(cfg, "nvme", tokens=None)
    tier.close()
    assert not (ours / "sg000000.state").exists()
    assert ("stale offload namespace(s) of dead runs" in caplog.text) == (local_rank == 0)


def test_half_built_namespace_is_not_counted(tmp_path):
    (tmp_path / "mlp_offload" / "run" / "rank00001.tmp-999").mkdir(parents=True)
    assert scan(str(tmp_path)) == []


def test_recycled_pid_is_dead(tmp_path):
    record = owner_record()
    record["start_ticks"] = (record["start_ticks"] or 0) + 1  # our pid, but another process's start
    assert owner_alive(record) is False


def test_release_removes_files_an_io_thread_creates_while_it_runs(tmp_path, monkeypatch):
    """On SIGTERM the release runs beside I/O threads still writing: a state file created after its first
    look (here: by the first removal, as a write landing then) is removed too, and the namespace goes."""
    from mlp_offload.tiers import housekeeping

    path = claim(str(tmp_path), "run", 0, "--offload-nvme-path")
    for k in range(3):
        (tmp_path / "mlp_offload" / "run" / "rank00000" / f"sg{k:06d}.state").write_bytes(b"x" * 4096)
    real_unlink, landed = housekeeping.remove_file, []

    def unlink_while_a_write_lands(target):
        real_unlink(target)
        if not landed:
            landed.append(os.path.join(path, "sg000099.state"))
            with open(landed[0], "wb") as f:  # a write the walk has already passed
                f.write(b"y" * 4096)
    monkeypatch.setattr(housekeeping, "remove_file", unlink_while_a_write_lands)
    housekeeping.release(path)
    assert landed and not os.path.exists(path)
    assert not (tmp_path / "mlp_offload").exists()  # the run's and the base directory went once empty
