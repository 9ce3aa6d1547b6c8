"""benchmarks/fork_costs.py: a fork's cost and a copy-on-write's, measured on this machine's real memory."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fork_costs.py"


def test_it_measures_both_page_sizes_in_one_line_each():
    done = subprocess.run([sys.executable, str(SCRIPT), "--gib", "0.05"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["0.05 GiB in 4 KiB pages", "0.05 GiB in huge pages"]
    for line in lines:
        found = re.search(r"fork ([0-9.]+)-([0-9.]+) ms; smaps read ([0-9.]+)-([0-9.]+) ms; each page written again "
                          r"([0-9.]+) s, with a child sharing them ([0-9.]+) s: (-?[0-9.]+) us a page$", line)
        assert found, line
        least, most, read_least, read_most, again, shared, _ = map(float, found.groups())
        assert 0 < least <= most and 0 < read_least <= read_most and again > 0 and shared > 0


def test_no_memory_to_hold_is_one_line_naming_the_flag():
    done = subprocess.run([sys.executable, str(SCRIPT), "--gib", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "fork_costs.py: error: --gib 0.0: needs at least one 4 KiB page"
