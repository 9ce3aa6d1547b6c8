"""benchmarks/experiments/profile_diff.py: each thread's own time by name and time inside events against sums
written out here, on hand-made traces and on nested intervals drawn at random, and a real torch.profiler trace of
the CPU read end to end."""

import json
import random

import torch
from hypothesis import given, settings, strategies as st

from benchmarks.experiments import profile_diff


def event(tid, ts, dur, name, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "tid": tid, "pid": 1, "ts": ts, "dur": dur, "name": name}


def write(tmp_path, name, events):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


HAND = [event(1, 0, 100, "aten::linear"), event(1, 10, 50, "aten::addmm"),
        event(1, 20, 5, "cudaLaunchKernel", cat="cuda_runtime"), event(1, 150, 20, "aten::relu"),
        event(2, 0, 500, "aten::copy_"),
        event(3, 0, 10, "a"), event(3, 5, 15, "b"),  # overlapping, not nested (rounded clocks): b's overlap is not a's
        event(7, 0, 900, "gemm_kernel", cat="kernel")]  # a GPU kernel: not a CPU thread's time


def test_a_hand_made_trace_reads_as_summed_here(tmp_path):
    r = profile_diff.read(write(tmp_path, "a.json", HAND))
    main, overlapping, side = r["threads"]  # thread 7's kernel is no CPU event
    assert (main["tid"], overlapping["tid"], side["tid"]) == (1, 3, 2)  # by their number of events
    assert main["span_us"] == 170 and main["inside_us"] == 120  # 0-100 and 150-170
    assert dict(main["own"]) == {"aten::linear": 50, "aten::addmm": 45, "cudaLaunchKernel": 5, "aten::relu": 20}
    assert side["inside_us"] == 500
    assert overlapping["inside_us"] == 20 and dict(overlapping["own"]) == {"a": 5, "b": 15}


def test_gpu_streams_read_apart_from_the_threads(tmp_path):
    gpu = [dict(event(7, 0, 30, "gemm"), cat="kernel", pid=0), dict(event(7, 20, 30, "gemm"), cat="kernel", pid=0),
           dict(event(9, 0, 5, "Memcpy DtoH"), cat="gpu_memcpy", pid=0)]
    r = profile_diff.read(write(tmp_path, "a.json", HAND[:5] + gpu))
    assert [t["tid"] for t in r["threads"]] == [1, 2]  # streams are no CPU threads
    assert r["streams"] == [{"stream": "device 0 stream 7", "busy_us": 50, "events": 2, "span_us": 50},
                            {"stream": "device 0 stream 9", "busy_us": 5, "events": 1, "span_us": 5}]
    line = profile_diff.report(r, r)[-2]
    assert line.startswith("GPU stream 1 by busy time (device 0 stream 7 / device 0 stream 7): busy 0.1 / 0.1 ms")


def test_the_grown_name_leads_and_the_change_is_its_own(tmp_path):
    slow = [dict(e) for e in HAND]
    slow[3]["dur"] = 80  # relu 20 -> 80 us
    lines = profile_diff.report(profile_diff.read(write(tmp_path, "a.json", slow)),
                                profile_diff.read(write(tmp_path, "b.json", HAND)), top=2)
    assert lines[2] == "thread 1 by events (ids 1 / 1):"
    assert lines[3].startswith("  span 0.2 / 0.2 ms (+0.1), inside events 0.2 / 0.1 (+0.1)")
    assert lines[5] == "    aten::relu: 0.1 / 0.0, +0.1; 1 / 1"


def nested(rng, start, end, depth):
    """Events that nest properly inside [start, end): siblings one after another with gaps, each with children."""
    out, t = [], start
    while depth and t < end - 2 and rng.random() < 0.8:
        s = t + rng.randint(0, 3)
        e = min(end, s + rng.randint(1, 40))
        if e <= s:
            break
        out.append((s, e - s, f"op{rng.randint(0, 4)}"))
        out += nested(rng, s, e, depth - 1)
        t = e
    return out


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5))
def test_own_times_add_up_to_the_time_inside_events(seed, depth):
    events = nested(random.Random(seed), 0, 400, depth)
    own, count, inside = profile_diff.own_times(events)
    covered = set()
    for s, d, _ in events:
        covered.update(range(s, s + d))
    assert inside == len(covered)  # the union, unit by unit
    assert sum(own.values()) == inside  # properly nested: each unit is one event's own
    assert all(v >= 0 for v in own.values()) and sum(count.values()) == len(events)


def test_a_torch_profiler_trace_of_the_cpu_reads(tmp_path):
    x = torch.ones(32, 32, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.tanh(x @ x).sum().backward()
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    r = profile_diff.read(path)
    busiest = r["threads"][0]
    assert busiest["count"]["aten::tanh"] == 5 and busiest["count"]["aten::mm"] >= 5
    assert 0 < busiest["inside_us"] <= busiest["span_us"]
    assert profile_diff.report(r, r)[3].endswith("(+0.0); events " + f"{sum(busiest['count'].values())} / "
                                                 f"{sum(busiest['count'].values())}")
