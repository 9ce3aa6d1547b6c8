"""The determinism experiment's samplers and readers (benchmarks/experiments/disk_watch.py, beside_writer.py,
pacing_model.py, first_step_copy.py, rest_vs_thread.py): the training rank found among torchrun's processes, its
main thread's time on a core, time waiting for one and context switches read as the kernel writes them, and those
summed over an iteration, on a /proc made in the test; the pacing model's figures; the first step after a save read
against its copy aside; the time outside the update read against the training thread's switches."""

import math
import mmap
import re
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "experiments")))

import beside_writer  # noqa: E402
import disk_watch  # noqa: E402
import first_step_copy  # noqa: E402
import pacing_model  # noqa: E402
import pooled_own_steps  # noqa: E402
import rest_vs_thread  # noqa: E402


def fake_process(proc, pid, ppid, cmdline, ran_ns=None, waited_ns=None, voluntary=0, involuntary=0, minflt=0,
                 cminflt=0):
    root = proc / str(pid)
    (root / "task" / str(pid)).mkdir(parents=True)
    (root / "cmdline").write_bytes(b"\0".join(cmdline) + b"\0")
    (root / "stat").write_text(f"{pid} (python3 (x)) S {ppid} 1 1 0 -1 4194560 {minflt} {cminflt} 0 0 7 3\n")  # a
    # name with ") " in it, as comm may have; its main thread took a third of its faults
    (root / "task" / str(pid) / "stat").write_text(f"{pid} (python3) S {ppid} 1 1 0 -1 4194560 {minflt // 3} 0 0 0\n")
    if ran_ns is not None:
        (root / "task" / str(pid) / "schedstat").write_text(f"{ran_ns} {waited_ns} 77\n")
        (root / "task" / str(pid) / "status").write_text(
            f"Name:\tpython3\nvoluntary_ctxt_switches:\t{voluntary}\nnonvoluntary_ctxt_switches:\t{involuntary}\n")


def test_the_rank_is_the_child_of_torchrun_not_torchrun_nor_the_ranks_own_children(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 10, 1, [b"/usr/bin/python3", b"/usr/bin/torchrun", b"--nproc_per_node", b"1", b"pretrain_gpt.py"])
    fake_process(proc, 31, 10, [b"/usr/bin/python3", b"-u", b"pretrain_gpt.py", b"--bf16"], 1_500_000_000, 250_000_000,
                 4000, 90)
    fake_process(proc, 12, 31, [b"/usr/bin/python3", b"-u", b"pretrain_gpt.py", b"--bf16"])  # its forked writer
    fake_process(proc, 13, 1, [b"/usr/bin/python3", b"disk_watch.py"])
    (proc / "self").mkdir()
    assert disk_watch.rank_pid(str(proc)) == 31
    assert disk_watch.thread_schedule(31, str(proc)) == (1.5, 0.25, 4000.0, 90.0)
    assert all(math.isnan(x) for x in disk_watch.thread_schedule(None, str(proc)))
    assert all(math.isnan(x) for x in disk_watch.thread_schedule(12, str(proc)))  # nothing to read: nan, no error
    empty = tmp_path / "empty"
    empty.mkdir()
    assert disk_watch.rank_pid(str(empty)) is None


def test_the_ranks_page_faults_are_apart_from_its_descendants_reaped_or_live(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 10, 1, [b"torchrun"], minflt=9000)
    fake_process(proc, 31, 10, [b"pretrain_gpt.py"], minflt=500, cminflt=40)  # 40: its writers already reaped
    fake_process(proc, 12, 31, [b"pretrain_gpt.py"], minflt=70)  # a live writer
    fake_process(proc, 14, 12, [b"pretrain_gpt.py"], minflt=5)  # the writer's own worker
    fake_process(proc, 13, 1, [b"disk_watch.py"], minflt=1000)
    (proc / "15").mkdir()  # gone between the listing and the read: skipped
    assert disk_watch.page_faults_of(31, str(proc)) == (500.0, 115.0)
    assert disk_watch.thread_faults(31, str(proc)) == 166.0
    assert math.isnan(disk_watch.thread_faults(None, str(proc))) and math.isnan(disk_watch.thread_faults(99, str(proc)))
    assert all(math.isnan(x) for x in disk_watch.page_faults_of(None, str(proc)))
    assert all(math.isnan(x) for x in disk_watch.page_faults_of(99, str(proc)))


def test_a_live_childs_page_faults_count_as_its_parents_descendants():
    """On the real /proc: a child that writes 64 MiB of fresh memory faults at least a page per 4 KiB of it."""
    before = disk_watch.page_faults_of(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (64 << 20); print('ok', flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        after = disk_watch.page_faults_of(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert after[1] - before[1] >= 0.9 * (64 << 20) / 4096
    assert after[0] >= before[0]


def test_the_main_threads_own_faults_count_what_it_touches_fresh():
    """On the real /proc: 32 MiB the main thread writes fresh are at least a fault per 4 KiB of its own (a fresh
    anonymous mapping: memory the allocator kept from earlier tests would fault nothing)."""
    size = 32 << 20
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        block.madvise(mmap.MADV_NOHUGEPAGE)  # a fault per 4 KiB, as the assertion counts
    before = disk_watch.thread_faults(os.getpid())
    for offset in range(0, size, 4096):
        block[offset] = 1
    after = disk_watch.thread_faults(os.getpid())
    block.close()
    assert after - before >= 0.9 * size / 4096


def test_an_iterations_page_faults_are_the_rank_and_its_descendants_apart():
    nan = float("nan")
    base = [0.0] * 13
    samples = [(100.0, *base[1:], nan, nan, nan),
               (101.0, *base[1:], 1000.0, 50.0, 500.0),
               (103.0, *base[1:], 191000.0, 2050.0, 150500.0)]
    ends = {3: 100.1, 4: 101.2, 5: 103.1}
    assert beside_writer.faults_during(5, ends, samples) == (0.19, 0.002, 0.15)
    assert beside_writer.faults_during(5, ends, [s[:15] for s in samples]) == (0.19, 0.002)  # no thread column yet
    assert beside_writer.faults_during(4, ends, samples) is None  # its start sampled before the rank was seen
    assert beside_writer.faults_during(5, ends, [s[:13] for s in samples]) is None  # an older disk_watch's samples


def test_an_iterations_thread_time_is_the_difference_of_the_samples_around_it():
    nan = float("nan")
    base = [0.0] * 9
    samples = [(100.0, *base[1:], nan, nan, nan, nan),
               (101.0, *base[1:], 10.0, 1.0, 500.0, 20.0),
               (103.0, *base[1:], 11.5, 1.75, 800.0, 26.0)]
    ends = {4: 101.2, 5: 103.1, 3: 100.1}
    assert beside_writer.thread_during(5, ends, samples) == (1.5, 0.75, 300.0, 6.0)
    assert beside_writer.thread_during(4, ends, samples) is None  # its start sampled before the thread was seen
    assert beside_writer.thread_during(5, ends, [s[:9] for s in samples]) is None  # an older disk_watch's samples


def test_an_iterations_switches_are_split_at_its_updates_start():
    nan = float("nan")
    base = [0.0] * 9
    samples = [(100.0, *base[1:], 10.0, 1.0, 500.0, 20.0),
               (102.0, *base[1:], 11.0, 1.0, 900.0, 20.0),  # the forward and backward: 400 switches, 1 s on a core
               (106.0, *base[1:], 11.5, 1.0, 950.0, 21.0)]  # the update: 50, 0.5 s
    ends, updates = {4: 100.5, 5: 106.2}, {5: 4.0}  # iteration 5's update from 102.2 on
    assert beside_writer.thread_in_phases(5, ends, updates, samples) == (400.0, 1.0, 50.0, 0.5)
    assert beside_writer.thread_in_phases(5, ends, {}, samples) is None  # no update time logged
    assert beside_writer.thread_in_phases(5, ends, updates, [(100.0, *base[1:], nan, nan, nan, nan)] + samples[1:]) \
        is None  # its start sampled before the thread was seen


def test_an_iterations_disk_bytes_are_split_at_its_updates_start():
    samples = [(100.0, 1e9, 5e9), (102.0, 1.5e9, 6e9),  # the forward and backward: read 0.5 GB, wrote 1 GB
               (106.0, 5.5e9, 10e9)]  # the update: read 4, wrote 4
    ends, updates = {4: 100.5, 5: 106.2}, {5: 4.0}  # iteration 5's update from 102.2 on
    assert beside_writer.disk_in_phases(5, ends, updates, samples) == pytest.approx((0.5, 1.0, 4.0, 4.0))
    assert beside_writer.disk_in_phases(5, ends, {}, samples) is None  # no update time logged


def test_where_the_writers_bytes_landed_is_summed_over_the_steps_beside_it(tmp_path):
    def step(stamp, it, total_s, update_s):
        return (f"[{stamp:.3f}] iteration {it:8d}/      16 | elapsed time per iteration (ms): {total_s * 1e3:.1f} "
                f"| offload update time (ms): {update_s * 1e3:.1f}")
    async_log = [step(100.0, 8, 5.0, 4.0), "[100.1] > checkpoint at iteration 8: training held 0.30 s (...)",
                 step(106.0, 9, 6.0, 4.5),
                 "[111.1] [offload rank 0] INFO offloaded state /x/iter_0000008/offload/a.offload paced: 8 GB",
                 step(112.0, 10, 6.0, 4.2), step(117.0, 11, 5.0, 4.0)]  # 9 and 10 beside the writer: 10 its last
    plain_log = [step(200.0, 8, 5.0, 4.0), step(205.0, 9, 5.0, 4.0), step(210.0, 10, 5.0, 4.0),
                 step(215.0, 11, 5.0, 4.0)]
    # (epoch, bytes read, bytes written, dirty) at each step's start, its update's start and its end
    async_disk = [(100.0, 0, 0, 0), (101.5, 1e9, 2e9, 0), (106.0, 5e9, 9e9, 0),  # 9: 1+2 GB, then 4+7
                  (107.8, 5.5e9, 10e9, 0), (112.0, 9.5e9, 15e9, 0)]  # 10: 0.5+1, then 4+5
    plain_disk = [(200.0, 0, 0, 0), (201.0, 0.2e9, 0.3e9, 0), (205.0, 4.2e9, 4.3e9, 0),  # 9: 0.5, then 8
                  (206.0, 4.4e9, 4.6e9, 0), (210.0, 8.4e9, 8.6e9, 0)]  # 10: 0.5, then 8
    paths = []
    for name, rows in (("a", async_disk), ("b", plain_disk)):
        paths.append(str(tmp_path / f"disk_{name}.txt"))
        with open(paths[-1], "w") as f:
            f.write("".join(" ".join(str(x) for x in row) + "\n" for row in rows))
    during = beside_writer.beside(async_log)
    assert during == {9: 8, 10: 8}
    row = beside_writer.disk_rows(during, async_log, plain_log, paths)[-1]
    # forward and backward: (3 - 0.5) + (1.5 - 0.5); updates: (11 - 8) + (9 - 8); seconds: (1.5 - 1) + (1.8 - 1),
    # (4.5 - 4) + (4.2 - 4)
    assert row == ("iterations 9-10: the disk moved 3.50 GB more in their forwards and backwards and 4.00 GB more "
                   "in their updates than without saves; they took 1.30 s and 0.70 s more")
    assert beside_writer.disk_rows({12: 8}, async_log, plain_log, paths) == [
        "no iteration's update split in both runs"]  # iteration 12 is in neither log


def test_the_iterations_after_and_before_the_first_save_are_summed_against_the_run_without_saves():
    times = {1: 9.0, 2: 6.0, 3: 5.0, 4: 7.0, 5: 8.0, 6: 6.0}
    plain = {1: 1.0, 2: 5.0, 3: 5.0, 4: 5.0, 5: 5.0}  # its iteration 6 missing: left out of both sums
    rows = beside_writer.summed_rows(times, plain, first_save=3)
    assert rows == ["iterations 4-5 (after the first save) together: 1.50x the run without saves",  # 15 / 10
                    "iterations 2-3 (before the first save) together: 1.10x the run without saves"]  # 11 / 10


def test_the_steps_beside_a_writer_are_read_against_the_median_of_the_same_steps_without_saves():
    plain = {8: 5.0, 9: 4.0, 10: 5.0, 11: 6.0, 12: 5.5}
    times = {8: 5.0, 9: 6.0, 10: 5.0, 11: 6.3, 12: 5.0}
    during = {9: 8, 10: 8, 11: 8}  # the median of 4.0, 5.0 and 6.0 is 5.0
    row = beside_writer.against_median_row(times, plain, during)
    assert row.startswith("iterations 9-11 beside the writer")
    assert "(5.00 s; that run's own 0.80-1.20x of it): worst 1.26x, mean 1.15x" in row  # 6.0/5.0 and 6.3/5.0
    assert beside_writer.against_median_row(times, plain, {13: 8}) is None


def iteration_line(it, seconds):
    return f" iteration {it:8d}/      16 | elapsed time per iteration (ms): {seconds * 1e3:.1f} | learning rate: 3E-04"


def test_a_second_run_without_saves_is_read_against_the_first_over_the_steps_beside_the_writer(tmp_path):
    async_log = [iteration_line(8, 5.0), "> checkpoint at iteration 8: training held 0.30 s (...)",
                 iteration_line(9, 6.0), iteration_line(10, 6.0),
                 "[offload rank 0] INFO offloaded state /x/iter_0000008/offload/a.offload paced: 8 GB",
                 iteration_line(11, 6.0), iteration_line(12, 9.0)]  # 11 the writer's last; 12 not beside it
    plain = [iteration_line(i, 5.0) for i in range(8, 13)]
    repeat = [iteration_line(8, 9.0), iteration_line(9, 5.5), iteration_line(10, 4.5), iteration_line(11, 5.0),
              iteration_line(12, 9.0)]
    assert beside_writer.beside(async_log) == {9: 8, 10: 8, 11: 8}
    assert beside_writer.repeat_row(async_log, plain, repeat) == (
        "iterations 9-11 of a second run without saves against the first (no writer in either): worst 1.10x, "
        "mean 1.00x")  # 5.5/5, 4.5/5, 5/5: iterations 8 and 12 are outside the writer's span
    assert beside_writer.repeat_row(async_log, plain, plain[:1]) is None
    paths = {}
    for name, lines in (("a", async_log), ("b", plain), ("c", repeat)):
        paths[name] = tmp_path / f"{name}.log"
        paths[name].write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, beside_writer.__file__, str(paths["a"]), str(paths["b"]), "--repeat",
                          str(paths["c"])], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1].startswith("iterations 9-11 of a second run without saves") and out[0].endswith(": 1.20x")  # 6.0 / 5.0


def test_the_training_thread_is_placed_by_its_state_wait_channel_and_system_call(tmp_path):
    import thread_waits  # noqa: E402

    task = tmp_path / "proc" / "31" / "task" / "31"
    task.mkdir(parents=True)
    (task / "stat").write_text("31 (python3 (x)) S 10 1 1 0 -1\n")
    (task / "wchan").write_text("futex_do_wait")
    (task / "syscall").write_text("202 0x7f 0x80 0x0 0x0 0x0 0x0 0x7ffe 0x7f00\n")
    assert thread_waits.wait_key(31, str(tmp_path / "proc")) == "S:futex_do_wait:202"
    (task / "stat").write_text("31 (python3) R 10 1 1 0 -1\n")
    assert thread_waits.wait_key(31, str(tmp_path / "proc")) == "R"
    assert thread_waits.wait_key(32, str(tmp_path / "proc")) == "gone"


def test_an_iterations_waits_are_the_windows_that_ended_in_its_forward_and_backward(tmp_path):
    stamped = ["[100.0] iteration 4/ 9 | elapsed time per iteration (ms): 5000.0 | offload update time (ms): 2000.0",
               "[106.0] iteration 5/ 9 | elapsed time per iteration (ms): 6000.0 | offload update time (ms): 3000.0"]
    lines = ["[99.0] > checkpoint at iteration 4: training held 0.30 s"] + stamped
    waits = tmp_path / "waits.txt"
    waits.write_text("100.0 10 R=10\n"  # iteration 4's: left out
                     "101.0 10 R=6 S:futex_do_wait:202=4\n"
                     "103.0 10 R=2 S:futex_do_wait:202=8\n"  # the forward and backward ends at 106 - 3 = 103
                     "104.0 10 S:-:16=10\n")  # the update's: left out
    rows = beside_writer.wait_rows({5: 4}, lines, stamped, [str(waits), str(waits)])
    assert rows == ["  iteration 5's training thread in its forward and backward: S:futex_do_wait:202 60%, R 40% "
                    "(without saves: S:futex_do_wait:202 60%, R 40%)"]


def test_beside_writer_names_a_missing_log_in_one_line(tmp_path, capsys):
    missing = str(tmp_path / "determinism_A8.log")
    with pytest.raises(SystemExit) as exit_:
        beside_writer.main(["beside_writer.py", missing, missing])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"beside_writer.py: error: {missing}: no such log" and "Traceback" not in "\n".join(err)


SMAPS = """55d0a000-55d0b000 rw-p 00000000 00:00 0                          [heap]
Size:                  4 kB
Rss:                 400 kB
Private_Dirty:       300 kB
Shared_Dirty:         60 kB
VmFlags: rd wr mr mw me ac
7f00-7f10 rw-p 00000000 00:00 0 
Rss:                1000 kB
Shared_Dirty:        900 kB
Private_Dirty:       100 kB
7f20-7f30 r--p 00001000 08:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                  80 kB
Private_Dirty:         8 kB
7f40-7f50 rw-s 00000000 00:05 99                         /dev/shm/torch_1_2 (deleted)
Rss:                  16 kB
Shared_Dirty:         16 kB
7ffd-7ffe rw-p 00000000 00:00 0                          [stack]
Rss:                  12 kB
Private_Dirty:        12 kB
ffff-10000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   4 kB
"""


def test_the_ranks_mappings_are_summed_by_kind_and_a_sample_line_reads_back():
    import rank_maps  # noqa: E402

    sums = rank_maps.by_kind(SMAPS)
    assert sums == {"heap": [400, 300, 60], "anon": [1000, 100, 900], "file": [80, 8, 0], "shmem": [16, 0, 16],
                    "stack": [12, 12, 0], "other": [4, 0, 0]}
    when, back = rank_maps.parse_line(rank_maps.sample_line(12.5, sums))
    assert when == 12.5 and back["anon"] == (1000, 100, 900) and set(back) == set(rank_maps.KINDS)
    assert rank_maps.parse_line("  \n") is None


def test_pages_written_while_a_forked_child_lives_turn_from_shared_to_private():
    """On the real /proc: 64 MiB written before a fork are shared dirty while the child lives; written again by the
    parent, they become its private copies (a copy-on-write fault a page)."""
    import rank_maps  # noqa: E402

    block = bytearray(b"x" * (64 << 20))  # anonymous memory: a block this large is mmap'ed on its own
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        time.sleep(0.2)
        shared = rank_maps.by_kind(rank_maps.read_smaps(os.getpid()))["anon"]
        for i in range(0, len(block), 4096):
            block[i] = 121
        copied = rank_maps.by_kind(rank_maps.read_smaps(os.getpid()))["anon"]
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    mib = 1024
    assert shared[2] >= 64 * mib and copied[2] <= shared[2] - 60 * mib  # KiB
    assert copied[1] >= shared[1] + 60 * mib


def test_an_iterations_rank_memory_change_is_read_from_the_samples_around_it(tmp_path):
    import rank_maps  # noqa: E402

    def line(when, heap_private, anon_private, anon_shared):
        return rank_maps.sample_line(when, {"heap": [0, heap_private, 0], "anon": [0, anon_private, anon_shared]})

    (tmp_path / "a.txt").write_text("\n".join([line(100.0, 1024, 0, 512000), line(101.0, 1024, 0, 512000),
                                               line(103.0, 3072, 204800, 307200)]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join([line(100.0, 1024, 0, 0), line(103.0, 1024, 0, 0)]) + "\n")
    lines = ["[101.10] iteration        4/      16 | elapsed time per iteration (ms): 1000.0",
             "[103.10] iteration        5/      16 | elapsed time per iteration (ms): 2000.0"]
    rows = beside_writer.maps_rows({5: 8}, lines, lines, [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert rows == ["  iteration 5's rank memory, MB private/shared dirty: heap +2/+0, anon +200/-200 (without saves: "
                    "no kind moved 1 MB)"]


@pytest.mark.parametrize("sampler, args", [("disk_watch.py", ["{tmp}", "{out}", "0.05"]),
                                           ("thread_waits.py", ["{out}", "50"]),
                                           ("rank_maps.py", ["{out}", "0.05"])])
def test_a_sampler_whose_experiment_is_gone_stops_itself(tmp_path, sampler, args):
    """A sampler outliving a killed experiment would go on writing into a file that the next run of the
    experiment writes too: it ends once its parent has."""
    script = os.path.join(os.path.dirname(beside_writer.__file__), sampler)
    line = " ".join([sys.executable, script] + [a.format(tmp=tmp_path, out=tmp_path / "samples.txt") for a in args])
    # the shell starts the sampler in the background and ends while it runs, as a killed experiment's shell would
    started = subprocess.run(["bash", "-c", f"{line} >/dev/null 2>&1 & echo $!; sleep 3"], capture_output=True,
                             text=True, check=True)
    pid = int(started.stdout.strip())
    deadline = time.time() + 20
    while time.time() < deadline and _state_of(pid) not in ("gone", "Z"):
        time.sleep(0.1)
    state = _state_of(pid)
    if state not in ("gone", "Z"):
        os.kill(pid, 9)  # not left running after the test
    assert state in ("gone", "Z"), f"{sampler} still runs after its parent ended"


def _state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_pacing_model_places_every_byte_in_a_quiet_spell_or_beside_an_update(capsys):
    """The model's two figures add up to the bytes it was given (whole chunks), and each step's bytes beside its
    update are at most the bytes it moved (where they go is the tree's rule: the pacing tests hold it)."""
    assert pacing_model.main(["pacing_model.py", "--gb", "0.5", "--disk-gbps", "1.0", "--step-s", "1.0",
                              "--busy", "0.5", "--steps-to-due", "4"]) == 0
    first, per_step = capsys.readouterr().out.splitlines()
    total = 0.5e9 // (32 << 20) * (32 << 20) / 1e9
    quiet, beside = (float(x) for x in re.findall(r"([0-9.]+) GB (?:in the quiet spells|beside the updates)", first))
    assert first.startswith(f"{total:.1f} GB in ") and quiet + beside == pytest.approx(total, abs=0.11)
    for pair in re.findall(r"\d+: ([0-9.]+)/([0-9.]+)", per_step):
        assert float(pair[0]) <= float(pair[1])


def test_the_first_step_and_its_copy_aside_are_read_from_a_readings_text():
    text = ("iteration 9: 7.08 s beside the writer of checkpoint 8 (update 4.76 + rest 2.32), 5.31 s without saves "
            "(update 3.85 + rest 1.46): 1.33x\niteration 10: 6.01 s beside ...: 1.16x\n"
            "[1796089829.503] [offload rank 0] INFO offloaded state /x paced: 8.13 GB copied aside first in 0.99 s; "
            "11.74 GB moved\n[1796089853.6] INFO offloaded state /y paced: 8.13 GB copied aside first in 0.74 s\n")
    assert first_step_copy.reading(text) == (8.13, 0.99, 1.33, 9)  # the first save's copy, the first step
    assert first_step_copy.reading("iteration 9: 1.0x\n") is None


def test_the_rank_correlation_shares_ties_and_is_one_for_any_rising_pair():
    assert list(first_step_copy.ranks(first_step_copy.np.array([3.0, 1.0, 3.0, 2.0]))) == [2.5, 0.0, 2.5, 1.0]
    seconds = first_step_copy.np.array([0.5, 0.8, 1.0, 2.0, 5.0])
    ratios = first_step_copy.np.exp(seconds)  # rising but not a line: Spearman 1, Pearson below it
    c = first_step_copy.correlations(seconds, ratios)
    assert c["spearman"] == pytest.approx(1.0) and c["pearson"] < 0.99
    mean_s, mean_r = seconds[:4].mean(), ratios[:4].mean()  # without the slowest, by the formula
    r = (((seconds[:4] - mean_s) * (ratios[:4] - mean_r)).sum()
         / math.sqrt(((seconds[:4] - mean_s) ** 2).sum() * ((ratios[:4] - mean_r) ** 2).sum()))
    assert c["pearson_without_slowest"] == pytest.approx(r)


def test_a_run_read_against_its_own_steps_before_the_save():
    lines = "".join(f" iteration {i:8d}/      16 | elapsed time per iteration (ms): {ms:.1f} | loss 1.0\n"
                    for i, ms in enumerate([9000, 5100, 5000, 4000, 5200, 4800, 6000, 5000, 7500, 5000, 5000, 5000,
                                            5000, 5250, 5000, 5000], start=1))
    base, first, most, mean = first_step_copy.own_reading(lines, save_at=8)
    assert base == 5.0  # median of steps 3-7 (5.0, 4.0, 5.2, 4.8, 6.0): warm-up steps 1-2 and the save's step out
    assert first == 1.5 and most == 1.5  # step 9
    assert mean == pytest.approx((7.5 + 5 + 5 + 5 + 5 + 5.25) / 5.0 / 6)
    assert first_step_copy.own_reading(lines, save_at=12) is None  # steps 13-18: the run ends at 16


def run_log(tmp_path, name, step_ms):
    path = tmp_path / name
    path.write_text("".join(f" iteration {i:8d}/      16 | elapsed time per iteration (ms): {ms:.1f} | loss 1.0\n"
                            for i, ms in enumerate(step_ms, start=1)))
    return str(path)


def test_runs_with_and_without_the_writer_are_pooled_against_their_own_steps_before_the_save(tmp_path, capsys):
    before = [9000, 6000, 5000, 5000, 5000, 5000, 5000, 5000]  # steps 3-7: median 5.0 s
    slow = run_log(tmp_path, "a1.log", before + [6500, 6000, 5500, 5500, 5000, 5000, 5000, 5000])
    slower = run_log(tmp_path, "a2.log", before + [7000, 5500, 5500, 5500, 5500, 5500, 5000, 5000])
    flat = run_log(tmp_path, "b1.log", before + [5000, 5000, 5000, 5000, 5000, 5500, 5000, 5000])
    short = run_log(tmp_path, "b2.log", before + [5000, 5000])  # steps 11-14 missing
    with_writer, skipped = pooled_own_steps.group_ratios([slow, slower], save_at=8)
    assert skipped == [] and with_writer[0] == pytest.approx([1.3, 1.2, 1.1, 1.1, 1.0, 1.0])
    without, skipped = pooled_own_steps.group_ratios([flat, short], save_at=8)
    assert skipped == [short] and without == [pytest.approx([1.0] * 5 + [1.1])]
    assert "2 runs, 12 steps" in pooled_own_steps.describe(with_writer)
    assert "most 1.40x; 2 of 12 over 1.25x" in pooled_own_steps.describe(with_writer)  # 6.5 and 7.0 s / 5.0 s
    diff, low, high = pooled_own_steps.mean_difference(with_writer, without)
    expected = (sum(with_writer[0]) + sum(with_writer[1])) / 12 - (5 * 1.0 + 1.1) / 6
    assert diff == pytest.approx(expected) and low <= diff <= high
    assert pooled_own_steps.main(["--with", slow, "--without", short]) == 2  # no run left without saves
    assert "b2.log: steps 3-14 not all in it, left out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        pooled_own_steps.main(["--with", slow, "--without", str(tmp_path / "none.log")])
    assert exited.value.code == 2 and "no such log: " in capsys.readouterr().err


def test_the_disk_sustain_phases_are_read_against_the_first_phases_median(tmp_path, capsys):
    import disk_sustain

    rows = [("idle", 0, s, 0) for s in (3.0, 3.2, 3.4)] + [("full", 1, s, 10) for s in (3.2, 4.25)]
    lines = disk_sustain.summary(rows)
    assert lines[0].startswith("phase 0 (idle): busy spells 3.00-3.40 s, median 3.20 s: 1.00x, worst 1.06x")
    assert "phase 1 (full): busy spells 3.20-4.25 s" in lines[1] and "worst 1.33x" in lines[1]
    assert disk_sustain.main([str(tmp_path), "--phases", "idle,bogus"]) == 2
    assert "--phases: unknown bogus" in capsys.readouterr().err
    assert disk_sustain.main([str(tmp_path / "d"), "--read-gb", "0.04", "--write-gb", "0.04", "--quiet-s", "0.05",
                              "--cycles", "1", "--phases", "idle,half"]) == 0
    out = capsys.readouterr().out
    assert "phase 1 (half) cycle 0: busy" in out and "phase 1 (half): busy spells" in out
    assert os.listdir(tmp_path / "d") == []  # its files are removed


def test_a_models_steps_are_timed_beside_the_writer_in_a_thread_and_in_a_forked_process(tmp_path, capsys):
    import writer_beside_steps

    rows = [(0, "none", s, 0, 1.0) for s in (1.0, 1.2)] + [(1, "process", s, 2e9, 2.0) for s in (1.1, 1.5)]
    lines = writer_beside_steps.summary(rows)
    assert lines[0].startswith("phase 0 (none): steps 1.000-1.200 s, median 1.100 s: 1.000x, worst 1.091x")
    assert lines[1].endswith("the writer moved 2.00 GB at 1.00 GB/s") and "worst 1.364x" in lines[1]
    assert writer_beside_steps.main([str(tmp_path), "--phases", "none,fork"]) == 2
    assert "--phases: unknown fork" in capsys.readouterr().err
    tiny = ["--gb", "0.3", "--steps", "1", "--layers", "1", "--hidden", "64", "--ffn", "128", "--heads", "2",
            "--seq", "32", "--micro", "1", "--device", "cpu"]
    phases = "none,thread,process,thread_nocopy,thread_dma"
    assert writer_beside_steps.main([str(tmp_path / "w"), "--phases", phases, *tiny]) == 0
    out = capsys.readouterr().out
    moved = [float(m) for m in re.findall(r"the writer moved ([0-9.]+) GB", out)]
    assert len(moved) == 4 and all(m >= 0.016 for m in moved)  # each writer wrote one 16 MiB piece at least
    assert os.listdir(tmp_path / "w") == []  # the file it wrote is removed


def test_a_saves_hold_counts_the_updates_after_it_that_waited_for_its_copies():
    """The goal's check takes the finalize line's whole pause (at the save and in the updates after it) where
    the hold at the save alone would pass: 0.30 s at the save, 2.31 s more in the update that overtook the copy."""
    async_log = [iteration_line(8, 5.0), "> checkpoint at iteration 8: training held 0.30 s (0.00 s of it ...)",
                 iteration_line(9, 9.0),
                 "[offload rank 0] INFO offloaded state /x/iter_0000008/offload/a.offload paced: 8 GB",
                 iteration_line(10, 5.0),
                 "> saved checkpoint at iteration 8 to /x (finalized in the background): 18.281 GB in 51.8 s; "
                 "training paused 2.61 s (0.30 s at the save, 2.31 s in the updates after it); torch_dist's writer: "
                 "8 files flushed paced (6.031 GB in 184 pieces)"]
    plain = [iteration_line(i, 5.0) for i in range(8, 11)]
    rows, _ = beside_writer.report(async_log, plain)
    assert "checkpoint 8: training paused 2.61 s (0.30 s at the save, 2.31 s in the updates after it)" in rows
    assert ("longest hold of a save, the updates' pauses after it included: 2.61 s (NOT met: goal <= 0.5 s for "
            "every save)") in rows
    no_pause = [line.replace("2.61 s (0.30 s at the save, 2.31 s", "0.30 s (0.30 s at the save, 0.00 s")
                for line in async_log]
    rows, _ = beside_writer.report(no_pause, plain)
    assert any(row.startswith("longest hold of a save, the updates' pauses after it included: 0.30 s (met")
               for row in rows)


def test_the_extra_time_outside_the_update_is_read_beside_the_training_threads_own_extra():
    def step(it, rest, plain_rest, switches, core):
        return (f"iteration {it}: 6.00 s beside the writer of checkpoint 8 (update 4.00 + rest {rest:.2f}), 5.00 s "
                f"without saves (update 3.80 + rest {plain_rest:.2f}): 1.20x\n"
                f"  iteration {it}'s training thread in its forward and backward: {switches} voluntary switches, "
                f"{core:.2f} s on a core; in its update: 40, 0.12 s (without saves: 200, 0.45 s; 30, 0.11 s)\n")
    text = step(9, 2.00, 1.20, 400, 1.10) + step(10, 1.60, 1.20, 1700, 0.60) + step(11, 1.25, 1.20, 250, 0.47)
    rows = rest_vs_thread.readings(text)
    assert [r[0] for r in rows] == [200, 1500, 50]  # switches over the run without saves'
    assert [round(r[1], 2) for r in rows] == [0.65, 0.15, 0.02] and [round(r[2], 2) for r in rows] == [0.8, 0.4, 0.05]
    assert [r[3] for r in rows] == [1, 2, 3]  # each step's place after the save
    assert [r[4] for r in rows] == [None] * 3  # no disk lines: no bytes read
    assert rest_vs_thread.readings(step(9, 2.0, 1.2, 400, 1.1).splitlines()[0]) == []  # no thread line: no reading


def test_the_extra_time_outside_the_update_is_read_by_the_writer_that_filled_the_forward_and_backward(capsys):
    """Each step's extra GB written in its forward and backward, as beside_writer.py prints it, over the run
    without saves'; the steps that took at least each threshold grouped by their place after the save."""
    def step(it, rest, wrote, plain_wrote):
        return (f"iteration {it}: 6.00 s beside the writer of checkpoint 8 (update 4.00 + rest {rest:.2f}), 5.00 s "
                f"without saves (update 3.80 + rest 1.20): 1.20x\n"
                f"  iteration {it}'s disk in its forward and backward: read 0.10 GB, wrote {wrote:.2f} GB; in its "
                f"update: read 4.10, wrote 4.90 (without saves: 0.05, {plain_wrote:.2f}; 4.06, 4.48)\n"
                f"  iteration {it}'s training thread in its forward and backward: 900 voluntary switches, 0.60 s on a "
                f"core; in its update: 40, 0.12 s (without saves: 200, 0.45 s; 30, 0.11 s)\n")
    text = (step(9, 1.30, 3.20, 0.10) + step(10, 1.25, 1.50, 0.00) + step(11, 2.00, 3.00, 0.40)
            + step(12, 1.60, 0.50, 0.0))
    rows = rest_vs_thread.readings(text)
    assert [round(r[4], 2) for r in rows] == [3.1, 1.5, 2.6, 0.5] and [r[3] for r in rows] == [1, 2, 3, 4]
    rest_vs_thread.by_writer(rows)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 * len(rest_vs_thread.WRITTEN_GB)
    assert out[0].startswith(">= 1.0 GB written", 2) and out[0].endswith("1 steps: extra rest 0.10 s on average (0.10)")
    assert out[1].endswith("1 steps: extra rest 0.05 s on average (0.05)")
    assert out[2].endswith("1 steps: extra rest 0.80 s on average (0.80)")  # 12 wrote 0.5 GB: not counted
    assert out[4].endswith("0 steps")  # 10 wrote 1.5 GB, under 2


def test_the_rest_reading_needs_four_steps_and_prints_both_readings(tmp_path, capsys):
    path = tmp_path / "r.txt"
    lines = []
    for it, (rest, switches) in enumerate([(1.3, 300), (1.5, 900), (1.7, 1500), (1.9, 2100), (2.1, 2700)], start=9):
        lines.append(f"iteration {it}: 6.00 s beside the writer of checkpoint 8 (update 4.00 + rest {rest:.2f}), "
                     f"5.00 s without saves (update 3.80 + rest 1.20): 1.20x")
        lines.append(f"  iteration {it}'s training thread in its forward and backward: {switches} voluntary switches, "
                     f"0.50 s on a core; in its update: 40, 0.12 s (without saves: 200, 0.45 s; 30, 0.11 s)")
    path.write_text("\n".join(lines) + "\n")
    assert rest_vs_thread.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "every step: 5 steps" in out and "without the first step after each save: 4 steps" in out
    assert "extra voluntary switches against the extra rest: Pearson r 1.00, Spearman 1.00" in out  # a line
    path.write_text("\n".join(lines[:6]) + "\n")
    assert rest_vs_thread.main([str(path)]) == 1  # three steps: too few

