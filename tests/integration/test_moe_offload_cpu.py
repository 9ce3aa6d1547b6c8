"""Mixture-of-experts models (megatron-core's MoE layers) with the offloaded optimizer on CPU.

megatron-core shards the experts' optimizer over the expert-data-parallel group, apart from the
dense parameters; the offload facade runs an engine for each. Against megatron-core's own
optimizer (unfused Adam on both sides): bit-identical losses, grad norms and learning rates in
DP2 x EP2 (alltoall dispatcher, expert-DP 1) and PP2 with dense and MoE layers mixed (expert-DP 1
per stage, allgather dispatcher). Checkpoints of the offloaded form reshard across EP: saved at
EP 2 and loaded at EP 1 (where megatron-core keeps the experts with the dense parameters) and back,
and from PP 2 x EP 1 to PP 1 x EP 2 and back, every global parameter's master copy and moments are
the same numbers (read back from each checkpoint's files with no resharding code: each file's local
tensors placed at their recorded global offsets), and each round trip resumes the uninterrupted run
bit for bit. MoE checkpoints also cross offload on/off (megatron-core's optimizer <-> the engines).
"""

import re

import pytest

from helpers import (MOE, assert_same_state, copy_checkpoint, global_offload_state, half_away_megatron, offload_args,
                     plan_json)
from launch import TINY_MODEL, TINY_SEQ, ranks_output, run_pretrain
from mlp_offload import GiB

OFFLOAD = ["--offload-tiers", "host", "--offload-adam-kernel", "single", "--offload-subgroup-size", "6000",
           "--no-store-param-remainders"]  # megatron-core's model params round to nearest even
LAYOUTS = {
    "dp2_ep2_alltoall": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    # No dropout: its RNG streams are kept per (PP, TP) position, so a reshard across PP changes them
    # (as in Megatron-LM) and the round trip below could not repeat the losses.
    "pp2_mixed_layers": ["--pipeline-model-parallel-size", "2", "--moe-layer-freq", "([0]+[1])*2",
                         "--hidden-dropout", "0", "--attention-dropout", "0"],
}


ITERS, SAVED_AT = 4, 2
EP2, PP2 = LAYOUTS["dp2_ep2_alltoall"], LAYOUTS["pp2_mixed_layers"]


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory):
    """DP2 x EP2 (expert-DP 1), 4 iterations saving at 2 and 4: megatron-core's optimizer
    (``base-ckpt``) and the offloaded one (``off-ckpt``), and each one's checkpoint 2 alone."""
    tmp = tmp_path_factory.mktemp("moe_ep2")
    saves = ["--save-interval", str(SAVED_AT)]
    baseline = run_pretrain(tmp / "base", [*MOE, *EP2, "--save", str(tmp / "base-ckpt"), *saves], train_iters=ITERS)
    offload = run_pretrain(tmp / "off", [*MOE, *EP2, *OFFLOAD, "--save", str(tmp / "off-ckpt"), *saves],
                           train_iters=ITERS)
    copy_checkpoint(tmp / "base-ckpt", [SAVED_AT], tmp / "plain-2")
    copy_checkpoint(tmp / "off-ckpt", [SAVED_AT], tmp / "off-2")
    return tmp, baseline, offload


def test_moe_offload_matches_megatron_bit_for_bit(ep2_runs):
    tmp, baseline, offload = ep2_runs
    assert [r["iteration"] for r in baseline] == list(range(1, ITERS + 1))
    assert offload == baseline
    out = (tmp / "base" / "loss-0.out").read_text()
    assert "load_balancing_loss:" in out  # logged after 'lm loss', as Megatron-LM
    # TINY_MODEL's 4 layers, all MoE: 4 experts of SwiGLU width 128 (8h/3 rounded down to 64s), top-2.
    h, s, v, ffn, batch = 64, TINY_SEQ, 384, 128, 8
    total = int(re.search(r"model parameters \(all stages, one replica\): (\d+)", out).group(1))
    active = int(re.search(r"active parameters per token: (\d+)", out).group(1))
    assert total - active == 4 * (4 - 2) * 3 * h * ffn
    assert "4 experts, top-2, in 4 of 4 layers | EP=2 ETP=1 expert-DP=1" in out
    # No grouped GEMM asked for: megatron-core's local spec builds sequential experts, 4 / EP 2 per rank.
    assert "> experts module: megatron.core.transformer.moe.experts.SequentialMLP, 2 local experts per rank" in out
    # FLOPs as Megatron-LM counts an MoE layer (top-2 experts per token), as the checkpoint keeps them.
    from megatron.core import dist_checkpointing

    per_token = 4 * 2 * (4 * h * h + s * h + 3 * h * 2 * ffn) + 2 * h * v
    common = dist_checkpointing.load_common_state_dict(str(tmp / "plain-2" / "iter_0000002"))
    assert common["num_floating_point_operations_so_far"] == SAVED_AT * 3 * per_token * s * batch


def test_the_plan_is_what_the_moe_run_did(ep2_runs):
    """tools/plan_offload.py on the same flags: the logged parameter count, and each engine's shard
    as the run's engines logged it (dense over DP 2, experts over expert-DP 1)."""
    tmp, _, _ = ep2_runs
    out = (tmp / "off" / "loss-0.out").read_text()
    plan = plan_json("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", *TINY_MODEL, *MOE, *EP2,
                     *OFFLOAD)
    assert plan["params_total"] == int(re.search(r"model parameters \(all stages, one replica\): (\d+)", out).group(1))
    logged = [int(n) for n in re.findall(r"offload rank 0: (\d+) params in", out)]
    planned = [e["optimizer_state_elements_per_rank"] for e in plan["engines"].values()]
    assert list(plan["engines"]) == ["dense", "experts"] and len(logged) == 2
    for want, got in zip(planned, logged):  # megatron-core pads each bucket for the data-parallel split
        assert want <= got < want * 1.01 + 256, (planned, logged)


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory):
    """PP2 with dense and MoE layers mixed (EP 1), 4 iterations: megatron-core's optimizer, and the
    offloaded one saving at 2 (``off-2``)."""
    tmp = tmp_path_factory.mktemp("moe_pp2")
    baseline = run_pretrain(tmp / "base", [*MOE, *PP2], train_iters=ITERS)
    offload = run_pretrain(tmp / "off", [*MOE, *PP2, *OFFLOAD, "--save", str(tmp / "off-ckpt"), "--save-interval",
                                         str(SAVED_AT)], train_iters=ITERS)
    copy_checkpoint(tmp / "off-ckpt", [SAVED_AT], tmp / "off-2")
    return tmp, baseline, offload


def test_moe_offload_matches_megatron_with_pipeline_stages(pp2_runs):
    _, baseline, offload = pp2_runs
    assert offload == baseline


def test_moe_checkpoints_cross_offload_on_and_off(ep2_runs):
    """Saved with offload, resumed by megatron-core's optimizer; saved by it, resumed with offload:
    both repeat the uninterrupted run's iterations 3-4 bit for bit (dense and expert state alike)."""
    tmp, baseline, _ = ep2_runs
    plain = run_pretrain(tmp / "x1", [*MOE, *EP2, "--load", str(tmp / "off-2")], train_iters=ITERS)
    assert plain == baseline[SAVED_AT:]
    offload = run_pretrain(tmp / "x2", [*MOE, *EP2, *OFFLOAD, "--load", str(tmp / "plain-2")], train_iters=ITERS)
    assert offload == baseline[SAVED_AT:]


def resave(tmp, name, flags, source):
    """Load ``source`` under ``flags`` and save it again with no step between (as
    tools/convert_offload_checkpoint.py does); the new checkpoint root."""
    out = tmp / f"{name}-ckpt"
    run_pretrain(tmp / name, [*MOE, *OFFLOAD, *flags, "--load", str(source), "--save", str(out)], train_iters=SAVED_AT)
    assert "resharded from" in (tmp / name / "loss-0.out").read_text()
    return out


def assert_same_saved_state(saved_root, resaved_root):
    """Every global parameter's master copy and moments, read back by geometry alone, experts included."""
    saved = global_offload_state(saved_root / "iter_0000002")
    assert any("experts" in key for key in saved)
    assert_same_state(saved, global_offload_state(resaved_root / "iter_0000002"))


def test_offloaded_checkpoint_reshards_across_expert_parallel_sizes(ep2_runs):
    """EP 2 -> EP 1 (DP 2, experts with the dense parameters) -> EP 2: the same numbers at each
    step, and the round trip resumes the uninterrupted EP 2 run's iterations 3-4 bit for bit."""
    tmp, _, offload = ep2_runs
    ep1 = resave(tmp, "to-ep1", [], tmp / "off-2")
    assert (tmp / "off-2" / "iter_0000002" / "offload_experts").is_dir()
    assert not (ep1 / "iter_0000002" / "offload_experts").exists()  # at EP 1 experts are dense parameters
    assert_same_saved_state(tmp / "off-2", ep1)
    resumed = run_pretrain(tmp / "from-ep1", [*MOE, *EP2, *OFFLOAD, "--load", str(ep1)], train_iters=ITERS)
    assert resumed == offload[SAVED_AT:]


def test_offloaded_checkpoint_reshards_between_pipeline_and_expert_parallelism(pp2_runs):
    """PP 2 x EP 1 -> PP 1 x EP 2 -> PP 2: the state survives both reshards, and the round trip resumes
    the uninterrupted PP 2 run bit for bit."""
    tmp, _, offload = pp2_runs
    ep2 = resave(tmp, "to-ep2", [*PP2[2:], *EP2], tmp / "off-2")  # PP2's layer pattern and dropout, at PP 1
    assert (ep2 / "iter_0000002" / "offload_experts").is_dir()
    assert_same_saved_state(tmp / "off-2", ep2)
    resumed = run_pretrain(tmp / "from-ep2", [*MOE, *PP2, *OFFLOAD, "--load", str(ep2)], train_iters=ITERS)
    assert resumed == offload[SAVED_AT:]


def test_moe_with_remainders_matches_half_away_megatron_core(tmp_path):
    """The default with --bf16 (16-bit master remainders, one engine per distributed optimizer, the
    experts' own source of bf16 halves) against megatron-core rounding its bf16 copy half away, as
    the remainders do (the reference of test_remainders_cpu): bit for bit, DP2 x EP2."""
    remainders = [flag for flag in OFFLOAD if flag != "--no-store-param-remainders"]
    reference = half_away_megatron(tmp_path / "ref", [*MOE, *EP2], ITERS)
    offload = run_pretrain(tmp_path / "rem", [*MOE, *EP2, *remainders], train_iters=ITERS)
    assert [r["iteration"] for r in reference] == list(range(1, ITERS + 1))
    assert offload == reference
    assert "state 10.0 B/param (rem16/fp32/fp32)" in (tmp_path / "rem" / "loss-0.out").read_text()


def test_a_host_budget_too_small_for_the_two_engines_is_refused_in_one_line(tmp_path):
    """2 layers, EP 2, one subgroup per engine: --offload-host-cache-gb 0.001 is refused before the
    first iteration in one line that names 0.001 (each engine alone saw only its share), the split by
    state elements and the least budget; that budget then trains."""
    model = list(TINY_MODEL)
    model[model.index("--num-layers") + 1] = "2"

    def flags(budget_gb):
        return [*MOE, *EP2, *offload_args(tmp_path, ("host", "nvme"), budget_gb, subgroup="100000000")]

    refused = run_pretrain(tmp_path / "refused", flags("0.001"), train_iters=1, model_args=model,
                           expect_success=False)[0]
    assert refused["returncode"] != 0
    output = ranks_output(refused["output"])  # under torchrun, without its own report of the failure
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, refused["output"][-3000:]
    assert "iteration        1/" not in output
    least = re.search(r"; --offload-host-cache-gb ([0-9.]+) starts both", errors[0]).group(1)

    run_pretrain(tmp_path / "least", flags(least), train_iters=1, model_args=model)
    out = (tmp_path / "least" / "loss-0.out").read_text()
    dense, experts = (int(n) for n in re.findall(r"offload rank 0: (\d+) params in", out))
    assert experts == 2 * 2 * 3 * 64 * 128  # 2 layers x 2 local experts of SwiGLU (h 64, ffn 128)
    # The reference: state elements split the bytes the flag keeps; an engine of one subgroup with a
    # file tier needs 2 buffers of its state, 3 fp32 regions each padded to 4096 B (O_DIRECT).
    budget, total = int(0.001 * GiB), dense + experts
    shares = {"dense": budget - budget * experts // total, "experts": budget * experts // total}
    needs = {k: 2 * 3 * -(-4 * n // 4096) * 4096 for k, n in (("dense", dense), ("experts", experts))}
    assert errors[0] == (
        f"error: --offload-host-cache-gb 0.001 is too small for the dense and experts engines together: split by "
        f"optimizer state elements it gives dense {shares['dense'] / GiB:.3g} GiB ({dense} elements, needs "
        f"{needs['dense'] / GiB:.3g}) / experts {shares['experts'] / GiB:.3g} GiB ({experts} elements, needs "
        f"{needs['experts'] / GiB:.3g}); --offload-host-cache-gb {least} starts both (or lower "
        f"--offload-subgroup-size)")
    exact = max(-(-needs[k] * total // n) for k, n in (("dense", dense), ("experts", experts)))
    assert exact <= int(float(least) * GiB) <= exact * 1.001  # 1/1000: 4 significant digits, rounded up
