"""Which checkpoint format a directory holds, and how dist_checkpointing reads and writes it.

Only torch_dist (megatron-core dist_checkpointing, Megatron-LM's default) is supported; a
directory in another of Megatron-LM's formats is refused with one line saying which it is.
"""

from __future__ import annotations

import glob
import os

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                            get_default_save_sharded_strategy)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                        FullyParallelSaveStrategyWrapper)

from megatron.training.errors import UserError


def detect_format(path: str) -> str:
    """'torch_dist', 'torch' (legacy mp_rank_XX files), 'torch_dcp', or 'unknown'."""
    config = maybe_load_config(path)
    if config is not None:
        return config.sharded_backend
    if glob.glob(os.path.join(path, "mp_rank_*")):
        return "torch"
    if os.path.exists(os.path.join(path, ".metadata")):
        return "torch_dcp"
    return "unknown"


def check_format(path: str, args) -> None:
    """Refuse, in one line, a checkpoint this loader cannot read."""
    found = detect_format(path)
    if found == "torch_dist":
        return
    flag = "--auto-detect-ckpt-format found" if args.auto_detect_ckpt_format else \
        f"--ckpt-format {args.ckpt_format}, but --load holds"
    raise UserError(f"--load {path}: {flag} a {found} checkpoint; only torch_dist loads here: convert it with "
                    f"Megatron-LM (--ckpt-convert-format torch_dist) first")


def _data_parallel_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save_strategies(args) -> dict:
    """--ckpt-fully-parallel-save: the data-parallel ranks share the writing of replicated shards."""
    if not args.ckpt_fully_parallel_save or parallel_state.get_data_parallel_world_size() == 1:
        return {}
    return {"sharded_strategy": FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                                                 _data_parallel_group())}


def load_strategies(args, path: str) -> dict:
    """--ckpt-fully-parallel-load: each data-parallel rank reads a part and they exchange it."""
    if not args.ckpt_fully_parallel_load or parallel_state.get_data_parallel_world_size() == 1:
        return {}
    return {"sharded_strategy": FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                                                 _data_parallel_group())}
