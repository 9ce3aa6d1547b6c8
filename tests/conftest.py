"""Suite-wide settings: the hypothesis profile (tests/profiles.py, MLP_OFFLOAD_TEST_PROFILE=ci|thorough),
and at the end a count of the process launches each test caused."""

import os
import tempfile
from collections import Counter

from tests.profiles import PROFILE

LAUNCH_LOG = "MLP_OFFLOAD_TEST_LAUNCH_LOG"  # launch.run_group appends one line per launch there


def pytest_configure(config):
    fd, path = tempfile.mkstemp(prefix="mlp_offload_launches_", suffix=".tsv")
    os.close(fd)
    os.environ[LAUNCH_LOG] = path


def pytest_unconfigure(config):
    path = os.environ.pop(LAUNCH_LOG, None)
    if path and os.path.exists(path):
        os.unlink(path)


def pytest_terminal_summary(terminalreporter):
    """How many process launches (torchrun, srun stand-ins, tools) each test caused, and their time:
    what the suite's wall time is made of."""
    path = os.environ.get(LAUNCH_LOG)
    if not path or not os.path.exists(path):
        return
    rows = [line.rstrip("\n").split("\t") for line in open(path) if line.strip()]
    if not rows:
        return
    per_test, seconds = Counter(), Counter()
    for test, wall in rows:
        per_test[test] += 1
        seconds[test] += float(wall)
    write = terminalreporter.write_line
    write(f"launches through launch.run_group: {len(rows)}, {sum(seconds.values()):.0f} s "
          f"(profile {PROFILE}); the most expensive tests:")
    for test, wall in seconds.most_common(15):
        write(f"  {wall:7.1f} s  {per_test[test]:3d} launch(es)  {test}")
