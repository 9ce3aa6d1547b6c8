"""The deferred update (defer_device_wait) on the CPU twin: a step queues only a few subgroups, the
rest as the forward asks for their params (in its order, a few ahead), with the hyperparameters of
the step that queued them even where a scheduler changed them since; the state equals
torch.optim.AdamW's bit for bit."""

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW

from .helpers import engine_state

LRS, BETAS, EPS, WD = (3e-3, 1e-3, 5e-4, 2e-3), (0.9, 0.95), 1e-8, 0.1
NUMEL, SUBGROUP = 20_000, 1_000  # 20 subgroups


def test_lazily_queued_deferred_steps_equal_adamw_with_a_changing_lr():
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(NUMEL, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    cfg = OffloadConfig(tiers=["host"], subgroup_size=SUBGROUP, update_on="device", defer_device_wait=True)
    eng = OffloadedAdamW(init.clone(), cfg, lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD,
                         model=ModelLink(grad_dtype=torch.bfloat16))
    try:
        deferred = eng.update_paths.deferred
        n = len(eng.subgroups)
        assert n == NUMEL // SUBGROUP
        for step, lr in enumerate(LRS):
            grad = (torch.randn(NUMEL, generator=gen) * 10).to(torch.bfloat16)
            # New grads only once the last step's update read them all (a backward after the forward
            # asked for every subgroup; here the half no forward asked for settles)
            eng.settle()
            eng.grad_buffer.copy_(grad)
            eng.step()
            assert deferred.queued_count == deferred.ahead  # the rest waits for the forward
            # the scheduler moves on before the next forward: the queued-late subgroups keep this step's lr
            eng.param_groups[0]["lr"] = LRS[(step + 1) % len(LRS)]
            ref.grad = grad.float()
            opt.step()
            opt.param_groups[0]["lr"] = LRS[(step + 1) % len(LRS)]
            forward = list(range(n - 1, -1, -1))  # the next forward's order: descending subgroups
            for k, i in enumerate(forward[: n // 2]):
                eng.params_ready(i)
                assert deferred.queued_count == min(n, k + 1 + deferred.ahead)
        params, exp_avg, exp_avg_sq = engine_state(eng)  # settles what no forward asked for
    finally:
        eng.close()
    state = opt.state[ref]
    assert torch.equal(params, ref.detach())
    assert torch.equal(exp_avg, state["exp_avg"])
    assert torch.equal(exp_avg_sq, state["exp_avg_sq"])


class _Fence:
    """A device fence that says when the host waited for it."""

    def __init__(self, index):
        self.index, self.waited = index, False

    def synchronize(self):
        self.waited = True

    def query(self):
        return True


def test_the_next_step_follows_each_subgroups_last_copy_out_without_the_host_waiting(monkeypatch):
    """A deferred step's fences (its copies out) go to the next step: each device update of a subgroup is
    given that subgroup's own fence (its copy in follows it on the device) and the host waits for none of
    them; a subgroup the split gives the CPU instead is waited for before the CPU reads it; settle() waits
    for the rest."""
    from mlp_offload.step.device_side import DeviceUpdate
    from mlp_offload.plan.placement import CPU

    made, given = [], []
    real = DeviceUpdate.update

    def update(self, job, io):
        real(self, job, io)
        given.append((job.sg.index, job.written))
        made.append(_Fence(job.sg.index))
        return made[-1]

    monkeypatch.setattr(DeviceUpdate, "update", update)
    cfg = OffloadConfig(tiers=["host"], subgroup_size=SUBGROUP, update_on="device", defer_device_wait=True)
    eng = OffloadedAdamW(torch.zeros(NUMEL), cfg, lr=LRS[0], model=ModelLink(grad_dtype=torch.bfloat16))
    try:
        n = len(eng.subgroups)
        made.clear(), given.clear()  # (the start-up timed the device update on a sample)
        eng.grad_buffer.fill_(1)
        eng.step()
        eng.grad_buffer.fill_(1)
        eng.step()  # queues the first step's rest, then this step's first subgroups
        first = {f.index: f for f in made[:n]}
        assert all(written is None for _, written in given[:n])
        second = given[n:]
        assert second and all(written is first[i] for i, written in second)
        assert not any(f.waited for f in made)  # the host waited for no copy out
        eng.queue_deferred()
        fences = {f.index: f for f in made[n:]}
        to_cpu = n - 1  # the split hands the CPU one subgroup the device updated last step
        eng.placement.update_on[to_cpu] = CPU
        eng.grad_buffer.fill_(1)
        eng.step()
        assert fences[to_cpu].waited and sum(f.waited for f in made) == 1
        eng.settle()  # waits for every subgroup's last copy out (one stream: it follows the ones before)
        assert all(f.waited for f in made[2 * n:]) and len(made) == 3 * n - 1
    finally:
        eng.close()
