"""A training step's forward and backward over its micro-batches in layer-major order: each transformer
layer runs for every micro-batch before the next layer starts, in the forward and again (recomputed,
then backpropagated) in the backward. It is the order in which a layer whose params live off the GPU
is brought in once per step instead of once per micro-batch (docs/design.md, "Params, grads and
activations beyond HBM"); not yet used by pretrain_gpt.py.

What it computes is what megatron-core's no-pipelining schedule computes with full recompute of every
layer (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``): the same
per-(layer, micro-batch) operations, each parameter's gradient summed over micro-batches 1..G in the same
order, the loss through megatron-core's own ``forward_step``/``backward_step`` (its scaling by the
micro-batch count or the token count). Its model's own forward is used twice per micro-batch, with the
decoder block's forward stood in for: once to capture the block's input and arguments (the embedding's
graph), once to run the head (final norm, output layer, loss) on the block's output.

Limits, each refused in one line by ``layer_major_refusal``: one pipeline stage and one model chunk,
full recompute of single layers, dropout 0 (its RNG would be drawn in another order), no fp8. With the
embedding tied to the output layer the shared weight's gradient is summed in another order (every
micro-batch's output-layer part, then every embedding part): equal up to rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, get_model_type


class _BlockInputCaptured(Exception):
    """Raised by the stand-in decoder to stop the model's forward once the block's input is known."""


@dataclass
class _MicroBatch:
    batch: object  # what the data iterator gave, handed to forward_step_func again for the head
    block_input: Optional[torch.Tensor] = None  # the embedding's output, with its graph
    layer_kwargs: Optional[dict] = None  # what the block passes each layer besides hidden_states
    hidden: Optional[torch.Tensor] = None  # the current layer's input (forward) or output gradient (backward)


def layer_major_refusal(config, num_model_chunks: int, pipeline_size: int) -> Optional[str]:
    """Why this configuration cannot run layer-major (one line), or None."""
    if pipeline_size != 1 or num_model_chunks != 1:
        return f"layer-major steps need one pipeline stage and one model chunk (pipeline size {pipeline_size})"
    if config.recompute_granularity != "full" or config.recompute_method != "uniform" \
            or config.recompute_num_layers != 1:
        return ("layer-major steps recompute each layer in the backward: they need --recompute-granularity full "
                "--recompute-method uniform --recompute-num-layers 1")
    if config.hidden_dropout or config.attention_dropout:
        return (f"layer-major steps need dropout 0 (--hidden-dropout {config.hidden_dropout}, "
                f"--attention-dropout {config.attention_dropout})")
    if config.fp8:
        return "layer-major steps do not run fp8 layers yet"
    return None


def forward_backward_layer_major(*, forward_step_func: Callable, data_iterator, model: list,
                                 num_microbatches: int, forward_only: bool = False, **_unused) -> List[dict]:
    """megatron-core's ``get_forward_backward_func()`` interface, layer-major (module docstring);
    returns what each micro-batch's loss function reported, in micro-batch order."""
    chunk = model[0]
    config = get_model_config(chunk)
    refusal = layer_major_refusal(config, len(model), 1)
    if refusal is not None:
        raise ValueError(refusal)
    if forward_only:
        raise ValueError("layer-major steps train: use megatron-core's schedule for forward-only passes")
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    gpt = _unwrapped(chunk)
    block = gpt.decoder
    micro = [_MicroBatch(next(iterator)) for _ in range(num_microbatches)]
    no_sync = config.no_sync_func or contextlib.nullcontext
    last = num_microbatches - 1

    for mb in micro:  # the embedding, with its graph kept for the backward's end
        mb.block_input, mb.layer_kwargs = _block_input(forward_step_func, chunk, block, mb.batch)
        mb.hidden = mb.block_input.detach()

    kept: List[List[torch.Tensor]] = []  # kept[l][m]: layer l's input for micro-batch m
    with torch.no_grad():
        for layer in block.layers:
            kept.append([mb.hidden for mb in micro])
            for mb in micro:
                mb.hidden = layer(hidden_states=mb.hidden, **mb.layer_kwargs)[0]

    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int, device=micro[0].hidden.device)
    model_type = get_model_type(chunk)
    for m, mb in enumerate(micro):  # the head: final norm, output layer, loss; its gradient into the block
        block_output = mb.hidden.detach().requires_grad_()
        with _sync_unless(m == last, no_sync), _stand_in(block, lambda *a, **k: _final_norm(block, block_output)):
            output, tokens = schedules.forward_step(
                forward_step_func, iter([mb.batch]), chunk, num_microbatches, None, forward_data_store, config,
                1, is_first_microbatch=m == 0, current_microbatch=m)
            total_tokens += tokens
            schedules.backward_step(None, output, None, model_type, config)
        mb.hidden = block_output.grad

    for layer_index in reversed(range(len(block.layers))):  # each layer recomputed and backpropagated
        layer = block.layers[layer_index]
        for m, mb in enumerate(micro):
            layer_input = kept[layer_index][m].detach().requires_grad_()
            with _sync_unless(m == last, no_sync), torch.enable_grad():
                layer_output = layer(hidden_states=layer_input, **mb.layer_kwargs)[0]
                torch.autograd.backward(layer_output, mb.hidden)
            mb.hidden = layer_input.grad
        kept[layer_index] = []  # this layer's inputs are done with

    for m, mb in enumerate(micro):  # the embedding's backward
        with _sync_unless(m == last, no_sync):
            torch.autograd.backward(mb.block_input, mb.hidden)

    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([chunk], total_tokens if config.calculate_per_token_loss else None)
    return forward_data_store


def _block_input(forward_step_func, chunk, block, batch):
    """The decoder block's input (the embedding's output, with its graph) and the per-layer arguments
    the block derives from its own (rotary embeddings, masks), from the model's own forward."""
    captured = {}

    def capture(hidden_states, **kwargs):
        captured.update(hidden=hidden_states, kwargs=kwargs)
        raise _BlockInputCaptured

    with _stand_in(block, capture), contextlib.suppress(_BlockInputCaptured):
        forward_step_func(iter([batch]), chunk)
    kwargs = captured["kwargs"]
    layer_kwargs = {name: kwargs.get(name) for name in ("attention_mask", "context", "context_mask",
                                                         "rotary_pos_emb", "attention_bias", "packed_seq_params",
                                                         "padding_mask")}
    layer_kwargs["inference_context"] = None
    return captured["hidden"], layer_kwargs


def _final_norm(block, hidden: torch.Tensor) -> torch.Tensor:
    return block.final_layernorm(hidden) if block.final_layernorm is not None else hidden


@contextlib.contextmanager
def _stand_in(block, forward):
    """``block``'s forward replaced by ``forward`` for the duration (an instance attribute over the method)."""
    block.forward = forward
    try:
        yield
    finally:
        del block.forward


def _sync_unless(is_last: bool, no_sync):
    """DDP's gradient sync only in the last micro-batch's backward, as megatron-core's schedule does."""
    return contextlib.nullcontext() if is_last else no_sync()


def _unwrapped(chunk):
    """The GPTModel inside DDP and Float16Module wrappers."""
    module = chunk
    while not hasattr(module, "decoder"):
        module = module.module
    return module
