"""Device memory the training itself takes beside parameters, gradients and optimizer state: the
activations one rank keeps and one layer's backward workspace, estimated from the flags (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022). The planner counts
them, and an auto gpu tier starts from them (``gpu_tier_start``)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

from mlp_offload import FP32_BYTES

from megatron.training.model.layer_params import stage_layer_counts
from megatron.training.model.sizes import kept_input_bytes


def activation_bytes(args, cfg, microbatches_in_flight: int) -> int:
    """Activations one rank of the binding pipeline stage keeps (the first, which holds the most
    micro-batches under 1F1B, where the split is even), by Korthikanti et al.'s per-layer counts for 16-bit training,
    plus the fp32 logits of the last stage when it is also the first."""
    s, b, h, a = args.seq_length, args.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t = cfg.tensor_model_parallel_size
    # Under 1F1B each later stage holds one micro-batch fewer than the one before: with an uneven split the stage
    # with the most layers in flight binds (the first, where the split is even).
    layer_microbatches = max(layers * max(1, microbatches_in_flight - stage)
                             for stage, layers in enumerate(stage_layer_counts(cfg)))
    scores = 5 * a * s / h / t  # attention scores and softmax: gone with selective recompute
    if cfg.recompute_granularity == "full":  # each layer's input only, and one layer recomputed at a time
        total = (layer_microbatches * kept_input_bytes(s, b, cfg)
                 + recomputed_layer_bytes(args, cfg) * microbatches_in_flight)
    else:
        if cfg.recompute_granularity == "selective":
            scores = 0.0
        total = layer_microbatches * s * b * h * (stored_per_token_layer(cfg) + scores)
    if cfg.pipeline_model_parallel_size == 1:
        total += s * b * args.padded_vocab_size / t * FP32_BYTES
    return int(total)


def layer_major_activation_bytes(args, cfg, microbatches: int, inputs_in_host: bool) -> Tuple[int, int]:
    """(GPU bytes, host bytes) of the layer-major step's activations on one rank of the stage that holds the most
    (``model.layer_major``; where megatron-core's split is uneven, the stage with the most layers): every
    micro-batch's current hidden state (its output gradient in the backward) and, on the first stage, the
    embedding's output kept with its graph until the step's end; each layer's input per micro-batch kept for its
    recompute, on the GPU, or with ``inputs_in_host`` in host memory with at most two layers' on the GPU (the one
    recomputed, the next fetched); one micro-batch's layer recompute and backward at a time; the last stage's
    logits one micro-batch at a time."""
    s, b, t = args.seq_length, args.micro_batch_size, cfg.tensor_model_parallel_size
    layers = max(stage_layer_counts(cfg))  # every stage holds all its micro-batches: the most layers bind
    kept = kept_input_bytes(s, b, cfg)
    inputs = layers * microbatches * kept
    # The first stage's embedding outputs or the last stage's logits, whichever the stage has: both, to be safe
    # for either (every stage holds all the micro-batches at once, not only the first).
    gpu = (2 * microbatches * kept + (2 * microbatches * kept if inputs_in_host else inputs)
           + recomputed_layer_bytes(args, cfg))
    gpu += s * b * args.padded_vocab_size / t * FP32_BYTES
    # In host memory each layer's inputs are pinned blocks on a GPU, which torch's caching host allocator rounds up
    # to a power of two.
    pinned = 2 ** math.ceil(math.log2(kept)) if getattr(args, "device", "cuda") == "cuda" and kept >= 1 else kept
    return int(gpu), int(layers * microbatches * pinned if inputs_in_host else 0)


def recomputed_layer_bytes(args, cfg) -> float:
    """One layer's activations while it is recomputed and backpropagated for one micro-batch (full recompute)."""
    s, b, h, a = args.seq_length, args.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t = cfg.tensor_model_parallel_size
    scores = 5 * a * s / h / t
    return s * b * h * (34 / t + scores) if cfg.sequence_parallel else s * b * h * (10 + 24 / t + scores)


def stored_per_token_layer(cfg) -> float:
    """Bytes a layer keeps for its backward, per token and per unit of hidden size (16-bit training),
    without the attention scores, for this layer's shape: Korthikanti et al.'s count taken through
    megatron-core's local layers with flash-style attention. Not split over the tensor-parallel ranks,
    Korthikanti's 10 (each block's input and its norm's output, and two dropout masks). Split over them:
    the fused QKV output (2 (1 + 2 g/a): V is a view of it), the rotated Q and K (2 + 2 g/a), the
    attention's output and its contiguous copy into the projection (2 + 2); the MLP's first output, its
    activation and the second's input, 2 (2f + f + f) / h with a gated unit (SwiGLU), 4 f / h without.
    A GPT layer (MHA, FFN 4h, GeLU) gives 10 + 30 / t, where Korthikanti's 24 / t counts neither the
    rotation nor the copy. Checked against recorded runs' peaks in tests/unit/test_plan_replay.py
    (docs/benchmarks.md)."""
    t = cfg.tensor_model_parallel_size
    h, f, a = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    kv = (cfg.num_query_groups or a) / a
    attention = 2 * (1 + 2 * kv) + (2 + 2 * kv) + 2 + 2
    mlp = 2 * (2 * f + f + f) / h if cfg.gated_linear_unit else 2 * (f + f) / h
    if cfg.sequence_parallel:
        return (10 + attention + mlp) / t
    return 10 + (attention + mlp) / t


def microbatches_in_flight(pp: int, vp: Optional[int], microbatches: int) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: PP under 1F1B (fewer
    where the step has fewer); with V chunks per rank the interleaved schedule's longer warm-up
    holds ceil((1 + (PP-1)/(PP*V)) * PP), as Megatron-LM's memory estimate counts it."""
    if not vp:
        return min(pp, microbatches)
    return math.ceil((1 + (pp - 1) / (pp * vp)) * pp)


def backward_workspace_bytes(args, cfg) -> int:
    """What the backward of one layer and of the loss hold beside the stored activations, with
    megatron-core's local attention (scores materialized): the softmax in fp32 and the gradients of
    scores and probabilities (12 bytes per score), and the logits' fp32 softmax and gradient
    (checked with the stored counts above in tests/unit/test_plan_replay.py)."""
    s, b, a = args.seq_length, args.micro_batch_size, cfg.num_attention_heads
    t = cfg.tensor_model_parallel_size
    scores = 12 * a * s * s * b / t
    logits = 2 * s * b * args.padded_vocab_size / t * FP32_BYTES
    return int(scores + logits)
