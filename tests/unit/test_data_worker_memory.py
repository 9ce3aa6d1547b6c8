"""A forked data worker of ``micro_batches`` keeps the rank's Python heap shared: a full collection in the worker
would otherwise write every inherited object's header and copy the heap's pages into the worker (about 0.1 GiB
here, after torch's and megatron-core's imports), more than the planner's figure for a worker."""

import gc

import torch

from megatron.training.data.datasets import micro_batches
from megatron.training.runtime.host_memory import DATA_WORKER_BYTES

MiB = 2**20


def private_dirty_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty:"))


class CollectingSamples(torch.utils.data.Dataset):
    """Each sample: the bytes its worker process wrote to pages of its own across a full collection."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        before = private_dirty_bytes()
        gc.collect()
        return torch.tensor([private_dirty_bytes() - before], dtype=torch.int64)


def collection_growth(loader_iterator) -> int:
    return int(next(loader_iterator).max())


def test_a_workers_full_collection_copies_none_of_the_ranks_heap():
    heap = [dict(a=[i]) for i in range(200_000)]  # a rank's objects, enough to show any copying plainly
    ours = collection_growth(micro_batches(CollectingSamples(), 0, 2, 0, 1, num_workers=2))
    # the same loader without the worker's first act: the reference that the copying is real here
    plain = torch.utils.data.DataLoader(CollectingSamples(), batch_size=2, num_workers=2)
    reference = collection_growth(iter(plain))
    del heap
    assert reference > DATA_WORKER_BYTES, f"the reference worker copied only {reference / MiB:.1f} MiB"
    assert ours < 0.25 * DATA_WORKER_BYTES, (ours / MiB, reference / MiB)
