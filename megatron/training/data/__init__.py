"""data/: what the model is fed — datasets and the resumable micro-batch order (``datasets``),
tokenizers, token-range checks, the global batch size per iteration (``batch_schedule``) and the
learning-rate schedule (``lr_schedule``, counted in samples).

May import: ``errors``, ``runtime``, ``model``.
"""
