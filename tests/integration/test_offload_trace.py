"""--offload-trace: one Chrome-trace file per rank from a 2-rank CPU run (the DP=2 run of
conftest.offload_runs, which test_offload_cpu checks bit for bit), drawn by tools/plot_timeline.py."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_trace_per_rank_and_timeline_png(tmp_path, offload_runs):
    run_dir, _ = offload_runs("dp2")
    traces = sorted((run_dir / "traces").iterdir())
    assert [p.name for p in traces] == ["trace-0.json", "trace-1.json"]
    for rank, path in enumerate(traces):
        spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {rank}
        names = {(e["name"], e["args"].get("tier")) for e in spans}
        for tier in ("nvme", "pfs"):
            assert ("write", tier) in names and ("read", tier) in names, (rank, tier, names)
        assert ("adam", None) in names

    png = tmp_path / "timeline.png"
    subprocess.run([sys.executable, str(REPO / "tools" / "plot_timeline.py"), *map(str, traces), str(png)],
                   check=True, cwd=REPO, timeout=60)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
