"""The two on-disk formats, read and written a tensor at a time (host memory holds the tensor in
hand, never a file's worth):

- safetensors (Hugging Face): an 8-byte header length, a JSON header (each tensor's dtype, shape and
  byte range), then the bytes. Read with ``pread`` of one tensor's range (no memory map: mapped pages
  of a multi-GB shard would count in the process's memory as they are touched); written into shards
  whose headers are laid out first, from the whole plan, so each tensor goes straight to its place.
- torch_dist (megatron-core's dist_checkpointing on torch.distributed.checkpoint): each item one
  ``torch.save`` record in a data file, ``.metadata`` (the pickled index of every item),
  ``common.pt`` (the non-tensor state) and ``metadata.json``. Written item by item here (DCP's own
  writer keeps every tensor of a file referenced until the file is done); read back a chunk at a time.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.training.checkpoint.torch_dist_ranges import FileSlice
from megatron.training.errors import UserError

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# -- safetensors -----------------------------------------------------------------------------------
class SafetensorsReader:
    """The tensors of a Hugging Face directory's safetensors files (one, or sharded with an index)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            files = [SINGLE]
        else:
            raise UserError(f"{hf_dir}: no {SINGLE} nor {INDEX} (only safetensors weights are read; "
                            "convert .bin weights with transformers' save_pretrained first)")
        self._where: Dict[str, Tuple[str, int, int, torch.dtype, List[int]]] = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            header, data_start = _read_header(path)
            for tensor, info in header.items():
                if tensor == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self._where[tensor] = (path, data_start + begin, end - begin, _DTYPES[info["dtype"]], info["shape"])
        self._fds: Dict[str, int] = {}

    def names(self) -> List[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name][3]

    def read(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"{self.dir}: the weights hold no tensor {name!r} (config.json's model needs it)")
        path, start, nbytes, dtype, shape = self._where[name]
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        buf = bytearray(nbytes)
        _pread_into(self._fds[path], buf, start, path)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_header(path: str):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def _pread_into(fd: int, buf: bytearray, offset: int, path: str) -> None:
    view = memoryview(buf)
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise UserError(f"{path}: truncated at byte {offset}")
        view, offset = view[n:], offset + n


class SafetensorsWriter:
    """Shards of at most ``shard_bytes`` (a tensor larger than that gets a shard of its own), laid out
    from ``plan`` (name -> (dtype, shape), in writing order); ``write`` puts one tensor in place and
    ``close`` writes the index (with several shards)."""

    def __init__(self, out_dir: str, plan: Dict[str, Tuple[torch.dtype, Sequence[int]]], shard_bytes: int):
        self.dir = out_dir
        shards: List[List[str]] = [[]]
        size = 0
        for name, (dtype, shape) in plan.items():
            nbytes = _nbytes(dtype, shape)
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        count = len(shards)
        self.files = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._place: Dict[str, Tuple[int, int, int]] = {}  # name -> (fd, byte offset, bytes)
        self._fds, self.total_bytes = [], 0
        for file_name, names in zip(self.files, shards):
            header, offset = {}, 0
            for name in names:
                dtype, shape = plan[name]
                nbytes = _nbytes(dtype, shape)
                header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            header["__metadata__"] = {"format": "pt"}
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            fd = os.open(os.path.join(out_dir, file_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, struct.pack("<Q", len(text)) + text)
            os.ftruncate(fd, 8 + len(text) + offset)
            self._fds.append(fd)
            for name in names:
                begin, end = header[name]["data_offsets"]
                self._place[name] = (fd, 8 + len(text) + begin, end - begin)
            self.total_bytes += offset
        self._shard_of = {name: file_name for file_name, names in zip(self.files, shards) for name in names}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        fd, offset, nbytes = self._place[name]
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise ValueError(f"{name}: {data.nbytes} bytes, the plan has {nbytes}")
        view = memoryview(data)
        while len(view):
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def close(self) -> None:
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self._shard_of}
            with open(os.path.join(self.dir, INDEX), "w") as f:
                json.dump(index, f, indent=2)


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()


# -- torch_dist --------------------------------------------------------------------------------------
TORCH_DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                     "common_backend_version": 1}
DATA_FILE = "__0_0.distcp"


class TorchDistWriter:
    """Items appended to one data file, then the index. ``add_tensor`` takes the piece's chunk of a
    global tensor; ``add_object`` a torch-saved object under its key (megatron-core's ShardedObject)."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint.metadata import Metadata

        self.path = path
        self._file = open(os.path.join(path, DATA_FILE), "wb")
        self._metadata = Metadata(state_dict_metadata={})
        self._storage = {}

    def add_tensor(self, key: str, global_shape, offset, chunk: torch.Tensor) -> None:
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)

        chunk = chunk.detach().contiguous()
        if chunk.untyped_storage().nbytes() != chunk.nbytes:
            chunk = chunk.clone()  # torch.save writes the whole storage: only the chunk's own bytes
        md = self._metadata.state_dict_metadata.setdefault(key, TensorStorageMetadata(
            properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(global_shape), chunks=[]))
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=chunk.shape))
        start = self._file.tell()
        torch.save(chunk, self._file)
        self._storage[MetadataIndex(key, torch.Size(offset))] = self._stored(start)

    def add_object(self, unique_key: str, obj) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        buf = io.BytesIO()
        torch.save([obj], buf)  # as megatron-core packs a ShardedObject's data
        self._metadata.state_dict_metadata[unique_key] = BytesStorageMetadata()
        start = self._file.tell()
        self._file.write(buf.getbuffer())
        self._storage[MetadataIndex(unique_key)] = self._stored(start)

    def _stored(self, start: int):
        # torch.distributed.checkpoint's own record of where an item lies (its FileSystemReader reads it)
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo(relative_path=DATA_FILE, offset=start, length=self._file.tell() - start)

    def close(self, common: dict) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._metadata.storage_data = self._storage
        with open(os.path.join(self.path, ".metadata"), "wb") as f:
            pickle.dump(self._metadata, f)
        torch.save(common, os.path.join(self.path, "common.pt"))
        with open(os.path.join(self.path, "metadata.json"), "w") as f:
            json.dump(TORCH_DIST_CONFIG, f)


class TorchDistReader:
    """Regions of a torch_dist checkpoint's global tensors, assembled from the chunks that overlap
    them, one chunk in memory at a time (at most one layer's share of a tensor, as it was saved)."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        metadata = FileSystemReader(path).read_metadata()
        self.tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._stored = {(index.fqn, tuple(index.offset)): info for index, info in metadata.storage_data.items()
                        if index.offset is not None}
        self._fds: Dict[str, int] = {}

    def global_shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The region [offset, offset + shape) of ``key``'s global tensor."""
        md = self.tensors[key]
        out: Optional[torch.Tensor] = None
        covered = 0
        for chunk in md.chunks:
            lo = [max(o, c) for o, c in zip(offset, chunk.offsets)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offset, shape, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            data = self._load(key, tuple(chunk.offsets))
            piece = data[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets))]
            if list(lo) == list(offset) and [b - a for a, b in zip(lo, hi)] == list(shape):
                return piece  # one chunk holds the whole region
            if out is None:
                out = torch.empty(tuple(shape), dtype=md.properties.dtype)
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))] = piece
            covered += piece.numel()
        total = 1
        for n in shape:
            total *= n
        if out is None or covered < total:
            raise UserError(f"{self.path}: {key} at {tuple(offset)} x {tuple(shape)} is not in the checkpoint")
        return out

    def _load(self, key: str, offset: Tuple[int, ...]) -> torch.Tensor:
        info = self._stored[(key, offset)]
        path = os.path.join(self.path, info.relative_path)
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        # torch.load reads the record straight from the file: the chunk's own bytes, no copy of them
        stream = io.BufferedReader(FileSlice(self._fds[path], info.offset, info.length))
        return torch.load(stream, map_location="cpu", weights_only=True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def load_common(path: str) -> dict:
    return torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=False)

