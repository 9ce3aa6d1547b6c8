"""Whether the params wait in host memory while megatron-core's DDP builds its buffers (training.build_model):
DDP allocates a param buffer and a grad buffer on the device while the params' own memory is still held."""

from mlp_offload import GiB

from megatron.training.model.ddp_staging import STAGING_MARGIN_BYTES, ddp_buffers_fit


def test_the_101_b_case_that_ran_out_of_memory_is_staged():
    # 101.9 B at TP4 on an H200 (2026-11-26): 47.44 GiB of bf16 params per rank and bf16 grads on a card of
    # 139.8 GiB: about 91.7 GiB free beside the params, where DDP's two buffers need 94.9 GiB (it stopped
    # allocating the grad buffer with 44.24 GiB left).
    params = int(47.44 * GiB)
    assert not ddp_buffers_fit(params, params, int(91.7 * GiB))
    assert ddp_buffers_fit(params, params, int((91.7 + 47.44) * GiB))  # with the params in host memory


def test_buffers_that_fit_beside_the_params_are_built_in_place():
    params = 10 * GiB  # a 5 B shard: 10 GiB of bf16 params, 20 GiB of fp32 grads
    assert ddp_buffers_fit(params, 2 * params, 3 * params + STAGING_MARGIN_BYTES)
    assert not ddp_buffers_fit(params, 2 * params, 3 * params + STAGING_MARGIN_BYTES - 1)
