"""--optimizer, as Megatron-LM's scripts pass it: adam (what the offload engine runs) is taken, the others are
refused in one line naming the flag."""

import pytest

from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


def test_adam_is_taken_and_is_the_default():
    assert parse_args(BASE + ["--optimizer", "adam"]).optimizer == "adam"
    assert parse_args(BASE).optimizer == "adam"


@pytest.mark.parametrize("other", ["sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"])
def test_megatron_lms_other_optimizers_are_refused_in_one_line(other):
    with pytest.raises(UserError) as refused:
        parse_args(BASE + ["--optimizer", other])
    message = str(refused.value)
    assert message.count("\n") == 0 and "--optimizer" in message and repr(other) in message and "adam" in message
