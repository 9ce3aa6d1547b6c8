"""model/: the network the flags describe — megatron-core's TransformerConfig and OptimizerConfig
(``configs``), sizes derived from flags and parameters per rank (``sizes``), FLOPs (``flops``),
optional kernels (transformer-engine, apex; ``kernels``), attention through torch's SDPA where
transformer-engine's is absent (``sdpa_attention``, ``attention_spec``), precision-aware optimizer dtypes,
the interleaved (virtual) pipeline's chunks, and a step's forward and backward in layer-major order
(``layer_major``: each layer for every micro-batch in turn; --offload-activations host).

May import: ``errors``, ``runtime``.
"""
