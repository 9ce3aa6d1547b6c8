"""The optimizer-state conversion moves the state in bounded pieces (2 CPU processes): with a model
whose per-rank shard of fp32 state (~77 MB) is ten times the bound, converting plain -> offloaded and
back grows each process's memory (its resident high-water mark, reset as the conversion starts) by
far less than a shard (the former code held a whole shard for plain -> offloaded), and the plain
state that comes back is exactly the plain run's own."""

import re

import pytest
import torch

from launch import TINY_MODEL, run_conversion, run_pretrain
from megatron.training.checkpoint.torch_dist_ranges import FlatTensorRanges

BOUND_MB = 8
SHARD_MB = 77  # 4 layers of hidden 512: 12.8 M parameters, DP=2, 12 bytes each
# 1 MB plain -> offloaded, 12 MB back (a piece's int16 remainders and the file reader's cache beside
# the piece) measured at 8 MB pieces; an fp32 temporary per piece made it 17-23 MB, holding the
# shard >= 77 MB.
GROWTH_LIMIT_MB = SHARD_MB / 4
SIZES = {"--hidden-size": "512", "--num-attention-heads": "8", "--seq-length": "32", "--global-batch-size": "4"}
MODEL = [SIZES.get(TINY_MODEL[i - 1], arg) if i else arg for i, arg in enumerate(TINY_MODEL)]
SAVE_AT_1 = ["--save-interval", "1"]


def offload_flags(tmp, subgroup):
    (tmp / "nvme").mkdir(parents=True, exist_ok=True)
    return ["--offload-tiers", "nvme", "--offload-nvme-path", str(tmp / "nvme"), "--offload-subgroup-size",
            str(subgroup), "--offload-adam-kernel", "single", "--offload-bandwidths", "nvme=2:1"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One iteration saved by megatron-core's optimizer."""
    tmp = tmp_path_factory.mktemp("memory")
    run_pretrain(tmp / "a", ["--save", str(tmp / "plain"), *SAVE_AT_1], train_iters=1, model_args=MODEL)
    return tmp


@pytest.fixture(scope="module")
def to_offloaded(plain):
    """Converted to the offloaded form (subgroups of 100 k elements: the engine's own buffers stay small)."""
    return convert(plain, "offload", plain / "plain", plain / "to-off", offload_flags(plain / "c", 100_000))


def convert(tmp, to, source, target, flags):
    code, output = run_conversion(["--to", to, "--load", str(source), "--save", str(target), "--max-memory-mb",
                                   str(BOUND_MB), "--", *MODEL, "--mock-data", *flags], tmp / f"convert-{to}.out")
    assert code == 0, output[-4000:]
    grown = re.search(r"optimizer state converted from .* in pieces of at most 8 MB .*memory grew by at most "
                      r"(\d+) MB on any rank", output)
    assert grown, output[-4000:]
    return int(grown.group(1))


def test_plain_to_offloaded_holds_a_fraction_of_a_shard(to_offloaded):
    assert to_offloaded < GROWTH_LIMIT_MB, to_offloaded


def test_back_to_plain_holds_a_fraction_of_a_shard_and_loses_nothing(plain, to_offloaded):
    grown = convert(plain, "plain", plain / "to-off", plain / "to-plain", [])
    assert grown < GROWTH_LIMIT_MB, grown
    converted, original = (FlatTensorRanges(str(root / "iter_0000001")) for root in (plain / "to-plain", plain / "plain"))
    keys = [k for k in original.keys() if ".bucket_idx_" in k]
    assert keys and sorted(keys) == sorted(k for k in converted.keys() if ".bucket_idx_" in k)
    for key in keys:
        numel = original.numel(key)
        a, b = torch.empty(numel), torch.empty(numel)
        original.read(key, 0, numel, a)
        converted.read(key, 0, numel, b)
        assert torch.equal(a, b), key
