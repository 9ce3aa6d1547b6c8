"""checkpoint/: one engine's offloaded state in a single checkpoint file. The file's layout and its
loading (``state_file``; its fixed parts and errors in ``file_format``, reading ranges of it in
``range_reader``), writing it from a snapshot, synchronously or by a thread (``write``); subgroups it takes by hard link
from their tier files (``parts``); megatron-core's forked writer's files paced behind the tiers (``paced_flush``: the
fsyncs and the pacing's plan; ``paced_file``: each file written as it comes).

This package is a face of the engine: code outside it imports these names from here. May import the
engine's other modules (the engine itself only for its type); none of them imports this package."""

from ..kernels.blockwise8 import BlockLayout, Quantized, quantize
from ..kernels.remainders import merge as merge_remainders
from ..state_formats import describe as describe_formats, is_blockwise
from .digest import MASK, TENSORS, StateDigest, add_pairs, as_pairs, find_mismatch
from .digest import digest as tensor_digest  # the module keeps its name: ``digest`` stays the submodule
from .file_blocks import FileBlocks, moments_change, note_moments_change, values_fill
from .file_format import MAGIC, TRAILER, CheckpointDataError, CheckpointSaveError
from .file_format import SUFFIX as STATE_FILE_SUFFIX
from .paced_file import read_report as read_flush_report
from .paced_flush import FlushPacing, flush_pacing
from .paced_flush import install as install_paced_fsync
from .paced_flush import uninstall as uninstall_paced_fsync
from .pacing import reserve_paced_staging
from .parts import is_part_path
from .range_reader import RangeReader
from .state_file import (StateFile, fill_engine, human_bytes, load_engine_state, read_footer, state_file_bytes,
                         stored_codecs, subgroups_file_bytes)
from .write import BackgroundStateWrite, free_bytes, save_engine_state, start_background_save, write_snapshot

__all__ = ["MAGIC", "TRAILER", "STATE_FILE_SUFFIX", "CheckpointDataError", "CheckpointSaveError", "RangeReader", "StateFile",
           "fill_engine", "human_bytes", "load_engine_state", "read_footer", "state_file_bytes", "stored_codecs",
           "subgroups_file_bytes", "FileBlocks", "moments_change", "note_moments_change", "values_fill",
           "BackgroundStateWrite", "free_bytes", "save_engine_state", "start_background_save", "write_snapshot",
           "merge_remainders", "BlockLayout", "Quantized", "quantize", "describe_formats", "is_blockwise",
           "MASK", "TENSORS", "StateDigest", "add_pairs", "as_pairs", "tensor_digest", "find_mismatch",
           "is_part_path", "FlushPacing", "flush_pacing", "read_flush_report", "install_paced_fsync",
           "uninstall_paced_fsync", "reserve_paced_staging"]
