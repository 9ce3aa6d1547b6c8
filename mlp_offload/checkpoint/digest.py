"""Digests of stored state, for the resume check: computed where a save already holds each tensor and
where a load writes it, so that nothing is read twice.

A tensor's digest is a pair over its raw bits, read as 32-bit words: element ``i`` of the tensor it
belongs to (a parameter's piece of a shard starts at that piece's offset in the parameter) is lane
``i % L`` of word ``k = i // L`` (``L`` = 4 bytes or 2 halves to a word, 1 for wider elements), and
adds ``v = bits << (lane * width)`` (its bits unsigned, but those of a word's top lane signed: the
word as a signed integer; 8-byte elements signed)::

    s1 = sum(v),  s2 = sum((k + 1) * v)   (mod 2**64)

``s2`` sees order (two swapped words, a piece shifted), ``s1`` any single changed element, and both add
up over chunks and over ranks, so any chunking of a tensor gives the same pair. Words make a digest
of 8- and 16-bit elements cost what one of 32-bit ones does per byte. It runs on CPU and CUDA tensors
alike, in chunks of ``CHUNK`` words (bounded extra memory), each seen as rows of ``ROW`` words: with
``r[k]`` a chunk's row sums and ``c[j]`` its column sums,
``sum((a + k*ROW + j + 1) * w) = (a + 1) * sum(r) + ROW * sum(k * r[k]) + sum(j * c[j])``, two
reductions that widen the words on the fly instead of a product per word (on the CPU one thread's: the
digests run beside training).

``StateDigest`` keeps them per parameter piece and state tensor of one engine's shard, fed a subgroup
at a time: by the checkpoint writer from the tensors it writes, and by a load from those its fill
callback wrote (``observing``). The master and the moments are digested as stored (a master kept as
16-bit remainders as those, whose high halves are the model's params; 8-bit moments as their codes
and, apart, their block scales indexed by each block's first element in the parameter).
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy
import torch

from ..state_formats import is_blockwise

MASK = (1 << 64) - 1
# Words per chunk on the CPU (16 MiB): each call that leaves the GIL (a numpy or torch call on many elements)
# takes it back from the training thread, which leaves it at every torch call: few calls, on large chunks.
CHUNK = 1 << 22
CUDA_CHUNK = 1 << 24  # on the GPU: few kernel launches, and at most 128 MiB widened beside training
ROW = 1 << 10
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
TENSORS = ("master", "exp_avg", "exp_avg_sq")


def raw_integers(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as the signed integers of their bits (flat; a view where ``t`` is contiguous)."""
    return t.reshape(-1).view(_SIGNED[t.element_size()])


def digest(t: torch.Tensor, first_index: int = 0) -> torch.Tensor:
    """(s1, s2) of ``t`` (int64 on ``t``'s device, wrapped mod 2**64), its element ``j`` being index
    ``first_index + j`` of the tensor it belongs to (see the module's docstring)."""
    x = raw_integers(t)
    lanes = _lanes(x)
    head = min(x.numel(), (-first_index) % lanes)  # elements before the first whole word
    words = (x.numel() - head) // lanes
    acc = _element_digest(x[:head], first_index, lanes)
    acc = acc + _element_digest(x[head + words * lanes:], first_index + head + words * lanes, lanes)
    span = (CUDA_CHUNK if x.is_cuda else CHUNK) * lanes
    for a in range(head, head + words * lanes, span):  # a chunk at a time: a copy to align it stays small
        acc = acc + _word_digest(_as_words(x[a: min(a + span, head + words * lanes)]), (first_index + a) // lanes)
    return acc


def _lanes(x: torch.Tensor) -> int:
    """Elements per digested word: a 32-bit word holds 4 bytes or 2 halves; wider elements are words."""
    return max(1, 4 // x.element_size())


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit words of ``x`` (a whole number of them; copied where ``x`` does not start on a word
    boundary in memory)."""
    if x.element_size() >= 4:
        return x
    if (x.storage_offset() * x.element_size()) % 4 or x.data_ptr() % 4:
        x = x.clone()
    return x.view(torch.int32)


def _word_digest(w: torch.Tensor, first_word: int) -> torch.Tensor:
    """(sum w, sum (k + 1) w) over words ``w`` numbered from ``first_word``: row and column sums per chunk."""
    if not w.is_cuda:
        return torch.tensor([_signed(v) for v in _numpy_word_digest(w.numpy(), first_word)], dtype=torch.int64)
    acc = torch.zeros(2, dtype=torch.int64, device=w.device)
    chunk = CUDA_CHUNK
    for a in range(0, w.numel(), chunk):
        part, at = w[a: a + chunk], first_word + a
        rows = part.numel() // ROW
        if rows:
            r, c = _row_and_column_sums(part[: rows * ROW].view(rows, ROW))
            total = r.sum()
            acc[0] += total
            acc[1] += total * (at + 1) + (r * torch.arange(rows, device=w.device)).sum() * ROW \
                + (c * torch.arange(ROW, device=w.device)).sum()
        tail = part[rows * ROW:]
        if tail.numel():
            acc += indexed_digest(tail, torch.arange(tail.numel(), device=w.device) + (at + rows * ROW))
    return acc


def _row_and_column_sums(block: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``block``'s (on a GPU) row and column sums, widened to int64."""
    return torch.sum(block, dim=1, dtype=torch.int64), torch.sum(block, dim=0, dtype=torch.int64)


def _numpy_word_digest(words: numpy.ndarray, first_word: int) -> Tuple[int, int]:
    """``_word_digest`` of words in host memory (mod 2**64), by numpy on the calling thread alone: torch's
    reductions of a chunk would take every core of the rank's intra-op pool, in bursts beside the training
    thread, for work one core does at several times a paced writer's rate. Per chunk two large reductions
    and a few small ones, the rest in Python integers (int64 products wrap, as the sums do mod 2**64)."""
    s1 = s2 = 0
    for a in range(0, words.size, CHUNK):
        part, at = words[a: a + CHUNK], first_word + a
        rows = part.size // ROW
        if rows:
            block = part[: rows * ROW].reshape(rows, ROW)
            r, c = block.sum(axis=1, dtype=numpy.int64), block.sum(axis=0, dtype=numpy.int64)
            total = int(r.sum())
            s1 += total
            s2 += total * (at + 1) + ROW * int(r @ numpy.arange(rows, dtype=numpy.int64)) \
                + int(c @ numpy.arange(ROW, dtype=numpy.int64))
        tail = part[rows * ROW:].astype(numpy.int64)
        if tail.size:
            s1 += int(tail.sum())
            s2 += int(tail @ numpy.arange(at + rows * ROW + 1, at + part.size + 1, dtype=numpy.int64))
    return s1 & MASK, s2 & MASK


def _signed(v: int) -> int:
    """An unsigned 64-bit integer as the int64 of its bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _element_digest(x: torch.Tensor, first_index: int, lanes: int) -> torch.Tensor:
    """What elements ``x`` (a few, outside whole words) add: each as its lane of its word."""
    index = torch.arange(x.numel(), device=x.device) + first_index
    lane = index % lanes
    bits = 8 * x.element_size()
    value = x.to(torch.int64)
    unsigned = value & ((1 << bits) - 1) if bits < 64 else value
    value = torch.where(lane == lanes - 1, value, unsigned) << (lane * bits)  # the top lane keeps its sign
    return torch.stack([value.sum(), (value * (index // lanes + 1)).sum()])


def indexed_digest(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of ``t`` whose element ``j`` has index ``index[j]`` (int64, on ``t``'s device)."""
    x = raw_integers(t).to(torch.int64)
    return torch.stack([x.sum(), (x * (index.to(torch.int64) + 1)).sum()])


def add_pairs(a: Sequence[int], b: Sequence[int]) -> List[int]:
    """Two digests of disjoint parts of one tensor (or of one parameter on two ranks) as one."""
    return [(x + y) & MASK for x, y in zip(a, b)]


class StateDigest:
    """Digests of one engine shard's stored state per parameter piece. ``pieces``: (name, offset in
    the parameter, length, offset in the shard) of each parameter this shard holds; ``codecs``: the
    stored formats of (master, exp_avg, exp_avg_sq); ``blocks``: the engine's ``blocks`` (``params``,
    ``block``) with 8-bit moments, else None. ``add`` takes each subgroup once, in any order."""

    def __init__(self, pieces: Sequence[Sequence], codecs, blocks=None):
        self.pieces = sorted((int(shard_at), int(length), int(offset), str(name))
                             for name, offset, length, shard_at in pieces)
        self._starts = [p[0] for p in self.pieces]
        self.codecs = tuple(codecs)
        self.blockwise = is_blockwise(self.codecs)
        self.blocks = blocks if self.blockwise else None
        self.formats = [c.describe() for c in self.codecs]
        self.nbytes = 0
        self._acc: Dict[Tuple[str, str], torch.Tensor] = {}
        self._beside: Optional[ThreadPoolExecutor] = None  # the load's digest thread (``observing``)
        self._pending: Dict[int, Future] = {}  # buffer (storage address) -> its digest in flight
        self._lock = threading.Lock()

    @classmethod
    def of_engine(cls, engine, pieces: Sequence[Sequence]) -> "StateDigest":
        return cls(pieces, engine.state_codecs, engine.blocks)

    def observing(self, fill: Callable) -> Callable:
        """``fill`` (an ``engine.load_state`` callback) that digests what it wrote, by a thread, beside what
        the engine does next (the subgroup's write to its tier, the next fills); a fill into a buffer
        still being digested waits for it first, as ``result`` waits for all. The last digests may still
        run when the load returns: take ``result`` before the engine is used again (streaming its state
        or stepping reads into the same scratch buffer, unaware of the digest)."""
        def fill_and_digest(sg, *tensors):
            buffers = {t.untyped_storage().data_ptr() for t in tensors}
            with self._lock:  # a load fills from two threads (the adopted subgroups' reads on their own)
                waits = [self._pending.pop(buffer) for buffer in buffers & self._pending.keys()]
            for digesting in waits:
                digesting.result()
            fill(sg, *tensors)
            with self._lock:
                if self._beside is None:
                    self._beside = ThreadPoolExecutor(1, thread_name_prefix="mlp-load-digest")
                digesting = self._beside.submit(self.add, sg, tensors)
                self._pending.update(dict.fromkeys(buffers, digesting))

        return fill_and_digest

    def _wait(self) -> None:
        pending, self._pending = list(self._pending.values()), {}
        for digesting in pending:
            digesting.result()

    def add(self, sg, tensors: Sequence[torch.Tensor]) -> None:
        """Subgroup ``sg``'s stored (master, exp_avg, exp_avg_sq)."""
        layout = None
        if self.blockwise:
            layout = self.blocks.params.layout(sg.start, sg.end, self.blocks.block)
            block_starts = layout.starts[:-1]  # from the subgroup's start; a block is its first element's piece's
            quantized = [codec.split(raw, sg.numel, sg.blocks) for raw, codec in zip(tensors[1:], self.codecs[1:])]
        for shard_at, length, offset, name in self._overlapping(sg.start, sg.end):
            lo, hi = max(shard_at, sg.start), min(shard_at + length, sg.end)
            first = offset + lo - shard_at  # the piece's first element here, as an index of the parameter
            a, b = lo - sg.start, hi - sg.start
            self._add(name, TENSORS[0], digest(tensors[0][a:b], first), tensors[0][a:b])
            if layout is None:
                for key, t in zip(TENSORS[1:], tensors[1:]):
                    self._add(name, key, digest(t[a:b], first), t[a:b])
                continue
            i, j = (int(k) for k in torch.searchsorted(block_starts, torch.tensor([a, b])))  # blocks starting in it
            starts = (block_starts[i:j] + (offset + sg.start - shard_at)).to(tensors[1].device)
            for key, q in zip(TENSORS[1:], quantized):
                self._add(name, key, digest(q.codes[a:b], first), q.codes[a:b])
                self._add(name, f"{key} scales", indexed_digest(q.scales[i:j], starts), q.scales[i:j])

    def _overlapping(self, start: int, end: int):
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        while k < len(self.pieces) and self.pieces[k][0] < end:
            if self.pieces[k][0] + self.pieces[k][1] > start:
                yield self.pieces[k]
            k += 1

    def _add(self, name: str, key: str, acc: torch.Tensor, t: torch.Tensor) -> None:
        self.nbytes += t.numel() * t.element_size()
        held = self._acc.get((name, key))
        self._acc[(name, key)] = acc if held is None else held + acc.to(held.device)

    def result(self) -> Dict[str, Dict[str, List[int]]]:
        """{parameter name: {state tensor: [s1, s2]}} of what was added."""
        self._wait()
        if self._beside is not None:
            self._beside.shutdown()
            self._beside = None
        keys = list(self._acc)
        pairs = as_pairs([self._acc[k] for k in keys])
        out: Dict[str, Dict[str, List[int]]] = {}
        for (name, key), pair in zip(keys, pairs):
            out.setdefault(name, {})[key] = pair
        return out


def as_pairs(accs: Sequence[torch.Tensor]) -> List[List[int]]:
    """Many digests as pairs of unsigned 64-bit integers (what records store and compare), moved off
    their device at once."""
    if not accs:
        return []
    stacked = torch.stack([a.to(accs[0].device) for a in accs]).tolist()
    return [[v & MASK for v in row] for row in stacked]


def find_mismatch(saved: Dict, loaded: Dict) -> Optional[Tuple[str, str, object, object]]:
    """The first (name, tensor, saved digest, loaded digest) that differs between two ``result()``s
    (a digest present on one side only differs too), or None."""
    for name in sorted(set(saved) | set(loaded)):
        a, b = saved.get(name, {}), loaded.get(name, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return name, key, a.get(key), b.get(key)
    return None
