"""The step loop's fault point and failure: an error raised at the ``update`` fault point comes at the
schedule's halfway subgroup (the crash tests kill a rank there), after exactly the subgroups before it
were updated, and the engine then refuses to step, naming the error."""

import errno

import pytest
import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadedAdamW, OffloadStateError, faults

from .helpers import fast_config

NUMEL, SUBGROUP = 60_000, 10_000  # 6 subgroups


@pytest.mark.parametrize("tiers,update_on", [(["host"], "cpu"), (["host"], "device"), (["nvme"], "cpu")],
                         ids=["host-cpu", "host-device", "file-cpu"])
def test_an_update_fault_stops_at_the_halfway_subgroup_and_the_engine_refuses_after(tmp_path, tiers, update_on):
    updated = []
    cfg = fast_config(tmp_path, tiers=tiers, subgroup_size=SUBGROUP, update_on=update_on, ranks_sharing_node=1)
    eng = OffloadedAdamW(torch.randn(NUMEL), cfg,
                         model=ModelLink(on_params_updated=lambda lo, hi, p: updated.append(lo)))
    try:
        order = list(eng.schedule.order)
        eng.grad_buffer.copy_(torch.randn(NUMEL).to(torch.bfloat16))
        faults.configure(fault="update#1=ENOSPC")
        with pytest.raises(OSError) as err:
            eng.step()
        assert err.value.errno == errno.ENOSPC
        starts = [eng.subgroups[i].start for i in order[:len(order) // 2]]
        if update_on == "device":  # the device's memory-held subgroups are all queued before the loop
            starts = [eng.subgroups[i].start for i in order]
        assert sorted(updated) == sorted(starts)
        with pytest.raises(OffloadStateError, match="stopped after an earlier error.*injected at update"):
            eng.step()
    finally:
        faults.configure()
        eng.close()
