"""A forked data worker of ``micro_batches`` keeps the rank's Python heap shared: a full collection in the worker,
or in the rank while the worker lives, would otherwise write every inherited object's header and copy the heap's
pages (about 0.1 GiB here, after torch's and megatron-core's imports), more than the planner's figure for a
worker."""

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


def compare_with_reference(growth, reference_loader, dataset) -> None:
    """``growth`` of a plain DataLoader's iterator (the reference: the copying is real here), then of
    ``micro_batches``' over the same ``dataset``, beside a heap of a rank's objects; the reference first, as
    micro_batches freezes this process's objects, which later workers inherit frozen."""
    heap = [dict(a=[i]) for i in range(200_000)]  # a rank's objects, enough to show any copying plainly
    try:
        plain = iter(reference_loader)
        reference = growth(plain)
        del plain  # its workers end: the rank's pages are its own again
        ours = growth(micro_batches(dataset, 0, 2, 0, 1, num_workers=2))
    finally:
        gc.unfreeze()  # this test process's objects collectable again (heap among them)
    del heap
    assert reference > DATA_WORKER_BYTES, f"the reference copied only {reference / MiB:.1f} MiB"
    assert ours < 0.25 * DATA_WORKER_BYTES, (ours / MiB, reference / MiB)


def test_a_workers_full_collection_copies_none_of_the_ranks_heap():
    # the reference loader lacks the worker's first act (keep_inherited_objects_shared)
    compare_with_reference(collection_growth,
                           torch.utils.data.DataLoader(CollectingSamples(), batch_size=2, num_workers=2),
                           CollectingSamples())


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([index])


def rank_collection_growth(loader_iterator) -> int:
    """What a full collection in this process (the rank) copies of its pages while its workers live."""
    next(loader_iterator)  # the workers are forked and alive
    before = private_dirty_bytes()
    gc.collect()
    return private_dirty_bytes() - before


def test_the_ranks_own_collections_copy_none_of_what_its_workers_inherited():
    # the reference loader leaves the rank's objects in its collections (no freeze before the fork)
    compare_with_reference(rank_collection_growth,
                           torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2), Numbers())
