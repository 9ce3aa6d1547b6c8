"""Process entry points for the multi-process tests (importable by the worker processes)."""

import multiprocessing as mp
import os
import time

import torch


def context():
    """Worker processes forked from a server that imported torch and this module once (a fresh
    interpreter each, as 'spawn' gives, costs seconds of imports per process); the server itself
    never ran a test, so no thread or lock of the test process is forked."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def hold_token(tier_path, lock_root, ready, hold_s):
    from mlp_offload.tiers.tokens import TierTokens

    tokens = TierTokens(tier_path, 1, lock_root=lock_root)
    tokens.acquire()
    ready.set()
    time.sleep(hold_s)  # killed here in the dead-holder test
    tokens.release()


def hold_tokens_then_block(paths, lock_root, ready):
    """A rank that takes the tokens of every path and then hangs there until it is killed."""
    from mlp_offload.tiers.tokens import TierTokens

    held = [TierTokens(p, 1, lock_root=lock_root) for p in paths]
    for tokens in held:
        tokens.acquire()
    ready.set()
    time.sleep(600)


def engine_matches_adamw(tier_path, lock_root, rank, steps, result_queue, second_path=None, started=None):
    """One 'rank' of a node: its own shard on the shared path(s), checked against torch AdamW."""
    torch.set_num_threads(1)
    from mlp_offload import OffloadConfig, OffloadedAdamW

    paths = {"nvme": tier_path, **({"pfs": second_path} if second_path else {})}
    cfg = OffloadConfig(tiers=list(paths), paths=paths, subgroup_size=20_000,
                        io_block_bytes=64 * 1024, io_threads=2, bandwidths={t: (1e9, 1e9) for t in paths},
                        adam_elems_per_s=1e9, run_id="shared", rank=rank, cache_alternating=False,
                        lock_dir=lock_root)
    gen = torch.Generator().manual_seed(rank)
    init = torch.randn(100_000, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, fused=True)
    token_wait = 0.0
    with OffloadedAdamW(init.clone(), cfg, lr=1e-3) as eng:
        if started is not None:
            started.put(rank)
        for _ in range(steps):
            grad = torch.randn(100_000, generator=gen).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            rec = eng.step()
            token_wait += sum(t.token_wait_s for t in rec.tiers.values())
            ref.grad = grad.float()
            opt.step()
        params = torch.cat([p.clone() for _, p, _, _ in eng.iter_state()])
    result_queue.put((rank, torch.equal(params, ref.detach()), token_wait))


def take_turns(tier_path, lock_root, store_port, rounds, marker_dir, errors):
    """A 'rank' that joins the path's tokens afresh each round, holds its single token briefly and
    leaves (the last one out removes the lock directory): nobody may ever be inside with it.
    With ``store_port``, the tokens are the job's (a TCPStore) instead of the node's."""
    from mlp_offload.tiers.tokens import JobTokens, TierTokens

    marker = os.path.join(marker_dir, "inside")
    store = None if store_port is None else torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False)
    for _ in range(rounds):
        tokens = TierTokens(tier_path, 1, lock_root=lock_root) if store is None else JobTokens(tier_path, 1, store)
        with tokens:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                errors.put("two holders of one token")
                return
            time.sleep(0.001)
            os.unlink(marker)
        tokens.close()
