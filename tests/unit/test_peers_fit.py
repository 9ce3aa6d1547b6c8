"""benchmarks/peers.py's fit checks count our state at the bytes the --ours-flags store, not at fp32's:
a 3.0 B run with fp8 moments was skipped as "disk: needs ~36 GB, 32 GB free" where it needs 12 GB."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCHMARKS))
peers = pytest.importorskip("peers")

FP8 = "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
THREE_B = ["--layers", "28", "--hidden", "3072", "--ffn", "8192", "--heads", "24", "--kv-heads", "8",
           "--host-budget-gb", "5.96"]


@pytest.mark.parametrize("flags, expected", [
    ("", 2 + 4 + 4),  # 16-bit remainders beside the bf16 param, fp32 moments
    ("--no-store-param-remainders", 4 + 4 + 4),
    ("--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", 2 + 2 + 2),
    (FP8, 2 + 2 * (1 + 4 / 128)),  # one e4m3 code a moment, one fp32 scale per 128 elements
])
def test_our_state_per_param_follows_the_flags(flags, expected):
    assert peers.ours_state_bytes_per_param(flags) == pytest.approx(expected)


def test_fp8_moments_fit_a_disk_deepspeed_does_not():
    args = peers.parse_args(THREE_B + ["--systems", "bd", f"--ours-flags={FP8}"])
    res = {"host_available_gb": 133.4, "disk_free_gb": 35.1, "gpu_gb": 150.1}
    assert peers.does_not_fit(args, "b", res) is None
    assert peers.does_not_fit(args, "d", res).startswith("disk: needs ~48 GB")


def test_lossless_state_at_that_disk_does_not_fit():
    args = peers.parse_args(THREE_B + ["--systems", "b"])
    res = {"host_available_gb": 133.4, "disk_free_gb": 30.0, "gpu_gb": 150.1}
    assert peers.does_not_fit(args, "b", res) == "disk: needs ~30 GB, 27 GB free"
