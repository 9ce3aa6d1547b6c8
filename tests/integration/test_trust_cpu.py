"""What a careful user trusts the checkpoints and errors with (2 CPU processes): no complete
checkpoint is ever deleted or loaded when altered, a full disk stops a save cleanly, a user error is
one line printed once per job, and SIGTERM (SLURM's time limit) saves before exiting."""

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BASELINE_ITERS as ITERS
from helpers import copy_checkpoint, offload_args
from launch import REPO, free_port, parent_pid, pretrain_command, pretrain_env, read_loss_log, run_and_clean_up, run_pretrain
from megatron.training.checkpoint import integrity
from tests.profiles import cases
from tests.small_file_system import small_file_system


def tree_digest(path):
    """Every file's name and bytes under ``path``: equal digests mean nothing was touched."""
    digest = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(dirpath, name)
            digest.update(os.path.relpath(full, path).encode())
            digest.update(open(full, "rb").read())
    return digest.hexdigest()


def error_lines(output):
    """Lines saying 'error: ...' (torchrun may prefix a rank tag), and whether any rank printed a traceback."""
    lines = [line for line in output.splitlines() if re.match(r"^(\[rank\d+\]:\s*)?error: ", line)]
    return lines, bool(re.search(r"^\[rank\d+\]:\s*Traceback", output, re.M))


def failed_run(tmp_path, args, name, with_output=False, **kw):
    """The one error line of a run that must fail (and, ``with_output``, all it printed)."""
    result = run_pretrain(tmp_path, args, loss_log=tmp_path / f"{name}.jsonl", expect_success=False, **kw)[0]
    assert result["returncode"] != 0, result["output"][-3000:]
    lines, traceback = error_lines(result["output"])
    assert len(lines) == 1 and not traceback, result["output"][-4000:]
    return (lines[0], result["output"]) if with_output else lines[0]


@pytest.fixture(scope="module")
def uninterrupted(offload_baseline):
    """The same offloaded run, never stopped (conftest.offload_baseline)."""
    return offload_baseline


@pytest.fixture
def saved(offload_saved, tmp_path):
    """``saved(*iterations)``: a checkpoint root of this test's own with the shared run's checkpoints
    of those iterations, saved every 2 (conftest.offload_saved): what a chain_args run stopped
    after its last save leaves."""
    return lambda *iterations: copy_checkpoint(offload_saved["ckpt"], iterations, tmp_path / "ckpt")


def chain_args(tmp_path, ckpt):
    return [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"]


@pytest.mark.parametrize("tracker", ["deleted", "stale", "garbage"])
def test_lost_or_stale_tracker_resumes_from_the_newest_complete_checkpoint(tmp_path, uninterrupted, saved, tracker):
    ckpt = saved(2, 4)
    kept = tree_digest(ckpt / "iter_0000004")
    if tracker == "deleted":
        (ckpt / "latest_checkpointed_iteration.txt").unlink()
    else:
        (ckpt / "latest_checkpointed_iteration.txt").write_text("2" if tracker == "stale" else "iter-4?")
    resumed = run_pretrain(tmp_path, chain_args(tmp_path, ckpt), train_iters=ITERS,
                           loss_log=tmp_path / "resumed.jsonl")
    assert resumed == uninterrupted[4:]
    output = (tmp_path / "resumed.out").read_text()
    assert f"resuming from {ckpt / 'iter_0000004'}, the newest complete checkpoint" in output
    assert "removed incomplete checkpoint" not in output
    assert tree_digest(ckpt / "iter_0000004") == kept  # never rewritten, never deleted


def test_an_unproven_checkpoint_is_never_discarded(tmp_path, saved):
    """A checkpoint directory without the completeness proof (an older version's, a partial copy)
    and no tracker: the run refuses to start fresh over it, in one line saying what to do."""
    ckpt = saved(2)
    (ckpt / "iter_0000002" / "COMPLETE.json").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    kept = tree_digest(ckpt)
    line = failed_run(tmp_path, chain_args(tmp_path, ckpt), "refused", train_iters=ITERS)
    assert f"--load {ckpt}: {ckpt / 'iter_0000002'} is unproven" in line
    assert "write 2 into" in line and "or move it out of" in line and "to start fresh" in line
    assert tree_digest(ckpt) == kept


def _edit_one_offset_digit(path):
    """Change one digit of the first per-parameter offset (still valid JSON, same length)."""
    data = bytearray(open(path, "rb").read())
    match = re.search(rb'"params": \[\["[^"]+", (\d)', bytes(data))
    pos = match.start(1)
    data[pos] = ord("1") if data[pos] != ord("1") else ord("2")
    open(path, "wb").write(bytes(data))


def test_edited_offload_footer_is_refused_at_another_dp_size(tmp_path, saved):
    """One digit of a slice offset edited: the offload file's own footer checksum refuses it (the
    directory's proof lists the file's size only, and the edit keeps it), in one line naming the file;
    nothing changes. A small file the proof checksums (metadata), edited, is refused by the proof."""
    ckpt = saved(2)
    target = ckpt / "iter_0000002"
    victim = target / "offload" / "pp000_tp000_dp001.offload"
    _edit_one_offset_digit(victim)
    kept = tree_digest(ckpt)
    line = failed_run(tmp_path, chain_args(tmp_path, ckpt), "edited", nproc=1, train_iters=ITERS)
    assert f"{victim}: checksum mismatch in the footer" in line
    assert tree_digest(ckpt) == kept
    metadata = target / "metadata.json"
    metadata.write_bytes(metadata.read_bytes().replace(b"{", b" ", 1))  # same size, other bytes
    line = failed_run(tmp_path, chain_args(tmp_path, ckpt), "metadata", nproc=1, train_iters=ITERS)
    assert f"{target} is damaged ({metadata} does not match its checksum)" in line and "restore it" in line


def test_disk_full_in_the_middle_of_a_save(tmp_path, uninterrupted, saved):
    """ENOSPC while rank 1 streams its offloaded state into checkpoint 4: one line naming the file
    and the bytes, no partial file or directory left, checkpoint 2 untouched and resumable."""
    ckpt = saved(2)
    kept = tree_digest(ckpt / "iter_0000002")
    line = failed_run(tmp_path, chain_args(tmp_path, ckpt), "full", train_iters=ITERS,
                      env={"MLP_OFFLOAD_FAULT": "save-offload@1#2=ENOSPC"})
    target = ckpt / "iter_0000004"
    assert re.search(rf"--save {ckpt}: rank 1: {target}/offload/pp000_tp000_dp001.offload: No space left on device"
                     r".* MB needed for this file, .* free; the partial file was removed; the unfinished "
                     rf"{target} was removed", line), line
    assert not target.exists() and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not list(ckpt.rglob("*.tmp")) and tree_digest(ckpt / "iter_0000002") == kept
    resumed = run_pretrain(tmp_path, chain_args(tmp_path, ckpt), train_iters=ITERS, loss_log=tmp_path / "r.jsonl")
    assert resumed == uninterrupted[2:]


def test_save_refused_up_front_when_the_file_system_is_too_small(tmp_path):
    """A real 5 MB file system holds one checkpoint (3.4 MB), not two: a warning at start-up, once, says the
    second will not fit; the second is refused before any byte is written, naming --save and the numbers; the
    first stays as it was. Needs root to mount it (CI runs it as root)."""
    with small_file_system(tmp_path / "small", "5m") as mount:
        ckpt = mount / "ckpt"
        line, output = failed_run(tmp_path, chain_args(tmp_path, ckpt), "small", with_output=True, train_iters=ITERS)
        assert re.search(rf"--save {ckpt}: the checkpoint of iteration 4 needs about 3\.\d+ MB, but only "
                         r"[\d.]+ MB are free there; nothing was written", line), line
        lines = output.splitlines()
        warnings = [n for n, ln in enumerate(lines) if "will be refused for space" in ln]
        assert len(warnings) == 1 and re.search(
            rf"warning: --save {ckpt}: the save at iteration 4 will be refused for space: about 3\.\d+ MB a "
            r"checkpoint \(every one kept\) and [\d.]+ MB free at start-up", lines[warnings[0]]), warnings
        first_step = next(n for n, ln in enumerate(lines) if re.search(r"iteration +1/", ln))
        assert warnings[0] < first_step  # before any work
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("flags,expected", [
    (["--offload-host-cache-gb", "inf"], "argument --offload-host-cache-gb: must be a finite number, got inf"),
    (["--offload-host-cache-gb", "1e7"],
     r"--offload-host-cache-gb \(1e\+07 GiB per rank\): 2 rank\(s\) of this node x 1e\+07 GiB = .* more than 64x"),
    (["--lr-warmup-iters", "6"], "argument --lr-warmup-iters: 6 must be below --lr-decay-iters"),
    (["--offload-prefetch-depth", "0"], "argument --offload-prefetch-depth"),
])
def test_user_errors_are_one_line_once_per_job(tmp_path, flags, expected):
    args = offload_args(tmp_path)
    for i in range(0, len(flags), 2):  # replace a flag offload_args already gives
        if flags[i] in args:
            del args[args.index(flags[i]): args.index(flags[i]) + 2]
    line = failed_run(tmp_path, args + flags, "bad", train_iters=ITERS)
    assert re.search(expected, line), line


RACING_RANKS = """
import os, time
from megatron.training.errors import UserError, reported_once
with reported_once():
    if os.environ["RANK"] == "0":
        time.sleep(4)  # rank 0 is the slow one: torchrun kills it once rank 1 exits
    raise UserError("--some-flag: bad value 7")
"""


def test_a_flag_error_prints_once_when_rank_0_is_slowest(tmp_path):
    """Before the process group exists, the first rank to fail claims the job's line in torchrun's
    own store: the line is out even when rank 0 is killed before it reaches the error."""
    script = tmp_path / "racing.py"
    script.write_text(RACING_RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    returncode, output = run_and_clean_up(cmd, pretrain_env(), 120, tmp_path / "racing.out")
    lines, traceback = error_lines(output)
    assert returncode != 0 and lines == ["error: --some-flag: bad value 7"] and not traceback, output[-3000:]


def _dead_namespaces(root):
    return sorted(p.name for p in root.glob("mlp_offload/*/rank*"))


def _start(tmp_path, args, log, env=None):
    out = open(tmp_path / f"{log.stem}.out", "w")
    cmd = pretrain_command(args, 2, ITERS, log)
    return subprocess.Popen(cmd, cwd=REPO, env=pretrain_env(env), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), out


def _wait_for_iterations(proc, log, count, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(read_loss_log(log)) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach iteration {count}")


def _wait_for_text(path, text, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def _children(pid):
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_pid(int(p.name)) == pid]


# one a CI run, drawn (the batch-shell SIGUSR1 of test_slurm_scripts runs every time); both under thorough
@pytest.mark.parametrize("how", cases(["SIGTERM", "SIGUSR1"], ci_keep=1))
def test_signal_saves_then_exits_and_the_run_continues_exactly(tmp_path, uninterrupted, how):
    """SIGTERM as SLURM's --signal sends it, to every process of the step (torchrun forwards it
    too); or --exit-signal SIGUSR1 sent to the ranks alone, as a batch script's trap would (torchrun
    < 2.12 SIGKILLs its workers 30 s after a SIGTERM), after a SIGQUIT that only prints a rank's
    stacks. With --exit-signal-handler the ranks finish
    the iteration, save a complete checkpoint (offloaded state included), remove their swap files
    and exit; the next job continues as if nothing had happened."""
    ckpt = tmp_path / "ckpt"
    args = [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt), "--exit-signal-handler",
            "--exit-signal", how]
    log = tmp_path / "signalled.jsonl"
    # 0.3 s at each update (numbers unchanged): the signals must land before the last of the 6
    # iterations, which took ~60 ms each once the CPU update ran in one pass (a CI run saw it save at 6)
    proc, out = _start(tmp_path, args, log, env={"MLP_OFFLOAD_DELAY": "update=0.3"})
    try:
        _wait_for_iterations(proc, log, 2)
        if how == "SIGTERM":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            ranks = _children(proc.pid)
            os.kill(ranks[0], signal.SIGQUIT)  # a rank prints its threads' stacks and trains on
            _wait_for_text(tmp_path / "signalled.out", "SIGQUIT: the stacks of")
            for rank in ranks:
                os.kill(rank, signal.SIGUSR1)
        proc.wait(timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        out.close()
    output = (tmp_path / "signalled.out").read_text()
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < ITERS, output[-3000:]
    assert f"exiting at iteration {saved} after receiving {how} (--exit-signal-handler)" in output
    if how == "SIGUSR1":
        assert proc.returncode == 0  # torchrun saw its workers finish
        # frames of the rank's code in the dump are the proof (the main thread may be in faults.py's delay)
        dump = output[output.index("SIGQUIT: the stacks of"):]
        assert re.search(r'File ".*(pretrain_gpt|megatron|mlp_offload).*\.py", line \d+ in ', dump), output[-3000:]
    assert (ckpt / f"iter_{saved:07d}" / "COMPLETE.json").exists()
    assert _dead_namespaces(tmp_path / "nvme") == [] and _dead_namespaces(tmp_path / "pfs") == []
    resumed = run_pretrain(tmp_path, args, train_iters=ITERS, loss_log=tmp_path / "resumed.jsonl")
    assert read_loss_log(log)[:saved] + resumed == uninterrupted


def test_exit_duration_saves_and_exits(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    args = [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt)]
    first = run_pretrain(tmp_path, args + ["--exit-duration-in-mins", "0"], train_iters=ITERS,
                         loss_log=tmp_path / "first.jsonl")
    assert [r["iteration"] for r in first] == [1]
    assert "exiting at iteration 1 after reaching --exit-duration-in-mins" in (tmp_path / "first.out").read_text()
    assert first + run_pretrain(tmp_path, args, train_iters=ITERS, loss_log=tmp_path / "rest.jsonl") == uninterrupted


# A rank SIGKILLed mid-update while torchrun SIGTERMs its peer, which must still remove its swap
# files: test_faults_cpu's update@1#3 case.
