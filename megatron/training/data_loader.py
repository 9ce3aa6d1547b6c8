"""Micro-batches in Megatron's sampler order, loaded by --num-workers DataLoader processes.

The order is ``data.MicroBatchIterator``'s (restartable from the consumed-sample count); workers
only move the reading and collating out of the rank, so the batches are the same for any count.

Losses must not depend on the worker count nor on where a run was resumed: a DataLoader iterator
draws its workers' base seed from torch's *global* CPU generator unless it is given its own, which
would shift the stream dropout draws from (and at a different point on a resume, where iterators
are made again). Each loader gets a generator of its own, seeded from the run's seed, the position
in the data and the rank, so no global random state is consumed.
"""

from __future__ import annotations

import torch

from megatron.training.data import MicroBatchIterator


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
    run's seed, where in the data the loader starts and the rank, never of the global RNG."""
    mixed = ((int(seed) * 1_000_003 + int(consumed_samples)) * 65_537 + int(dp_rank)) % (2**63)
    return torch.Generator().manual_seed(mixed)


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  num_workers: int, seed: int = 0):
    if num_workers == 0:
        return MicroBatchIterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)
    sampler = MegatronOrderSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=torch.utils.data.default_collate,
                                         generator=loader_generator(seed, consumed_samples, dp_rank))
    return iter(loader)
