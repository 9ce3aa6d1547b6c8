"""Multi-latent attention on megatron-core's local (non transformer-engine) layers.

megatron-core 0.16.1's MLA builds its core attention with separate key and value head widths
(``k_channels``: qk-head-dim + qk-pos-emb-head-dim, ``v_channels``: v-head-dim); only
transformer-engine's attention takes them, the local ``DotProductAttention`` refuses the keywords and
sizes its output by kv-channels x heads. ``MLADotProductAttention`` is that same local attention,
taking both widths: its scores already read the key width from the tensors and MLA passes its own
softmax scale, so only the output's width changes (heads x v-head-dim). ``local_mla_spec`` puts it in
megatron-core's local layer specs.

Without transformer-engine installed, megatron-core's MLA module still believes it present (its
import of the TE extension succeeds with mock classes) and ``isinstance(layer, <mock>)`` fails in
its constructor: ``local_mla_spec`` tells the module the truth first.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` (its arguments passed on as given) with MLA's ``v_channels``, which it
    does not take; ``k_channels`` (the query-key width) changes nothing here."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the context is heads x v_channels wide, not heads x kv_channels
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def local_mla_spec(spec):
    """megatron-core's local layer spec (one ``ModuleSpec``, or a block's ``layer_specs``) with
    ``MLADotProductAttention`` as each MLA layer's core attention."""
    _without_absent_transformer_engine()
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        self_attention = layer.submodules.self_attention
        if self_attention.module is MLASelfAttention and self_attention.submodules.core_attention is DotProductAttention:
            self_attention.submodules.core_attention = MLADotProductAttention
    return spec


def _without_absent_transformer_engine() -> None:
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False  # only gates TE-only branches (FP8 input saving)
