"""Each distributed optimizer's engine config (an MoE model's dense and experts' engines): the host
and gpu budgets shared by the state each holds on the rank, the experts' own namespace and trace."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.offload.shard_budgets import config_for_kind
from mlp_offload import OffloadConfig


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**9), st.integers(0, 10**11), st.integers(0, 10**9))
def test_budgets_are_shared_by_state_elements(dense, experts, host, gpu):
    config = OffloadConfig(tiers=["gpu", "host", "nvme"], paths={"nvme": "/nonexistent"}, host_budget_bytes=host,
                           gpu_budget_bytes=gpu, run_id="job7", trace_path="/tmp/trace.json")
    numels = {"dense": dense, "experts": experts}
    parts = {kind: config_for_kind(config, kind, numels) for kind in numels}
    assert parts["dense"].host_budget_bytes + parts["experts"].host_budget_bytes == host  # nothing lost to rounding
    assert parts["experts"].host_budget_bytes == host * experts // (dense + experts)
    assert parts["experts"].gpu_budget_bytes == gpu * experts // (dense + experts)
    assert parts["dense"].resolved_run_id() == "job7" and parts["experts"].resolved_run_id() == "job7.experts"
    assert parts["experts"].trace_path == "/tmp/trace.json.experts" and parts["dense"].trace_path == "/tmp/trace.json"


def test_one_engine_keeps_the_whole_config():
    config = OffloadConfig(tiers=["host"], host_budget_bytes=1 << 30)
    assert config_for_kind(config, "dense", {"dense": 5}) is config
