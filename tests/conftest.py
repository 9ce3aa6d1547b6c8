"""Suite-wide settings: the hypothesis profile (tests/profiles.py, MLP_OFFLOAD_TEST_PROFILE=ci|thorough),
the seed of the launch-heavy cases under every failure, and at the end a count of the process
launches each test caused."""

import os
import resource
import tempfile
from collections import Counter

import pytest

from tests.profiles import CASE_SEED, PROFILE, RERUN_CASES

LAUNCH_LOG = "MLP_OFFLOAD_TEST_LAUNCH_LOG"  # launch.run_group appends one line per launch there


def pytest_report_header(config):
    return f"test profile {PROFILE}; launch-heavy cases of seed {CASE_SEED} (rerun the same ones: {RERUN_CASES})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure says which seed drew the launch-heavy cases, so that run can be repeated."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("launch-heavy cases",
                                f"drawn by seed {CASE_SEED} under profile {PROFILE}: rerun with {RERUN_CASES}"))


def _is_worker(config) -> bool:
    """A pytest-xdist worker: it inherits the controller's launch log (and case seed) through its environment."""
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if _is_worker(config):
        return
    fd, path = tempfile.mkstemp(prefix="mlp_offload_launches_", suffix=".tsv")
    os.close(fd)
    os.environ[LAUNCH_LOG] = path


def pytest_unconfigure(config):
    if _is_worker(config):
        return
    path = os.environ.pop(LAUNCH_LOG, None)
    if path and os.path.exists(path):
        os.unlink(path)


def pytest_terminal_summary(terminalreporter):
    """The process launches (torchrun, srun stand-ins) each test caused, with their wall and CPU
    seconds: what the suite's time is made of. CPU seconds vary less with other load."""
    terminalreporter.write_line(f"launch-heavy cases of seed {CASE_SEED} under profile {PROFILE} "
                                f"({RERUN_CASES} reruns the same ones)")
    path = os.environ.get(LAUNCH_LOG)
    rows = [line.rstrip("\n").split("\t") for line in open(path)] if path and os.path.exists(path) else []
    if not rows:
        return
    count, wall, cpu, launchers = Counter(), Counter(), Counter(), Counter()
    for test, wall_s, cpu_s, launcher in rows:
        launchers[launcher] += 1
        test = test.rsplit(" (", 1)[0]  # a fixture's launch counts for the test that first needed it
        count[test] += 1
        wall[test] += float(wall_s)
        cpu[test] += float(cpu_s)
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    write = terminalreporter.write_line
    write(f"profile {PROFILE}; CPU seconds of the whole session: {own.ru_utime + own.ru_stime:.0f} in pytest, "
          f"{children.ru_utime + children.ru_stime:.0f} in its child processes")
    write(f"launches through launch.run_group: {sum(count.values())} ({launchers['warm']} of them warm_ranks, "
          f"{launchers['torchrun']} torchrun), {sum(wall.values()):.0f} s wall, "
          f"{sum(cpu.values()):.0f} s CPU; the longest tests:")
    for test, seconds in wall.most_common(20):
        write(f"  {seconds:7.1f} s wall {cpu[test]:7.1f} s CPU {count[test]:3d} launch(es)  {test}")
