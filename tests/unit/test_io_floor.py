"""benchmarks/io_floor.py: the update's I/O floor may not exceed what a disk that reads and writes at once
delivers. 2026-11-28 (docs/benchmarks.md §20): both systems beat a floor that counted reads then writes
(measured / floor 0.78-0.80): the disk moved 1.64-1.81 GB/s in both directions together."""

import os
import sys

import pytest
from hypothesis import given, strategies as st

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
io_floor = pytest.importorskip("io_floor")

GB = 1e9
DISK = {"read_gbps": 1.33, "write_gbps": 1.45, "st_dev": 1}


def test_without_a_mixed_rate_reads_then_writes():
    assert io_floor.device_seconds(6.5 * GB, 6.6 * GB, DISK) == pytest.approx(6.5 / 1.33 + 6.6 / 1.45)


@pytest.mark.parametrize("mixed, expected", [
    (1.8, 13.1 / 1.8),  # both at once: the bytes of both directions at the mixed rate
    (20.0, 6.5 / 1.33),  # never under the slower direction alone
    (0.5, 6.5 / 1.33 + 6.6 / 1.45),  # never over one after the other, which any disk can do
])
def test_a_mixed_rate_bounds_both_directions_together(mixed, expected):
    disk = dict(DISK, mixed_gbps=mixed)
    assert io_floor.device_seconds(6.5 * GB, 6.6 * GB, disk) == pytest.approx(expected)


def test_tiers_on_one_device_add_up_and_devices_run_side_by_side():
    fast = dict(DISK, mixed_gbps=2.0)
    other = dict(fast, st_dev=2)
    one = io_floor.io_seconds({"a": (2 * GB, 2 * GB), "b": (2 * GB, 2 * GB)}, {"a": fast, "b": fast})
    two = io_floor.io_seconds({"a": (2 * GB, 2 * GB), "b": (2 * GB, 2 * GB)}, {"a": fast, "b": other})
    assert one == pytest.approx(2 * 4 / 2.0)
    assert two == pytest.approx(4 / 2.0)


def test_the_probe_measures_all_three_rates(tmp_path):
    got = io_floor.file_bandwidth(str(tmp_path), 4 * io_floor.BLOCK, threads=2)
    assert got["bytes"] == 4 * io_floor.BLOCK
    assert min(got["read_gbps"], got["write_gbps"], got["mixed_gbps"]) > 0
    assert not any(name.startswith(".floor_probe") for name in os.listdir(tmp_path))


rates = st.floats(0.05, 50.0)
nbytes = st.floats(0.0, 1e12)


@given(read=nbytes, write=nbytes, read_gbps=rates, write_gbps=rates, mixed=st.one_of(st.none(), rates))
def test_the_floor_lies_between_one_direction_alone_and_one_after_the_other(read, write, read_gbps, write_gbps, mixed):
    disk = {"read_gbps": read_gbps, "write_gbps": write_gbps, "mixed_gbps": mixed, "st_dev": 1}
    alone = max(read / (read_gbps * GB), write / (write_gbps * GB))
    sequential = read / (read_gbps * GB) + write / (write_gbps * GB)
    got = io_floor.device_seconds(read, write, disk)
    assert alone * (1 - 1e-12) <= got <= sequential * (1 + 1e-12)
    if mixed is not None:
        assert got <= max(alone, (read + write) / (mixed * GB)) * (1 + 1e-12)
