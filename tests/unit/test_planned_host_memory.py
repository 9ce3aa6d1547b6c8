"""The planner's host memory for a rank (the engine's buffers, its data workers) against the peak
measured on CPU: the summed proportional memory of a rank-like process and all its children while
it builds the engine, its data workers live and it takes steps. Within 10%."""

import subprocess
import sys
import time
from pathlib import Path

from megatron.training.runtime.host_memory import beside_engine
from mlp_offload import OffloadConfig
from mlp_offload.plan.capacity import plan_engine
from mlp_offload.plan.prediction import MeasuredRates
from tests.proc_memory import PeakSampler, tree_pss_bytes

REPO = Path(__file__).resolve().parents[2]
NUMEL, SUBGROUP, WORKERS = 60_000_000, 5_000_000, 2
OPTIONS = dict(tiers=["host"], subgroup_size=SUBGROUP, adam_elems_per_s=1e9, run_id="plan-peak",
               state_dtypes=("fp32", "bf16", "bf16"))

RANK = f"""
import sys, torch
from megatron.training.data.datasets import MockGPTData
from megatron.training.data.datasets import micro_batches
from mlp_offload import ModelLink, OffloadConfig, OffloadedAdamW
params = torch.randn({NUMEL})  # the model's: held before the engine, as in a rank
grads = torch.randn({NUMEL}).to(torch.bfloat16)
print("ready", flush=True); sys.stdin.readline()
batches = micro_batches(MockGPTData(1024, 1), 0, 4, 0, 1, num_workers={WORKERS}, seed=1)
next(batches)
engine = OffloadedAdamW(params, OffloadConfig(**{OPTIONS!r}), model=ModelLink(grad_dtype=torch.bfloat16))
for _ in range(2):
    engine.grad_buffer.copy_(grads)
    engine.step()
    next(batches)
print("done", flush=True); sys.stdin.readline()
"""


def test_planned_host_memory_is_the_measured_peak():
    plan = plan_engine(NUMEL, OffloadConfig(**OPTIONS), MeasuredRates({}, 1e9, 1e9), {}, 1, host_grad_itemsize=2)
    planned = plan.host_bytes + beside_engine(WORKERS, 0)["data workers"]
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        baseline = tree_pss_bytes(rank.pid)
        with PeakSampler(rank.pid, interval_s=0.05) as sampler:
            rank.stdin.write("\n")
            rank.stdin.flush()
            assert rank.stdout.readline().strip() == "done"
            time.sleep(0.3)
        rank.stdin.write("\n")
        rank.stdin.flush()
        assert rank.wait(timeout=60) == 0
    finally:
        rank.kill()
    measured = sampler.peak - baseline
    assert abs(measured - planned) <= 0.1 * planned, \
        (measured / 2**20, planned / 2**20, f"baseline {baseline / 2**20:.1f} MiB", sampler.at_peak())
