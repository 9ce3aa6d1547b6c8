"""Element ranges of flat (1-D) tensors in a torch_dist checkpoint, read straight from its files.

megatron-core loads through torch.distributed.checkpoint, whose file reader ``torch.load``s each
saved item whole before narrowing it to what was asked: a piece of a large item costs the whole item
in memory, and the load is collective. Here each saved item's data record is found in its file (an
item is a ``torch.save`` zip archive holding one uncompressed storage record of exactly the item's
elements: DCP clones a tensor to its own size before saving it) and only the bytes asked for are
read. Reads are local, so ranks need not agree on how many they make. An item in any other shape
(compressed, transformed, ...) is loaded whole, with a warning.
"""

from __future__ import annotations

import io
import logging
import os
import re
import struct
import zipfile
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mlp_offload.checkpoint import CheckpointDataError

log = logging.getLogger(__name__)
_STORAGE_RECORD = re.compile(r"^[^/]+/data/\d+$")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip entry's local file header
_LOCAL_HEADER_MAGIC = 0x04034B50


class FlatTensorRanges:
    """``read(key, start, end, out)``: elements [start, end) of the saved 1-D tensor ``key``."""

    def __init__(self, checkpoint_dir: str):
        self.where = checkpoint_dir
        metadata = FileSystemReader(checkpoint_dir).read_metadata()
        # key -> [(first element, elements, where it is stored)], and its saved dtype
        self._items: Dict[str, List[Tuple[int, int, object]]] = {}
        self._dtype: Dict[str, torch.dtype] = {}
        for index, stored in metadata.storage_data.items():
            meta = metadata.state_dict_metadata.get(index.fqn)
            if not isinstance(meta, TensorStorageMetadata) or len(meta.size) != 1:
                continue
            sizes = {tuple(c.offsets): c.sizes[0] for c in meta.chunks}
            self._items.setdefault(index.fqn, []).append((index.offset[0], sizes[tuple(index.offset)], stored))
            self._dtype[index.fqn] = meta.properties.dtype
        self._files: Dict[str, int] = {}
        self._data_at: Dict[Tuple[str, int], Optional[int]] = {}  # item -> its data's byte offset in the file
        self._whole: Dict[Tuple[str, int], torch.Tensor] = {}  # items that had to be loaded whole

    def keys(self) -> List[str]:
        """The names of the flat tensors the checkpoint holds ranges of."""
        return list(self._items)

    def numel(self, key: str) -> int:
        """Elements of ``key`` the checkpoint holds, over all its stored ranges."""
        return sum(count for _, count, _ in self._items.get(key, []))

    def read(self, key: str, start: int, end: int, out: torch.Tensor) -> None:
        dtype = self._dtype.get(key)
        filled = 0
        for first, count, stored in self._items.get(key, []):
            lo, hi = max(start, first), min(end, first + count)
            if lo >= hi:
                continue
            data_at = self._data_offset(stored, count * dtype.itemsize)
            if data_at is None:
                piece = self._whole_item(stored, dtype)[lo - first: hi - first]
            else:
                buf = bytearray((hi - lo) * dtype.itemsize)
                self._pread_into(stored.relative_path, buf, data_at + (lo - first) * dtype.itemsize)
                piece = torch.frombuffer(buf, dtype=dtype)
            out[lo - start: hi - start].copy_(piece)
            filled += hi - lo
        if filled != end - start:
            raise CheckpointDataError(f"{self.where}: elements {start}..{end} of {key} are not in the checkpoint")

    def _data_offset(self, stored, nbytes: int) -> Optional[int]:
        item = (stored.relative_path, stored.offset)
        if item not in self._data_at:
            self._data_at[item] = self._locate_record(stored, nbytes)
            if self._data_at[item] is None:
                log.warning("%s: a saved item of %s is not a plain torch.save archive; it is loaded whole",
                            self.where, stored.relative_path)
        return self._data_at[item]

    def _locate_record(self, stored, nbytes: int) -> Optional[int]:
        if getattr(stored, "transform_descriptors", None):
            return None
        fd = self._file(stored.relative_path)
        try:
            with zipfile.ZipFile(FileSlice(fd, stored.offset, stored.length)) as archive:
                records = [r for r in archive.infolist() if _STORAGE_RECORD.match(r.filename)]
        except zipfile.BadZipFile:
            return None
        if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != nbytes:
            return None
        header = os.pread(fd, _LOCAL_HEADER.size, stored.offset + records[0].header_offset)
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_HEADER_MAGIC:
            return None
        name_len, extra_len = fields[-2:]
        return stored.offset + records[0].header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def _whole_item(self, stored, dtype: torch.dtype) -> torch.Tensor:
        item = (stored.relative_path, stored.offset)
        if item not in self._whole:
            buf = bytearray(stored.length)
            self._pread_into(stored.relative_path, buf, stored.offset)
            self._whole[item] = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True).to(dtype)
        return self._whole[item]

    def _pread_into(self, relative_path: str, buf: bytearray, offset: int) -> None:
        view, fd = memoryview(buf), self._file(relative_path)
        while len(view):
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise CheckpointDataError(f"{self.where}/{relative_path}: truncated at byte {offset}")
            view, offset = view[n:], offset + n

    def _file(self, relative_path: str) -> int:
        if relative_path not in self._files:
            self._files[relative_path] = os.open(os.path.join(self.where, relative_path), os.O_RDONLY)
        return self._files[relative_path]

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._whole.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable stream (for zipfile)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        data = os.pread(self._fd, n, self._offset + self._pos)
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)
