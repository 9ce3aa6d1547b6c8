"""Bad input fails early with an error that names the option or path and the numbers."""

import os
import shutil

import pytest
import torch

from mlp_offload import ModelLink
from mlp_offload import (
    OffloadConfig, OffloadConfigError, OffloadedAdamW, OffloadStateError, PlacementError, TierPathError,
    parse_bandwidths,
)
from mlp_offload.tiers.files import FileTier

from .helpers import fast_config


def test_file_tier_without_path():
    with pytest.raises(OffloadConfigError, match=r"paths\['nvme'\]"):
        OffloadConfig(tiers=["host", "nvme"], host_budget_bytes=1 << 20)


def test_path_for_unlisted_tier(tmp_path):
    with pytest.raises(OffloadConfigError, match=r"paths\['pfs'\] is given, but 'pfs' is not a file tier"):
        OffloadConfig(tiers=["nvme"], paths={"nvme": str(tmp_path), "pfs": str(tmp_path)})


def test_mixed_tiers_need_a_host_budget(tmp_path):
    with pytest.raises(OffloadConfigError, match="host_budget_bytes"):
        OffloadConfig(tiers=["host", "nvme"], paths={"nvme": str(tmp_path)})


@pytest.mark.parametrize("field,value,match", [
    ("subgroup_size", 0, "subgroup size"),
    ("io_block_bytes", 5000, "multiple of 4096"),
    ("prefetch_depth", -1, "prefetch depth"),
    ("adam_kernel", "turbo", "adam kernel"),
    ("tiers", ["host", "host"], "twice"),
    ("tiers", [], "empty"),
    ("tokens_per_tier", 0, "tokens per tier"),
    ("probe_bytes", 4096, "at least 1 MiB"),
])
def test_invalid_values(field, value, match):
    with pytest.raises(OffloadConfigError, match=match):
        OffloadConfig(**{field: value})


def test_bandwidth_syntax():
    assert parse_bandwidths("nvme=3:2.5")["nvme"].write_bps == 2.5e9
    assert parse_bandwidths("nvme=3:2.5")["nvme"].mixed_bps is None
    assert parse_bandwidths("nvme=3:2.5:2.75")["nvme"].mixed_bps == 2.75e9  # read+write at once, as probed
    for bad in ("nvme=fast", "nvme=1:2:3:4", "nvme=1"):
        with pytest.raises(OffloadConfigError, match="TIER=READ_GBPS:WRITE_GBPS"):
            parse_bandwidths(bad)


def test_missing_path(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"])
    cfg.paths["nvme"] = str(tmp_path / "nope")
    with pytest.raises(TierPathError, match=r"paths\['nvme'\] .*nope: the directory does not exist"):
        OffloadedAdamW(torch.zeros(100), cfg)


def test_path_is_a_file(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"])
    (tmp_path / "afile").write_text("x")
    cfg.paths["nvme"] = str(tmp_path / "afile")
    with pytest.raises(TierPathError, match="not a directory"):
        OffloadedAdamW(torch.zeros(100), cfg)


def test_unwritable_path(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"])
    if os.geteuid() == 0:
        target = "/proc/1"  # root may write anywhere else; procfs refuses even root
    else:
        target = str(tmp_path / "ro")
        os.mkdir(target, 0o500)
    cfg.paths["nvme"] = target
    with pytest.raises(TierPathError, match="not writable"):
        OffloadedAdamW(torch.zeros(100), cfg)


def test_not_enough_disk_space(tmp_path, monkeypatch):
    monkeypatch.setattr(FileTier, "free_bytes", lambda self: 1 << 20)
    cfg = fast_config(tmp_path, tiers=["nvme", "pfs"], subgroup_size=100_000, ranks_sharing_node=4)
    with pytest.raises(PlacementError, match=r"not enough disk space.*4 rank\(s\).*nvme 0.00 GiB free"):
        OffloadedAdamW(torch.zeros(1_000_000), cfg)
    # Nothing is left behind by the failed start.
    assert not (tmp_path / "nvme" / "mlp_offload").exists()


def test_host_budget_below_pipeline_minimum(tmp_path):
    cfg = fast_config(tmp_path, tiers=["host", "nvme"], subgroup_size=100_000, host_budget_bytes=1 << 20)
    with pytest.raises(PlacementError, match=r"below the pipeline's minimum of 2 subgroup buffers"):
        OffloadedAdamW(torch.zeros(1_000_000), cfg)


def test_host_only_budget_too_small():
    cfg = OffloadConfig(tiers=["host"], host_budget_bytes=1 << 20)
    with pytest.raises(PlacementError, match=r"needs 0.011 GiB but the host budget is 0.001 GiB"):
        OffloadedAdamW(torch.zeros(1_000_000), cfg)


def _engine_with_files_written(tmp_path, seen):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=4_000, cache_alternating=False, prefetch_depth=1)
    eng = OffloadedAdamW(torch.randn(20_000), cfg, model=ModelLink(on_params_updated=lambda a, b, p: seen.append(a)))
    eng.grad_buffer.normal_()
    eng.step()
    eng.flush()
    return eng


def _damage_then_step(eng, seen, damage):
    seen.clear()
    # Damage a subgroup that is not already prefetched for the next step.
    victim = eng.subgroups[-1]
    path = eng.file_tiers["nvme"].path_of(f"sg{victim.index:06d}.state")
    damage(path)
    with pytest.raises(OffloadStateError) as info:
        eng.step()
    assert victim.start not in seen  # its damaged data never reached Adam or the caller
    return str(info.value), path


def test_truncated_state_file(tmp_path):
    seen = []
    eng = _engine_with_files_written(tmp_path, seen)
    try:
        msg, path = _damage_then_step(eng, seen, lambda p: os.truncate(p, 1000))
        assert "subgroup 4" in msg and path in msg and "truncated" in msg
        with pytest.raises(OffloadStateError, match="stopped after an earlier error"):
            eng.step()
    finally:
        eng.close()


def test_corrupt_state_file(tmp_path):
    def flip_byte(path):
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))

    seen = []
    eng = _engine_with_files_written(tmp_path, seen)
    try:
        msg, path = _damage_then_step(eng, seen, flip_byte)
        assert "subgroup 4" in msg and path in msg and "checksum mismatch" in msg
    finally:
        eng.close()


def test_tier_directory_disappears(tmp_path):
    seen = []
    eng = _engine_with_files_written(tmp_path, seen)
    try:
        shutil.rmtree(eng.file_tiers["nvme"].dir)
        with pytest.raises(OffloadStateError, match="subgroup 4.*disappeared|No such file"):
            eng.step()
    finally:
        eng.close()
