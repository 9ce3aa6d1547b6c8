"""Checkpoints across every boundary (2 CPU processes, DP=2, 4 iterations, saves at 2):
offload on/off between save and resume in both directions, weights-only loads, and a checkpoint
laid out as Megatron-LM's save_checkpoint writes it, and the offline conversion tool. Offload and plain runs are bit-identical on
CPU (test_offload_cpu), so every resume must repeat the uninterrupted plain run's iterations 3-4."""

import sys

import pytest

from conftest import copy_checkpoint
from launch import (REPO, TINY_MODEL, TINY_SEQ, pretrain_command, pretrain_env, run_and_clean_up,
                    run_conversion, run_pretrain, tool_module)
from test_offload_cpu import offload_args

ITERS, SAVED_AT = 4, 2


def saving(ckpt):
    return ["--save", str(ckpt), "--save-interval", str(SAVED_AT), "--exit-interval", str(SAVED_AT)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted plain run (saving at 2 and 4, ``base-ckpt``; ``plain-ckpt`` holds its
    checkpoint 2 alone) and an offloaded run that saved at 2 and stopped (``off-ckpt``)."""
    tmp = tmp_path_factory.mktemp("crossing")
    baseline = run_pretrain(tmp / "base", ["--save", str(tmp / "base-ckpt"), "--save-interval", str(SAVED_AT)],
                            train_iters=ITERS)
    copy_checkpoint(tmp / "base-ckpt", [SAVED_AT], tmp / "plain-ckpt")
    run_pretrain(tmp / "off", [*offload_args(tmp / "off"), *saving(tmp / "off-ckpt")], train_iters=ITERS)
    return tmp, baseline


def test_offloaded_checkpoint_resumes_without_offload(runs):
    tmp, baseline = runs
    resumed = run_pretrain(tmp / "r1", ["--load", str(tmp / "off-ckpt")], train_iters=ITERS)
    assert resumed == baseline[SAVED_AT:]


def test_no_load_optim_loads_weights_across_forms(runs):
    """The weights and data position load (iteration 3's loss is the baseline's); Adam starts fresh."""
    tmp, baseline = runs
    resumed = run_pretrain(tmp / "r3", ["--load", str(tmp / "off-ckpt"), "--no-load-optim"], train_iters=ITERS)
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert resumed[0]["loss"] == baseline[SAVED_AT]["loss"]
    assert resumed[1]["loss"] != baseline[SAVED_AT + 1]["loss"]


def test_upstream_megatron_layout_loads_and_trains_on(runs):
    """A checkpoint with Megatron-LM's torch_dist keys (written by upstream_layout_writer.py from the
    plain checkpoint) resumes bit for bit, without and with offload."""
    tmp, baseline = runs
    upstream = tmp / "upstream-ckpt"
    cmd = pretrain_command(["--load", str(tmp / "plain-ckpt"), "--upstream-out", str(upstream)], 2, ITERS,
                           tmp / "unused.jsonl", warm=True,
                           script=REPO / "tests" / "integration" / "upstream_layout_writer.py")
    code, output = run_and_clean_up(cmd, pretrain_env(), 240, tmp / "writer.out")
    assert code == 0, output[-4000:]
    assert not (upstream / "iter_0000002" / "COMPLETE.json").exists()
    plain = run_pretrain(tmp / "u1", ["--load", str(upstream)], train_iters=ITERS)
    assert plain == baseline[SAVED_AT:]
    offload = run_pretrain(tmp / "u2", [*offload_args(tmp / "u2"), "--load", str(upstream)], train_iters=ITERS)
    assert offload == baseline[SAVED_AT:]


def convert(tmp, to, source, target, training_flags, warm=False):
    """tools/convert_offload_checkpoint.py, with the training flags of the run that saved ``source``:
    the tool as users run it (its own torchrun), or its conversion launched warm (launch.run_conversion)."""
    tool_args = ["--to", to, "--load", str(source), "--save", str(target), "--", *TINY_MODEL, "--mock-data",
                 *training_flags]
    if warm:
        code, output = run_conversion(tool_args, tmp / f"convert-{to}.out", timeout=240)
    else:
        cmd = [sys.executable, str(REPO / "tools" / "convert_offload_checkpoint.py"), *tool_args]
        code, output = run_and_clean_up(cmd, pretrain_env(), 240, tmp / f"convert-{to}.out")
    assert code == 0, output[-4000:]
    return output


def test_conversion_tool_offload_to_plain_and_back(runs):
    """Converted offline, each form resumes bit for bit as the uninterrupted run: offload -> plain
    without offload, plain -> offload with offload."""
    tmp, baseline = runs
    convert(tmp, "plain", tmp / "off-ckpt", tmp / "to-plain", [])
    assert not (tmp / "to-plain" / f"iter_{SAVED_AT:07d}" / "offload").exists()
    assert run_pretrain(tmp / "t1", ["--load", str(tmp / "to-plain")], train_iters=ITERS) == baseline[SAVED_AT:]
    convert(tmp, "offload", tmp / "plain-ckpt", tmp / "to-off", offload_args(tmp / "t2"), warm=True)
    assert (tmp / "to-off" / f"iter_{SAVED_AT:07d}" / "offload" / "pp000_tp000_dp001.offload").exists()
    resumed = run_pretrain(tmp / "t2", [*offload_args(tmp / "t2"), "--load", str(tmp / "to-off")], train_iters=ITERS)
    assert resumed == baseline[SAVED_AT:]


@pytest.mark.parametrize("to,load,save,why", [
    ("plain", "missing", "out", "not a directory"),
    ("offload", "off-ckpt", "out", "already in the offload form"),
    ("plain", "off-ckpt", "plain-ckpt", "not an empty directory"),
])
def test_conversion_tool_refuses_in_one_line(runs, to, load, save, why):
    tmp, _ = runs
    with pytest.raises(SystemExit) as refused:
        tool_module("convert_offload_checkpoint").main(["--to", to, "--load", str(tmp / load), "--save",
                                                         str(tmp / save), "--", *TINY_MODEL])
    line = str(refused.value)
    assert line.startswith("error: ") and why in line and "\n" not in line


def test_saved_keys_are_megatron_lm_s(runs):
    from megatron.core import dist_checkpointing

    tmp, _ = runs
    common = dist_checkpointing.load_common_state_dict(str(tmp / "plain-ckpt" / "iter_0000002"))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == SAVED_AT
    assert common["args"].consumed_train_samples == SAVED_AT * 8
    assert "opt_param_scheduler" in common
    # TINY_MODEL (4 layers, hidden 64, FFN 256, seq TINY_SEQ, vocab 384 padded, batch 8), counted by hand
    # as Megatron-LM does: per token and layer 2*(qkv 3h^2 + attention s*h (causal half of 2sh) + proj
    # h^2 + MLP 8h^2), logits 2*h*v; three passes; 8 sequences of s tokens per iteration.
    h, s, v = 64, TINY_SEQ, 384
    per_token = 4 * 2 * (3 * h * h + s * h + h * h + 8 * h * h) + 2 * h * v
    assert common["num_floating_point_operations_so_far"] == SAVED_AT * 3 * per_token * s * 8
    assert (tmp / "base-ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)  # the last save


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
