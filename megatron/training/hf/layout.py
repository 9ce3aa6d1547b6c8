"""What a model's torch_dist checkpoint holds, asked of the model itself: the model is built from its
flags on the meta device (no memory) in this process, at TP = PP = EP = 1, and its sharded state dict
names every tensor (key, global shape, the piece each module owns) and every extra-state object. The
import writes exactly these, so ``--load`` finds what it asks for at any TP, PP and EP (torch_dist
reshards on load), and a flag the model cannot be built with fails here, before anything is written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from unittest import mock
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Flags parse_args requires that say nothing of the model's tensors.
_RUN_FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "0",
              "--mock-data", "--device", "cpu", "--seq-length", "1", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "1", "--transformer-impl", "local"]


@dataclass(frozen=True)
class Piece:
    """One tensor of the checkpoint: ``key``'s region at ``offset`` of its ``global_shape``, ``shape``
    without the leading ``prepended`` axes, which index layers and/or experts (megatron-core stacks
    them; the piece is one along each)."""
    key: str
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    prepended: int

    @property
    def name(self) -> str:
        """The key without its layer prefix: ``self_attention.linear_qkv.weight``."""
        match = _LAYER_KEY.match(self.key)
        if match:
            return match.group(2)
        return self.key[len("decoder.layers."):] if self.key.startswith("decoder.layers.") and \
            self.prepended and "final_layernorm" not in self.key else self.key

    @property
    def layer(self) -> Optional[int]:
        match = _LAYER_KEY.match(self.key)
        if match:
            return int(match.group(1))
        return self.offset[0] if self.key.startswith("decoder.layers.") and self.prepended else None

    @property
    def expert(self) -> Optional[int]:
        return self.offset[self.prepended - 1] if ".experts.experts." in self.key else None

    @property
    def region(self) -> Tuple[slice, ...]:
        """Where the piece lies in its layer's (and expert's) own tensor."""
        return tuple(slice(start, start + size) for start, size in zip(self.offset[self.prepended:], self.shape))

    @property
    def chunk_sizes(self) -> Tuple[int, ...]:
        """Its size in the checkpoint's global tensor (one along each prepended axis)."""
        return (1,) * self.prepended + self.shape


def piece_of_key(key: str, global_shape, offset, shape) -> Piece:
    """A piece named by a checkpoint's key (its prepended axes read from the key's form)."""
    prepended = 0
    if key.startswith("decoder.layers.") and not _LAYER_KEY.match(key):
        prepended = 1  # layers stacked along a leading axis
    if ".experts.experts." in key:
        prepended += 1
    return Piece(key, tuple(global_shape), tuple(offset), tuple(shape)[prepended:], prepended)


def model_pieces(model_flags: List[str]) -> Tuple[List[Piece], List[str]]:
    """(the tensors, the extra-state objects' keys) of the model these flags build."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    with _single_rank(model_flags) as (args, model):
        from megatron.training.checkpoint.state_dict import sharding_metadata

        state = model.sharded_state_dict(metadata=sharding_metadata())
        apply_factories(state)
        pieces, objects = [], []
        for item in nested_values(state):
            if isinstance(item, ShardedTensor):
                pieces.append(Piece(item.key, tuple(item.global_shape), tuple(item.global_offset),
                                    tuple(item.local_shape), item.prepend_axis_num))
            elif isinstance(item, ShardedObject):
                objects.append(item.unique_key)
    return pieces, objects


def parse_model_flags(model_flags: List[str], parallel: Optional[List[str]] = None):
    """The args of these model flags (with run flags that change no tensor), checked as training checks them."""
    from megatron.training.args.arguments import parse_args

    return parse_args([*model_flags, *_RUN_FLAGS, *(parallel or [])])


@contextlib.contextmanager
def _single_rank(model_flags: List[str]):
    """A one-rank process group and the model on the meta device, torn down after."""
    from megatron.core import parallel_state

    from megatron.training.model.configs import transformer_config
    from megatron.training.runtime import cpu_compat

    args = parse_model_flags(model_flags)
    args.device_resolved = "cpu"
    cpu_compat.define_missing_te_names()
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        config = transformer_config(args)
        # Uninitialised, and allocated through torch's default device (the meta one here), not
        # on an explicit accelerator.
        config.use_cpu_initialization, config.perform_initialization = True, False
        # megatron-core asks torch.cuda for the device in places (MLA's RoPE, the MoE router): the meta
        # device there too, for this build only (no CUDA needed, no GPU memory taken where there is one).
        with torch.device("meta"), mock.patch.object(torch.cuda, "current_device", lambda: "meta"):
            model = _model_provider()(args, config)
        real = [name for name, p in model.named_parameters() if not p.is_meta]
        if real:
            raise RuntimeError(f"the meta-device model allocated {real[:3]}")
        yield args, model
    finally:
        parallel_state.destroy_model_parallel()
        if owns_group:
            torch.distributed.destroy_process_group()


def _model_provider():
    """pretrain_gpt.py's model provider: the model exactly as training builds it."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_for_hf", os.path.join(REPO, "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model_provider
