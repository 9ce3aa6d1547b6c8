"""Split/merge of 16-bit master remainders on the GPU against the CPU, bit for bit: random fp32
bit patterns (negatives, subnormals, infinities, values near bf16's largest) and the round trip.
Run: python3 benchmarks/experiments/remainders_roundtrip.py   (on a CUDA machine; prints one line)"""

import torch

from mlp_offload import merge_remainders as merge, split_remainders as split

gen = torch.Generator().manual_seed(0)
n = 1 << 24
bits = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.3895e38, -3.3895e38, float("inf"), -float("inf"), 1.0, -1.0])
master = torch.cat([bits.view(torch.float32), special])
finite_high = ~torch.isnan(master.view(torch.int32).bitwise_right_shift(16).to(torch.int16).view(torch.bfloat16))
master = master[finite_high]
rem_cpu, high_cpu = split(master)
device = "cuda" if torch.cuda.is_available() else "cpu"
rem_dev, high_dev = split(master.to(device))
same_split = torch.equal(rem_dev.cpu(), rem_cpu) and torch.equal(high_dev.cpu().view(torch.int16), high_cpu.view(torch.int16))
back = merge(high_dev, rem_dev).cpu()
round_trip = torch.equal(back.view(torch.int32), master.view(torch.int32))
print(f"remainders on {device}: {master.numel()} fp32 patterns; split equal to the CPU's: {same_split}; "
      f"merge(split(x)) == x bit for bit: {round_trip}")
