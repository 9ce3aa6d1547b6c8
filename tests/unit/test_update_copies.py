"""The update's copies of params in host memory, as the adapter adds them to the engine's predicted update
(``params_streaming.update_with_copies_s`` at the link rate ``host_memory.measured_link_bytes_per_s`` measures on
a GPU)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron.training.runtime.host_memory import measured_link_bytes_per_s
from megatron.training.offload.params_streaming import update_with_copies_s
from tests.profiles import examples


def test_the_20b_streamed_update_is_the_params_read_in_then_updated_the_way_back_beside():
    # 20.68 B, one H200, fp8 moments, every subgroup updated on the device: the engine predicts 0.64 s of its own
    # work; 41.4 GB of bf16 params cross a ~54 GB/s link in, then back beside the next pieces (measured 1.54 s).
    params, link, own = 20.68e9 * 2, 54e9, 0.64
    reference = own + params / link + max(0.0, params / link - own)
    got = update_with_copies_s(own, int(params), 0, link, 1.0, reads_high=True)
    assert got == pytest.approx(reference)
    assert got == pytest.approx(1.54, rel=0.03)


@settings(max_examples=examples(200))
@given(own=st.floats(0.0, 100.0), host=st.integers(0, 10**12), grads=st.integers(0, 10**12),
       link=st.floats(1e9, 1e11), share=st.floats(0.0, 1.0), reads_high=st.booleans())
def test_the_copies_add_what_a_reference_says(own, host, grads, link, share, reads_high):
    got = update_with_copies_s(own, host, grads, link, share, reads_high)
    in_series = share * ((host if reads_high else 0) + grads) / link
    back = share * host / link
    assert got == pytest.approx(own + in_series + max(0.0, back - own), rel=1e-9, abs=1e-12)
    assert got >= own - 1e-12
    if share == 0.0:
        assert got == own  # a CPU update moves nothing across the link


def test_no_link_is_measured_off_a_gpu():
    assert measured_link_bytes_per_s(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_the_link_measured_on_a_gpu_is_a_pcie_or_faster_rate():
    rate = measured_link_bytes_per_s(torch.device("cuda"), nbytes=64 * 2**20)
    assert 1e9 < rate < 1e12
