"""model/: the network the flags describe — megatron-core's TransformerConfig and OptimizerConfig
(``configs``), sizes derived from flags and parameters per rank (``sizes``), FLOPs (``flops``),
optional kernels (transformer-engine, apex; ``kernels``), attention through torch's SDPA where
transformer-engine's is absent (``sdpa_attention``, ``attention_spec``), precision-aware optimizer dtypes,
and the interleaved (virtual) pipeline's chunks.

May import: ``errors``, ``runtime``.
"""
