"""A checkpoint written by upstream Megatron-LM itself trains on here, with and without offload.

tests/data/upstream_gpt/upstream_iter4.tar.gz was written at iteration 4 by upstream Megatron-LM
(tag core_v0.16.1) on an H100 (benchmarks/experiments/upstream_checkpoint.sh); upstream's own log of the same
run goes on to iteration 8. Resuming that checkpoint on CPU must continue upstream's loss curve:
iteration 5 is the forward pass on the loaded weights, 6 follows the loaded Adam moments and
schedule (upstream's log goes on to 8; iteration 6 already depends on every kind of loaded state).
The tolerance covers CPU against GPU bf16 arithmetic; dropping the optimizer state
(``--no-load-optim``) must break it, which shows the check can fail.
"""

import math
import re
import shlex
import tarfile
from pathlib import Path

import pytest

from tests.integration.launch import REPO, run_conversion, run_pretrain

DATA = REPO / "tests" / "data" / "upstream_gpt"
UPSTREAM_LOG = REPO / "docs" / "results" / "upstream_checkpoint_h100_2026-11-22" / "upstream_train.log"
# Upstream's training_log line, as Megatron-LM users' parsers read it.
UPSTREAM_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")
RELATIVE_TOLERANCE = 5e-5  # measured: CPU within 5e-6 of upstream's GPU run at iterations 5..8
SAVED_AT, RESUMED_TO = 4, 6


def shared_flags(data_dir: Path) -> list:
    """The flags both runs used (benchmarks/experiments/upstream_flags.sh, the one copy of them), less
    --train-iters, which run_pretrain adds."""
    text = (REPO / "benchmarks" / "experiments" / "upstream_flags.sh").read_text()
    flags = shlex.split(re.search(r'UPSTREAM_COMMON="([^"]*)"', text, re.S).group(1).replace("$D", str(data_dir)))
    at = flags.index("--train-iters")
    return flags[:at] + flags[at + 2:]


def upstream_losses() -> dict:
    found = (UPSTREAM_LINE.search(line) for line in UPSTREAM_LOG.read_text().splitlines())
    return {int(m.group(1)): float(m.group(2)) for m in found if m}


@pytest.fixture(scope="module")
def upstream_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("upstream")
    with tarfile.open(DATA / "upstream_iter4.tar.gz") as tar:
        tar.extractall(root, filter="data")
    return root / "up4"


def resume(tmp_path, checkpoint, *extra, nproc=1, expect_success=True, load_rng=False):
    # A GPU checkpoint's generator states cannot seed a CPU run; dropout is 0, so they do not matter.
    rng = [] if load_rng else ["--no-load-rng"]
    return run_pretrain(tmp_path, [*shared_flags(DATA), "--device", "cpu", "--num-workers", "0",
                                   "--data-cache-path", str(tmp_path / "cache"),
                                   "--load", str(checkpoint), "--save", str(tmp_path / "save"), *rng, *extra],
                        nproc=nproc, train_iters=RESUMED_TO, model_args=[], mock_data=False,
                        expect_success=expect_success)


def saved_common(iteration_dir: Path) -> dict:
    import torch

    return torch.load(iteration_dir / "common.pt", weights_only=False)


def deviation(records) -> float:
    upstream = upstream_losses()
    assert [r["iteration"] for r in records] == list(range(SAVED_AT + 1, RESUMED_TO + 1))
    return max(abs(r["loss"] - upstream[r["iteration"]]) / upstream[r["iteration"]] for r in records)


def test_upstream_log_is_the_run_that_wrote_the_checkpoint():
    losses = upstream_losses()
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert "successfully saved checkpoint from iteration       4" in UPSTREAM_LOG.read_text()


def test_resumes_upstream_checkpoint_on_its_curve_with_and_without_offload(tmp_path, upstream_checkpoint):
    plain = resume(tmp_path / "plain", upstream_checkpoint)
    assert deviation(plain) < RELATIVE_TOLERANCE
    offloaded = resume(tmp_path / "offload", upstream_checkpoint, *offload_flags(tmp_path, probe_mb=64))
    # Megatron-LM's FLOP counter goes on at upstream's rate.
    saved_flops = [saved_common(tmp_path / run / "save" / f"iter_{RESUMED_TO:07d}")["num_floating_point_operations_so_far"]
                   for run in ("plain", "offload")]
    upstream_flops = saved_common(upstream_checkpoint / f"iter_{SAVED_AT:07d}")["num_floating_point_operations_so_far"]
    assert saved_flops == [upstream_flops * RESUMED_TO // SAVED_AT] * 2
    # The engine's update equals megatron-core's bit for bit; so must the resumed curve.
    assert [r["loss"] for r in offloaded] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in offloaded] == [r["grad_norm"] for r in plain]


def offload_flags(tmp_path: Path, probe_mb: int = 0) -> list:
    """The offload flags of these runs: the nvme tier's bandwidths given, or (``probe_mb``) probed
    with files of that size, as a first run on a path does (the default probe writes 1 GB: 5-8 s)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    rates = ["--offload-probe-mb", str(probe_mb)] if probe_mb else ["--offload-bandwidths", "nvme=2:1"]
    return ["--offload-tiers", "host,nvme", "--offload-host-cache-gb", "0.002", "--offload-nvme-path", str(nvme),
            "--offload-subgroup-size", "20000", "--no-store-param-remainders", *rates]  # megatron-core's rounding


def test_upstream_checkpoint_moves_to_two_tensor_parallel_ranks_through_the_offloaded_form(
        tmp_path, upstream_checkpoint):
    # Upstream's default dp_reshardable state is keyed by the saved run's buckets: TP2 refuses in one line ...
    direct = resume(tmp_path / "direct", upstream_checkpoint, "--tensor-model-parallel-size", "2",
                    *offload_flags(tmp_path), nproc=2, expect_success=False)[0]
    errors = [line for line in direct["output"].splitlines() if line.startswith("error:")]
    assert direct["returncode"] != 0 and len(errors) == 1 and "dp_reshardable" in errors[0], direct["output"][-3000:]
    # ... and goes through the tool's conversion at the saved sizes, whose form reshards.
    converted = tmp_path / "converted"
    code, output = run_conversion(["--to", "offload", "--load", str(upstream_checkpoint), "--save", str(converted),
                                   "--nproc", "1", "--", *shared_flags(DATA), "--device", "cpu", "--num-workers",
                                   "0", "--no-load-rng", "--data-cache-path", str(tmp_path / "cache"),
                                   *offload_flags(tmp_path / "convert")], tmp_path / "convert.out")
    assert code == 0, output[-4000:]
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP: halving the divisor keeps upstream's
    # 640 rows (else 128 freshly initialised output rows would change the loss).
    records = resume(tmp_path / "tp2", converted, "--tensor-model-parallel-size", "2",
                     "--make-vocab-size-divisible-by", "64", *offload_flags(tmp_path / "tp2"), nproc=2)
    assert deviation(records) < RELATIVE_TOLERANCE


def test_without_the_optimizer_state_the_curve_leaves_upstream(tmp_path, upstream_checkpoint):
    """The tolerance is tight enough to notice Adam's moments missing."""
    records = resume(tmp_path, upstream_checkpoint, "--no-load-optim")
    assert deviation(records) > 10 * RELATIVE_TOLERANCE


def test_gpu_rng_state_on_cpu_is_one_line(tmp_path, upstream_checkpoint):
    result = resume(tmp_path, upstream_checkpoint, expect_success=False, load_rng=True)[0]
    assert result["returncode"] != 0
    errors = [line for line in result["output"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--no-load-rng" in errors[0] and "16-byte" in errors[0], result["output"][-3000:]
