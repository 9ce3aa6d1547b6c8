"""Children of a rank (--num-workers DataLoader workers) must not cost a copy of the host cache.

The rank's update rewrites its host cache every step. Before the fix, workers forked after the
cache was allocated shared it copy-on-write, so each rewrite while they lived copied every page once
more (and pinned pages were copied at the fork): the tree's memory grew by the cache's size."""

import gc

import torch

from megatron.training.data.datasets import micro_batches
from mlp_offload.tiers.host import HostMemory
from tests.proc_memory import tree_pss_bytes

CACHE = 768 << 20  # a host cache large against the workers' own memory (torch's import, ~100s of MB)


class Tiny(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, idx):
        return {"tokens": torch.full((8,), idx)}


def _growth_while_workers_live(cache: torch.Tensor) -> int:
    cache.fill_(1)  # allocated and written, as the engine fills the state before training
    batches = micro_batches(Tiny(), 0, 2, 0, 1, num_workers=2, seed=1)
    next(batches)  # the workers are up
    before = tree_pss_bytes()
    cache.fill_(2)  # one update rewrites the cache while the workers live
    after = tree_pss_bytes()
    del batches  # stops the workers
    gc.unfreeze()  # micro_batches froze this test process's objects before the fork
    return after - before


def test_workers_cost_no_copy_of_the_host_cache():
    cache = HostMemory(CACHE, pin=False).allocate(CACHE, "cache")
    assert _growth_while_workers_live(cache) < 0.1 * CACHE


def test_an_ordinary_buffer_is_copied_which_is_what_the_test_detects():
    # The control: memory the allocator hands out is shared with forked workers copy-on-write.
    assert _growth_while_workers_live(torch.empty(CACHE, dtype=torch.uint8)) > 0.8 * CACHE
