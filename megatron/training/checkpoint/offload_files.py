"""A checkpoint's offload files: where they lie, what each records, how they are written, and how one (pp, tp)
position's files are read by parameter name (``PositionFiles``).

Each rank writes its shard of the engine's state as ``iter_N/offload/ppPPP_tpTTT_dpDDD.offload``
(the experts' shard: ``offload_experts/``, "tp" its place in the stage's EP x ETP grid, "dp" its
expert-data-parallel rank), by element range, so subgroup size, tiers and budget may change between
save and load. A file's footer holds the data-parallel size, per-parameter slices (name, offset in
the parameter, length, offset in the file), each parameter's place in its global tensor (its
``ParamGeometry``), the model chunks per rank and the EP size: so a run with another DP, TP or PP
size finds its elements in the old ranks' files (offloaded_state reads them back).

A parameter's geometry comes from its ShardedTensor (the model chunk's ``sharded_state_dict()``):
the global tensor's key (layout-free: a pipeline stage's layer 0 is global layer ``offset[0]``),
its global shape and this rank's offset in it.

The offload facade hands in its shards (``kind``, ``engine``, ``layout``, ``dp_group``); the files
are written through the engine's face (``save_engine_state``, ``start_background_save``), tier files on
the checkpoint's file system taken by hard link (``mlp_offload.checkpoint.parts``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron.training.checkpoint.state_dict import rank_coordinates, sharding_metadata
from mlp_offload import BackgroundStateWrite, save_engine_state, start_background_save
from mlp_offload.checkpoint import (STATE_FILE_SUFFIX, BlockLayout, CheckpointDataError, Quantized, RangeReader,
                                    StateFile, quantize, subgroups_file_bytes)

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # the order of the tensors in an offload file
# The dense parameters' files, and the experts' (sharded over the expert grid and expert-data-parallel ranks).
SUBDIRS = {"dense": "offload", "experts": "offload_experts"}
FILE_NAME = re.compile(r"^pp(\d+)_tp(\d+)_dp(\d+)\.offload$")


# -- where they lie -------------------------------------------------------------------------------
def offload_file_path(checkpoint_dir: str, pp: int, tp: int, dp: int, kind: str = "dense") -> str:
    return os.path.join(checkpoint_dir, SUBDIRS[kind], f"pp{pp:03d}_tp{tp:03d}_dp{dp:03d}{STATE_FILE_SUFFIX}")


def shard_coordinates(kind: str = "dense"):
    """(pp, tp, dp) sizes and this rank's position, as offload files of ``kind`` are keyed, and the EP
    size. Dense: the model-parallel grid. Experts: "tp" is the place in the stage's EP x ETP grid
    and "dp" the expert-data-parallel rank, over which megatron-core shards the experts' optimizer."""
    ps = parallel_state
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if kind == "dense":
        return (*rank_coordinates(), ep)
    shape = (ps.get_pipeline_model_parallel_world_size(), ep * etp, ps.get_expert_data_parallel_world_size())
    place = (ps.get_pipeline_model_parallel_rank(),
             ps.get_expert_model_parallel_rank() * etp + ps.get_expert_tensor_parallel_rank(),
             ps.get_expert_data_parallel_rank())
    return shape, place, ep


def param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """The names offload files use for the parameters of ``model_chunks`` (the DDP-wrapped list):
    stable, so a checkpoint can be resharded onto another data-parallel size."""
    return {param: f"{i}.{name}" for i, chunk in enumerate(model_chunks) for name, param in chunk.named_parameters()}


# -- where each parameter lies in its global tensor -------------------------------------------------
Box = Tuple[int, ...]


@dataclass(frozen=True)
class ParamGeometry:
    key: str  # the global tensor's name in a checkpoint
    global_shape: Box
    global_offset: Box  # of this rank's local tensor, one entry per global axis
    local_shape: Box  # the local tensor with megatron-core's prepended axes (size 1) in front
    allow_shape_mismatch: bool  # padded (the vocabulary): the global shape may differ between layouts

    def to_json(self) -> list:
        return [self.key, list(self.global_shape), list(self.global_offset), list(self.local_shape),
                self.allow_shape_mismatch]

    @classmethod
    def from_json(cls, entry) -> Optional["ParamGeometry"]:
        """None for an entry that does not have the shape of one (the caller names the file)."""
        try:
            key, shape, offset, local, mismatch = entry
            geometry = cls(str(key), tuple(map(int, shape)), tuple(map(int, offset)), tuple(map(int, local)),
                           bool(mismatch))
        except (TypeError, ValueError):
            return None
        sound = (len(geometry.global_shape) == len(geometry.global_offset) == len(geometry.local_shape)
                 and all(0 <= o and 0 < n and o + n <= g for o, n, g in
                         zip(geometry.global_offset, geometry.local_shape, geometry.global_shape)))
        return geometry if sound else None

    @property
    def numel(self) -> int:
        return volume(self.local_shape)


def volume(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_geometries(model_chunks, metadata: dict) -> Dict[torch.nn.Parameter, ParamGeometry]:
    """Each parameter's geometry, matched to its ShardedTensor by storage (the tensor *is* the param).
    Of the parameters megatron-core shards through a factory, SwiGLU's fc1 (two halves) gets one;
    others get none."""
    found: Dict[torch.nn.Parameter, ParamGeometry] = {}
    for chunk in model_chunks:
        by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in chunk.parameters()}
        module = getattr(chunk, "module", chunk)  # DDP has no sharded_state_dict; its module does
        for value in nested_values(module.sharded_state_dict(metadata=metadata)):
            data = getattr(value, "data", None)
            if not isinstance(data, torch.Tensor) or getattr(value, "flattened_range", None) is not None:
                continue
            param = by_storage.get((data.data_ptr(), tuple(data.shape)))
            if param is None:
                continue
            if isinstance(value, ShardedTensor):
                found[param] = _plain_geometry(value)
            elif isinstance(value, ShardedTensorFactory):
                geometry = _two_halves_geometry(value)
                if geometry is not None:
                    found[param] = geometry
    return found


def _plain_geometry(value: ShardedTensor) -> ParamGeometry:
    local = (1,) * value.prepend_axis_num + tuple(value.local_shape)
    return ParamGeometry(value.key, tuple(value.global_shape), tuple(value.global_offset), local,
                         bool(value.allow_shape_mismatch))


def _two_halves_geometry(factory: ShardedTensorFactory) -> Optional[ParamGeometry]:
    """A parameter stored as two halves along one axis, each TP-sharded on its own (SwiGLU's fc1:
    [gate; up]). Seen through a new axis of size 2 before that one, the global tensor is (..., 2, F, ...)
    and this rank's parameter is one box in it, so the halves reshard like any tensor. None if the
    factory builds anything else."""
    built = factory.build()
    if not (isinstance(built, (list, tuple)) and len(built) == 2 and all(isinstance(t, ShardedTensor) for t in built)):
        return None
    w, v = (_plain_geometry(t) for t in built)
    differs = [axis for axis in range(len(w.global_offset)) if w.global_offset[axis] != v.global_offset[axis]]
    same_key = w.key == v.key == factory.key
    if same_key and len(differs) == 1:  # one global tensor [w halves; v halves]
        axis = differs[0]
        rows = w.global_shape[axis] // 2
        if v.global_offset[axis] != w.global_offset[axis] + rows:
            return None
    elif (w.key, v.key) == (f"{factory.key}_w", f"{factory.key}_v") and not differs:  # two global tensors
        axis = len(w.global_shape) - len(factory.data.shape)  # the halves' axis: the first local one
        rows = w.global_shape[axis]
    else:
        return None
    prepended = len(w.local_shape) - factory.data.dim()
    if w.local_shape != v.local_shape or w.local_shape[axis] * 2 != factory.data.shape[axis - prepended] \
            or w.global_offset[axis] + w.local_shape[axis] > rows:
        return None
    split = lambda box, pair: box[:axis] + pair + box[axis + 1:]  # noqa: E731
    return ParamGeometry(factory.key, split(w.global_shape, (2, rows)), split(w.global_offset, (0, w.global_offset[axis])),
                         split(w.local_shape, (2, w.local_shape[axis])), w.allow_shape_mismatch)


# -- writing them ---------------------------------------------------------------------------------
def offloaded_state_writes(shards, model_chunks, checkpoint_dir: str, digests: Optional[dict] = None) -> list:
    """What ``write_offloaded_state`` writes into ``checkpoint_dir``: a file per rank and shard, its
    metadata read from the model here, on the caller's thread. ``digests``: kind -> StateDigest, which
    the writer adds what it writes to."""
    digests = digests or {}
    return [(shard.engine, *_file_and_metadata(shard, model_chunks, checkpoint_dir), digests.get(shard.kind))
            for shard in shards]


def write_offloaded_state(writes: list) -> int:
    """Stream each engine's state into its file (any thread: it touches the engines and the files
    only); returns the bytes written."""
    return sum(save_engine_state(*write, link_tier_files=True) for write in writes)


def start_offloaded_save(shards, model_chunks, checkpoint_dir: str, digests: Optional[dict] = None,
                         next_save_in_s: Optional[float] = None) -> "StateWrites":
    """The same files, written by a thread from a snapshot taken now, once ``start()``ed (--async-save), done
    before the next save where ``next_save_in_s`` says when it comes."""
    digests = digests or {}
    return StateWrites([start_background_save(shard.engine, *_file_and_metadata(shard, model_chunks, checkpoint_dir),
                                              digests.get(shard.kind), link_tier_files=True,
                                              next_save_in_s=next_save_in_s) for shard in shards])


def offloaded_state_bytes(shards) -> int:
    """What ``write_offloaded_state`` writes on this rank."""
    return sum(subgroups_file_bytes(shard.engine.subgroups) for shard in shards)


def _file_and_metadata(shard, model_chunks, checkpoint_dir: str):
    _, (p, t, d), ep = shard_coordinates(shard.kind)
    path = offload_file_path(checkpoint_dir, p, t, d, shard.kind)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    layout, names = shard.layout, param_names(model_chunks)
    pieces = shard_pieces(shard, names)
    # Where each parameter lies in its global tensor: what a run at other TP/PP sizes needs.
    geometry = {names[p]: g.to_json()  # of this shard's parameters (dense or experts)
                for p, g in param_geometries(model_chunks, sharding_metadata()).items()
                if p in layout.param_flat_range}
    return path, {"dp_size": shard.dp_group.size(), "params": pieces, "geometry": geometry,
                  "model_chunks": len(model_chunks), "ep_size": ep}


def shard_pieces(shard, names: Dict[torch.nn.Parameter, str]) -> List[list]:
    """[name, offset in the parameter, length, offset in the shard] of each parameter ``shard`` holds."""
    layout = shard.layout
    return [[names[p], layout.param_slice[p], b - a, a] for p, (a, b) in layout.param_flat_range.items()]


class StateWrites:
    """Each shard's background write of one checkpoint, as one writer thread (async_save.WriterThread)."""

    def __init__(self, writes: List[BackgroundStateWrite]):
        self.writes = writes

    nbytes = property(lambda self: sum(w.nbytes for w in self.writes))
    write_s = property(lambda self: max(w.write_s for w in self.writes))
    paused_s = property(lambda self: sum(w.paused_s for w in self.writes))
    failure = property(lambda self: next((w.failure for w in self.writes if getattr(w, "failure", None)), None))

    def start(self) -> None:
        for w in self.writes:
            w.start()

    def done(self) -> bool:
        return all(w.done() for w in self.writes)

    def wait(self) -> None:
        for w in self.writes:
            w.wait()

    def cancel(self) -> None:
        for w in self.writes:
            w.cancel()

    def yield_to(self, running: Callable[[], bool], until: Optional[float]) -> None:
        """Each paced write waits while ``running`` (a writer due first, by ``until``) before its first chunk."""
        for w in self.writes:
            if w.pacer is not None:
                w.pacer.first, w.pacer.first_until = running, until


class PositionFiles:
    """The files of one (pp, tp) position, read by (parameter name, element range). Their readers
    are made on the first read; ``cache_bytes`` bounds what they keep (None: two subgroups a file)."""

    def __init__(self, files: List[StateFile], where: str, cache_bytes: Optional[int]):
        self.files, self.where = files, where
        self.dp_size = len(files)
        self.geometry: Dict[str, list] = {}  # name -> ParamGeometry as JSON; each file records its own
        # param name -> [(offset in the param, length, offset in the file, index of the file)]
        self._held: Dict[str, List[Tuple[int, int, int, int]]] = {}
        for i, saved in enumerate(files):
            self.geometry.update(saved.metadata["geometry"])
            for name, offset, length, flat in saved.metadata["params"]:
                self._held.setdefault(name, []).append((offset, length, flat, i))
        self._share = None if cache_bytes is None else cache_bytes // len(files)
        self._readers: Optional[List[RangeReader]] = None

    def param_names(self):
        return self._held.keys()

    def read_by_name(self, name: str, start: int, end: int, outs, high: Optional[torch.Tensor] = None,
                     keys: Sequence[int] = (0, 1, 2)) -> None:
        """Elements [start, end) of parameter ``name`` into ``outs`` (one tensor per STATE_KEYS entry,
        or per entry of ``keys``). ``high``: the model's bf16 values of these elements, which complete a
        master saved as 16-bit remainders into fp32 (without it such a file is refused)."""
        filled = 0
        for x, y, reader, at in self._holdings(name, start, end):
            for k, out in zip(keys, outs):
                target = out[x - start: y - start]
                master = reader.codecs[0]
                if k == 0 and high is not None and master.needs_high and out.dtype != master.storage_dtype:
                    rem = master.empty(y - x)
                    reader.read(k, at + x, at + y, rem)
                    piece_high = high[x - start: y - start].cpu()
                    if target.dtype == torch.float32 and target.is_contiguous():
                        master.unpack(rem, out=target, high=piece_high)  # no fp32 temporary per piece
                    else:
                        target.copy_(master.unpack(rem, high=piece_high))
                    continue
                reader.read(k, at + x, at + y, target)
            filled += y - x
        if filled != end - start:
            raise CheckpointDataError(f"{self.where}: elements {start}..{end} of {name} are in no offload file "
                                      f"(another model or TP/PP layout?)")

    def _holdings(self, name: str, start: int, end: int):
        """(x, y, reader, at): elements [x, y) of [start, end) of parameter ``name`` are in ``reader``'s
        file from its element ``at + x`` on."""
        if self._readers is None:
            self._readers = [saved.ranges(self._share) for saved in self.files]
        for old_offset, length, flat, i in self._held.get(name, []):
            x, y = max(start, old_offset), min(end, old_offset + length)
            if x < y:
                yield x, y, self._readers[i], flat - old_offset

    def read_moments_by_name(self, name: str, start: int, end: int, targets: Sequence[Quantized],
                             layout: BlockLayout) -> None:
        """8-bit moments (exp_avg, exp_avg_sq) of elements [start, end) of parameter ``name`` into
        ``targets``, whose blocks ``layout`` gives (this run's: multiples of its block in the
        parameter, and the range's ends). A stretch whose both ends are block boundaries in the saved
        file and in ``layout`` moves as its codes and scales, unchanged; the blocks around any other
        cut are dequantized and quantized again under ``layout`` (one more rounding, there only)."""
        block, moved = layout.block, []

        def ours(pos: int) -> bool:
            return pos in (start, end) or pos % block == 0

        for x, y, reader, at in self._holdings(name, start, end):
            if any(c.block != block or getattr(c, "fmt", None) != t.fmt for c, t in zip(reader.codecs[1:], targets)):
                continue  # saved in other formats or blocks: as values, below

            def both(pos: int) -> bool:
                return ours(pos) and reader.is_block_boundary(at + pos)

            a = x if both(x) else min(y, -(-x // block) * block)
            b = y if both(y) else y // block * block
            if a >= b or not (both(a) and both(b)):
                continue
            first, last = layout.block_span(a - start, b - start)
            for k, target in enumerate(targets, 1):
                reader.read_quantized(k, at + a, at + b, Quantized(
                    target.codes[a - start: b - start], target.scales[first:last], target.fmt))
            moved.append((a, b))
        pos = start
        for a, b in sorted(moved) + [(end, end)]:
            if pos < a:  # whole blocks of ``layout`` between moved stretches: through their values
                values = [torch.empty(a - pos, dtype=torch.float32) for _ in targets]
                self.read_by_name(name, pos, a, values, keys=(1, 2))
                first, last = layout.block_span(pos - start, a - start)
                for value, target in zip(values, targets):
                    quantize(value, layout.span(first, last), target.fmt, out=Quantized(
                        target.codes[pos - start: a - start], target.scales[first:last], target.fmt))
            pos = b

    def drop_cached(self) -> None:
        """Forget the stored subgroups kept for the next read (bounds memory over many positions)."""
        for reader in self._readers or []:
            reader.drop_cached()
