"""8-bit Adam moments (--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8) through a DP2 -> DP1 -> DP2 hand-over,
and at the same layout, at PP2, converted to megatron-core's own optimizer and back, and resumed with bf16
moments (CPU processes, the tiny GPT on host and nvme tiers).

A DP2 run saves at iteration 2 and goes on to 4. Its checkpoint is loaded at DP1 and saved at once,
then loaded back at DP2 and trained to 4. Where megatron-core's DP2 shard cuts a parameter at a
multiple of 128 of its elements, the cut is a block boundary on both sides: codes and scales move
unchanged both ways, and the DP1 checkpoint holds the DP2 one's bits. A cut inside a block makes the
DP1 shard hold one whole block where DP2 held two short ones: those blocks are quantized again (the
DP1 scale is the larger of the two, so the smaller half's codes lose up to its ratio in precision),
the rest keep their bits. The masters move exactly. Where every cut is aligned the resumed DP2 run
continues bit for bit; otherwise its losses stay within 1e-4 relative of the uninterrupted run's
(measured: 4e-6 at iteration 4). Why close and not equal: the cut block's moments were quantized twice
more (DP2 -> DP1 -> DP2); e4m3 keeps 3 mantissa bits, so each such moment may move by up to 1/16 of
itself (plus a subnormal step of its block's largest), in those 128 elements of ~100k alone, and
the update of those elements moves with them.
"""

import sys

import pytest
import torch

from helpers import copy_checkpoint, global_offload_state, offload_args
from launch import run_pretrain

FP8 = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # RNG states stay behind across DP sizes
SAVED_AT, ITERS, BLOCK = 2, 4, 128



def cut_blocks(iteration_dir):
    """Per global tensor key, the elements of the blocks the DP2 files cut inside (where a file's piece
    of a parameter starts or ends off a multiple of 128 of its elements), as a flat boolean mask, and
    whether any piece was cut at all."""
    from megatron.training.checkpoint.offload_files import ParamGeometry
    from megatron.training.checkpoint.offloaded_state import SavedOffloadState
    masks, cut_any = {}, False
    with SavedOffloadState(str(iteration_dir)) as saved:
        position = saved.position("dense", 0, 0)
        for saved_file in position.files:
            for name, offset, length, _ in saved_file.metadata["params"]:
                geometry = ParamGeometry.from_json(position.geometry[name])
                local = torch.zeros(geometry.numel, dtype=torch.bool)
                for at in (offset, offset + length):
                    cut_any |= 0 < at < geometry.numel
                    if 0 < at < geometry.numel and at % BLOCK:
                        local[at // BLOCK * BLOCK: at // BLOCK * BLOCK + BLOCK] = True
                mask = masks.setdefault(geometry.key, torch.zeros(geometry.global_shape, dtype=torch.bool))
                place = tuple(slice(o, o + n) for o, n in zip(geometry.global_offset, geometry.local_shape))
                mask[place] |= local.view(geometry.local_shape)  # (a layer of a stacked global tensor)
    return {key: mask.view(-1) for key, mask in masks.items()}, cut_any


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """Per hidden size, made once: (the flags of a leg by its name, the uninterrupted DP2 run's
    records, its checkpoint at iteration 2 alone)."""
    runs = {}

    def make(hidden: int):
        if hidden not in runs:
            tmp = tmp_path_factory.mktemp(f"fp8-h{hidden}")

            def args(name, moments=FP8):
                return [*NO_DROPOUT, "--hidden-size", str(hidden), *moments,
                        *offload_args(tmp / name, tiers=("host", "nvme"))]

            whole = run_pretrain(tmp / "a", [*args("a"), "--save", str(tmp / "a-ckpt"), "--save-interval",
                                             str(SAVED_AT)], train_iters=ITERS)
            runs[hidden] = (args, whole, copy_checkpoint(tmp / "a-ckpt", [SAVED_AT], tmp / "fp8-ckpt"))
        return runs[hidden]

    return make


def test_fp8_moments_resume_at_the_same_layout_bit_for_bit(tmp_path, fp8_run):
    """Each rank's own file, as saved: codes and scales copied byte for byte, no notice."""
    args, whole, at2 = fp8_run(64)
    resumed = run_pretrain(tmp_path / "s", [*args("s"), "--load", str(at2)], train_iters=ITERS)
    assert resumed == whole[SAVED_AT:]
    output = (tmp_path / "s" / "loss-0.out").read_text()
    assert "resharded" not in output and "Adam moments are stored as" not in output


# The tiny GPT's DP2 cuts all fall on multiples of 128 of their params; at hidden size 48 one cuts
# a block of linear_fc1 (megatron-core's shard cuts are multiples of 64 in a param: either may happen).
@pytest.mark.parametrize("hidden,cut_inside", [(64, False), (48, True)], ids=["cuts-on-blocks", "a-cut-in-a-block"])
def test_fp8_moments_go_dp2_to_dp1_and_back(tmp_path, fp8_run, hidden, cut_inside):
    args, whole, at2 = fp8_run(hidden)
    run_pretrain(tmp_path / "b", [*args("b"), "--load", str(at2), "--save", str(tmp_path / "dp1-ckpt")],
                 nproc=1, train_iters=SAVED_AT)
    assert "offloaded state resharded from data-parallel size 2 to 1" in (tmp_path / "b" / "loss-0.out").read_text()
    name = f"iter_{SAVED_AT:07d}"
    masks, cut_any = cut_blocks(at2 / name)
    assert cut_any  # DP2 cuts parameters: the case in question
    dp2, dp1 = global_offload_state(at2 / name), global_offload_state(tmp_path / "dp1-ckpt" / name)
    for key, mask in masks.items():
        assert torch.equal(dp1[key][0], dp2[key][0]), key  # fp32 masters move exactly
        for a, b in zip(dp1[key][1:], dp2[key][1:]):
            a, b = a.view(-1), b.view(-1)
            assert torch.equal(a[~mask], b[~mask]), key  # outside the blocks cut inside: the same bits
            if mask.any():  # quantized once more under the DP1 block's (larger) scale: e4m3's 3 mantissa bits
                top = float(b[mask].abs().max())
                assert ((a[mask] - b[mask]).abs() <= 0.13 * b[mask].abs() + top / 64).all(), key
    inside = any(mask.any() for mask in masks.values())
    assert inside == cut_inside

    resumed = run_pretrain(tmp_path / "c", [*args("c"), "--load", str(tmp_path / "dp1-ckpt")],
                           train_iters=ITERS)
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert "offloaded state resharded from data-parallel size 1 to 2" in (tmp_path / "c" / "loss-0.out").read_text()
    if not inside:
        assert resumed == whole[SAVED_AT:]
    else:
        for mine, theirs in zip(resumed, whole[SAVED_AT:]):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)


def test_fp8_moments_go_to_pp2_and_back_unchanged(tmp_path, fp8_run):
    """Another PP size reads by global region; each parameter is the same tensor there, so its codes and
    scales move as by name: the PP2 checkpoint holds the DP2 one's bits (the tiny GPT's DP2 cuts are on
    blocks), and back at PP1 DP2 the run continues bit for bit. (Requantizing an unchanged block gives its
    bits back too, so these bits cannot tell the two paths apart; test_eight_bit_reshard tells them by reads.)"""
    args, whole, at2 = fp8_run(64)
    run_pretrain(tmp_path / "p", [*args("p"), "--pipeline-model-parallel-size", "2", "--load", str(at2), "--save",
                                  str(tmp_path / "pp2-ckpt")], train_iters=SAVED_AT)
    assert "resharded from TP=1 PP=1 DP=2 to TP=1 PP=2 DP=1" in (tmp_path / "p" / "loss-0.out").read_text()
    name = f"iter_{SAVED_AT:07d}"
    before, after = global_offload_state(at2 / name), global_offload_state(tmp_path / "pp2-ckpt" / name)
    assert sorted(before) == sorted(after)
    for key in before:
        assert all(torch.equal(a, b) for a, b in zip(after[key], before[key])), key
    resumed = run_pretrain(tmp_path / "q", [*args("q"), "--load", str(tmp_path / "pp2-ckpt")], train_iters=ITERS)
    assert resumed == whole[SAVED_AT:]


def test_fp8_moments_convert_to_megatron_cores_form_and_back(tmp_path, fp8_run):
    """Offloaded fp8 -> megatron-core's own optimizer (fp32 moments: dequantized) -> offloaded
    fp8 again (quantized under the same blocks: the blocks' codes come back, bar the rare block whose
    scale does not survive ``absmax / qmax`` of its dequantized values). Each direction says so in
    one line; the run continues within 1e-4 of the uninterrupted one (measured: the same losses)."""
    offload, whole, at2 = fp8_run(64)
    run_pretrain(tmp_path / "b", [*NO_DROPOUT, "--load", str(at2), "--save", str(tmp_path / "plain-ckpt")],
                 train_iters=SAVED_AT)
    run_pretrain(tmp_path / "c", [*offload("c"), "--load", str(tmp_path / "plain-ckpt"), "--save",
                                  str(tmp_path / "back-ckpt")], train_iters=SAVED_AT)
    for leg, what in (("b", "dequantized for megatron-core's optimizer"),
                      ("c", "quantized from megatron-core's saved moments")):
        lines = [line for line in (tmp_path / leg / "loss-0.out").read_text().splitlines()
                 if "the offloaded Adam moments are 8-bit" in line]
        assert len(lines) == 1 and what in lines[0] and "one scale per tensor" in lines[0], lines
    name = f"iter_{SAVED_AT:07d}"
    before, after = global_offload_state(at2 / name), global_offload_state(tmp_path / "back-ckpt" / name)
    for key in before:
        assert torch.equal(after[key][0], before[key][0]), key
        for a, b in zip(after[key][1:], before[key][1:]):
            assert ((a - b).abs() <= 0.13 * b.abs()).all(), key
            assert torch.eq(a, b).float().mean() > 0.99, key  # (measured: every element, 2026-11-27)
    resumed = run_pretrain(tmp_path / "d", [*offload("d"), "--load", str(tmp_path / "back-ckpt")], train_iters=ITERS)
    for mine, theirs in zip(resumed, whole[SAVED_AT:]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)


def test_fp8_checkpoint_resumes_with_bf16_moments_after_one_notice(tmp_path, fp8_run):
    """Another --exp-avg-dtype at resume: the moments are dequantized into bf16, said once (rank 0),
    and training goes on: iteration 3's loss (before any step) is the uninterrupted run's, the next
    one within bf16's rounding of the moments."""
    args, whole, at2 = fp8_run(64)
    bf16 = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    resumed = run_pretrain(tmp_path / "e", [*args("e", moments=bf16), "--load", str(at2)], train_iters=ITERS)
    output = (tmp_path / "e" / "loss-0.out").read_text()
    notices = [line for line in output.splitlines() if "Adam moments are stored as" in line]
    assert len(notices) == 1 and "e4m3-b128/sqrt-e4m3-b128" in notices[0] and "bf16/bf16" in notices[0] \
        and "dequantized" in notices[0], notices
    assert resumed[0] == whole[SAVED_AT]
    assert resumed[1]["loss"] == pytest.approx(whole[SAVED_AT + 1]["loss"], rel=1e-3)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
