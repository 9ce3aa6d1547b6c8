"""cpu_compat touches only the megatron-core modules it names (checked in a fresh process)."""

import subprocess
import sys

from launch import REPO

CHECK = r"""
import torch
from megatron.training.runtime import cpu_compat
from megatron.core.distributed import param_and_grad_buffer as pgb
from megatron.core.optimizer import distrib_optimizer
real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda
cpu_compat.apply(); cpu_compat.apply()  # idempotent
assert pgb.torch.cuda.current_device() == torch.device("cpu")
assert pgb.torch.zeros(2, device="cuda").device.type == "cpu"
assert pgb.torch.Tensor is torch.Tensor and pgb.torch.distributed is torch.distributed
assert torch.zeros(1).type() == "torch.FloatTensor"          # global torch untouched
assert torch.Tensor.type is real_type and torch.Tensor.cuda is real_cuda
assert distrib_optimizer.DistributedOptimizer.__init__.__cpu_compat__
with cpu_compat._cpu_tensors_report_cuda_types():
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float16).dtype == torch.float16  # casts unchanged
assert torch.Tensor.type is real_type
import megatron.core.tensor_parallel.random as r
state = torch.get_rng_state(); r._set_cuda_rng_state(r._get_cuda_rng_state(clone=True))
assert torch.equal(state, torch.get_rng_state())
print("ok")
"""


def test_cpu_compat_is_narrow():
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
