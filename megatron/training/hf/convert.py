"""Import (a Hugging Face directory -> this project's torch_dist checkpoint, weights only) and export
(any of our checkpoints -> a Hugging Face directory), a tensor at a time, with a progress line.

The import writes ``CKPT_DIR/iter_0000000`` (complete, with its proof and the tracker),
``CKPT_DIR/model_args.txt`` (the model's flags, one per line) and ``CKPT_DIR/hf/`` (config.json and
the tokenizer files, for the tokenizer flags and for the export). The checkpoint's tensors are
stored whole per layer and expert, the global form torch_dist reshards from, so ``--finetune --load``
loads it at any TP, PP and EP; ``--tensor-model-parallel-size`` and the others given to the import
check that the model splits that way. The export takes its config.json from ``--hf-template``, else
``CKPT_DIR/hf``, else the checkpoint's ``--load`` (the import a fine-tuning started from); failing all,
it derives one from the checkpoint's saved args (``families.config_from_args``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint import integrity
from megatron.training.errors import UserError
from megatron.training.hf import families
from megatron.training.hf.files import (SafetensorsReader, SafetensorsWriter, TorchDistReader, TorchDistWriter,
                                        load_common)
from megatron.training.hf.layout import Piece, model_pieces, parse_model_flags, piece_of_key
from megatron.training.hf.tensor_map import TensorMap

MODEL_ARGS = "model_args.txt"
HF_FILES = "hf"  # the import's copy of config.json and the tokenizer files
# Files of a Hugging Face directory that are weights (not copied beside a checkpoint, nor exported)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Tensors a Hugging Face file may hold that the model computes instead of storing
_DERIVED = ("rotary_emb.inv_freq",)
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class Progress:
    """One stderr line, rewritten in place: tensors done, GB moved and the rate."""

    def __init__(self, what: str, total: int, stream=None):
        self.what, self.total, self.done, self.bytes = what, total, 0, 0
        self.stream = stream or sys.stderr
        self.started = self._last = time.perf_counter()

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if now - self._last >= 0.5 or self.done == self.total:
            self._last = now
            rate = self.bytes / 1e9 / max(now - self.started, 1e-9)
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r{self.what}: {self.done}/{self.total} tensors, {self.bytes / 1e9:.2f} GB, "
                              f"{rate:.2f} GB/s{end}")
            self.stream.flush()


# -- import ------------------------------------------------------------------------------------------
def import_checkpoint(hf_dir: str, ckpt_dir: str, tp: int = 1, pp: int = 1, ep: int = 1) -> List[str]:
    """Write ``hf_dir``'s model as a checkpoint in ``ckpt_dir``; returns the model's flags."""
    cfg = families.read_config(hf_dir)
    flags = families.model_flags(cfg)
    shape = families.model_shape(cfg)
    check_layout(flags, shape, tp, pp, ep)
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise UserError(f"{ckpt_dir}: not empty; the import writes a new checkpoint directory")
    reader = SafetensorsReader(hf_dir)
    tmap = TensorMap(shape)
    pieces, objects = model_pieces(flags)
    _check_names(reader, tmap, pieces, shape, hf_dir)
    dtype = reader.dtype("model.embed_tokens.weight")
    path = integrity.checkpoint_dir(ckpt_dir, 0)
    integrity.mark_in_progress(path)
    writer = TorchDistWriter(path)
    progress = Progress(f"import {hf_dir}", len(pieces))
    last: Tuple[Optional[tuple], Optional[torch.Tensor]] = (None, None)  # the halves of [gate; up] share one
    for piece in pieces:
        which = (piece.name, piece.layer, piece.expert)
        whole = last[1] if last[0] == which else tmap.to_ours(*which, reader.read)
        last = (which, whole)
        chunk = whole[piece.region].to(dtype).reshape(piece.chunk_sizes)
        writer.add_tensor(piece.key, piece.global_shape, piece.offset, chunk)
        progress.step(chunk.nbytes)
    reader.close()
    for key in objects:
        writer.add_object(key, None)  # megatron-core's local layers keep no extra state
    writer.close(_common_state(flags, hf_dir))
    integrity.mark_complete(path, 0)
    integrity.write_tracker(ckpt_dir, 0)
    with open(os.path.join(ckpt_dir, MODEL_ARGS), "w") as f:
        f.write("".join(_flag_lines(flags)))
    _copy_side_files(hf_dir, os.path.join(ckpt_dir, HF_FILES))
    return flags


def check_layout(flags: List[str], shape: families.ModelShape, tp: int, pp: int, ep: int) -> None:
    """Refuse, in one line, a TP/PP/EP the model does not split into (training would refuse it later)."""
    parse_model_flags(flags, ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              "--expert-model-parallel-size", str(ep)])
    if shape.padded_vocab % tp:
        raise UserError(f"--tensor-model-parallel-size {tp}: does not divide the padded vocabulary "
                        f"{shape.padded_vocab}")
    if shape.ffn % tp:
        raise UserError(f"--tensor-model-parallel-size {tp}: does not divide the FFN width {shape.ffn}")
    if ep > 1 and (not shape.experts or shape.experts % ep):
        raise UserError(f"--expert-model-parallel-size {ep}: does not divide the {shape.experts} experts")


def _check_names(reader: SafetensorsReader, tmap: TensorMap, pieces: List[Piece], shape, hf_dir: str) -> None:
    """Every tensor the model needs is there and every stored one is used (none silently dropped)."""
    needed = set()
    for piece in pieces:
        needed.update(tmap.hf_names(piece.name, piece.layer, piece.expert))
    missing = sorted(needed - set(reader.names()))
    if missing:
        raise UserError(f"{hf_dir}: config.json's model needs {len(missing)} tensors the weights lack, "
                        f"e.g. {missing[0]}")
    unused = [n for n in reader.names() if n not in needed and not n.endswith(_DERIVED)
              and not (shape.tied and n == "lm_head.weight")]
    if unused:
        raise UserError(f"{hf_dir}: {len(unused)} tensors would be dropped (no place for them in the model the "
                        f"config describes), e.g. {sorted(unused)[0]}")


def _flag_lines(flags: List[str]) -> List[str]:
    """'--flag value' per line (a switch alone on its line)."""
    lines, i = [], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            lines.append(f"{flags[i]} {flags[i + 1]}\n")
            i += 2
        else:
            lines.append(f"{flags[i]}\n")
            i += 1
    return lines


def _common_state(flags: List[str], hf_dir: str) -> dict:
    """The checkpoint's non-tensor state as this project saves it: the model's args (what
    --use-checkpoint-args reads), iteration 0, no optimizer, scheduler or RNG state."""
    from megatron.training.checkpoint.checkpointing import CHECKPOINT_VERSION
    from megatron.training.checkpoint.saved_args import MODEL_SHAPE_ARGS

    parsed = parse_model_flags(flags)
    saved = argparse.Namespace(**{name: getattr(parsed, name, None) for name in MODEL_SHAPE_ARGS})
    for name in ("padded_vocab_size", "kv_channels", "norm_epsilon", "qk_layernorm", "num_experts",
                 "moe_ffn_hidden_size", "moe_router_topk", "use_rope_scaling", "rope_scaling_factor"):
        setattr(saved, name, getattr(parsed, name, None))
    saved.tensor_model_parallel_size = saved.pipeline_model_parallel_size = 1
    saved.no_save_optim = saved.no_save_rng = True
    saved.consumed_train_samples = saved.consumed_valid_samples = 0
    saved.hf_import = os.path.abspath(hf_dir)
    return {"args": saved, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
            "num_floating_point_operations_so_far": 0}


def _copy_side_files(src: str, dst: str) -> None:
    """config.json, generation_config.json and the tokenizer's files: everything but the weights."""
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if os.path.isfile(full) and not name.endswith(_WEIGHT_SUFFIXES) and name not in _WEIGHT_INDEXES:
            shutil.copy2(full, os.path.join(dst, name))


# -- export ------------------------------------------------------------------------------------------
def export_checkpoint(ckpt_dir: str, hf_dir: str, template: Optional[str] = None, shard_gb: float = 5.0) -> str:
    """Write the newest complete checkpoint of ``ckpt_dir`` as a Hugging Face directory; returns the
    iteration directory it read."""
    path, common = _chosen_checkpoint(ckpt_dir)
    saved = common.get("args")
    source = _template_dir(ckpt_dir, saved, template)
    if source is None:
        if saved is None:
            raise UserError(f"{path}: holds no saved args and no config.json was found: pass --hf-template DIR")
        cfg = families.config_from_args(saved)
        print(f"export: no config.json beside {ckpt_dir} or its run's --load: the config is derived from the "
              f"checkpoint's args ({cfg['model_type']}), no tokenizer files", file=sys.stderr)
    else:
        cfg = families.read_config(source)
        _check_same_model(cfg, saved, source, path)
    shape = families.model_shape(cfg)
    if os.path.isdir(hf_dir) and os.listdir(hf_dir):
        raise UserError(f"{hf_dir}: not empty; the export writes a new Hugging Face directory")
    reader = TorchDistReader(path)
    tmap = TensorMap(shape)
    tensors = _logical_tensors(reader)
    plan: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
    for key, name, layer, expert, index, tail in tensors:
        meta = torch.empty(tail, dtype=reader.dtype(key), device="meta")
        for hf_name, t in tmap.to_hf(name, layer, expert, meta).items():
            plan[hf_name] = (t.dtype, tuple(t.shape))
    os.makedirs(hf_dir, exist_ok=True)
    writer = SafetensorsWriter(hf_dir, plan, int(shard_gb * 1e9))
    progress = Progress(f"export {path}", len(tensors))
    for key, name, layer, expert, index, tail in tensors:
        ours = reader.read(key, (*index, *[0] * len(tail)), (*[1] * len(index), *tail)).reshape(tail)
        for hf_name, t in tmap.to_hf(name, layer, expert, ours).items():
            writer.write(hf_name, t)
        progress.step(ours.nbytes)
    writer.close()
    reader.close()
    dtypes = {dtype for dtype, _ in plan.values()}
    if source is not None:
        _copy_side_files(source, hf_dir)
    _write_config(cfg, dtypes, hf_dir)
    return path


def _chosen_checkpoint(ckpt_dir: str):
    if not os.path.isdir(ckpt_dir):
        raise UserError(f"{ckpt_dir}: not a directory")
    try:
        iteration, _ = integrity.choose_checkpoint(ckpt_dir)
    except ValueError as err:
        raise UserError(f"{ckpt_dir}: {err}") from None
    if iteration is None:
        raise UserError(f"{ckpt_dir}: holds no complete checkpoint")
    path = integrity.checkpoint_dir(ckpt_dir, iteration)
    return path, load_common(path)


def _template_dir(ckpt_dir: str, saved, template: Optional[str]) -> Optional[str]:
    """Where config.json (and the tokenizer files) come from; None: nowhere (derived from the args)."""
    if template:
        return template
    candidates = [os.path.join(ckpt_dir, HF_FILES)]
    load = getattr(saved, "load", None)
    if load:
        candidates.append(os.path.join(load, HF_FILES))
    tokenizer = getattr(saved, "tokenizer_model", None)
    if tokenizer:
        candidates.append(tokenizer)
    for candidate in candidates:
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    return None


def _check_same_model(cfg: dict, saved, source: str, path: str) -> None:
    """The template's model is the checkpoint's (sizes its saved args hold)."""
    if saved is None:
        return
    flags = families.model_flags(cfg)
    expected = parse_model_flags(flags)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_experts"):
        have, want = getattr(saved, name, None), getattr(expected, name, None)
        if have is not None and have != want:
            raise UserError(f"{path}: {name.replace('_', '-')} {have}, but {source}/config.json describes {want}: "
                            "pass --hf-template with the model this checkpoint was trained from")


def _logical_tensors(reader: TorchDistReader):
    """(key, name, layer, expert, index along the prepended axes, the tensor's own shape) for every
    model tensor of the checkpoint (the optimizer's and the RNG's state are not exported)."""
    out = []
    for key in reader.tensors:
        if not key.startswith(_MODEL_KEY_PREFIXES):
            continue
        global_shape = reader.global_shape(key)
        probe = piece_of_key(key, global_shape, (0,) * len(global_shape), global_shape)
        lead, tail = global_shape[:probe.prepended], global_shape[probe.prepended:]
        for index in itertools.product(*(range(n) for n in lead)):
            piece = piece_of_key(key, global_shape, (*index, *[0] * len(tail)), (*[1] * len(index), *tail))
            out.append((key, piece.name, piece.layer, piece.expert, index, tuple(tail)))
    return out


def _write_config(cfg: dict, dtypes, hf_dir: str) -> None:
    cfg = dict(cfg)
    if len(dtypes) == 1:
        name = _DTYPE_NAMES.get(next(iter(dtypes)))
        if name:
            cfg["dtype"] = name
            cfg.pop("torch_dtype", None)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
