"""Process entry points for the multi-process tests (importable under the 'spawn' start method)."""

import os
import time

import torch


def hold_token(tier_path, lock_root, ready, hold_s):
    from mlp_offload.tiers.tokens import TierTokens

    tokens = TierTokens(tier_path, 1, lock_root=lock_root)
    tokens.acquire()
    ready.set()
    time.sleep(hold_s)  # killed here in the dead-holder test
    tokens.release()


def engine_matches_adamw(tier_path, lock_root, rank, steps, result_queue):
    """One 'rank' of a node: its own shard on the shared path, checked against torch AdamW."""
    os.environ["MLP_OFFLOAD_LOCK_DIR"] = lock_root
    torch.set_num_threads(1)
    from mlp_offload import OffloadConfig, OffloadedAdamW

    cfg = OffloadConfig(tiers=["nvme"], paths={"nvme": tier_path}, subgroup_size=20_000,
                        io_block_bytes=64 * 1024, io_threads=2, bandwidths={"nvme": (1e9, 1e9)},
                        adam_elems_per_s=1e9, run_id="shared", rank=rank, cache_alternating=False)
    gen = torch.Generator().manual_seed(rank)
    init = torch.randn(100_000, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, fused=True)
    token_wait = 0.0
    with OffloadedAdamW(init.clone(), cfg, lr=1e-3) as eng:
        for _ in range(steps):
            grad = torch.randn(100_000, generator=gen).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            rec = eng.step()
            token_wait += rec.tiers["nvme"].token_wait_s
            ref.grad = grad.float()
            opt.step()
        params = torch.cat([p.clone() for _, p, _, _ in eng.iter_state()])
    result_queue.put((rank, torch.equal(params, ref.detach()), token_wait))
