"""Put the chosen core attention into megatron-core's local layer specs.

megatron-core's local spec builds its unfused ``DotProductAttention``; where the flags resolved to
torch's SDPA (``args.core_attention == "sdpa"``, see ``kernels``) each layer's self-attention gets
``SdpaAttention`` instead. Only the core attention changes: it has no parameters, so the model's
state dict (and checkpoints) stay the same.
"""

from __future__ import annotations

import dataclasses


def with_core_attention(spec, args):
    """``spec`` (a layer's ModuleSpec or a block's TransformerBlockSubmodules) with SDPA as every
    layer's core attention when ``args.core_attention`` says so; unchanged otherwise."""
    if getattr(args, "core_attention", None) != "sdpa":
        return spec
    from megatron.training.model.sdpa_attention import SdpaAttention

    return _replaced(spec, SdpaAttention)


def _replaced(spec, core_attention):
    if hasattr(spec, "layer_specs"):  # a decoder block: one spec per layer (MoE mixes kinds)
        return dataclasses.replace(spec, layer_specs=[_replaced(s, core_attention) for s in spec.layer_specs])
    layer = spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention))
