"""Shared set-up for engine tests: small, fast configurations, whole-state readout, and the
reference they are checked against (torch.optim.AdamW over the same ranges and hyperparameters); checkpoint
directories made by hand and the parser's one-line errors, for the checkpoint flags' tests."""

import dataclasses
import os

import torch

from megatron.training.checkpoint import integrity
from mlp_offload import OffloadConfig
from mlp_offload.kernels.remainders import HostParamHigh

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1  # the engines' and their reference's hyperparameters


def fast_config(tmp_path, tiers, **overrides) -> OffloadConfig:
    """A config whose file tiers live under ``tmp_path``, with rates given so nothing is probed."""
    paths = {}
    for name in tiers:
        if name not in ("host", "gpu"):  # memory tiers have no directory
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


def device_config(setup, extra, root) -> OffloadConfig:
    """``setup``'s config with the device options ``extra`` (strategies.device_setups), the gpu tier
    put in front where a budget for it is given."""
    cfg = setup.config(root)
    tiers = (["gpu"] if "gpu_budget_bytes" in extra or extra.get("gpu_budget_auto") else []) + cfg.tiers
    return dataclasses.replace(cfg, tiers=tiers, **extra)


def adamw_reference(setup, init, kernel):
    """torch.optim.AdamW with one parameter per range of ``setup``'s param groups (as the engine's
    span sees them), starting from ``init``: ``(pieces, optimizer)``, pieces as ``((a, b), param)``."""
    pieces, groups = [], []
    for ranges, options in setup.groups or [([(0, setup.numel)], {})]:
        params = [torch.nn.Parameter(init[a:b].clone()) for a, b in ranges]
        pieces += zip(ranges, params)
        groups.append({"params": params, **options})
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=kernel == "foreach", fused=kernel == "fused")
    return pieces, opt


def assert_state_equals_reference(engine, pieces, opt):
    """The engine's params and moments equal the reference's bit for bit, range by range."""
    params, exp_avg, exp_avg_sq = engine_state(engine)
    for (a, b), p in pieces:
        assert torch.equal(params[a:b], p.detach()), (a, b)
        assert torch.equal(exp_avg[a:b], opt.state[p]["exp_avg"]), (a, b)
        assert torch.equal(exp_avg_sq[a:b], opt.state[p]["exp_avg_sq"]), (a, b)


class ModelParams:
    """The model's bf16 params: the param-high source, written by ``on_params_updated``."""

    def __init__(self, params: torch.Tensor):
        self.params = params
        self.source = HostParamHigh(params)
        self.handed = 0
        self.dtypes = set()

    def on_params(self, start, end, params):
        self.params[start:end].copy_(params)  # an fp32 master (no remainders): rounded to nearest even
        self.handed += end - start
        self.dtypes.add(params.dtype)


def megatron_world_of_one():
    """A gloo world of one process with megatron-core's parallel state (TP = PP = 1), for tests that
    build megatron-core modules; a generator for a module fixture (``yield from``)."""
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


# -- checkpoint directories and the parser's one-line errors (retention, non-persistent checkpoints) --------------
def make_checkpoint_dir(root, iteration, nbytes=10, marker=integrity.COMPLETE):
    """A checkpoint directory with one file of ``nbytes`` and ``marker`` (None: neither, as upstream's)."""
    path = integrity.checkpoint_dir(str(root), iteration)
    os.makedirs(os.path.join(path, "offload"))
    with open(os.path.join(path, "offload", "state.offload"), "wb") as f:
        f.write(b"x" * nbytes)
    if marker is not None:
        open(os.path.join(path, marker), "w").close()  # the markers alone decide whether it may retire
    return path


MARKERS = [integrity.COMPLETE, integrity.IN_PROGRESS, None]

TINY_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "2", "--lr", "1e-4"]


def parse_error(flags) -> str:
    """The one line the parser refuses ``flags`` with (mock data and a tiny model added)."""
    import pytest
    from megatron.training.args.arguments import parse_args
    from megatron.training.errors import UserError
    with pytest.raises(UserError) as raised:
        parse_args(["--mock-data", *flags, *TINY_ARGS])
    return str(raised.value)
