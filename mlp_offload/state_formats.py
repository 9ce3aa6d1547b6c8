"""The stored form of each optimizer state tensor (master params, exp_avg, exp_avg_sq): one codec
class per format, asked by every layer (the kernels' dispatch, the tiers' sizes, the checkpoint
files, the planner, the start-up line).

A format narrower than fp32 is widened to fp32 for the update and rounded back after it
(round-to-nearest-even, as ``Tensor.to`` does): fewer bytes per parameter in every tier, the same
fp32 AdamW arithmetic. ``unpack``/``pack`` are that widening and rounding (the multi-pass path and
the reference every one-pass kernel is checked against); ``kernel_key`` is what the one-pass
kernels dispatch on. Adding a format is one class here and its kernels.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from .kernels.blockwise8 import FORMATS, CodeFormat, Quantized
from .kernels.remainders import merge, split_

STATE_TENSORS = ("param", "exp_avg", "exp_avg_sq")
FP32_STATE: Tuple[str, str, str] = ("fp32", "fp32", "fp32")


class UnsupportedStateDtype(ValueError):
    """A state dtype the engine cannot store (e.g. fp8)."""


class StateCodec:
    """One stored format. Stored size: ``bytes_per_element`` per element, plus, for a blockwise
    format, ``side_bytes_per_block`` (e.g. an fp32 scale) for each started block of ``block``
    elements. ``needs_high``: the format holds only part of a value, the rest is the model's bf16
    param (its "high half"), which ``unpack`` reads and ``pack`` writes."""

    name: str  # what a user asks for where it is user-named; ``describe()`` is the tag saved files carry
    storage_dtype: torch.dtype  # element dtype of the stored tensor (of its values, for a blockwise one)
    bytes_per_element: int
    block: int = 0  # elements per block that carries side bytes (0: none)
    side_bytes_per_block: int = 0
    needs_high: bool = False
    kernel_key: str  # what the one-pass kernels (fused_update, cpu_one_pass) dispatch on

    def stored_bytes(self, numel: int, blocks: Optional[int] = None) -> int:
        """Bytes ``numel`` elements take stored (before any alignment padding); ``blocks``: how
        many blocks a blockwise format's elements make (their layout's; default: whole blocks)."""
        return numel * self.bytes_per_element

    @property
    def bytes_per_param(self) -> float:
        """Stored bytes per element, side bytes spread over their block (for the planner)."""
        side = self.side_bytes_per_block / self.block if self.block else 0
        return self.bytes_per_element + side

    @property
    def is_fp32(self) -> bool:
        """Stored as the fp32 working form itself: updated in place, nothing to widen."""
        return self.storage_dtype == torch.float32 and not self.needs_high

    def describe(self) -> str:
        """The tag a checkpoint footer and the start-up line give it (``codec_for_tag`` reads it back)."""
        return self.name

    def empty(self, numel: int, device="cpu", pin_memory: bool = False, blocks: Optional[int] = None) -> torch.Tensor:
        return torch.empty(self.stored_bytes(numel, blocks) // self.storage_dtype.itemsize, dtype=self.storage_dtype,
                           device=device, pin_memory=pin_memory)

    def view(self, raw: torch.Tensor, numel: int, blocks: Optional[int] = None) -> torch.Tensor:
        """The stored tensor of ``numel`` elements over ``raw``, a uint8 region at least that large."""
        return raw[: self.stored_bytes(numel, blocks)].view(self.storage_dtype)

    def narrow(self, stored: torch.Tensor, numel: int, blocks: Optional[int] = None) -> torch.Tensor:
        """The first ``numel`` elements' stored tensor, of a stored tensor sized for at least as many."""
        return stored[:numel]

    def unpack(self, stored: torch.Tensor, out: Optional[torch.Tensor] = None, *,
               high: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
        """The fp32 values of ``stored`` (into ``out`` where given). ``high``: the bf16 high halves
        of a format that ``needs_high``, and only of one; ``layout``: a blockwise format's blocks."""
        self._check_high(high)
        out = torch.empty(stored.shape, dtype=torch.float32, device=stored.device) if out is None else out
        self._unpack(stored, out, high)
        return out

    def pack(self, fp32: torch.Tensor, out: Optional[torch.Tensor] = None, *,
             high: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
        """``fp32`` in the stored form (into ``out`` where given); ``fp32`` is left as it was.
        ``high`` receives the bf16 high halves of a format that ``needs_high``."""
        out = self.empty(fp32.numel(), fp32.device) if out is None else out
        self.pack_(fp32.clone() if self.needs_high else fp32, out, high=high)
        return out

    def pack_(self, fp32: torch.Tensor, out: torch.Tensor, *, high: Optional[torch.Tensor] = None,
              layout=None) -> None:
        """``pack`` into ``out``, free to use ``fp32``'s memory as scratch (it may be garbage after):
        the update's path, which spends its working copy."""
        self._check_high(high)
        self._pack(fp32, out, high)

    def _check_high(self, high: Optional[torch.Tensor]) -> None:
        if self.needs_high and high is None:
            raise ValueError(f"state format {self.name} needs the model's bf16 params (high) to pack or unpack")
        if not self.needs_high and high is not None:
            raise ValueError(f"state format {self.name} takes no high halves; high was given")

    def _unpack(self, stored, out, high) -> None:
        out.copy_(stored)

    def _pack(self, fp32, out, high) -> None:
        out.copy_(fp32)  # rounds to nearest even

    def __eq__(self, other) -> bool:  # by format, so a copy (e.g. unpickled) equals its original
        return type(other) is type(self) and other.describe() == self.describe()

    def __hash__(self) -> int:
        return hash(self.describe())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fp32(StateCodec):
    name, storage_dtype, bytes_per_element, kernel_key = "fp32", torch.float32, 4, "fp32"


class Bf16(StateCodec):
    name, storage_dtype, bytes_per_element, kernel_key = "bf16", torch.bfloat16, 2, "bf16"


class Fp16(StateCodec):
    name, storage_dtype, bytes_per_element, kernel_key = "fp16", torch.float16, 2, "fp16"


class Remainders16(StateCodec):
    """An fp32 master stored as its int16 low halves beside the model's bf16 param, which is its
    high half (megatron-core's ``store_param_remainders``; the bit arithmetic is ``remainders``'):
    lossless, 2 bytes per param. Not a dtype a user names: ``param_remainders`` asks for it."""

    name, storage_dtype, bytes_per_element, kernel_key = "rem16", torch.int16, 2, "rem16"
    needs_high = True

    def _unpack(self, stored, out, high) -> None:
        merge(high, stored, out=out)

    def _pack(self, fp32, out, high) -> None:
        split_(fp32, out, high)


class Blockwise8(StateCodec):
    """An Adam moment in 8 bits with one fp32 scale per block of ``block`` elements of each param
    (``kernels.blockwise8``: the arithmetic, the formats, the block layout). Stored as one uint8
    region: the codes, one byte per element at the element's own position, then (from the next
    multiple of 4 bytes) the blocks' scales in shard order. How many blocks a subgroup's elements
    make depends on where its params start and end (``subgroups.blocks``), so the sizes take
    ``blocks``; without it, whole blocks from the first element (one param). Not widened and rounded
    back as the element-wise formats are: the update's kernels read and write codes and scales in
    one pass (``step.eight_bit``); ``unpack``/``pack`` need the ``layout``."""

    storage_dtype, bytes_per_element, side_bytes_per_block, kernel_key = torch.uint8, 1, 4, "blockwise8"
    name = "fp8"  # megatron-core's flags name it so (--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8)

    def __init__(self, fmt: str, block: int = 128):
        if fmt not in FORMATS:
            raise ValueError(f"8-bit moment format {fmt!r}: expected one of {', '.join(FORMATS)}")
        self.fmt: CodeFormat = FORMATS[fmt]
        self.block = block

    def describe(self) -> str:
        return f"{self.fmt.name}-b{self.block}"

    def stored_bytes(self, numel: int, blocks: Optional[int] = None) -> int:
        blocks = -(-numel // self.block) if blocks is None else blocks
        return _scales_at(numel) + blocks * self.side_bytes_per_block

    @property
    def is_fp32(self) -> bool:
        return False

    def narrow(self, stored, numel, blocks=None):
        return stored[: self.stored_bytes(numel, blocks)]

    def split(self, stored: torch.Tensor, numel: int, blocks: Optional[int] = None) -> Quantized:
        """Codes and scales (views) of the stored region of ``numel`` elements in ``blocks`` blocks."""
        blocks = -(-numel // self.block) if blocks is None else blocks
        at = _scales_at(numel)
        return Quantized(stored[:numel].view(self.fmt.dtype), stored[at: at + 4 * blocks].view(torch.float32),
                         self.fmt)

    def unpack(self, stored, out=None, *, high=None, layout=None):
        from .kernels.blockwise8 import dequantize
        self._check_layout(layout)
        value = dequantize(self.split(stored, layout.numel, layout.blocks), layout)
        return value if out is None else out.copy_(value)

    def pack(self, fp32, out=None, *, high=None, layout=None):
        from .kernels.blockwise8 import quantize
        self._check_layout(layout)
        out = self.empty(layout.numel, fp32.device, blocks=layout.blocks) if out is None else out
        quantize(fp32, layout, self.fmt, out=self.split(out, layout.numel, layout.blocks))
        return out

    def pack_(self, fp32, out, *, high=None, layout=None):
        self.pack(fp32, out, layout=layout)

    def _check_layout(self, layout) -> None:
        if layout is None:
            raise ValueError(f"state format {self.describe()} needs its block layout to pack or unpack")

    def __repr__(self) -> str:
        return f"Blockwise8({self.fmt.name!r}, {self.block})"


def _scales_at(numel: int) -> int:
    """Where a blockwise region's scales start: after the codes, on a multiple of 4 bytes."""
    return (numel + 3) // 4 * 4


FP32, BF16, FP16, REMAINDERS16 = Fp32(), Bf16(), Fp16(), Remainders16()
# megatron-core's fp8 for each moment: e4m3 codes of the first, e4m3 codes of the second's root
# (half its exponent range), blocks of 128 (docs/design.md, "Adam moments in 8 bits").
FP8_MOMENTS = {"exp_avg": Blockwise8("e4m3"), "exp_avg_sq": Blockwise8("sqrt-e4m3")}

# Every stored format, by tag (what a checkpoint footer may name), and the ones a user may ask for
# in ``state_dtypes`` (fp8: the moment's own ``FP8_MOMENTS`` codec, ``codec_named``).
_BY_TAG: Dict[str, StateCodec] = {}
_USER_NAMED: Dict[str, StateCodec] = {}


def register(codec: StateCodec, user_named: bool) -> None:
    """Make ``codec`` known by its tag (checkpoint files), and by its name in ``state_dtypes`` where
    ``user_named``."""
    _BY_TAG[codec.describe()] = codec
    if user_named:
        _USER_NAMED[codec.name] = codec


def forget(codec: StateCodec) -> None:
    """Make ``codec`` unknown again, by its tag and its name (a format registered for a while)."""
    _BY_TAG.pop(codec.describe(), None)
    if _USER_NAMED.get(codec.name) == codec:
        del _USER_NAMED[codec.name]


for _codec in (FP32, FP16, BF16):
    register(_codec, user_named=True)
register(REMAINDERS16, user_named=False)
for _codec in FP8_MOMENTS.values():
    register(_codec, user_named=False)
_USER_NAMED["fp8"] = FP8_MOMENTS["exp_avg"]  # a name users give; which codec: by the moment (codec_named)

# Accepted spellings, e.g. megatron-core's torch dtypes or their names.
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.uint8: "fp8", "uint8": "fp8"}  # megatron-core's OptimizerConfig says fp8 moments as uint8


def dtype_name(value) -> str:
    """The short name (fp32, fp16, bf16) of a state dtype given as a name or a torch dtype."""
    name = _ALIASES.get(value, value)
    if isinstance(name, str) and name.startswith("torch."):
        name = _ALIASES.get(name[len("torch."):], name)
    if name not in _USER_NAMED:
        raise UnsupportedStateDtype(f"{value!r} is not supported ({_supported()})")
    return name


def _supported() -> str:
    """``fp32, fp16 or bf16`` (registration order)."""
    names = list(_USER_NAMED)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def codec_named(value, tensor: str = "exp_avg") -> StateCodec:
    """The codec of a state dtype a user names (a short name, a torch dtype or its name) for
    ``tensor`` (STATE_TENSORS): fp8 is a moment's own blockwise format, and no master's."""
    name = dtype_name(value)
    if name == "fp8":
        if tensor not in FP8_MOMENTS:
            raise UnsupportedStateDtype(f"fp8 is for the Adam moments only, not the {tensor}")
        return FP8_MOMENTS[tensor]
    return _USER_NAMED[name]


def is_blockwise(codecs: Sequence[StateCodec]) -> bool:
    """Whether the moments are stored blockwise (then both are: ``check_moments``)."""
    return any(c.block for c in codecs)


def codec_for_tag(tag) -> Optional[StateCodec]:
    """The codec a checkpoint footer's tag names, or None where it names none known."""
    return _BY_TAG.get(tag) if isinstance(tag, str) else None


def codecs_for(tags: Sequence[str]) -> Tuple[StateCodec, ...]:
    """The codecs of (param, exp_avg, exp_avg_sq) from their tags (all known: ``codec_for_tag``)."""
    codecs = tuple(codec_for_tag(t) for t in tags)
    if None in codecs:
        raise UnsupportedStateDtype(f"unknown stored state format in {list(tags)!r}")
    return codecs


def describe(codecs: Sequence[StateCodec]) -> str:
    """The formats of a whole state, for a start-up line (e.g. ``rem16/bf16/bf16``)."""
    return "/".join(c.describe() for c in codecs)


def state_bytes(codecs: Sequence[StateCodec], numel: int, blocks: Optional[int] = None) -> int:
    """Bytes the three tensors of ``numel`` elements take stored, unpadded."""
    return sum(c.stored_bytes(numel, blocks) for c in codecs)


def bytes_per_param(codecs: Sequence[StateCodec]) -> float:
    """Stored bytes per parameter of a whole state (an int for element-wise formats)."""
    total = sum(c.bytes_per_param for c in codecs)
    return int(total) if float(total).is_integer() else total
