"""One metrics record per iteration, many sinks: one short run (2 CPU ranks, offload on the host
tier) writes the console, --loss-log, TensorBoard and an offline W&B run; each is read back here.

The console is read with regular expressions written from Megatron-LM's ``training_log`` and
``evaluate_and_print_results`` formats (as tools that parse its logs do); its interval averages
are checked against the loss log, an independent record of every iteration.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.integration.launch import run_pretrain

ITERS, LOG_INTERVAL, EVAL_INTERVAL = 6, 3, 3
NUMBER = r"([-+\d.E]+)"  # the %E and %f formats Megatron-LM prints

# Megatron-LM's iteration line, field by field (throughput only with --log-throughput).
TRAINING_LINE = re.compile(
    r"^ \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\] iteration\s+(\d+)/\s*(\d+) \|"
    r" consumed samples:\s+(\d+) \|"
    r" elapsed time per iteration \(ms\):\s+([\d.]+) \|"
    r" throughput per GPU \(TFLOP/s/GPU\):\s+([\d.]+) \|"
    r" learning rate:\s+" + NUMBER + r" \|"
    r" global batch size:\s+(\d+) \|"
    r" lm loss:\s+" + NUMBER + r" \|"
    r" loss scale:\s+([\d.]+) \|"
    r" grad norm:\s+([\d.]+) \|"
    r" number of skipped iterations:\s+(\d+) \|"
    r" number of nan iterations:\s+(\d+) \|"
    r"(.*)$")
VALIDATION_LINE = re.compile(
    r"^ validation loss at iteration (\d+) \| lm loss value: " + NUMBER + r" \| lm loss PPL: " + NUMBER + r" \| $")
KEY_VALUE = re.compile(r" ([^|:]+): ([^|]+) \|")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    records = run_pretrain(tmp, [
        "--log-interval", str(LOG_INTERVAL), "--eval-interval", str(EVAL_INTERVAL), "--eval-iters", "1",
        "--log-throughput", "--timing-log-level", "1", "--offload-tiers", "host",
        "--tensorboard-dir", str(tmp / "tb"), "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
        "--wandb-project", "metrics-test", "--wandb-exp-name", "cpu", "--wandb-save-dir", str(tmp / "wandb"),
        "--offload-telemetry-log", str(tmp / "telemetry-{rank}.jsonl")],
        train_iters=ITERS, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    output = (tmp / "loss-0.out").read_text()
    return tmp, records, output


def _training_lines(output):
    return [m for m in map(TRAINING_LINE.match, output.splitlines()) if m]


def test_console_iteration_lines_parse_and_average_the_interval(run):
    _, records, output = run
    losses = {r["iteration"]: r["loss"] for r in records}
    lines = _training_lines(output)
    # The job's first iteration, then every --log-interval.
    assert [int(m.group(2)) for m in lines] == [1, 3, 6], output[-3000:]
    # Iteration 1 is off the boundary: it stays in the first interval, averaged at iteration 3.
    intervals = {1: [1], 3: [1, 2, 3], 6: [4, 5, 6]}
    for m in lines:
        iteration = int(m.group(2))
        assert int(m.group(3)) == ITERS
        assert int(m.group(4)) == iteration * 8  # consumed samples: global batch size 8
        assert float(m.group(5)) > 0 and float(m.group(6)) >= 0  # ms per iteration; TFLOP/s (a tiny model: 0.0)
        assert int(m.group(8)) == 8
        expected = sum(losses[i] for i in intervals[iteration]) / len(intervals[iteration])
        assert float(m.group(9)) == pytest.approx(expected, rel=1e-6)  # printed with 7 significant digits
        assert float(m.group(10)) == 1.0  # bf16: no loss scaling
        assert int(m.group(12)) == 0 and int(m.group(13)) == 0
        assert float(m.group(7)) == pytest.approx(next(r["lr"] for r in records if r["iteration"] == iteration),
                                                  rel=1e-6)


# The console's engine figures and the telemetry record's fields they average.
CONSOLE_FIELDS = {"offload update time (ms)": "update_s", "offload predicted update time (ms)": "predicted_update_s",
                  "offload adam time (ms)": "adam_s", "offload read wait (ms)": "read_wait_s"}


def test_console_offload_figures_average_the_engines_telemetry(run):
    """Each line's engine figures are its interval's averages of the engine's own per-step records
    (--offload-telemetry-log of the last rank, which prints the console), summed in step order."""
    tmp, _, output = run
    steps = [json.loads(line) for line in open(tmp / "telemetry-1.jsonl")]
    assert [r["step"] for r in steps] == list(range(1, ITERS + 1))
    intervals = {1: [1], 3: [1, 2, 3], 6: [4, 5, 6]}
    for m in _training_lines(output):
        pairs = dict(KEY_VALUE.findall(m.group(14)))
        chosen = [steps[i - 1] for i in intervals[int(m.group(2))]]
        for key, name in CONSOLE_FIELDS.items():
            assert pairs[key].strip() == f"{sum(r[name] for r in chosen) / len(chosen) * 1000:.1f}", (key, m.group(0))


def test_console_offload_figures_are_key_value_pairs(run):
    _, _, output = run
    tail = _training_lines(output)[-1].group(14)
    pairs = dict(KEY_VALUE.findall(tail))
    figures = {key: float(pairs[key]) for key in CONSOLE_FIELDS}
    # A CPU run updates every subgroup with CPU Adam: it took time, the model predicted some, and the
    # update's wall time holds its Adam and its waits.
    assert figures["offload adam time (ms)"] > 0 and figures["offload predicted update time (ms)"] > 0, tail
    assert figures["offload update time (ms)"] >= figures["offload adam time (ms)"], tail
    assert figures["offload update time (ms)"] >= figures["offload read wait (ms)"] >= 0, tail


def test_validation_lines_as_megatron_prints_them(run):
    _, _, output = run
    lines = output.splitlines()
    found = []
    for k, line in enumerate(lines):
        m = VALIDATION_LINE.match(line)
        if m:
            dashes = "-" * (len(line) + 1)
            assert lines[k - 1] == dashes and lines[k + 1] == dashes
            loss, ppl = float(m.group(2)), float(m.group(3))
            assert ppl == pytest.approx(math.exp(loss), rel=1e-5)  # both printed with 7 significant digits (%E)
            found.append(int(m.group(1)))
    assert found == [3, 6]


def _tensorboard_scalars(tb_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_has_megatron_scalars_and_offload_figures(run):
    tmp, records, _ = run
    scalars = _tensorboard_scalars(tmp / "tb")
    for tag in ("learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples", "lm loss",
                "lm loss vs samples", "loss-scale", "grad-norm", "grad-norm vs samples", "lm loss validation",
                "lm loss validation vs samples", "lm loss validation ppl", "iteration-time", "throughput",
                "forward-backward-time", "optimizer-time", "offload/update-time",
                "offload/update-time-predicted", "offload/read-wait-time", "offload/host-state-bytes"):
        assert tag in scalars, (tag, sorted(scalars))
    import numpy as np

    for r in records:  # TensorBoard keeps float32: the loss log's values, rounded so
        assert scalars["lm loss"][r["iteration"]] == np.float32(r["loss"])
        assert scalars["lm loss vs samples"][r["iteration"] * 8] == np.float32(r["loss"])
        assert scalars["grad-norm"][r["iteration"]] == np.float32(r["grad_norm"])
        assert scalars["learning-rate"][r["iteration"]] == np.float32(r["lr"])
    assert sorted(scalars["lm loss validation"]) == [3, 6]
    assert scalars["offload/host-state-bytes"][1] > 0


def _wandb_history(run_file: Path):
    """The history rows of an offline W&B run, read from its record log (a LevelDB-style log of
    protobuf Records behind a 7-byte ':W&B' header, in 32 KiB blocks): wandb ships no reader."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_has_the_same_scalars(run):
    tmp, records, _ = run
    runs = list((tmp / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    rows = {row["_step"]: row for row in _wandb_history(next(runs[0].glob("run-*.wandb")))}
    assert sorted(rows) == list(range(1, ITERS + 1))
    for r in records:
        row = rows[r["iteration"]]
        assert row["lm loss"] == r["loss"] and row["grad-norm"] == r["grad_norm"] and row["learning-rate"] == r["lr"]
        assert row["samples vs steps"] == r["iteration"] * 8 and row["batch-size"] == 8 and row["loss-scale"] == 1
        for key in ("offload/update-time", "offload/update-time-predicted", "offload/read-wait-time",
                    "offload/cache-hits", "offload/host-state-bytes"):
            assert key in row, (key, sorted(row))
    for iteration in (3, 6):  # evaluations, and the interval's timers
        for key in ("lm loss validation", "iteration-time", "throughput", "forward-backward-time"):
            assert key in rows[iteration], (key, sorted(rows[iteration]))
