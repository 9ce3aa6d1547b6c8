"""What a rank holds in host memory beside the offload engine's buffers, for the start-up guard
(``mlp_offload.tiers.host.check_host_memory``, which adds up the node's ranks) and the planner.

Data workers are forked from the rank; the engine's buffers are left out of them (MADV_DONTFORK,
``mlp_offload.tiers.no_fork``), so a worker costs its own prefetched batches and the pages of the
rank it rewrites (Python's reference counts): about 13 MiB each measured on CPU with mock data
(tests/unit/test_planned_host_memory.py), counted at 32 MiB for larger batches and datasets.
"""

from __future__ import annotations

from typing import Dict

from mlp_offload import MiB, GiB, own_pss_bytes

DATA_WORKER_BYTES = 32 * MiB
# The planner's figure for a rank process on a GPU node before the engine allocates (torch, the
# CUDA context's host side, NCCL buffers): the guard measures it instead.
PROCESS_BYTES_GPU = 4 * GiB
PROCESS_BYTES_CPU = GiB // 2  # a CPU rank after its imports (about 0.33 GiB measured), model aside


def beside_engine(num_workers: int, process_bytes: int) -> Dict[str, int]:
    return {"process": int(process_bytes), "data workers": int(num_workers) * DATA_WORKER_BYTES}


def measured_beside_engine(num_workers: int) -> Dict[str, int]:
    """This rank's figures now: its own proportional memory, and its workers to come."""
    return beside_engine(num_workers, own_pss_bytes())
