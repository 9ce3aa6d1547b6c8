"""Make ``from launch import run_pretrain`` work however pytest is invoked; and the training runs
several test modules check, each launched once per session (a launch costs seconds of start-up:
interpreters, torch and megatron-core imports), on first use.

A shared run is a reference or a source of checkpoints; a test that needs to change what a run
left on disk works on a copy (``helpers.copy_checkpoint``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

# test_checkpoint_crossing_cpu still imports it from here; helpers.py is its home.
from helpers import copy_checkpoint  # noqa: E402,F401

# Iterations of the shared offloaded runs (the trust, fault, async-save, srun and two-node tests):
# checkpoints every 2 give three of them (2, 4, 6).
BASELINE_ITERS = 6
SAVE_EVERY = 2


@pytest.fixture(scope="session")
def plain_runs(tmp_path_factory):
    """``plain_runs(layout)``: the loss records of an uninterrupted 10-iteration run of megatron-core's
    own distributed optimizer at that layout of 2 ranks (launch.LAYOUTS): the reference of the
    bit-for-bit tests of test_pretrain_cpu and test_offload_cpu."""
    from launch import LAYOUTS, run_pretrain

    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = run_pretrain(tmp_path_factory.mktemp(f"plain-{name}"), LAYOUTS[name])
        return runs[name]

    return get


@pytest.fixture(scope="session")
def offload_runs(tmp_path_factory):
    """``offload_runs(layout)`` -> ``(tmp, records)``: the same 10 iterations with the offload flags of
    helpers.offload_args (host, nvme, pfs; the host budget holds the pipeline's buffers
    only) in ``tmp``, the engine's telemetry in ``tmp/telemetry-{rank}.jsonl`` and its Chrome trace in
    ``tmp/traces/trace-{rank}.json`` (test_offload_cpu, test_offload_trace)."""
    from launch import LAYOUTS, run_pretrain
    from helpers import offload_args

    runs = {}

    def get(name):
        if name not in runs:
            tmp = tmp_path_factory.mktemp(f"offload-{name}")
            records = run_pretrain(tmp / "run", [*LAYOUTS[name], *offload_args(tmp),
                                                 "--offload-telemetry-log", str(tmp / "telemetry-{rank}.jsonl"),
                                                 "--offload-trace", str(tmp / "traces" / "trace-{rank}.json")])
            runs[name] = tmp, records
        return runs[name]

    return get


REAL_DATA_ITERS = 5


@pytest.fixture(scope="session")
def real_data_runs(tmp_path_factory):
    """``real_data_runs(per_token_loss, offload)`` -> records: REAL_DATA_ITERS iterations at DP=2 on
    upstream's GPT-2 tokenizer and corpus with --eod-mask-loss (so micro-batches hold different
    token counts and some embedding rows get zero grads), megatron-core's optimizer or the
    offloaded one on the host tier with its default kernel (test_offload_cpu, test_per_token_loss_cpu)."""
    from launch import REPO, run_pretrain

    data = REPO / "tests" / "data" / "upstream_gpt"
    tmp = tmp_path_factory.mktemp("real_data")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(data / "vocab.json"),
             "--merge-file", str(data / "merges.txt"), "--data-path", str(data / "corpus_text_document"),
             "--split", "100,0,0", "--eval-iters", "0", "--eod-mask-loss", "--data-cache-path", str(tmp / "cache")]
    runs = {}

    def get(per_token_loss, offload):
        key = (per_token_loss, offload)
        if key not in runs:
            extra = (["--calculate-per-token-loss"] if per_token_loss else []) + (
                ["--offload-tiers", "host", "--no-store-param-remainders"] if offload else [])
            runs[key] = run_pretrain(tmp / f"per_token{int(per_token_loss)}-offload{int(offload)}", [*flags, *extra],
                                     train_iters=REAL_DATA_ITERS, mock_data=False)
        return runs[key]

    return get


@pytest.fixture(scope="session")
def offload_baseline(tmp_path_factory):
    """Loss records of one torchrun launch of 2 ranks with the tiny model and the offload flags of
    helpers.offload_args, BASELINE_ITERS iterations, no checkpoints: the uninterrupted run
    that the killed, signalled and resumed runs must reproduce, and the srun and two-node launches."""
    from launch import run_pretrain
    from helpers import offload_args

    tmp = tmp_path_factory.mktemp("baseline")
    return run_pretrain(tmp, [*offload_args(tmp), "--exit-signal-handler"], nproc=2, train_iters=BASELINE_ITERS)


@pytest.fixture(scope="session")
def offload_saved(tmp_path_factory, offload_baseline):
    """The same offloaded run saving synchronously every SAVE_EVERY iterations: ``{"ckpt": root with
    iterations 2, 4 and 6, "losses": its records}``. Saving must not change training."""
    from launch import run_pretrain
    from helpers import offload_args

    tmp = tmp_path_factory.mktemp("saved")
    ckpt = tmp / "ckpt"
    losses = run_pretrain(tmp, [*offload_args(tmp), "--save", str(ckpt), "--save-interval", str(SAVE_EVERY)],
                          train_iters=BASELINE_ITERS, loss_log=tmp / "run.jsonl")
    assert losses == offload_baseline
    return {"ckpt": ckpt, "losses": losses, "output": (tmp / "run.out").read_text()}
