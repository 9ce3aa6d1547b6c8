"""The params handed to the model are copied out of the state's own buffer (on a GPU, by a copy that
runs after ``on_params_updated`` returns its fence). The CPU's next update of that subgroup rewrites the
buffer, so it must wait for the fence first, also where the pipeline keeps the buffer for the next
step (a cache hit: no read into it, so the pipeline's wait before a read never comes). On the CPU the
copy is done when the callback returns; a recording fence shows whether the wait happened."""

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW

from .helpers import BETAS, EPS, LR, WD

NUMEL, SUBGROUP, STEPS = 12_000, 1_000, 4


class _Fence:
    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True

    def query(self):
        return self.waited


def test_each_cpu_update_waits_for_its_buffers_last_params_copy(tmp_path):
    fences = {}  # (start, step) -> the fence that step's callback returned
    unwaited = []  # (start, step): a subgroup updated again before its last copy's fence was waited for
    steps_seen = {}

    def on_params(start, end, params):
        step = steps_seen.get(start, 0) + 1
        steps_seen[start] = step
        last = fences.get((start, step - 1))
        if last is not None and not last.waited:
            unwaited.append((start, step))
        fences[(start, step)] = _Fence()
        return fences[(start, step)]

    (tmp_path / "nvme").mkdir()
    # one file tier, a pipeline of 3 buffers, 2 kept as cache: the alternating order makes hits
    cfg = OffloadConfig(tiers=["host", "nvme"], paths={"nvme": str(tmp_path / "nvme")}, subgroup_size=SUBGROUP,
                        host_budget_bytes=3 * SUBGROUP * 12, bandwidths={"nvme": (2e9, 1e9)},
                        adam_elems_per_s=1e9, update_on="cpu", cache_alternating=True, run_id="fence")
    gen = torch.Generator().manual_seed(5)
    with OffloadedAdamW(torch.randn(NUMEL, generator=gen), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        model=ModelLink(on_params_updated=on_params)) as eng:
        hits = 0
        for _ in range(STEPS):
            eng.grad_buffer.copy_(torch.randn(NUMEL, generator=gen).to(torch.bfloat16))
            hits += eng.step().cache_hits
    assert hits > 0, "no cache hit: the case this test is about did not occur"
    assert len(fences) == STEPS * (NUMEL // SUBGROUP)
    assert unwaited == []
