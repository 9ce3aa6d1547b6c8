"""HostParams (megatron/training/model/host_params.py), the residency of --offload-params host, without DDP:
the layers run on device copies of their params, each step sees the host params as they are then, and every
gradient reaches ``main_grad`` through its own hook (DDP's is gone once a param's data changes device). On the
CPU, and on a GPU where there is one (the GPU suite's CUDA unit tests)."""

import pytest
import torch

from megatron.training.model.device_slots import DeviceSlot, largest_sizes
from megatron.training.model.host_grads import DEVICE_GRAD_NORM
from megatron.training.model.host_params import HostParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device: str):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    head = torch.nn.Linear(8, 2)
    for module in (*layers, head):
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape, device=device)
            if device == "cuda":
                p.data = p.data.pin_memory()
    return layers, head


def _step(residency: HostParams, layers, head, x):
    residency.step_started(backward=True)
    hidden = [x]
    for i, layer in enumerate(layers):
        residency.bring_in(i)
        assert layer.weight.device == x.device and layer.weight.data_ptr() != residency.host[i][0].data_ptr()
        hidden.append(torch.relu(layer(hidden[-1])))
        residency.release(i, after_backward=False)
        assert layer.weight.device.type == "cpu"
    grad = torch.autograd.grad(head(hidden[-1]).square().sum(), hidden[-1])[0]
    for i in reversed(range(len(layers))):
        residency.bring_in(i)
        inp = hidden[i].detach().requires_grad_()
        torch.autograd.backward(torch.relu(layers[i](inp)), grad)
        grad = inp.grad
        residency.release(i, after_backward=True)
    residency.grads_complete()
    residency.step_ended()


@pytest.mark.parametrize("device", DEVICES)
def test_layers_run_on_copies_and_every_gradient_reaches_main_grad(device):
    layers, head = _model(device)
    reference = [torch.nn.Linear(8, 8) for _ in range(3)]
    reference_head = torch.nn.Linear(8, 2)
    for mine, theirs in zip((*layers, head), (*reference, reference_head)):
        theirs.load_state_dict({k: v.detach().clone() for k, v in mine.state_dict().items()})
    for module in (*reference, reference_head):
        module.to(device)
    head.to(device)  # the head stays on the device here (the residency's "rest" is empty)
    residency = HostParams([list(layer.parameters()) for layer in layers], [], torch.device(device))
    x = torch.randn(4, 8, device=device)
    for step in range(2):
        _step(residency, layers, head, x)
        for module in reference:
            module.zero_grad()
        out = x
        for module in reference:
            out = torch.relu(module(out))
        reference_head.to(device)
        reference_head(out).square().sum().backward()
        for mine, theirs in zip(layers, reference):
            assert torch.equal(mine.weight.main_grad.cpu(), theirs.weight.grad.cpu())
            assert mine.weight.grad is None
            mine.weight.main_grad.zero_()
        # an update in host memory between steps: the next step must run on it
        with torch.no_grad():
            for mine, theirs in zip(layers, reference):
                mine.weight.add_(0.5)
                theirs.weight.add_(0.5)
    assert residency.copies > 0


@pytest.mark.parametrize("device", DEVICES)
def test_grads_in_host_memory_are_summed_in_device_slots_and_land_whole(device):
    """--offload-grads host: main_grad is a device slot during each layer's backward and the host buffer
    after it; the host buffer then holds the reference gradient (overwritten, not added to: it is not zeroed
    between steps), each param carries the norm taken on the device, and NaN stops the step."""
    layers, head = _model(device)
    for layer in layers:
        for p in layer.parameters():
            p.main_grad = torch.full(p.shape, 7.0).pin_memory() if device == "cuda" else torch.full(p.shape, 7.0)
    head.to(device)
    residency = HostParams([list(layer.parameters()) for layer in layers], [], torch.device(device),
                           grads_in_host=True)
    x = torch.randn(4, 8, device=device)
    reference = [torch.nn.Linear(8, 8).to(device) for _ in range(3)]
    for mine, theirs in zip(layers, reference):
        theirs.load_state_dict({k: v.detach().to(device) for k, v in mine.state_dict().items()})
    out = x
    for module in reference:
        out = torch.relu(module(out))
    head(out).square().sum().backward()
    for step in range(2):  # the second step finds last step's grads in the host buffer: overwritten
        _step(residency, layers, head, x)
        for mine, theirs in zip(layers, reference):
            assert mine.weight.main_grad.device.type == "cpu"
            assert torch.equal(mine.weight.main_grad, theirs.weight.grad.cpu())
            norm = getattr(mine.weight, DEVICE_GRAD_NORM)
            assert norm.device.type == device and torch.equal(norm, torch.norm(theirs.weight.grad.float()).reshape(1))
    with torch.no_grad():
        layers[1].weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="NaN or inf"):
        _step(residency, layers, head, x)


class _Chunk:
    def finish_grad_sync(self, *args, **kwargs):
        raise AssertionError("DDP's sync ran on grads in host memory")


def test_the_finalize_leaves_out_what_the_slots_reduced():
    """With the grads in host memory megatron-core's finalize runs without DDP's sync, and finds the grads summed
    over the tensor-parallel ranks from their slots hidden (``main_grad`` None, which it skips); both come back."""
    layers, _ = _model("cpu")
    residency = HostParams([list(layer.parameters()) for layer in layers], [], torch.device("cpu"),
                           grads_in_host=True)
    norm_grad = layers[1].bias.main_grad
    residency.grads.reduction.tensor_parallel = {id(layers[1].bias)}
    chunk = _Chunk()
    with residency.finalizing(chunk):
        chunk.finish_grad_sync()
        assert layers[1].bias.main_grad is None and layers[1].weight.main_grad is not None
    assert layers[1].bias.main_grad is norm_grad
    with pytest.raises(AssertionError, match="DDP's sync"):
        chunk.finish_grad_sync()
    with HostParams([list(layer.parameters()) for layer in layers], [], torch.device("cpu")).finalizing(chunk):
        assert layers[1].bias.main_grad is norm_grad  # grads resident: the finalize as it is


def test_a_slot_is_cut_into_one_piece_per_run_of_params_reduced_over_one_group():
    """``DeviceSlot.runs``: a layer's dense params, then its experts' (each kind summed over its own data-parallel
    group), are one flat piece of the slot per dtype each, covering exactly their views."""
    dense, expert = object(), object()
    like = [torch.empty(3), torch.empty(2, dtype=torch.bfloat16), torch.empty(4), torch.empty(5), torch.empty(6)]
    keys = [dense, dense, dense, expert, expert]
    slot = DeviceSlot(largest_sizes([like]), torch.device("cpu"))
    views = slot.views(like)
    runs = slot.runs(like, keys)
    assert [(key, flat.dtype, flat.numel()) for key, flat in runs] == [
        (dense, torch.float32, 7), (dense, torch.bfloat16, 2), (expert, torch.float32, 11)]
    for key, flat in runs:  # writing a piece writes exactly the views of its params
        flat.fill_(1.0 if key is dense else 2.0)
    assert [float(v.reshape(-1)[0]) for v in views] == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert sum(flat.numel() for _, flat in runs) == sum(t.numel() for t in like)
    interleaved = slot.runs(like, [dense, dense, expert, dense, expert])  # unsorted: more pieces, still exact
    assert [(key, flat.numel()) for key, flat in interleaved] == [(dense, 3), (dense, 2), (expert, 4), (dense, 5),
                                                                  (expert, 6)]
