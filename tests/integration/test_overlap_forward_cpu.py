"""--offload-overlap-forward on the CPU twin: the step returns with the device's subgroups still
queued (on a CPU their fences are already done, so this checks the bookkeeping: grads zeroed by the
update as it reads them instead of by the training loop, a skipped step's grads zeroed, no param
all-gather issued, state settled before checkpoints), and the losses must stay bit-identical to
megatron-core without offload; above data-parallel size 1 each bucket's all-gather follows its update."""

import json
import re

import pytest

from launch import TINY_MODEL, ranks_output, run_pretrain
from helpers import MOE, offload_args

OVERLAP = ["--offload-overlap-forward"]


@pytest.mark.parametrize("tiers,extra", [
    (("host",), ["--offload-update", "gpu"]),  # every subgroup through the device path (the CPU twin's)
    # file-tier subgroups streamed through the device too: the step waits for them, and for no more
    # than the deferred ones queued ahead of them
    (("host", "nvme"), ["--offload-update", "gpu"]),
])
def test_overlapped_update_matches_megatron_bit_for_bit(tmp_path, tiers, extra):
    baseline = run_pretrain(tmp_path / "base", [], nproc=1, train_iters=6)
    overlapped = run_pretrain(tmp_path / "ovl", [*offload_args(tmp_path, tiers=tiers), *extra, *OVERLAP],
                              nproc=1, train_iters=6)
    assert overlapped == baseline
    out = (tmp_path / "ovl" / "loss-0.out").read_text()
    assert "the update runs under the next forward" in out
    # where the time to the first step went, phase by phase, and their sum
    phases = re.search(r"> start-up \(s\): initialize ([0-9.]+) \| model ([0-9.]+) \| optimizer ([0-9.]+) \| "
                       r"checkpoint ([0-9.]+) \| data ([0-9.]+) \| total ([0-9.]+)", out)
    # (six figures each rounded to 0.1 s: their sum may differ from the total by 6 x 0.05)
    assert phases and sum(map(float, phases.groups()[:5])) == pytest.approx(float(phases.group(6)), abs=0.31)
    # the device's time, measured from its queue to done, beside the host's share (from iteration 2 on)
    device_ms = [float(x) for x in re.findall(r"offload device update time \(ms\): ([0-9.]+)", out)]
    assert len(device_ms) == 5 and all(ms > 0 for ms in device_ms)
    # the iteration predicted once a compute time was measured (the iteration after a settled step)
    assert len(re.findall(r"offload predicted iteration time \(ms\): [0-9.]+", out)) == 4


def test_a_cpu_share_under_the_overlap_matches_megatron_bit_for_bit(tmp_path):
    """--offload-update auto with --offload-cpu-share: the CPU updates that many host-held subgroups in
    the step, the device twin the rest from the queue; the losses stay bit-identical. After the
    settled steps the optimizer tells the engine the forward's length (a given share stays)."""
    baseline = run_pretrain(tmp_path / "base", [], nproc=1, train_iters=6)
    args = [*offload_args(tmp_path, tiers=("host",)), "--offload-update", "auto", "--offload-cpu-share", "2", *OVERLAP]
    assert run_pretrain(tmp_path / "ovl", args, nproc=1, train_iters=6) == baseline
    out = (tmp_path / "ovl" / "loss-0.out").read_text()
    assert re.search(r"update split under the overlap: cpu 2 of [0-9]+ host-held subgroups \(given\)", out), out[-3000:]
    assert "split cpu 2/device" in out  # the start-up prediction prices that split


def test_skipped_fp16_steps_stay_exact(tmp_path):
    """fp16 from a loss scale that overflows: the first steps are skipped, and their grads must still
    be zeroed (the update that would have zeroed them did not run)."""
    model = [a for a in TINY_MODEL if a != "--bf16"]
    fp16 = ["--fp16", "--initial-loss-scale", "4294967296"]
    args = [*fp16, *offload_args(tmp_path, tiers=("host",)), "--offload-update", "gpu", *OVERLAP]
    baseline = run_pretrain(tmp_path / "base", fp16, model_args=model, nproc=1, train_iters=8)
    skipped = (tmp_path / "base" / "loss-0.out").read_text().count("number of skipped iterations:   1")
    assert skipped >= 1  # the case this test is about
    assert run_pretrain(tmp_path / "ovl", args, model_args=model, nproc=1, train_iters=8) == baseline


def test_a_save_and_resume_with_the_overlap_is_exact(tmp_path):
    """A checkpoint taken right after a deferred step holds the settled state: resumed in new
    processes, the run gives the uninterrupted losses."""
    args = [*offload_args(tmp_path, tiers=("host",)), "--offload-update", "gpu", *OVERLAP]
    baseline = run_pretrain(tmp_path / "base", [], nproc=1, train_iters=6)
    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    run_pretrain(tmp_path / "a", [*args, "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"],
                 nproc=1, train_iters=6, loss_log=log)
    run_pretrain(tmp_path / "b", [*args, "--load", str(ckpt)], nproc=1, train_iters=6, loss_log=log)
    assert [json.loads(line)["loss"] for line in open(log)] == [r["loss"] for r in baseline]


@pytest.mark.parametrize("layout", ["pp2", "moe"])
def test_pipeline_stages_and_experts_with_the_overlap_match_megatron(tmp_path, layout):
    """Two pipeline stages (each rank gates its own layers), and a mixture-of-experts model (a dense
    and an expert engine, experts a router may leave out of a forward)."""
    extra, nproc = (["--pipeline-model-parallel-size", "2"], 2) if layout == "pp2" else (MOE, 1)
    baseline = run_pretrain(tmp_path / "base", extra, nproc=nproc, train_iters=5)
    run = run_pretrain(tmp_path / "ovl", [*extra, *offload_args(tmp_path, tiers=("host",)), "--offload-update", "gpu",
                                          *OVERLAP], nproc=nproc, train_iters=5)
    assert run == baseline
    assert "the update runs under the next forward" in (tmp_path / "ovl" / "loss-0.out").read_text()


GATHER = ["--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.mark.parametrize("layout", ["dp2", "pp2dp2", "moe_ep2"])
def test_above_one_data_parallel_rank_each_bucket_is_gathered_after_its_update(tmp_path, layout):
    """Data-parallel size 2: each rank updates its shard under the forward, and megatron-core's
    per-bucket all-gather (its forward hooks, with --overlap-param-gather) must follow this rank's
    update of that bucket. On the CPU twin a deferred subgroup is updated when the gate asks for it:
    a bucket gathered before its gate asked would gather stale params, and the losses would differ.
    Small buckets (--overlap-grad-reduce's) and several subgroups per bucket; unowned grads zeroed."""
    extra, nproc = {"dp2": (GATHER, 2), "pp2dp2": ([*GATHER, "--pipeline-model-parallel-size", "2"], 4),
                    "moe_ep2": ([*GATHER, *MOE, "--expert-model-parallel-size", "2"], 4)}[layout]
    baseline = run_pretrain(tmp_path / "base", extra, nproc=nproc, train_iters=6)  # 3 settled steps first
    run = run_pretrain(tmp_path / "ovl", [*extra, *offload_args(tmp_path, tiers=("host",), subgroup="500"),
                                          "--offload-update", "gpu", *OVERLAP], nproc=nproc, train_iters=6)
    assert run == baseline
    assert "the update runs under the next forward" in (tmp_path / "ovl" / "loss-0.out").read_text()


def test_above_one_data_parallel_rank_the_overlap_needs_the_per_bucket_gather(tmp_path):
    [run] = run_pretrain(tmp_path / "ovl", [*offload_args(tmp_path, tiers=("host",)), "--offload-update", "gpu",
                                            *OVERLAP], nproc=2, train_iters=2, expect_success=False)
    assert run["returncode"] != 0
    line = "--offload-overlap-forward at data-parallel size 2 needs --overlap-param-gather"
    output = ranks_output(run["output"])  # under torchrun, without its own report of the failure
    assert output.count(line) == 1, run["output"][-3000:]
    assert "Traceback" not in output, run["output"][-3000:]
