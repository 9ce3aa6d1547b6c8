"""megatron-core's own optimizers in a checkpoint load, without apex or transformer-engine: the
torch Adam(W) step count needs two fix-ups there (see each function)."""

from __future__ import annotations

import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer


def megatron_optimizers(optimizer) -> list:
    """megatron-core's optimizers in ``optimizer``: a ChainedOptimizer's parts, or itself; none for
    the offload facade, whose state is no torch optimizer's."""
    if isinstance(optimizer, ChainedOptimizer):
        return optimizer.chained_optimizers
    return [optimizer] if isinstance(optimizer, MegatronOptimizer) else []


def prepare_fresh_optimizer_for_load(optimizer) -> None:
    """Give a never-stepped torch Adam(W) the 'step' entries its state_dict() asserts on.

    Without apex/transformer-engine, megatron-core's init_state_fn creates exp_avg/exp_avg_sq but
    no 'step', and DistributedOptimizer.state_dict() then fails while building the load template.
    The placeholder value is overwritten by load_state_dict from the checkpoint.
    """
    for opt in megatron_optimizers(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def restore_adam_steps(optimizer, loaded) -> None:
    """Put the checkpoint's Adam step back, one tensor per param, after a load.

    Without apex/TE two things go wrong in DistributedOptimizer's load path: the dp_reshardable
    param state carries 'step' as a LocalNonpersistentObject, so load copies the *template's*
    placeholder step over the restored one; and load_state_dict puts ONE step tensor in every
    param's state, which torch keeps aliased, so each step would bump it once per param.
    The true step is in the loaded param_groups.
    """
    chained = megatron_optimizers(optimizer)
    states = [loaded] if len(chained) == 1 else [loaded[k] for k in sorted(loaded)]
    for opt, opt_state in zip(chained, states):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        groups = opt_state.get("optimizer", {}).get("param_groups", []) if isinstance(opt_state, dict) else []
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)
