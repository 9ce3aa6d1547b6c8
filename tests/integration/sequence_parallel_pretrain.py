"""``pretrain_gpt.py`` with --sequence-parallel on the CPU (a test's variant of it): megatron-core's local layer
spec with torch's norms marked ``sequence_parallel``, as transformer-engine's and apex's norms mark theirs (torch's
``WrappedTorchNorm`` refuses sequence parallelism, so pretrain_gpt.py does). Each rank's norm gradients then cover
its part of the sequence only, and megatron-core's finalize sums them over the tensor-parallel ranks."""

import argparse
import os
import sys

import torch


def sequence_parallel_norm(cls, config, hidden_size: int, eps: float = 1e-5, **_):
    """A torch LayerNorm or RMSNorm whose params say whether they see a part of the sequence."""
    norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    norm = norm_class(hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def with_sequence_parallel_norms(model_provider):
    """pretrain_gpt.py's model provider with ``sequence_parallel_norm`` as megatron-core's torch norm (every local
    spec's norms are built by it); pretrain_gpt.py's refusal of --sequence-parallel is what this variant lifts."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    WrappedTorchNorm.__new__ = staticmethod(sequence_parallel_norm)

    def provider(args, config, *rest, **keywords):
        return model_provider(argparse.Namespace(**{**vars(args), "sequence_parallel": False}), config, *rest,
                              **keywords)

    return provider


if __name__ == "__main__":  # (dist_checkpointing's writer starts child processes)
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
    from rank_world import pretrain_gpt

    from megatron.training.training import pretrain

    steps = pretrain_gpt()
    pretrain(with_sequence_parallel_norms(steps.model_provider), steps.datasets_provider, steps.forward_step)
