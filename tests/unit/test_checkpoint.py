"""Streaming engine checkpoints: bit-identical continuation, whatever the new layout; damage detected."""

import os

import pytest
import torch

from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import CheckpointDataError, load_engine_state, read_footer, save_engine_state

from .helpers import engine_state, fast_config

NUMEL = 70_001


def grads(seed, steps):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen).to(torch.bfloat16) for _ in range(steps)]


def run(engine, grad_list):
    for g in grad_list:
        engine.grad_buffer.copy_(g)
        engine.step()


@pytest.mark.parametrize("resume", [
    dict(tiers=["nvme", "pfs"], subgroup_size=9_000),                                  # other paths
    dict(tiers=["host"], subgroup_size=25_000),                                       # host only
    dict(tiers=["host", "pfs"], subgroup_size=7_000, host_budget_bytes=6 * 3 * 28672),  # other budget
])
def test_resume_is_bit_identical(tmp_path, resume):
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    g = grads(2, 5)
    with OffloadedAdamW(init.clone(), fast_config(tmp_path / "ref", tiers=["nvme"], subgroup_size=10_000)) as ref:
        run(ref, g)
        expected = engine_state(ref)

    first = OffloadedAdamW(init.clone(), fast_config(tmp_path / "a", tiers=["host", "nvme"], subgroup_size=10_000,
                                                     host_budget_bytes=7 * 3 * 40960))
    run(first, g[:3])
    ckpt = str(tmp_path / "engine.ckpt")
    save_engine_state(first, ckpt, metadata={"iteration": 3})
    first.close()

    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(tmp_path / "b", **resume)) as second:
        assert load_engine_state(second, ckpt) == {"iteration": 3}
        assert second.steps_done == 3
        run(second, g[3:])
        got = engine_state(second)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _saved(tmp_path):
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path, tiers=["nvme"])) as eng:
        run(eng, grads(0, 2))
        path = str(tmp_path / "x.ckpt")
        save_engine_state(eng, path)
    return path


def test_truncated_checkpoint(tmp_path):
    path = _saved(tmp_path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointDataError, match="not a complete offload checkpoint"):
        read_footer(path)


def test_corrupt_checkpoint_is_not_loaded(tmp_path):
    path = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.seek(2 * 12 * 10_000 + 4 * 10_000 + 123)  # inside exp_avg of the third stored subgroup
        f.write(b"\xff\xff")
    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(tmp_path / "b", tiers=["host"])) as eng:
        with pytest.raises(CheckpointDataError, match="checksum mismatch in exp_avg of elements 20000..30000"):
            load_engine_state(eng, path)


def test_wrong_shard_size(tmp_path):
    path = _saved(tmp_path)
    with OffloadedAdamW(torch.zeros(NUMEL + 1), fast_config(tmp_path / "b", tiers=["host"])) as eng:
        with pytest.raises(CheckpointDataError, match="holds 70001 elements but this rank's shard has 70002"):
            load_engine_state(eng, path)


def test_crash_while_saving_leaves_previous_file(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = open(path, "rb").read()
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path / "b", tiers=["nvme"])) as eng:
        def boom(*a, **k):
            raise OSError("disk full")
        monkeypatch.setattr(os, "fsync", boom)
        with pytest.raises(OSError, match="disk full"):
            save_engine_state(eng, path)
    assert open(path, "rb").read() == before
