"""The console line's interval arithmetic, as Megatron-LM's training_log does it: the loss over the
iterations that stepped, time over all of them, skipped and NaN iterations counted, a new interval
after each printed boundary; the offload engine's figures as key: value pairs."""

import re
from types import SimpleNamespace

import pytest

from megatron.training.metrics.console import Console
from megatron.training.metrics.records import IterationRecord
from mlp_offload.telemetry.traffic import StepRecord, TierTraffic


def _record(iteration, loss, skipped=False, nan=False, elapsed=0.1, first=False, offload=None):
    return IterationRecord(iteration=iteration, consumed_samples=8 * iteration, global_batch_size=8,
                           learning_rate=1e-3, loss_scale=4096.0, skipped=skipped, nan=nan, elapsed_s=elapsed,
                           forward_backward_s=0.0, optimizer_s=0.0, forward_s=0.0, backward_s=0.0, flops=1e12,
                           loss=loss, grad_norm=None if skipped else 1.0, first_of_run=first, offload=offload)


def _fields(line):
    return dict(re.findall(r" ([^|:\]]+): ([^|]+?) \|", line))


def test_interval_averages_skipped_and_nan(capsys):
    console = Console(SimpleNamespace(log_interval=4, train_iters=8, log_throughput=True), world_size=2)
    console.iteration(_record(1, 2.0, first=True, elapsed=0.5))  # printed, stays in the first interval
    console.iteration(_record(2, 4.0, elapsed=0.1))
    console.iteration(_record(3, float("nan"), skipped=True, nan=True, elapsed=0.1))
    console.iteration(_record(4, 6.0, elapsed=0.1))
    console.iteration(_record(5, 1.0, skipped=True, elapsed=0.2))
    console.iteration(_record(6, 3.0, elapsed=0.2))
    console.iteration(_record(7, 5.0, elapsed=0.2))
    console.iteration(_record(8, 7.0, elapsed=0.2))
    lines = capsys.readouterr().out.splitlines()
    assert [int(re.search(r"iteration\s+(\d+)/", line).group(1)) for line in lines] == [1, 4, 8]
    first, fourth, eighth = map(_fields, lines)
    assert float(first["lm loss"]) == 2.0
    # approx on the printed figures: losses with 7 significant digits (%.6E), times and TFLOP/s with one decimal
    assert float(fourth["lm loss"]) == pytest.approx((2.0 + 4.0 + 6.0) / 3)  # the NaN iteration skipped
    assert fourth["number of skipped iterations"].strip() == "1" and fourth["number of nan iterations"].strip() == "1"
    assert float(fourth["elapsed time per iteration (ms)"]) == pytest.approx(800 / 4, abs=0.05)
    assert float(fourth["throughput per GPU (TFLOP/s/GPU)"]) == pytest.approx(1e12 / (0.2 * 1e12 * 2), abs=0.05)
    assert float(eighth["lm loss"]) == pytest.approx(5.0)  # 6, 7, 8 stepped; 5 was skipped
    assert eighth["number of skipped iterations"].strip() == "1" and eighth["number of nan iterations"].strip() == "0"
    assert eighth["loss scale"] == "4096.0"


def test_offload_figures_are_interval_averages(capsys):
    def step(n, read_bytes):
        return StepRecord(step=n, update_s=0.5, predicted_update_s=0.4, read_wait_s=0.1, adam_s=0.2, cache_hits=1,
                          streamed=2, tiers={"nvme": TierTraffic(read_bytes=read_bytes, write_bytes=read_bytes,
                                                                 read_busy_s=1.0, write_busy_s=2.0)})

    console = Console(SimpleNamespace(log_interval=2, train_iters=2, log_throughput=False), world_size=1)
    console.iteration(_record(1, 1.0, offload=step(1, 2e9)))
    console.iteration(_record(2, 1.0, offload=step(2, 4e9)))
    fields = _fields(capsys.readouterr().out.splitlines()[-1])
    assert float(fields["offload update time (ms)"]) == 500.0
    assert float(fields["offload predicted update time (ms)"]) == 400.0
    assert float(fields["offload nvme read (GB)"]) == 3.0  # per iteration
    assert float(fields["offload nvme read (GB/s)"]) == 3.0  # 6 GB over 2 s busy
    assert float(fields["offload nvme write (GB/s)"]) == 1.5
    assert fields["offload cache hits"] == "2/4"
