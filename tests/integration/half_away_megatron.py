"""pretrain_gpt.py with megatron-core's own distributed optimizer changed in one place: its fp32 main
params go to the bf16 model params rounded half away from zero (as transformer-engine's FusedAdam
stores remainders) instead of to nearest even. The reference of test_remainders_cpu: the offload
engine's default keeps the same fp32 master as megatron-core and gives the model that rounding.

Run in place of pretrain_gpt.py (under torchrun): ``half_away_megatron.py <pretrain_gpt.py's flags>``.
"""

import runpy
import sys
from pathlib import Path

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

PRETRAIN = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"


def round_half_away(master: torch.Tensor) -> torch.Tensor:
    """bf16 of an fp32 tensor, ties away from zero: the high 16 bits, plus one where the low 16 bits
    are >= 0x8000 (written here independently of mlp_offload.kernels.remainders)."""
    bits = master.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = (bits >> 16) + ((bits & 0xFFFF) >= 0x8000).to(torch.int64)
    high = high & 0xFFFF
    return torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16).view(torch.bfloat16)


_original = DistributedOptimizer._copy_main_params_to_model_params


def _copy_main_params_to_model_params(self):
    _original(self)  # everything else as megatron-core does it; then the bf16 params again, half away
    for main_group, model_group in zip(self.shard_fp32_from_float16_groups, self.model_float16_groups):
        for main, model_param in zip(main_group, model_group):
            world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
            data = self.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)
            assert data.dtype == torch.bfloat16
            data[world.start: world.end].copy_(round_half_away(main.view(-1)))


DistributedOptimizer._copy_main_params_to_model_params = _copy_main_params_to_model_params

if __name__ == "__main__":
    sys.argv[0] = str(PRETRAIN)
    sys.path.insert(0, str(PRETRAIN.parent))
    runpy.run_path(str(PRETRAIN), run_name="__main__")
