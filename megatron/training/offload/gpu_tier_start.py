"""Where an auto gpu tier (``--offload-gpu-cache-gb auto``) starts: half the device memory the
planner's activation estimate leaves free after the model, instead of nothing.

Started empty, the first iteration streams the state that does not fit pinned host memory from the
disk before the measured peak lets the tier grow (docs/benchmarks.md). Half, because the first
iteration's peak runs above the steady one and the activation estimate counts the unfused attention's
scores; the engine's own measurement after iteration 1 then promotes or hands back from there
(engine.observe_device_memory).
``--offload-gpu-start-gb`` sets the start instead (0: empty), for a run whose activations the
estimate misjudges, or to see the promotions after iteration 1 on a model that fits at once.
"""

from __future__ import annotations

from mlp_offload import GiB
from megatron.training.offload.activation_memory import (activation_bytes, backward_workspace_bytes,
                                                          microbatches_in_flight)

START_SHARE = 0.5


def starting_gpu_tier_bytes(args, cfg, free_bytes: int, margin_bytes: int, data_parallel: int) -> int:
    """Bytes of optimizer state an auto gpu tier may take at start-up, where ``free_bytes`` of the
    device are free with the model and its gradient buffers in place."""
    given = getattr(args, "offload_gpu_start_gb", None)
    if given is not None:
        return int(given * GiB)
    microbatches = max(1, args.global_batch_size // (args.micro_batch_size * data_parallel))
    in_flight = microbatches_in_flight(cfg.pipeline_model_parallel_size,
                                       cfg.virtual_pipeline_model_parallel_size, microbatches)
    needed = activation_bytes(args, cfg, in_flight) + backward_workspace_bytes(args, cfg) + margin_bytes
    return max(0, int((free_bytes - needed) * START_SHARE))
