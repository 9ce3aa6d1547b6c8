"""Tokenizer, datasets and the resumable micro-batch iterator.

- ``ByteLevelTokenizer``: UTF-8 bytes are tokens 0..255, plus EOD and PAD. Nothing to download.
- ``MockGPTData``: deterministic, learnable sequences derived from (seed, sample index) only.
- ``build_gpt_datasets``: real data through megatron-core's indexed datasets and
  ``BlendedMegatronDatasetBuilder`` / ``GPTDataset``.
- ``MicroBatchIterator``: Megatron's pretraining sampler order, restartable from consumed samples.
"""

from __future__ import annotations

import os
from typing import Dict, List

import numpy as np
import torch

from megatron.training.errors import UserError
from megatron.core.tokenizers import MegatronTokenizerBase


class ByteLevelTokenizer(MegatronTokenizerBase):
    """Bytes 0..255, then special tokens EOD=256 and PAD=257."""

    NUM_BYTES = 256

    def __init__(self):
        super().__init__(path="byte-level", config={})
        self._eod = self.NUM_BYTES
        self._pad = self.NUM_BYTES + 1
        # megatron-core serializes this into its dataset cache key: keep it stable.
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:
        vocab = {chr(i) if 32 <= i < 127 else f"<0x{i:02X}>": i for i in range(self.NUM_BYTES)}
        vocab.update({"<eod>": self._eod, "<pad>": self._pad})
        return vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + 2

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte-level tokenizer has no chat template")

    def __repr__(self) -> str:
        return f"ByteLevelTokenizer(vocab_size={self.vocab_size})"


def build_tokenizer(args) -> ByteLevelTokenizer:
    if args.tokenizer_type != "ByteLevelTokenizer":
        raise UserError(f"--tokenizer-type: unsupported {args.tokenizer_type!r}")
    return ByteLevelTokenizer()


def padded_vocab_size(args, tokenizer) -> int:
    """--vocab-size if given (must hold the tokenizer), else padded as Megatron-LM does: up to a
    multiple of --make-vocab-size-divisible-by x TP."""
    if args.vocab_size is not None:
        if args.vocab_size < tokenizer.vocab_size:
            raise UserError(f"--vocab-size: {args.vocab_size} is smaller than the "
                             f"tokenizer's {tokenizer.vocab_size} tokens")
        if args.vocab_size % args.tensor_model_parallel_size:
            raise UserError("--vocab-size: must be divisible by --tensor-model-parallel-size")
        return args.vocab_size
    from megatron.training.model_arithmetic import vocab_size_with_padding

    return vocab_size_with_padding(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)


class MockGPTData(torch.utils.data.Dataset):
    """Arithmetic byte sequences (random start and stride per sample): learnable, so loss falls fast.

    Sample ``i`` depends only on (seed, i), so every rank and every restart sees the same data.
    """

    def __init__(self, seq_length: int, seed: int, num_samples: int = 1 << 30):
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, idx])
        start = int(rng.integers(0, 256))
        stride = int(rng.integers(1, 8))
        text = torch.from_numpy((start + stride * np.arange(self.seq_length + 1)) % 256).long()
        return {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }


def _split_string(split: str) -> str:
    return split.replace("/", ",")


def build_gpt_datasets(args, tokenizer, train_samples: int, eval_samples: int):
    """(train, valid) datasets: mock, or megatron-core GPTDatasets over --data-path."""
    if args.mock_data:
        return (MockGPTData(args.seq_length, args.seed),
                MockGPTData(args.seq_length, args.seed + 1))

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    for prefix in args.data_path:
        if prefix.replace(".", "", 1).isdigit():
            continue  # a weight
        for ext in (".bin", ".idx"):
            if not os.path.exists(prefix + ext):
                raise UserError(f"--data-path: {prefix + ext} does not exist "
                                 "(make it with tools/preprocess_data.py)")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        split=_split_string(args.split),
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    _drop_unused_or_empty_splits(config, eval_samples)
    train, valid, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, eval_samples, 0], lambda: True, config).build()
    return train, valid


def _drop_unused_or_empty_splits(config, eval_samples: int) -> None:
    """Build only the splits we read, and none that holds no documents.

    megatron-core 0.16.1 loops forever in GPTDataset._get_num_epochs when a split with a non-zero
    weight gets no documents (a small corpus with the default 969,30,1 split). Setting a split's
    range to None skips it and keeps the others' document boundaries unchanged.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = config.split_matrix
    num_docs = [IndexedDataset(prefix, mmap=True).document_indices.shape[0] - 1
                for prefix in config.blend[0]]

    def empty(i):
        beg, end = matrix[i]
        return any(int(round(end * n)) <= int(round(beg * n)) for n in num_docs)

    if matrix[0] is None or empty(0):
        raise UserError(f"--split: {config.split!r} leaves the training split with "
                         f"no documents (the corpus has {min(num_docs)})")
    if matrix[1] is not None and (eval_samples == 0 or empty(1)):
        matrix[1] = None
    matrix[2] = None  # the test split is never read


class MicroBatchIterator:
    """Yields this data-parallel rank's micro-batches in Megatron's sampler order.

    Global step g covers samples [g*gbs, (g+1)*gbs); within it, micro-batch m of DP rank r is
    ``mbs`` consecutive samples starting at g*gbs + m*mbs*dp + r*mbs. Restart by passing the
    consumed-sample count. Datasets shorter than the run wrap around.
    """

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.next_sample = consumed_samples
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        first = self.next_sample + self.dp_rank * self.mbs
        self.next_sample += self.mbs * self.dp_size
        n = len(self.dataset)
        samples = [self.dataset[(first + k) % n] for k in range(self.mbs)]
        return torch.utils.data.default_collate(samples)
