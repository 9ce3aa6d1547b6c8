"""Shared set-up for engine tests: small, fast configurations and whole-state readout."""

import os

import torch

from mlp_offload import OffloadConfig


def fast_config(tmp_path, tiers, **overrides) -> OffloadConfig:
    """A config whose file tiers live under ``tmp_path``, with rates given so nothing is probed."""
    paths = {}
    for name in tiers:
        if name != "host":
            paths[name] = str(tmp_path / name)
            os.makedirs(paths[name], exist_ok=True)
    options = dict(
        tiers=list(tiers), paths=paths, subgroup_size=10_000, io_block_bytes=64 * 1024, io_threads=2,
        bandwidths={t: (2e9, 1e9) for t in paths}, adam_elems_per_s=1e9, run_id="test",
    )
    if "host" in tiers and paths:
        options["host_budget_bytes"] = 64 * 1024 * 1024
    options.update(overrides)
    return OffloadConfig(**options)


def engine_state(engine):
    """The engine's whole (param, exp_avg, exp_avg_sq), gathered for comparison."""
    parts = [[], [], []]
    for _, *tensors in engine.iter_state():
        for acc, t in zip(parts, tensors):
            acc.append(t.clone())
    return tuple(torch.cat(p) for p in parts)


def bf16_grads(seed, steps, numel):
    """``steps`` reproducible bf16 gradients for a shard of ``numel`` elements."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(steps)]


def run_steps(engine, grad_list):
    for g in grad_list:
        engine.grad_buffer.copy_(g)
        engine.step()


def one_process_world():
    """A gloo world of this process alone with megatron-core's parallel state (TP = PP = 1), for a
    module-scoped fixture to yield from: megatron-core's modules look their groups up there."""
    import socket

    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
