"""Ranks of several "nodes" streaming through one shared path: turns per node or across the job?

    python benchmarks/token_scope.py --path /lustre/$USER/bench --nodes 2 --ranks 2 --mb 256 --ops 8

Starts nodes x ranks processes on this machine, each writing then reading ``ops`` files of ``mb``
MB through the engine's FileTier (O_DIRECT where possible) in its own namespace on ``--path``,
taking one I/O token per operation: with no tokens, with the tokens of each node (node-local locks,
one lock directory per simulated node), or with the tokens of the whole job (a TCPStore counter).
Prints the aggregate rate and the mean time each rank waited for a token, per scope. Run it where
the nodes really are different machines to see a parallel file system's behaviour; on one machine
it shows one device's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(args, scope, node, rank, port, lock_root, barrier, results):
    import torch

    from mlp_offload import FileIo, FileTier, TierOwner
    from mlp_offload import HostMemory
    from mlp_offload import JobTokens, TierTokens

    torch.set_num_threads(1)
    tier = FileTier("bench", args.path, TierOwner(f"scope-{scope}", rank), FileIo(8 << 20, 2, op_threads=2))
    if scope == "node":
        tier.tokens = TierTokens(args.path, args.tokens, lock_root=os.path.join(lock_root, f"node{node}"))
    elif scope == "job":
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
        tier.tokens = JobTokens(args.path, args.tokens, store)
    buf = HostMemory(None, pin=False).allocate(args.mb << 20, "bench", counted=False)
    barrier.wait()
    start = time.time()
    waited = sum(tier.submit_write(f"f{i}", [(0, buf)]).result().token_wait_s for i in range(args.ops))
    waited += sum(tier.submit_read(f"f{i}", [(0, buf)]).result().token_wait_s for i in range(args.ops))
    results.put((start, time.time(), waited))
    if tier.tokens is not None:
        tier.tokens.close()
    tier.close()


def run(args, scope: str) -> dict:
    ctx = mp.get_context("spawn")
    procs, port = args.nodes * args.ranks, None
    store = None
    if scope == "job":
        import torch

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    with tempfile.TemporaryDirectory() as lock_root:
        workers = [ctx.Process(target=_rank, args=(args, scope, n, n * args.ranks + r, port, lock_root, barrier,
                                                   results))
                   for n in range(args.nodes) for r in range(args.ranks)]
        for w in workers:
            w.start()
        spans = [results.get(timeout=1800) for _ in workers]
        for w in workers:
            w.join()
    del store
    seconds = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    moved = 2 * procs * args.ops * (args.mb << 20)
    return {"scope": scope, "GB/s": round(moved / seconds / 1e9, 3), "seconds": round(seconds, 2),
            "mean token wait s": round(sum(w for _, _, w in spans) / procs, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per node")
    p.add_argument("--tokens", type=int, default=1, help="tokens per path (per node or per job)")
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--ops", type=int, default=8)
    p.add_argument("--scopes", default="none,node,job")
    args = p.parse_args()
    for scope in args.scopes.split(","):
        print(json.dumps(run(args, scope)), flush=True)


if __name__ == "__main__":
    main()
