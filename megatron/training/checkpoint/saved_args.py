"""The training args inside a checkpoint, as Megatron-LM keeps them ('args': a Namespace).

Saving stores a copy holding plain values only (the run's objects, e.g. its signal watcher, stay
out), with the data position in ``consumed_train_samples`` / ``consumed_valid_samples`` as upstream.
``--use-checkpoint-args`` takes the model's shape from the saved args; upstream spells a few of
them differently from this repo's flags, which the mapping below translates.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron.training.errors import UserError

_PLAIN = (bool, int, float, str, type(None))

# The args that fix the model's shape: taken from the checkpoint with --use-checkpoint-args.
MODEL_SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "max_position_embeddings", "normalization", "swiglu", "position_embedding_type", "rotary_base",
    "untie_embeddings_and_output_weights", "disable_bias_linear", "vocab_size",
    # multi-latent attention's and Qwen2.5's (a checkpoint from before they existed leaves the flags' values)
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "add_qkv_bias",
)
# Taken from the checkpoint only where the command line does not give them (as upstream).
FILLED_IF_MISSING = ("seq_length",)


PER_RANK_ARGS = ("rank", "local_rank")


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


def args_to_save(args, consumed_train_samples: int, consumed_valid_samples: int = 0) -> argparse.Namespace:
    """A picklable copy of ``args`` with the data position where Megatron-LM reads it."""
    # Without the rank's own values: rank 0 writes the common state, and megatron-core checks that
    # every rank's copy of it is the same.
    saved = argparse.Namespace(**{k: v for k, v in vars(args).items() if _plain(v) and k not in PER_RANK_ARGS})
    saved.consumed_train_samples = consumed_train_samples
    saved.consumed_valid_samples = consumed_valid_samples
    saved.add_bias_linear = not getattr(args, "disable_bias_linear", False)  # upstream's name for it
    return saved


def _upstream_value(saved, name: str):
    """``name`` (this repo's spelling) from a checkpoint's args, which may be upstream's."""
    if name == "disable_bias_linear" and not hasattr(saved, name) and hasattr(saved, "add_bias_linear"):
        return not saved.add_bias_linear
    if name == "vocab_size" and getattr(saved, "padded_vocab_size", None) is not None:
        return saved.padded_vocab_size  # the embedding's size: what the weights need
    if name == "num_query_groups" and hasattr(saved, "group_query_attention"):
        return saved.num_query_groups if saved.group_query_attention else None
    if name == "rotary_base" and not hasattr(saved, name):
        return getattr(saved, "rotary_base", 10000)
    return getattr(saved, name, None)


def apply_model_shape(args, saved) -> list:
    """Overwrite the model-shape args with the checkpoint's; returns the names that changed."""
    changed = []
    for name in MODEL_SHAPE_ARGS:
        value = _upstream_value(saved, name)
        if value is None and name not in ("num_query_groups", "ffn_hidden_size", "vocab_size"):
            continue  # not in the checkpoint: the flag's value stays
        if getattr(args, name, None) != value:
            changed.append(name)
            setattr(args, name, value)
    for name in FILLED_IF_MISSING:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(saved, name, None))
    return changed


def read_saved_args(load_dir: str) -> Optional[argparse.Namespace]:
    """The args of the checkpoint ``--load`` resumes from (before any process group exists), or None."""
    # Only with --use-checkpoint-args: parsing the flags stays light (no megatron-core, no torch) otherwise.
    from megatron.core import dist_checkpointing

    from megatron.training.checkpoint import integrity

    if not os.path.isdir(load_dir):
        raise UserError(f"--use-checkpoint-args: --load {load_dir} is not a directory")
    try:
        iteration, _ = integrity.choose_checkpoint(load_dir)
    except ValueError as err:
        raise UserError(f"--use-checkpoint-args: --load {load_dir}: {err}") from None
    if iteration is None:
        raise UserError(f"--use-checkpoint-args: no complete checkpoint in --load {load_dir}")
    path = integrity.checkpoint_dir(load_dir, iteration)
    saved = dist_checkpointing.load_common_state_dict(path).get("args")
    if saved is None:
        raise UserError(f"--use-checkpoint-args: {path} holds no saved args")
    return saved
