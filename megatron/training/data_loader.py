"""Micro-batches in Megatron's sampler order, loaded by --num-workers DataLoader processes.

The order is ``data.MicroBatchIterator``'s (restartable from the consumed-sample count); workers
only move the reading and collating out of the rank, so the batches are the same for any count.
"""

from __future__ import annotations

import torch

from megatron.training.data.datasets import MicroBatchIterator


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


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  num_workers: int):
    if num_workers == 0:
        return MicroBatchIterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)
    sampler = MegatronOrderSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=torch.utils.data.default_collate)
    return iter(loader)
