"""Both update sides offer exactly the step loop's interface (``step.context.UpdateSide``): the same
methods with the same parameters, so the loop can hold either without asking which it holds."""

import inspect

import pytest

from mlp_offload.step.context import UpdateSide
from mlp_offload.step.cpu_side import CpuUpdate
from mlp_offload.step.device_side import DeviceSide

PROTOCOL_METHODS = ("begin", "update", "end")


def _shape(function):
    """A signature without its annotations: each parameter's name, kind and default."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _public_methods(cls):
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_the_protocol_is_begin_update_end():
    assert _public_methods(UpdateSide) == set(PROTOCOL_METHODS)


@pytest.mark.parametrize("side", [CpuUpdate, DeviceSide])
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_each_side_has_the_protocols_signature(side, method):
    assert _shape(getattr(side, method)) == _shape(getattr(UpdateSide, method))


@pytest.mark.parametrize("side", [CpuUpdate, DeviceSide])
def test_each_side_offers_nothing_beyond_the_protocol(side):
    assert _public_methods(side) == set(PROTOCOL_METHODS)
    assert isinstance(side.asynchronous, bool)
