"""What rank 0 prints about the job and about each node; the rest stays in each rank's own log.

Per job (rank 0): ranks, nodes and the offload swap namespace's run id. Per node (rank 0, gathered
from all ranks): host, its ranks, and its file tiers' measured rates and I/O tokens (the probe is
per host and path, so they are the same for every rank of a node). Per rank: the engine's own
placement line, on that rank's stderr, which a launcher keeps apart (torchrun --log-dir ... --tee 3
--local-ranks-filter 0, as examples/slurm does); no rank repeats the per-node line.
"""

from __future__ import annotations

import logging
from itertools import groupby
from typing import Dict, List, Tuple

import torch

from megatron.training.runtime.slurm_env import node_key
from mlp_offload import PER_NODE


class PerNodeByRank0(logging.Filter):
    """For the engine's log handler: drop what ``report`` prints once for every node."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, PER_NODE, False)


def _ranks(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs = []
    for _, run in groupby(enumerate(sorted(ranks)), key=lambda pair: pair[1] - pair[0]):
        values = [r for _, r in run]
        runs.append(str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}")
    return ",".join(runs)


def report(optimizer) -> None:
    """Gather every rank's node facts; rank 0 prints the job's and one line per node."""
    from megatron.training.offload.optimizer import OffloadDistributedOptimizer

    engine = optimizer.engine if isinstance(optimizer, OffloadDistributedOptimizer) else None
    node, host = node_key()  # two launches on one machine are two nodes (tests)
    mine = {"host": host, "node": node, "rank": torch.distributed.get_rank(),
            "tiers": engine.describe_tiers() if engine is not None else "",
            "run_id": engine.config.resolved_run_id() if engine is not None else None}
    facts: List[Dict] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(facts, mine)
    if mine["rank"] != 0:
        return
    nodes: Dict[Tuple[str, str], List[Dict]] = {}
    for fact in facts:
        nodes.setdefault((fact["node"], fact["host"]), []).append(fact)
    run_ids = {fact["run_id"] for fact in facts}
    namespace = ""
    if engine is not None:
        namespace = (f" | offload swap namespace: mlp_offload/{run_ids.pop()}/ in each tier path" if len(run_ids) == 1
                     else " | offload swap namespaces: one per process (no SLURM or torchrun run id)")
    print(f"> job: {len(facts)} ranks on {len(nodes)} node(s){namespace}", flush=True)
    for (node, host), entries in nodes.items():
        tiers = entries[0]["tiers"]
        print(f"> node {node + ' ' if node else ''}{host}: ranks {_ranks([e['rank'] for e in entries])}"
              + (f" | offload tiers: {tiers}" if tiers else ""), flush=True)
