"""The CPU one-pass AdamW with 8-bit block-scaled moments: ``blockwise8.adamw_step``'s bits in one
pass over the shard, block by block on every core (a C++ extension built at run time, as
``cpu_one_pass`` builds its own: cached per CPU model, source and flags)."""

from __future__ import annotations

import functools
import hashlib
from typing import Optional

import torch

from .blockwise8 import BlockLayout, Quantized, step_scalars
from .blockwise8_cpu_source import SOURCE
from .cpu_one_pass import CFLAGS, cpu_fingerprint, import_built
from .fused_update import AdamHyper, f32


def _name() -> str:
    key = f"{cpu_fingerprint()}\n{SOURCE}\n{CFLAGS}\n{torch.__version__}"
    return f"mlp_offload_blockwise8_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled extension (built once per CPU; a failed build raises: no fallback is chosen here)."""
    from torch.utils.cpp_extension import load_inline

    name = _name()
    try:
        built = import_built(name)
    except Exception:  # a half-written file from a build that died: build it again
        built = None
    return built or load_inline(name=name, cpp_sources=SOURCE, functions=["adamw8"], extra_cflags=CFLAGS,
                                extra_ldflags=["-fopenmp"], verbose=False)


TAKES_REMAINDERS = True  # ``high``: a master stored as remainders, merged and split in the pass


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: Quantized, exp_avg_sq: Quantized,
               layout: BlockLayout, hyper: AdamHyper, step: int, param_out: Optional[torch.Tensor] = None,
               high: Optional[torch.Tensor] = None) -> None:
    """``blockwise8.adamw_step`` on CPU tensors, in one pass (the same bits). ``high``: ``master`` is
    the int16 remainders of the fp32 master whose bf16 high halves these are (``remainders``); both
    are updated in place."""
    if exp_avg.fmt.root:
        raise ValueError(f"exp_avg format {exp_avg.fmt.name!r}: the first moment cannot be a root format")
    s = step_scalars(hyper, step)
    scalars = [s.decay, s.w1, f32(1.0 - s.w1), s.beta2, s.w2, s.inv_bc2, s.eps, s.neg_step,
               exp_avg.fmt.qmax, exp_avg_sq.fmt.qmax]
    flags = (s.small_lerp | (hyper.weight_decay != 0) << 1 | exp_avg_sq.fmt.root << 2
             | (param_out is not None) << 3 | (high is not None) << 4)
    out = high if high is not None else param_out if param_out is not None else master
    extension().adamw8(master, grad, exp_avg.codes, exp_avg.scales, exp_avg_sq.codes, exp_avg_sq.scales,
                       layout.starts, out, scalars, flags)
