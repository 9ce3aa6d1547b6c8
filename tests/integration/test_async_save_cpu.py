"""--async-save with offload (2 CPU processes): the torch_dist files are written by a background
process and the offloaded optimizer state by a thread of each rank, from a snapshot taken at the
save, while training goes on. The writer is slowed down (MLP_OFFLOAD_DELAY, per subgroup written)
so that the next iterations overwrite the state, in host memory and in the tier files, while it
is still being written. A checkpoint is proven complete (COMPLETE.json) and named by the tracker
only in the finalize step, once every rank's writes have ended; a rank killed in the middle of the
background write leaves that checkpoint unfinished, and the restart resumes from the previous one
exactly as a run that never stopped. The nvme and pfs tiers are on the checkpoint's file system, so
torch_dist's forked writer puts its files on the disk paced behind them (mlp_offload.checkpoint.paced_flush)."""

import re
from pathlib import Path

import pytest
import torch

from conftest import BASELINE_ITERS as ITERS
from conftest import SAVE_EVERY
from launch import run_pretrain
from megatron.training.checkpoint import integrity
from mlp_offload.checkpoint import StateFile, read_footer
from helpers import global_weights, offload_args

SAVES = ["--save-interval", str(SAVE_EVERY)]
SLOW_WRITER = {"MLP_OFFLOAD_DELAY": "save-offload=0.1"}  # per subgroup: about 2 s per checkpoint


def offload_file(ckpt, iteration, dp):
    return ckpt / f"iter_{iteration:07d}" / "offload" / f"pp000_tp000_dp{dp:03d}.offload"


def saved_contents(path):
    """A state file's footer but where each subgroup lies, and each subgroup's stored tensors: what it
    holds, whether a subgroup was copied into it or taken by hard link from a tier file (a part)."""
    with StateFile(str(path)) as saved:
        reader = saved.ranges()
        tensors = [[reader.stored_bytes(e, k) for k in range(3)] for e in saved.footer["subgroups"]]
        footer = {**saved.footer, "subgroups": [(e["start"], e["end"]) for e in saved.footer["subgroups"]]}
    return footer, tensors


@pytest.fixture(scope="module")
def sync_saved(offload_saved):
    """The reference: the same run with synchronous saves (conftest.offload_saved)."""
    return offload_saved


@pytest.fixture(scope="module")
def async_saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    ckpt = tmp / "ckpt"
    losses = run_pretrain(tmp, [*offload_args(tmp), "--save", str(ckpt), *SAVES, "--async-save"],
                          train_iters=ITERS, env=SLOW_WRITER, loss_log=tmp / "run.jsonl")
    return {"ckpt": ckpt, "losses": losses, "output": (tmp / "run.out").read_text()}


@pytest.fixture(scope="module")
def worker_saved(tmp_path_factory):
    """The async run with torch_dist's files written by the worker each rank made at start-up."""
    tmp = tmp_path_factory.mktemp("worker")
    ckpt = tmp / "ckpt"
    losses = run_pretrain(tmp, [*offload_args(tmp), "--save", str(ckpt), *SAVES, "--async-save",
                                "--use-persistent-ckpt-worker"],
                          train_iters=ITERS, env=SLOW_WRITER, loss_log=tmp / "run.jsonl")
    return {"ckpt": ckpt, "losses": losses, "output": (tmp / "run.out").read_text()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, sync_saved):
    """A run whose rank 1 is killed while its thread writes checkpoint 4's offloaded state (with no
    staging: the update waits for the writer where it overtakes it), then the same command again."""
    tmp = tmp_path_factory.mktemp("chain")
    ckpt = tmp / "ckpt"
    args = [*offload_args(tmp), "--save", str(ckpt), "--load", str(ckpt), *SAVES, "--async-save",
            "--offload-save-staging-gb", "0"]
    per_save = len(read_footer(str(offload_file(sync_saved["ckpt"], 2, 1)))["subgroups"])
    kill = {"MLP_OFFLOAD_FAULT": f"save-offload@1#{per_save + 2}"}  # after the 2nd subgroup of save 4
    crashed = run_pretrain(tmp, args, train_iters=ITERS, env=kill, loss_log=tmp / "crashed.jsonl",
                           expect_success=False, torchrun=True)[0]
    after_crash = {
        "tracker": (ckpt / integrity.TRACKER).read_text(),
        "states": {n: integrity.status(str(integrity.checkpoint_dir(ckpt, n))).state for n in (2, 4)},
        "partial": [p.name for p in (ckpt / "iter_0000004" / "offload").glob("*")],
    }
    resumed = run_pretrain(tmp, args, train_iters=ITERS, loss_log=tmp / "resumed.jsonl")
    return {"ckpt": ckpt, "crashed": crashed, "after_crash": after_crash, "resumed": resumed,
            "resumed_output": (tmp / "resumed.out").read_text()}


def test_async_saved_checkpoints_hold_exactly_what_sync_saved_ones_do(sync_saved, async_saved):
    """The iterations after each save overwrote the state while it was being written: the files
    nevertheless hold byte for byte the synchronous save's state (in the file or in its part files),
    and training was unchanged."""
    assert async_saved["losses"] == sync_saved["losses"]
    for iteration in (2, 4, 6):
        for dp in (0, 1):
            written = saved_contents(offload_file(async_saved["ckpt"], iteration, dp))
            assert written == saved_contents(offload_file(sync_saved["ckpt"], iteration, dp)), (iteration, dp)
    states = {n: integrity.status(p).state for n, p in integrity.iteration_dirs(str(async_saved["ckpt"])).items()}
    assert states == {n: integrity.COMPLETE_STATE for n in (2, 4, 6)}


def test_training_goes_on_while_the_offloaded_state_is_written(async_saved):
    """Iteration 3 ran while checkpoint 2 was being written, and training paused for a fraction of
    the write: the update did not wait for the writer."""
    output = async_saved["output"]
    saved = output.index("> checkpoint at iteration 2: training held")
    finalized = output.index("> saved checkpoint at iteration 2 ")
    assert saved < output.index(" iteration        3/") < finalized
    figures = re.search(r"> saved checkpoint at iteration 2 .*offloaded optimizer state [0-9.]+ GB in ([0-9.]+) s .* "
                        r"per rank written in the background; training paused ([0-9.]+) s", output)
    write_s, paused_s = float(figures.group(1)), float(figures.group(2))
    assert write_s >= 1.0 and paused_s < write_s / 2, figures.group(0)


def test_torch_dists_forked_writer_flushes_its_files_paced(async_saved, chain):
    """Its tiers on the checkpoint's disk: each save says torch_dist's writer is paced behind them, and once
    finalized, that its processes put every file on the disk in paced pieces, none by a plain fsync; the chain that resumed from such checkpoints goes on exactly (test below)."""
    saves = list(range(SAVE_EVERY, ITERS + 1, SAVE_EVERY))
    resumed_at = int(chain["after_crash"]["tracker"])
    for output, iterations in ((async_saved["output"], saves), (chain["resumed_output"],
                                                                [n for n in saves if n > resumed_at])):
        assert iterations, (saves, resumed_at)
        for n in iterations:
            assert re.search(rf"> checkpoint at iteration {n}: training held .*; its files put on the disk as "
                             r"written, in 32 MiB pieces paced behind the nvme/pfs tier", output), output[-3000:]
            flushed = re.search(rf"> saved checkpoint at iteration {n} .*; torch_dist's writer: ([0-9]+) files flushed "
                                r"paced \(([0-9.]+) GB in ([0-9]+) pieces, [0-9]+ waited [0-9.]+ s for the tiers\)$",
                                output, re.MULTILINE)
            assert flushed, [ln for ln in output.splitlines() if f"saved checkpoint at iteration {n}" in ln]
            assert int(flushed.group(1)) >= 1 and int(flushed.group(3)) >= int(flushed.group(1))



def test_each_saves_writers_are_due_before_the_next_save_and_the_last_ones_are_not(async_saved):
    """A save with another after it gives torch_dist's flushes and the offloaded state's writer that save's
    time (at the iterations' pace before it) to be done by; the end of training's save has none."""
    output = async_saved["output"]
    saves = list(range(SAVE_EVERY, ITERS + 1, SAVE_EVERY))
    for n in saves:
        line = next(ln for ln in output.splitlines() if f"> checkpoint at iteration {n}: training held" in ln)
        assert ("before the next save" in line) == (n != ITERS), line
    writer_lines = [ln for ln in output.splitlines() if "INFO async save: writer paced" in ln]
    assert len(writer_lines) == 2 * len(saves)  # each save's line from each of the two ranks
    due = [ln for ln in writer_lines if re.search(r"to be done within [0-9.]+ s, before the next save", ln)]
    assert len(due) == 2 * (len(saves) - (ITERS in saves)), writer_lines


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(chain):
    assert chain["crashed"]["returncode"] != 0, chain["crashed"]["output"][-3000:]
    assert "> saved checkpoint at iteration 2 " in chain["crashed"]["output"]  # finalized before the kill
    assert chain["after_crash"]["tracker"] == "2"
    assert chain["after_crash"]["states"] == {2: integrity.COMPLETE_STATE, 4: integrity.INCOMPLETE}
    assert "pp000_tp000_dp001.offload.tmp" in chain["after_crash"]["partial"]  # killed mid-file
    assert f"removed incomplete checkpoint {chain['ckpt'] / 'iter_0000004'}" in chain["resumed_output"]


def test_the_async_chain_resumes_exactly(chain, sync_saved):
    resumed = chain["resumed"]
    assert [r["iteration"] for r in resumed] == list(range(3, ITERS + 1))
    assert resumed == sync_saved["losses"][2:]


def test_every_save_is_finalized_before_exit(chain):
    """Each save says how long training was held, then, later, that it completed and what training
    paused in all; the exit waited for the last one: all complete, the tracker at the last."""
    ckpt, output = chain["ckpt"], chain["resumed_output"]
    for n in (4, 6):
        assert f"> checkpoint at iteration {n}: training held" in output
        assert "and offloaded optimizer state" in output
        assert re.search(rf"> saved checkpoint at iteration {n} to {ckpt} \(finalized in the background\): .*"
                         r"written in the background; training paused [0-9.]+ s \([0-9.]+ s at the save, "
                         r"[0-9.]+ s in the updates after it\)", output)
    assert "not implemented" not in output
    assert (ckpt / integrity.TRACKER).read_text() == "6"
    assert {n: integrity.status(p).state for n, p in integrity.iteration_dirs(str(ckpt)).items()} == \
        {n: integrity.COMPLETE_STATE for n in (2, 4, 6)}


def _bytes_on_disk(path) -> int:
    """What a complete checkpoint directory holds, but its proof (which the save writes last)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.name != integrity.COMPLETE)


def test_each_sync_save_and_each_load_prints_bytes_seconds_and_rate(sync_saved, chain):
    """One line per synchronous save and per load (rank 0): bytes, seconds and GB/s; the bytes are
    the checkpoint's on disk (to the printed 3 decimals of a GB)."""
    number = r"([0-9]+\.[0-9]+)"
    for n in (2, 4, 6):
        lines = re.findall(rf"> saved checkpoint at iteration {n} to {sync_saved['ckpt']}: {number} GB in "
                           rf"{number} s \({number} GB/s\).*; torch_dist {number} GB in {number} s .* beside the "
                           rf"offloaded optimizer state {number} GB", sync_saved["output"])
        assert len(lines) == 1, sync_saved["output"][-3000:]
        gb = float(lines[0][0])
        assert abs(gb - _bytes_on_disk(integrity.checkpoint_dir(sync_saved["ckpt"], n)) / 1e9) <= 0.0005
    loads = re.findall(rf"> loading checkpoint from {chain['ckpt']}: done, {number} GB in {number} s \({number} GB/s\)",
                       chain["resumed_output"])
    assert len(loads) == 1, chain["resumed_output"][-3000:]
    assert abs(float(loads[0][0]) - _bytes_on_disk(integrity.checkpoint_dir(chain["ckpt"], 2)) / 1e9) <= 0.0005


def test_a_save_that_finds_the_last_one_unfinished_waits_and_says_how_long(async_saved):
    """Checkpoint 2's slowed writer (about 2 s) is still going when iteration 4 saves: that save waits
    for it, within the time training was held, and its line says how long."""
    output = async_saved["output"]
    assert output.index("> checkpoint at iteration 4: training held") < output.index("> saved checkpoint at iteration 4 ")
    line = re.search(r"> checkpoint at iteration 4: training held ([0-9.]+) s \(([0-9.]+) s of it for the previous "
                     r"save to finish[;)]", output)
    assert line, [ln for ln in output.splitlines() if "checkpoint at iteration" in ln]
    held_s, waited_s = float(line.group(1)), float(line.group(2))
    assert 0 < waited_s <= held_s, line.group(0)
    # the rest of the hold, part by part (each on its slowest rank; parts under 5 ms are left out)
    parts = re.search(r"training held [0-9.]+ s \(([^)]*)\)", line.group(0) + output[line.end():]).group(1)
    seconds = [float(x) for x in re.findall(r"([0-9.]+) s of it", parts)]
    assert all(s <= held_s + 0.01 for s in seconds) and sum(seconds) >= held_s - 0.08, parts
    # and it waited for the previous save's end: checkpoint 2 was finalized before checkpoint 4 began writing
    assert output.index("> saved checkpoint at iteration 2 ") < line.start()


def test_the_paced_writers_staging_is_made_at_start_up_and_said_once(async_saved, chain):
    """Its tiers on the checkpoint's disk and no staging size given: the staging for the state held in memory is
    made before the first iteration (one line, rank 0's size); with --offload-save-staging-gb given, none is."""
    output = async_saved["output"]
    lines = [ln for ln in output.splitlines() if "kept for the saves' copies aside of the offloaded state" in ln]
    assert len(lines) == 1, lines
    size = re.search(r"--async-save: ([0-9.,]+) ([MG]B) of host memory", lines[0])
    assert size and float(size.group(1).replace(",", "")) > 0, lines[0]
    first_iteration = next(i for i, ln in enumerate(output.splitlines()) if re.search(r"iteration\s+1/", ln))
    assert output.splitlines().index(lines[0]) < first_iteration
    assert "copies aside of the offloaded state" not in chain["resumed_output"]


def test_the_standing_workers_checkpoints_equal_the_synchronous_ones(sync_saved, worker_saved):
    """With --use-persistent-ckpt-worker the torch_dist files are written by the process each rank forked at
    start-up, from the staging the save copied them into: the weights and the offloaded state are the
    synchronous save's, every save is complete, and training is unchanged."""
    assert worker_saved["losses"] == sync_saved["losses"]
    for iteration in (2, 4, 6):
        written = global_weights(integrity.checkpoint_dir(worker_saved["ckpt"], iteration))
        reference = global_weights(integrity.checkpoint_dir(sync_saved["ckpt"], iteration))
        assert written.keys() == reference.keys() and written, iteration
        for key, tensor in reference.items():
            assert torch.equal(written[key], tensor), (iteration, key)
        for dp in (0, 1):
            assert saved_contents(offload_file(worker_saved["ckpt"], iteration, dp)) == \
                saved_contents(offload_file(sync_saved["ckpt"], iteration, dp)), (iteration, dp)
    states = {n: integrity.status(p).state for n, p in integrity.iteration_dirs(str(worker_saved["ckpt"])).items()}
    assert states == {n: integrity.COMPLETE_STATE for n in (2, 4, 6)}


def test_the_standing_worker_is_made_before_the_first_iteration_and_flushes_paced(worker_saved):
    """One start-up line names the worker and its staging; each save's files are flushed paced behind the tiers,
    as the forked writer's are."""
    output = worker_saved["output"]
    lines = [ln for ln in output.splitlines() if "kept as the staging of the checkpoint worker made at start-up" in ln]
    assert len(lines) == 1, output[-3000:]
    assert re.search(r"--async-save: [0-9.,]+ [kMG]B of host memory \(rank 0\) .* \(pid [0-9]+\)", lines[0]), lines[0]
    first_iteration = next(i for i, ln in enumerate(output.splitlines()) if re.search(r"iteration\s+1/", ln))
    assert output.splitlines().index(lines[0]) < first_iteration
    for n in range(SAVE_EVERY, ITERS + 1, SAVE_EVERY):
        assert re.search(rf"> saved checkpoint at iteration {n} .*; torch_dist's writer: [1-9][0-9]* files flushed "
                         r"paced", output), [ln for ln in output.splitlines() if f"iteration {n} " in ln]
