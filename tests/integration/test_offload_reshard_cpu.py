"""Offloaded optimizer state across TP and PP changes (CPU; dropout off and one padded vocabulary
size, whose padding rows TP=1 would otherwise drop, so only the layout differs).

A TP=2 run saves at iteration 2. Loading it at PP=2 and saving at once must write the same global
fp32 master/exp_avg/exp_avg_sq tensors (reassembled here from each checkpoint's files by their
recorded geometry); loading that PP=2 checkpoint back at TP=2 must continue bit for bit as the
uninterrupted TP=2 run. One process at TP=1 PP=1 trains on from the TP=2 state bit for bit alike with
megatron-core's own optimizer (filled from the offloaded form) and with the engine, and close to the
TP=2 run: another reduction order, not the same bits.
"""

import sys

import pytest

from helpers import assert_same_state, copy_checkpoint, global_offload_state, offload_args
from launch import run_pretrain

SAVED_AT, ITERS = 2, 4
SAME_MODEL = ["--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "512"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    tp2 = run_pretrain(tmp / "a", [*SAME_MODEL, *TP2, *offload_args(tmp / "a"), "--save", str(tmp / "a-ckpt"),
                                   "--save-interval", str(SAVED_AT)], train_iters=ITERS)
    at2 = copy_checkpoint(tmp / "a-ckpt", [SAVED_AT], tmp / "tp2-ckpt")
    # Loaded at PP=2 and saved at once: no step in between.
    run_pretrain(tmp / "b", [*SAME_MODEL, *PP2, *offload_args(tmp / "b"), "--load", str(at2),
                             "--save", str(tmp / "pp2-ckpt")], train_iters=SAVED_AT)
    return tmp, tp2


def test_tp2_state_loads_at_pp2_unchanged(runs):
    tmp, _ = runs
    name = f"iter_{SAVED_AT:07d}"
    assert sorted(p.name for p in (tmp / "pp2-ckpt" / name / "offload").glob("*.offload")) == [
        "pp000_tp000_dp000.offload", "pp001_tp000_dp000.offload"]
    assert_same_state(global_offload_state(tmp / "tp2-ckpt" / name), global_offload_state(tmp / "pp2-ckpt" / name))
    assert "offloaded state resharded from TP=2 PP=1 DP=1 to TP=1 PP=2 DP=1" in (tmp / "b" / "loss-0.out").read_text()


def test_pp2_state_back_at_tp2_continues_bit_for_bit(runs):
    tmp, tp2 = runs
    resumed = run_pretrain(tmp / "c", [*SAME_MODEL, *TP2, *offload_args(tmp / "c"), "--load", str(tmp / "pp2-ckpt")],
                           train_iters=ITERS)
    assert resumed == tp2[SAVED_AT:]


def test_one_process_trains_on_from_tp2_state_alike_with_and_without_offload(runs):
    tmp, tp2 = runs
    resumed = run_pretrain(tmp / "d", [*SAME_MODEL, "--load", str(tmp / "tp2-ckpt")], nproc=1, train_iters=ITERS)
    assert [r["iteration"] for r in resumed] == [3, 4]
    # The exact reference at TP1: the engine reading the same TP2 state by global region, beside
    # megatron-core's optimizer filled from it; one layout, one reduction order, the same bits.
    offloaded = run_pretrain(tmp / "e", [*SAME_MODEL, *offload_args(tmp / "e"), "--load", str(tmp / "tp2-ckpt")],
                             nproc=1, train_iters=ITERS)
    assert offloaded == resumed
    for mine, theirs in zip(resumed, tp2[SAVED_AT:]):
        # Not bit for bit: TP2 splits each row-parallel matmul's reduction over two ranks and TP1 sums in
        # another order, so bf16 activations differ in their last bits from the first resumed step on;
        # hence a tolerance here where the suite's same-layout resumes compare with ==.
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-3)
    assert "converted from the offloaded form" in (tmp / "d" / "loss-0.out").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
