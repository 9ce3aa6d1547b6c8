"""Background saves of the engine's state: the file a background writer produces while the engine
steps on is byte for byte the one a synchronous save at that moment gives, whether the update
stages what it overtakes or waits for the writer; a cancelled or failed write leaves nothing."""

import os
import sys

import pytest
import torch

from mlp_offload import OffloadedAdamW, faults
from mlp_offload.checkpoint import CheckpointSaveError, load_engine_state
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.snapshot import SnapshotCancelled
from mlp_offload.tiers.files import FileTier

from .helpers import bf16_grads, engine_state, fast_config, run_steps

NUMEL = 70_001
# Host-resident subgroups, streamed ones on a file tier, and the alternating-order cache.
MIXED = dict(subgroup_size=10_000, host_budget_bytes=4 * 3 * 40960)
DELAY_S = 0.2
SLOW_WRITER = f"save-offload={DELAY_S}"  # after each subgroup written: the 8 subgroups take 1.6 s


def grads(seed, steps):
    return bf16_grads(seed, steps, NUMEL)


run = run_steps


def engine_at_step_3(path, **overrides):
    engine = OffloadedAdamW(torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)),
                            fast_config(path, tiers=["host", "nvme"], **{**MIXED, **overrides}))
    run(engine, grads(2, 3))
    return engine


@pytest.mark.parametrize("staging_bytes", [1 << 30, 0], ids=["staged", "waits"])
def test_steps_during_a_background_save_change_nothing_it_writes(tmp_path, monkeypatch, staging_bytes):
    later = grads(3, 2)
    with engine_at_step_3(tmp_path / "ref") as reference:
        run(reference, later)
        expected = engine_state(reference)
    with engine_at_step_3(tmp_path / "e", save_staging_bytes=staging_bytes) as engine:
        save_engine_state(engine, str(tmp_path / "sync.ckpt"), metadata={"iteration": 3})
        monkeypatch.setattr(faults, "_delays", SLOW_WRITER)
        write = start_background_save(engine, str(tmp_path / "async.ckpt"), metadata={"iteration": 3})
        assert write.snapshot.memory and write.snapshot.on_tier  # both kinds of source are exercised
        write.start()
        run(engine, later)  # overwrite every subgroup, in memory and in the tier's files, twice
        if staging_bytes:  # the steps took copies and went on: the writer was still at work
            assert not write.done()
        write.wait()
        monkeypatch.setattr(faults, "_delays", None)
        assert write.failure is None
        assert write.write_s >= 8 * DELAY_S
        if staging_bytes:
            assert write.paused_s < DELAY_S
        else:  # the first update waited for the writer to pass the subgroups held in memory
            assert write.paused_s >= DELAY_S / 2
        assert all(torch.equal(a, b) for a, b in zip(engine_state(engine), expected))  # stepped on unharmed
        assert not list((tmp_path / "e" / "nvme").rglob("snapshot/*"))  # its links are gone
    assert (tmp_path / "async.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()
    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(tmp_path / "r", tiers=["nvme"], subgroup_size=9_000)) as r:
        assert load_engine_state(r, str(tmp_path / "async.ckpt")) == {"iteration": 3}
        run(r, later)
        for a, b in zip(engine_state(r), expected):
            assert torch.equal(a, b)


def test_a_cancelled_write_leaves_no_file_and_releases_the_engine(tmp_path, monkeypatch):
    with engine_at_step_3(tmp_path / "e", save_staging_bytes=0) as engine:
        monkeypatch.setattr(faults, "_delays", SLOW_WRITER)
        write = start_background_save(engine, str(tmp_path / "x.ckpt"))
        write.start()
        write.cancel()
        assert isinstance(write.failure, SnapshotCancelled)
        run(engine, grads(3, 1))  # nothing holds the update back any more
        assert not os.path.exists(tmp_path / "x.ckpt") and not os.path.exists(tmp_path / "x.ckpt.tmp")
        assert not list((tmp_path / "e" / "nvme").rglob("snapshot/*"))


def test_a_disk_full_in_the_background_is_reported_and_removes_the_partial_file(tmp_path, monkeypatch):
    with engine_at_step_3(tmp_path / "e") as engine:
        monkeypatch.setattr(faults, "_passes", {})  # counted from here, whatever ran before in this process
        monkeypatch.setattr(faults, "_fault", "save-offload#3=ENOSPC")
        write = start_background_save(engine, str(tmp_path / "x.ckpt"))
        write.start()
        write.wait()
        assert isinstance(write.failure, CheckpointSaveError)
        assert "No space left on device" in str(write.failure)
        assert not os.path.exists(tmp_path / "x.ckpt.tmp")
        run(engine, grads(3, 1))


def test_closing_the_engine_stops_its_writer(tmp_path, monkeypatch):
    engine = engine_at_step_3(tmp_path / "e")
    monkeypatch.setattr(faults, "_delays", SLOW_WRITER)
    write = start_background_save(engine, str(tmp_path / "x.ckpt"))
    write.start()
    engine.close()
    write.wait()
    assert isinstance(write.failure, SnapshotCancelled)
    assert not os.path.exists(tmp_path / "x.ckpt.tmp")


def test_a_tier_without_room_for_both_copies_is_saved_synchronously(tmp_path, monkeypatch, caplog):
    """The updates rewrite linked files to new ones while the writer reads the old: where the tier
    has no room for that, the save is written at once instead (same bytes), with a warning."""
    with engine_at_step_3(tmp_path / "e") as engine:
        save_engine_state(engine, str(tmp_path / "sync.ckpt"))
        monkeypatch.setattr(FileTier, "free_bytes", lambda self: 0)
        write = start_background_save(engine, str(tmp_path / "x.ckpt"))
        assert write.done() and write.failure is None
        assert "the offloaded state is written synchronously" in caplog.text
        assert not list((tmp_path / "e" / "nvme").rglob("snapshot/*"))
        run(engine, grads(3, 1))
    assert (tmp_path / "x.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the training's stream is a CUDA stream")
def test_on_cuda_the_writer_reads_the_gpu_tier_beside_the_training_stream(tmp_path):
    """State in the gpu tier is read by the writer on a stream of its own: it does not wait for work the
    training's stream queued after the snapshot (a long kernel here), and it writes the state as it was at the
    snapshot, byte for byte what a synchronous save then gives."""
    config = fast_config(tmp_path / "e", tiers=["gpu", "nvme"], device="cuda", gpu_budget_bytes=10**9,
                         pin_memory=False, update_on="device", device_adam_elems_per_s=1e9,
                         device_streamed_elems_per_s=1e9)
    with OffloadedAdamW(torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)), config) as engine:
        run(engine, grads(2, 3))
        assert engine.placement.subgroups_on("gpu")  # the case is about device-held state
        save_engine_state(engine, str(tmp_path / "sync.ckpt"), metadata={"iteration": 3})
        write = start_background_save(engine, str(tmp_path / "async.ckpt"), metadata={"iteration": 3})
        assert any(v.buf.is_cuda for v in write.snapshot.memory.values())
        torch.cuda._sleep(4_000_000_000)  # seconds of GPU time on the training's stream, queued after the snapshot
        write.start()
        write.wait()
        assert write.failure is None
        assert not torch.cuda.current_stream().query()  # the writer finished while the long kernel still ran
        torch.cuda.synchronize()
    assert (tmp_path / "async.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()


def test_a_second_background_save_stages_into_the_buffers_of_the_first(tmp_path, monkeypatch):
    """The staging outlives a snapshot: the next save's copies aside go into the same memory, and what it
    writes is still the synchronous save's file at its moment."""
    with engine_at_step_3(tmp_path / "e", save_staging_bytes=1 << 30) as engine:
        made = []
        for k in range(2):
            save_engine_state(engine, str(tmp_path / f"sync{k}.ckpt"), metadata={"iteration": 3 + 2 * k})
            monkeypatch.setattr(faults, "_delays", SLOW_WRITER)
            write = start_background_save(engine, str(tmp_path / f"async{k}.ckpt"),
                                          metadata={"iteration": 3 + 2 * k})
            write.start()
            run(engine, grads(3 + k, 2))  # the updates stage what they overtake
            write.wait()
            monkeypatch.setattr(faults, "_delays", None)
            assert write.failure is None
            made.append(write.snapshot.staging_new)
            assert (tmp_path / f"async{k}.ckpt").read_bytes() == (tmp_path / f"sync{k}.ckpt").read_bytes()
    assert made[0] > 0 and made[1] == 0, made


def first_paced_save_staging(path, reserve: bool):
    """(staging buffers kept at start-up, buffers the first paced background save made)."""
    from mlp_offload.checkpoint import reserve_paced_staging
    from mlp_offload.subgroups.partition import slot_subgroup
    with engine_at_step_3(path / "e") as engine:
        buffer = slot_subgroup(engine.subgroups).state_bytes
        kept = reserve_paced_staging(engine, str(path / "ckpt" / "iter_3")) if reserve else 0
        write = start_background_save(engine, str(path / "e" / "async.ckpt"), metadata={"iteration": 3},
                                      next_save_in_s=5.0)
        assert write.pacer is not None  # the checkpoint shares the nvme tier's disk: paced, its staging raised
        write.start()
        write.wait()
        assert write.failure is None
        return kept // buffer, write.snapshot.staging_new


def test_staging_made_at_start_up_serves_the_first_paced_save(tmp_path):
    """The staging made at start-up for the state held in memory (resident, and in the pipeline's buffers) is what
    the first paced save copies it into: that save makes no buffer of its own."""
    kept, made_with = first_paced_save_staging(tmp_path / "with", reserve=True)
    _, made_without = first_paced_save_staging(tmp_path / "without", reserve=False)
    assert made_without > 0  # MIXED keeps subgroups resident in host memory: without, the save makes their staging
    assert kept >= made_without and made_with == 0, (made_with, made_without, kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_staging_made_at_start_up_is_in_memory_before_any_save(tmp_path):
    """Reserved staging is faulted in at once (the process's resident set grows by it), not at the first save."""
    from mlp_offload.checkpoint import reserve_paced_staging

    def resident_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with engine_at_step_3(tmp_path / "e") as engine:
        before = resident_bytes()
        kept = reserve_paced_staging(engine, str(tmp_path / "ckpt"))
        grown = resident_bytes() - before
    assert kept > 0 and grown >= 0.9 * kept, (kept, grown)


def test_a_background_save_writes_by_a_helper_process_and_a_synchronous_one_by_threads(tmp_path, monkeypatch):
    from mlp_offload.tiers.write_helper import WriteHelper
    started, start = [], WriteHelper.start
    monkeypatch.setattr(WriteHelper, "start", staticmethod(lambda *args: started.append(start(*args)) or started[-1]))
    with engine_at_step_3(tmp_path / "e") as engine:
        save_engine_state(engine, str(tmp_path / "sync.ckpt"), metadata={"iteration": 3})
        assert started == []  # training waits for it: threads, from a ring in huge pages
        write = start_background_save(engine, str(tmp_path / "async.ckpt"), metadata={"iteration": 3})
        write.start()
        write.wait()
        assert write.failure is None
    assert len(started) == 1 and started[0].process.returncode == 0  # one file, one helper, ended
    assert (tmp_path / "async.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()
