"""--deterministic-mode: the environment it sets or refuses, torch's switches, SDPA's kernels, the
one-line error for an op without a deterministic kernel. On CUDA the SDPA case is the proof that the
default attention's backward repeats bit for bit (the GPU suite runs this file); on the CPU it runs
the same code (torch's CPU SDPA, deterministic on its own)."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from megatron.training.errors import UserError
from megatron.training.runtime import determinism


@pytest.fixture
def restore_torch_switches():
    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _args(on: bool):
    return argparse.Namespace(deterministic_mode=on)


def test_off_changes_nothing(monkeypatch, restore_torch_switches):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    torch.use_deterministic_algorithms(False)
    determinism.apply(_args(False))
    assert "CUBLAS_WORKSPACE_CONFIG" not in __import__("os").environ
    assert not torch.are_deterministic_algorithms_enabled()
    assert determinism.describe(_args(False)) == ""


def test_on_sets_environment_and_switches(monkeypatch, restore_torch_switches):
    import os

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a deterministic choice the user made stays
    determinism.apply(_args(True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Tree"
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    line = determinism.describe(_args(True))
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in line and "NCCL_ALGO=Tree" in line


@pytest.mark.parametrize("name, value", [("CUBLAS_WORKSPACE_CONFIG", ":0:0"), ("NCCL_ALGO", "CollNet")])
def test_a_conflicting_setting_is_refused_in_one_line(monkeypatch, restore_torch_switches, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as err:
        determinism.apply(_args(True))
    message = str(err.value)
    assert "\n" not in message and message.startswith("--deterministic-mode:") and f"{name}={value}" in message


def test_nondeterministic_op_error_becomes_one_line():
    # torch's wording (aten/src/ATen/Context.cpp, alertNotDeterministic)
    err = RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set "
                       "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
                       "operation, or you can use the 'warn_only=True' option")
    line = determinism.explain_nondeterministic_op(err)
    assert line.startswith("--deterministic-mode: index_add_cuda_ has no deterministic implementation")
    assert determinism.explain_nondeterministic_op(RuntimeError("CUDA out of memory")) is None


def _sdpa_grads(device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(7)
    b, heads, groups, seq, dim = 2, 8, 2, 256, 64
    q = torch.randn(b, heads, seq, dim, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(b, groups, seq, dim, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(b, groups, seq, dim, generator=gen).to(device, dtype).requires_grad_()
    with determinism.sdpa_backends(True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.randn(out.shape, generator=gen).to(device, dtype))
    return [t.grad.clone() for t in (q, k, v)]


def test_sdpa_backward_repeats_bit_for_bit_under_the_mode(monkeypatch, restore_torch_switches):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    determinism.apply(_args(True))
    first = _sdpa_grads(device, dtype)
    for _ in range(4):
        again = _sdpa_grads(device, dtype)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    # the same grads as torch's math kernel to rounding: the mode changes the kernel, not the maths
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        gen = torch.Generator(device="cpu").manual_seed(7)
        q, k, v = (torch.randn(2, n, 256, 64, generator=gen).to(device, torch.float32).requires_grad_()
                   for n in (8, 2, 2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.randn(out.shape, generator=gen).to(device, dtype).float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, ref in zip(first, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)


def test_the_flag_parses():
    from megatron.training.args.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--device", "cpu"]
    assert parse_args(base + ["--deterministic-mode"]).deterministic_mode
    assert not parse_args(base).deterministic_mode


def test_the_mode_holds_the_engines_update_split(tmp_path):
    from megatron.training.args.arguments import parse_args
    from megatron.training.offload.flags import config_from_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--device", "cpu", "--offload-tiers", "host,nvme", "--offload-nvme-path", str(tmp_path),
            "--offload-host-cache-gb", "0.01"]
    assert config_from_args(parse_args(base + ["--deterministic-mode"]), rank=0).hold_update_split
    assert not config_from_args(parse_args(base), rank=0).hold_update_split
