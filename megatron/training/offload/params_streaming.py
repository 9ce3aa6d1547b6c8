"""The planner's model of --offload-params host (``model.host_params``): where the params take memory, and what
their copies add to a step.

- GPU: two layer slots (the largest layer's params twice) and the params outside the layers (embedding, final
  norm, output layer), instead of every param; host memory: every param, pinned.
- Forward and backward: each layer's params cross the host link into the GPU for its forward and again for its
  backward, the copy of the next under the compute of this one, so each layer costs the longer of its compute
  and its copy. With full recompute a layer's forward is a quarter of its compute (forward, recompute, and a
  backward of twice the forward); the rest is its backward.
- Update: where the device updates, with the master stored as 16-bit remainders the update first reads the
  params' high halves (the bf16 params) from host memory, in series with it; the updated params go back on a
  side stream (``offload.copy_back``), beside the next piece's read and update, so the way back costs only what
  it takes beyond the update's own time. A CPU update reads and writes them in host memory.
- With --offload-grads host the grads follow: two layer slots and the rest's on the GPU, all of them in host
  memory; each layer's grads go out after its backward on the same side stream as the next layer's params come
  in (so a backward layer costs the longer of its compute and both copies), and the device update reads them
  back across the link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.training.model.layer_params import layer_params, layers_of_stage, moe_pattern
from megatron.training.model.host_grads import host_grads_refusal, tied_across_stages
from megatron.training.model.host_params import host_params_refusal
from megatron.training.model.layer_major import layer_major_refusal

FORWARD_SHARE_FULL_RECOMPUTE = 0.25


@dataclass(frozen=True)
class StreamedParams:
    device_bytes: int  # two layer slots and the params outside the layers
    host_bytes: int  # every param of the rank
    layers: int
    layer_bytes: int  # the average layer's params (what one copy moves)
    grad_device_bytes: int = 0  # with the grads in host memory: their slots on the GPU
    grad_host_bytes: int = 0  # ... and every grad, in host memory
    layer_grad_bytes: int = 0  # ... and the average layer's grads (what one copy out moves)


def streamed_params(cfg, params_per_rank: int, param_bytes: int, grad_bytes: int = 0) -> StreamedParams:
    """The rank's params with the layers streamed (one pipeline stage: stage 0 holds every layer); with
    ``grad_bytes`` (bytes per grad) their grads too."""
    pattern = moe_pattern(cfg)
    sizes = [sum(vars(layer_params(cfg, bool(pattern[i]))).values()) for i in layers_of_stage(cfg, 0)]
    in_layers = sum(sizes)
    slots = 2 * max(sizes) + max(0, params_per_rank - in_layers)  # elements the GPU holds of each
    return StreamedParams(device_bytes=slots * param_bytes, host_bytes=params_per_rank * param_bytes,
                          layers=len(sizes), layer_bytes=in_layers * param_bytes // max(1, len(sizes)),
                          grad_device_bytes=slots * grad_bytes, grad_host_bytes=params_per_rank * grad_bytes,
                          layer_grad_bytes=in_layers * grad_bytes // max(1, len(sizes)))


def streamed_compute_seconds(compute_s: float, streamed: StreamedParams, link_bytes_per_s: float,
                             passes: int = 1) -> float:
    """The forward and backward with every layer brought in twice per pass over a group of micro-batches
    (``link_bytes_per_s``: one direction); after the first pass each layer's grads in host memory come back in for
    its backward to sum on, in series."""
    per_layer = compute_s / max(1, streamed.layers) / passes
    copy = streamed.layer_bytes / link_bytes_per_s
    grads_out = streamed.layer_grad_bytes / link_bytes_per_s
    backward_copies = copy + grads_out  # one side stream: in, then out
    forward = per_layer * FORWARD_SHARE_FULL_RECOMPUTE
    one_pass = streamed.layers * (max(forward, copy) + max(per_layer - forward, backward_copies))
    return passes * one_pass + (passes - 1) * streamed.layers * grads_out


@dataclass(frozen=True)
class UpdateCopies:
    """What the device update's params (and grads in host memory) take across the link: ``in_series`` with the
    update (the params' high halves and the grads read in), and ``beside`` it (the updated params' way back)."""
    in_series: float
    beside: float

    def added_to(self, update_s: float) -> float:
        """What the copies add to an update of ``update_s`` on its own."""
        return self.in_series + max(0.0, self.beside - update_s)


def update_copies(streamed: StreamedParams, link_bytes_per_s: float, device_share: float,
                  reads_high: bool) -> UpdateCopies:
    """The device-updated share's copies (``device_share``: of the elements; ``link_bytes_per_s``: one
    direction)."""
    read_in = (streamed.host_bytes if reads_high else 0) + streamed.grad_host_bytes
    return UpdateCopies(in_series=device_share * read_in / link_bytes_per_s,
                        beside=device_share * streamed.host_bytes / link_bytes_per_s)


def update_with_copies_s(update_s: float, host_bytes: int, grad_host_bytes: int, link_bytes_per_s: float,
                        device_share: float, reads_high: bool) -> float:
    """An update predicted at ``update_s`` without the copies, with them: the rank's params (``host_bytes``) and
    grads in host memory (``grad_host_bytes``) read in and written back across a link of ``link_bytes_per_s``."""
    streamed = StreamedParams(device_bytes=0, host_bytes=host_bytes, layers=0, layer_bytes=0,
                              grad_host_bytes=grad_host_bytes)
    return update_s + update_copies(streamed, link_bytes_per_s, device_share, reads_high).added_to(update_s)


def streamed_params_refusal(cfg, args, params_in_host: bool = True, grads_in_host: bool = False) -> Optional[str]:
    """What the training refuses in one line for this layout and these flags, before it builds the model."""
    return (layer_major_refusal(cfg, cfg.virtual_pipeline_model_parallel_size or 1)
            or host_params_refusal(args)
            or (host_grads_refusal(params_in_host, cfg, tied_across_stages(args)) if grads_in_host else None))
