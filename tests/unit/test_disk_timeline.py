"""benchmarks/experiments/disk_timeline.py: the disk's rates in bins after a save from disk_watch.py's cumulative
samples, and a tier's share of time moving data and its quiet spells from a trace, against figures worked out by
hand for runs made up in the test."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "experiments")))

import disk_timeline  # noqa: E402


def test_bins_turn_cumulative_samples_into_rates_after_the_save():
    # every 0.2 s: 1 GB/s read throughout; writes only from 1.0 s on, at 2 GB/s; 3 busy cores, 1 niced
    samples = [[100.0 + 0.2 * k, 0.2e9 * k, max(0, k - 5) * 0.4e9, 1e9 * k, 0.0, 0.6 * k, 0.2 * k] for k in range(20)]
    rows = disk_timeline.bins(samples, start=100.0, seconds=2.0, width=0.6)
    assert [round(r[0], 2) for r in rows] == [0.6, 1.2, 1.8]
    assert [round(r[1], 6) for r in rows] == [1.0, 1.0, 1.0]
    # the bin ending at 0.6 s began at 0.0: no writes; 0.6-1.2 s: writes from 1.0 s, 0.4 GB in 0.6 s
    assert [round(r[2], 6) for r in rows] == [0.0, round(0.4 / 0.6, 6), 2.0]
    assert rows[0][3] == pytest.approx(3.0) and rows[0][5] == pytest.approx(3.0) and rows[0][6] == pytest.approx(1.0)


def test_quiet_spells_are_the_gaps_of_over_20_ms_and_overlapping_operations_count_once():
    events = [{"name": "read", "ts": 0.0, "dur": 1.0e6}, {"name": "write", "ts": 0.5e6, "dur": 1.0e6},  # 0-1.5 s
              {"name": "read", "ts": 1.51e6, "dur": 0.49e6},  # after 10 ms: no quiet spell
              {"name": "read wait", "ts": 2.0e6, "dur": 3.0e6},  # not a tier operation
              {"name": "write", "ts": 3.0e6, "dur": 1.0e6}]  # after 1.0 s: a quiet spell
    spans = disk_timeline.tier_spans({"traceEvents": events})
    assert spans == [[0.0, 1.5], [1.51, 2.0], [3.0, 4.0]]
    share, gaps = disk_timeline.quiet_spells(spans, 0.0, 5.0)
    assert share == pytest.approx((1.5 + 0.49 + 1.0) / 5.0)
    assert gaps == [pytest.approx(1.0)]


def test_the_command_prints_the_bins_and_each_iterations_quiet_spells(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("".join(f"[{100.0 + 6 * i:.3f}]  [date] iteration        {i}/       8 | elapsed ...\n"
                           for i in range(1, 7)))
    disk = tmp_path / "disk.txt"
    disk.write_text("".join(f"{118.0 + 0.2 * k:.3f} {int(1e8 * k)} {int(3e8 * k)} 0 0 {0.2 * k:.2f} 0 0 0 nan nan nan "
                            "nan\n" for k in range(40)))
    trace = tmp_path / "trace.json"
    # iterations 4-6: 1.5 s quiet (forward and backward), then 4.5 s of tier operations ending at the step's line
    trace.write_text(json.dumps({"traceEvents": [{"name": "read", "ts": (118.0 + 6 * j + 1.5) * 1e6, "dur": 4.5e6}
                                                 for j in range(3)]}))
    assert disk_timeline.main([str(log), str(disk), str(trace), "--seconds", "2"]) == 0
    out = capsys.readouterr().out
    assert "time 0: the end of iteration 4" in out
    assert "read  0.50  write  1.50 GB/s" in out  # 0.1 and 0.3 GB per 0.2 s
    assert "the first tier operation after time 0 began at 1.50 s" in out
    assert "iteration 5: 6.00 s, a tier operation moving data 75% of it; 1 gaps of over 20 ms: 1.50 s" in out
    assert disk_timeline.main([str(log), str(disk), "--after", "9"]) == 2
