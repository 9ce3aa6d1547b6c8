"""Mixture-of-experts models (megatron-core's MoE layers) with the offloaded optimizer on CPU.

megatron-core shards the experts' optimizer over the expert-data-parallel group, apart from the
dense parameters; the offload facade runs an engine for each. Against megatron-core's own
optimizer (unfused Adam on both sides): bit-identical losses, grad norms and learning rates in
DP2 x EP2 (alltoall dispatcher, expert-DP 1) and PP2 with dense and MoE layers mixed (expert-DP 1
per stage, allgather dispatcher). Checkpoints of the offloaded form reshard across EP: saved at
EP 2 and loaded at EP 1 (where megatron-core keeps the experts with the dense parameters), every
global parameter's master copy and moments are the same numbers (read back from each checkpoint's
files with no resharding code: each file's local tensors placed at their recorded global offsets).
"""

from pathlib import Path

import pytest
import torch

from conftest import copy_checkpoint
from launch import run_pretrain

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--swiglu",
       "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
OFFLOAD = ["--offload-tiers", "host", "--offload-adam-kernel", "single", "--offload-subgroup-size", "6000"]
LAYOUTS = {
    "dp2_ep2_alltoall": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    "pp2_mixed_layers": ["--pipeline-model-parallel-size", "2", "--moe-layer-freq", "([0]+[1])*2"],
}


ITERS, SAVED_AT = 4, 2
EP2 = LAYOUTS["dp2_ep2_alltoall"]


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


def test_moe_offload_matches_megatron_with_pipeline_stages(tmp_path):
    layout = LAYOUTS["pp2_mixed_layers"]
    baseline = run_pretrain(tmp_path / "base", [*MOE, *layout], train_iters=3)
    assert run_pretrain(tmp_path / "off", [*MOE, *layout, *OFFLOAD], train_iters=3) == baseline


def test_moe_checkpoints_cross_offload_on_and_off(ep2_runs):
    """Saved with offload, resumed by megatron-core's optimizer; saved by it, resumed with offload:
    both repeat the uninterrupted run's iterations 3-4 bit for bit (dense and expert state alike)."""
    tmp, baseline, _ = ep2_runs
    plain = run_pretrain(tmp / "x1", [*MOE, *EP2, "--load", str(tmp / "off-2")], train_iters=ITERS)
    assert plain == baseline[SAVED_AT:]
    offload = run_pretrain(tmp / "x2", [*MOE, *EP2, *OFFLOAD, "--load", str(tmp / "plain-2")], train_iters=ITERS)
    assert offload == baseline[SAVED_AT:]


def global_states(iteration_dir: Path):
    """{global key: [param, exp_avg, exp_avg_sq] global tensors} from every offload file, by geometry."""
    from megatron.training.checkpoint.offload_files import (SUBDIRS, OffloadFileSet, has_offloaded_state,
                                                            saved_model_parallel_sizes)
    from megatron.training.checkpoint.param_geometry import ParamGeometry

    found = {}
    for kind in SUBDIRS:
        if not has_offloaded_state(str(iteration_dir), kind):
            continue
        pp_size, tp_size = saved_model_parallel_sizes(str(iteration_dir), kind)
        for pp in range(pp_size):
            for tp in range(tp_size):
                with OffloadFileSet(str(iteration_dir), pp, tp, kind=kind) as files:
                    for name, entry in files.geometry.items():
                        g = ParamGeometry.from_json(entry)
                        local = [torch.empty(g.numel) for _ in range(3)]
                        files.read(name, 0, g.numel, local)
                        whole = found.setdefault(g.key, [torch.full(g.global_shape, float("nan")) for _ in range(3)])
                        box = tuple(slice(o, o + n) for o, n in zip(g.global_offset, g.local_shape))
                        for w, t in zip(whole, local):
                            w[box] = t.view(g.local_shape)
    return found


def test_offloaded_checkpoint_reshards_across_expert_parallel_sizes(tmp_path):
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    run_pretrain(tmp_path / "a", [*MOE, *OFFLOAD, "--expert-model-parallel-size", "2", "--save", str(ckpt)],
                 train_iters=2)
    # EP 1: loaded and saved again with no step between (as tools/convert_offload_checkpoint.py does).
    run_pretrain(tmp_path / "b", [*MOE, *OFFLOAD, "--load", str(ckpt), "--save", str(again)], train_iters=2)
    assert "resharded from" in (tmp_path / "b" / "loss-0.out").read_text()
    assert (ckpt / "iter_0000002" / "offload_experts").is_dir()
    assert not (again / "iter_0000002" / "offload_experts").exists()  # at EP 1 experts are dense parameters
    saved, resaved = global_states(ckpt / "iter_0000002"), global_states(again / "iter_0000002")
    assert sorted(saved) == sorted(resaved)
    assert any("experts" in key for key in saved)
    for key in saved:
        for a, b in zip(saved[key], resaved[key]):
            assert not torch.isnan(a).any(), key  # every element was saved
            assert torch.equal(a, b), key
