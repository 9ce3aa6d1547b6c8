"""Token ids in --data-path files must lie inside the vocabulary.

A .bin/.idx made with another tokenizer (GPT-2 ids, say, read with the byte-level one) otherwise
ends deep in the embedding as ``IndexError: index out of range``. Before training, each file is
scanned (all of it up to SCAN_BYTES, evenly spread windows beyond); while training, every sample
is checked too, which catches what the windows of a huge file missed.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from megatron.training.errors import UserError

SCAN_BYTES = 1 << 30  # per file: a full scan of bigger files would delay every start
SCAN_WINDOWS = 64


def check_token_ids(prefixes: Iterable[str], vocab_size: int, tokenizer_name: str) -> None:
    """One line naming the first file whose largest token id is outside [0, vocab_size)."""
    for prefix in prefixes:
        largest, whole = max_token_id(prefix)
        if largest >= vocab_size:
            raise UserError(_beyond_message(prefix, largest, vocab_size, tokenizer_name,
                                            "" if whole else " (in the part scanned)"))


def max_token_id(prefix: str, scan_bytes: int = SCAN_BYTES):
    """(largest token id in PREFIX.bin, whether the whole file was read)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dtype = IndexedDataset(prefix, mmap=True).index.dtype
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if tokens.size == 0:
        return -1, True
    if tokens.nbytes <= scan_bytes:
        return int(tokens.max()), True
    window = max(1, scan_bytes // tokens.itemsize // SCAN_WINDOWS)
    starts = np.linspace(0, tokens.size - window, SCAN_WINDOWS, dtype=np.int64)
    return max(int(tokens[s:s + window].max()) for s in starts), False


class VocabCheckedDataset(torch.utils.data.Dataset):
    """Passes samples through, raising the one-line error for a token id beyond the vocabulary."""

    def __init__(self, dataset, vocab_size: int, tokenizer_name: str):
        self.dataset = dataset
        self.vocab_size = vocab_size
        self.tokenizer_name = tokenizer_name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx):
        sample = self.dataset[idx]
        largest = max(int(sample["tokens"].max()), int(sample["labels"].max()))
        if largest >= self.vocab_size:
            raise UserError(_beyond_message(_source_of(self.dataset, idx), largest, self.vocab_size,
                                            self.tokenizer_name, f" (sample {idx})"))
        return sample


def _source_of(dataset, idx) -> str:
    """The .bin/.idx prefix sample ``idx`` comes from (through a blend, if any)."""
    if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):
        dataset = dataset.datasets[int(dataset.dataset_index[idx])]
    return getattr(getattr(dataset, "dataset", None), "path_prefix", "the data")


def _beyond_message(source, largest, vocab_size, tokenizer_name, where="") -> str:
    return (f"--data-path: {source} holds token id {largest}{where}, beyond the {tokenizer_name} "
            f"vocabulary of {vocab_size} tokens: pass the --tokenizer-type (and its files) "
            "the data was made with")
