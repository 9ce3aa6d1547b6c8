"""Datasets and the resumable micro-batch iterator.

- Tokenizers live in ``tokenizers`` (re-exported here for older imports).
- ``MockGPTData``: deterministic, learnable sequences derived from (seed, sample index) only.
- ``build_gpt_datasets``: real data through megatron-core's indexed datasets and
  ``BlendedMegatronDatasetBuilder`` / ``GPTDataset``.
- ``MicroBatchIterator``: Megatron's pretraining sampler order, restartable from consumed samples.
- ``micro_batches``: the same order loaded by --num-workers DataLoader processes (workers only move
  the reading and collating out of the rank, so the batches are the same for any count).
"""

from __future__ import annotations

import gc
import os
from typing import Dict

import numpy as np
import torch

from megatron.training.data.byte_level_tokenizer import ByteLevelTokenizer  # noqa: F401 (re-export)
from megatron.training.errors import UserError
from megatron.training.data.token_range import VocabCheckedDataset, check_token_ids
from megatron.training.data.tokenizers import (build_tokenizer, padded_vocab_size,  # noqa: F401 (re-export)
                                          vocab_size_before_padding)


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
    vocab_size = vocab_size_before_padding(args, tokenizer)
    tokenizer_name = args.tokenizer_type or type(tokenizer).__name__
    if args.mock_data:  # bytes: a vocabulary under 256 (NullTokenizer) gets the one-line error
        return tuple(VocabCheckedDataset(MockGPTData(args.seq_length, seed), vocab_size, tokenizer_name)
                     for seed in (args.seed, args.seed + 1))

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    per_split = [("--train-data-path", args.train_data_path), ("--valid-data-path", args.valid_data_path),
                 ("--test-data-path", args.test_data_path)] if args.train_data_path else None
    for flag, prefixes in per_split or [("--data-path", args.data_path)]:
        for prefix in prefixes or ():
            if prefix.replace(".", "", 1).isdigit():
                continue  # a weight
            for ext in (".bin", ".idx"):
                if not os.path.exists(prefix + ext):
                    raise UserError(f"{flag}: {prefix + ext} does not exist "
                                     "(make it with tools/preprocess_data.py)")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if per_split else get_blend_from_list(args.data_path),
        # the test split is never read: none built
        blend_per_split=[get_blend_from_list(prefixes) if k < 2 else None for k, (_, prefixes) in enumerate(per_split)]
        if per_split else None,
        split=None if per_split else _split_string(args.split),
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),  # --no-mmap-bin-files reads them instead
        num_dataset_builder_threads=args.num_dataset_builder_threads,
    )
    if per_split:
        check_token_ids(config.blend_per_split[0][0], vocab_size, tokenizer_name)
        if eval_samples == 0:
            config.blend_per_split[1] = None  # not read: not built
    else:
        check_token_ids(config.blend[0], vocab_size, tokenizer_name)
        _drop_unused_or_empty_splits(config, eval_samples)
    train, valid, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, eval_samples, 0], lambda: True, config).build()
    return tuple(None if ds is None else VocabCheckedDataset(ds, vocab_size, tokenizer_name)
                 for ds in (train, valid))


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


class MegatronOrderSampler(torch.utils.data.Sampler):
    """Index lists of this DP rank's micro-batches, the same as MicroBatchIterator's, forever."""

    def __init__(self, dataset_size: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.n = dataset_size
        self.next_sample = consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        while True:
            first = self.next_sample + self.dp_rank * self.mbs
            self.next_sample += self.mbs * self.dp_size
            yield [(first + k) % self.n for k in range(self.mbs)]


def loader_generator(seed: int, consumed_samples: int, dp_rank: int) -> torch.Generator:
    """A generator for the DataLoader's own draws (its workers' base seed): a function of the
    run's seed, where in the data the loader starts and the rank, never of the global RNG.

    Losses must not depend on the worker count nor on where a run was resumed: without a generator
    of its own a DataLoader iterator draws its workers' base seed from torch's global CPU generator,
    which shifts the stream dropout draws from (at another point on a resume, where iterators are
    made again)."""
    mixed = ((int(seed) * 1_000_003 + int(consumed_samples)) * 65_537 + int(dp_rank)) % (2**63)
    return torch.Generator().manual_seed(mixed)


def keep_inherited_objects_shared(worker_id: int) -> None:
    """A forked data worker's first act: the objects it inherited from the rank go to gc's permanent generation
    (moving them touches only the lists' ends), so its collections never write their headers, and the rank's
    Python heap (large after torch's and megatron-core's imports: docs/design.md, the ``data/datasets.py`` row)
    stays shared, not copied into each worker."""
    gc.freeze()


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  num_workers: int, seed: int = 0):
    if num_workers == 0:
        return MicroBatchIterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)
    sampler = MegatronOrderSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=torch.utils.data.default_collate,
                                         worker_init_fn=keep_inherited_objects_shared,
                                         generator=loader_generator(seed, consumed_samples, dp_rank))
    freeze_before_fork()
    return iter(loader)  # forks the workers


def freeze_before_fork() -> None:
    """The rank's side of ``keep_inherited_objects_shared``, before it forks its workers: its own objects go to
    gc's permanent generation too, so its later collections do not write the headers of objects its workers share
    (each write copies the page, and the workers' old copy then costs memory of its own). Garbage cycles are
    collected first: frozen, they would stay for the run."""
    gc.collect()
    gc.freeze()
