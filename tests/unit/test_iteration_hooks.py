"""--profile's window and where its trace goes (megatron.training.runtime.iteration_hooks), on the CPU: the
operators of exactly the profiled iterations reach --profile-dir (or --tensorboard-dir) as a Chrome trace, a rank
outside --profile-ranks profiles nothing, and the flags are checked in one line."""

import argparse
import json
import os

import pytest
import torch

from megatron.training.runtime.iteration_hooks import IterationHooks


def hooks_args(**overrides):
    args = argparse.Namespace(profile=True, profile_ranks=[0], profile_step_start=2, profile_step_end=3,
                              profile_dir=None, tensorboard_dir=None, manual_gc=False, manual_gc_interval=0,
                              empty_unused_memory_level=0)
    vars(args).update(overrides)
    return args


def train(hooks, iterations, op_of):
    """``iterations`` steps, each running the operator ``op_of(i)`` for its own count i (1-based, as after())."""
    a = torch.ones(8, 8)
    for done in range(iterations):
        hooks.before(done)
        op_of(done + 1)(a)
        hooks.after(done + 1)
    hooks.stop()


def step_ops(i):
    return {1: torch.sin, 2: torch.cos, 3: torch.tanh, 4: torch.exp}[i]


def op_names(path):
    with open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


@pytest.mark.parametrize("where", ["profile_dir", "tensorboard_dir"])
def test_the_trace_holds_the_profiled_iteration_alone(tmp_path, where):
    hooks = IterationHooks(hooks_args(**{where: str(tmp_path / where)}), rank=0, device=torch.device("cpu"))
    train(hooks, 4, step_ops)
    names = op_names(tmp_path / where / "profile_rank0.json")
    assert "aten::tanh" in names  # iteration 3: after 2 done, up to 3
    assert not names & {"aten::sin", "aten::cos", "aten::exp"}


def test_profile_dir_wins_over_tensorboard_dir(tmp_path):
    args = hooks_args(profile_dir=str(tmp_path / "p"), tensorboard_dir=str(tmp_path / "tb"), profile_ranks=[3])
    train(IterationHooks(args, rank=3, device=torch.device("cpu")), 4, step_ops)
    assert os.listdir(tmp_path / "p") == ["profile_rank3.json"] and not (tmp_path / "tb").exists()


def test_without_a_directory_the_busiest_operators_are_printed(capsys):
    train(IterationHooks(hooks_args(), rank=0, device=torch.device("cpu")), 4, step_ops)
    out = capsys.readouterr().out
    assert out.startswith("> profile of iterations 3..3 (rank 0):") and "aten::tanh" in out and "aten::exp" not in out


def test_a_rank_outside_profile_ranks_profiles_nothing(tmp_path, capsys):
    train(IterationHooks(hooks_args(profile_dir=str(tmp_path)), rank=1, device=torch.device("cpu")), 4, step_ops)
    assert os.listdir(tmp_path) == [] and capsys.readouterr().out == ""


@pytest.mark.parametrize("flags,message", [
    (["--profile-dir", "x"], "argument --profile-dir: only with --profile"),
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"],
     "argument --profile-step-end: 4 must be above --profile-step-start 4"),
])
def test_the_flags_are_checked_in_one_line(flags, message):
    from megatron.training.args.arguments import parse_args
    from megatron.training.errors import UserError
    with pytest.raises(UserError) as raised:
        parse_args(["--mock-data", *flags] + TINY)
    assert str(raised.value) == message


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
        "--lr", "1e-4"]
