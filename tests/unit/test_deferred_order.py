"""The deferred update (defer_device_wait) on the CPU twin: a step queues only a few subgroups, the
rest as the forward asks for their params (in its order, a few ahead), with the hyperparameters of
the step that queued them even where a scheduler changed them since; the state equals
torch.optim.AdamW's bit for bit."""

import torch

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
                         grad_dtype=torch.bfloat16)
    try:
        deferred = eng._deferred
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
