"""The interleaved (virtual) pipeline on CPU: PP=2 x VPP=2 on 2 processes (the tiny model's 4 layers,
one per model chunk: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3), evaluated every 2 iterations.

The offloaded run is bit-identical to megatron-core's distributed optimizer with the same flags; a
checkpoint saved with VPP in either optimizer form resumes bit for bit with VPP in either; its global weights
and offloaded optimizer state load unchanged into a run without VPP (PP=2), and that run's checkpoint
resumes with VPP as if nothing had happened. megatron-core's own optimizer form, keyed by DDP bucket,
refuses another layout (here one process, no pipeline) in one line.
"""

import sys

import pytest
import torch

from launch import run_pretrain
from helpers import assert_same_state, copy_checkpoint, global_offload_state, global_weights, offload_args

ITERS, SAVED_AT = 4, 2
PP2 = ["--pipeline-model-parallel-size", "2", "--eval-interval", "2", "--eval-iters", "1"]
VPP2 = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]


def saving(ckpt):
    return ["--save", str(ckpt), "--save-interval", str(SAVED_AT)]


def at_saved(tmp, form: str):
    """A root holding only the ``form`` run's checkpoint of iteration SAVED_AT."""
    into = tmp / f"{form}-at{SAVED_AT}"
    return into if into.exists() else copy_checkpoint(tmp / f"{form}-ckpt", [SAVED_AT], into)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 iterations with megatron-core's optimizer and offloaded, each saving at 2."""
    tmp = tmp_path_factory.mktemp("vpp")
    plain = run_pretrain(tmp / "plain", [*VPP2, *saving(tmp / "plain-ckpt")], train_iters=ITERS)
    offload = run_pretrain(tmp / "off", [*VPP2, *offload_args(tmp / "off"), *saving(tmp / "off-ckpt")],
                           train_iters=ITERS)
    return tmp, plain, offload


@pytest.fixture(scope="module")
def pp2_checkpoint(runs):
    """The VPP checkpoint of iteration 2 loaded without VPP and saved at once (no step between)."""
    tmp, _, _ = runs
    at2 = at_saved(tmp, "off")
    run_pretrain(tmp / "pp2", [*PP2, *offload_args(tmp / "pp2"), "--load", str(at2), "--save", str(tmp / "pp2-ckpt")],
                 train_iters=SAVED_AT)
    return at2 / f"iter_{SAVED_AT:07d}", tmp / "pp2-ckpt" / f"iter_{SAVED_AT:07d}", tmp / "pp2" / "loss-0.out"


def test_offload_matches_megatron_core_bit_for_bit(runs):
    tmp, plain, offload = runs
    assert [r["iteration"] for r in plain] == [1, 2, 3, 4]
    assert offload == plain
    assert "TP=1 PP=2 VPP=2 DP=1 | micro-batches per step: 4" in (tmp / "off" / "loss-0.out").read_text()


@pytest.mark.parametrize("saved, resumed", [("off", "off"), ("plain", "plain"), ("off", "plain"), ("plain", "off")])
def test_checkpoint_resumes_bit_for_bit_with_vpp_in_either_optimizer(runs, saved, resumed):
    tmp, plain, _ = runs
    run = tmp / f"{saved}-to-{resumed}"
    extra = offload_args(run) if resumed == "off" else []
    assert run_pretrain(run, [*VPP2, *extra, "--load", str(at_saved(tmp, saved))], train_iters=ITERS) == plain[SAVED_AT:]


def test_vpp_checkpoint_loads_without_vpp_unchanged(pp2_checkpoint):
    vpp, pp2, output = pp2_checkpoint
    saved, loaded = global_weights(vpp), global_weights(pp2)
    assert saved.keys() == loaded.keys() and "decoder.layers.mlp.linear_fc1.weight" in saved
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    assert_same_state(global_offload_state(vpp), global_offload_state(pp2))
    assert "offloaded state resharded from TP=1 PP=2 VPP=2 DP=1 to TP=1 PP=2 DP=1" in output.read_text()


def test_checkpoint_without_vpp_resumes_with_vpp_bit_for_bit(runs, pp2_checkpoint):
    tmp, plain, _ = runs
    resumed = run_pretrain(tmp / "back", [*VPP2, *offload_args(tmp / "back"), "--load", str(pp2_checkpoint[1].parent)],
                           train_iters=ITERS)
    assert resumed == plain[SAVED_AT:]


def test_megatron_core_form_refuses_another_layout_in_one_line(runs):
    tmp, _, _ = runs
    (failed,) = run_pretrain(tmp / "refused", ["--load", str(at_saved(tmp, "plain"))], nproc=1, train_iters=ITERS,
                             expect_success=False)
    errors = [line for line in failed["output"].splitlines() if line.startswith("error: ")]
    assert failed["returncode"] != 0 and len(errors) == 1, failed["output"][-3000:]
    assert "saved at TP=1 PP=2 VPP=2" in errors[0] and "this run is TP=1 PP=1:" in errors[0]
    assert "--no-load-optim" in errors[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
