"""The layer-major step's stores of layer inputs (megatron/training/model/layer_major.py): what a layer's
backward takes back is, bit for bit, what its forward put, in the order the step takes them (last layer
first), while inputs of later layers are overwritten on the device as the forward goes on. On the CPU and,
where there is one, on the GPU (the side stream's copies out and prefetches back)."""

import pytest
import torch

from megatron.training.model.kept_inputs import HostKeptInputs, KeptInputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _forward_like(store, device, layers=5, micro_batches=3):
    """Put each layer's inputs as the step's forward does, then reuse their device memory for the next."""
    generator = torch.Generator(device="cpu").manual_seed(3)
    put = []
    hidden = [torch.randn(8, 2, 16, generator=generator).to(device, torch.bfloat16) for _ in range(micro_batches)]
    for layer in range(layers):
        store.put(layer, hidden)
        put.append([h.cpu().clone() for h in hidden])
        hidden = [h * 1.5 + layer for h in hidden]  # the layer's output: new tensors, the inputs may be freed
        if device == "cuda":
            torch.cuda._sleep(1_000_000)  # a long kernel on the compute stream: the copies must not wait on luck
    return put


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store_kind", ["device", "host"])
def test_each_layer_takes_back_what_it_put(device, store_kind):
    dev = torch.device(device)
    store = KeptInputs() if store_kind == "device" else HostKeptInputs(dev)
    put = _forward_like(store, dev)
    for layer in reversed(range(len(put))):
        taken = store.take(layer)
        assert all(t.device.type == device for t in taken)
        assert all(torch.equal(t.cpu(), p) for t, p in zip(taken, put[layer])), f"layer {layer}"
        taken[0].mul_(0)  # the backward may write into what it took; a later layer's must not change


def test_host_store_keeps_no_input_on_the_device_between_forward_and_backward():
    store = HostKeptInputs(torch.device("cpu"))
    hidden = [torch.ones(4)]
    store.put(0, hidden)
    hidden[0].fill_(7)  # the forward's tensor changed after the put: the kept copy is its own
    assert torch.equal(store.take(0)[0], torch.ones(4))
