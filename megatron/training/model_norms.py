"""--log-params-norm: the L2 norm of the whole model's parameters, as Megatron-LM logs it."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared


def params_l2_norm(model_chunks) -> float:
    """Each parameter counted once: shared embeddings once, tensor-parallel copies (norms, biases)
    once; then summed over the model-parallel ranks. Data-parallel replicas are identical."""
    squares = None
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                value = param.detach().float().square().sum()
                squares = value if squares is None else squares + value
    device = next(model_chunks[0].parameters()).device
    total = (squares if squares is not None else torch.zeros((), device=device)).reshape(1)
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt().item())
