"""Build pretrain_gpt.py's model for each flag list on stdin (a JSON list of lists) in one CPU
process of world size 1 and print {parameter name: shape} per list as JSON: what the tests compare
with Megatron-LM's arithmetic."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    from megatron.core import parallel_state
    from megatron.training.runtime import cpu_compat
    from megatron.training.args.arguments import parse_args
    from megatron.training.data.datasets import build_tokenizer, padded_vocab_size
    from megatron.training.initialize import set_seeds
    from megatron.training.model.configs import transformer_config
    from pretrain_gpt import model_provider

    cpu_compat.apply()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    set_seeds(1234, torch.device("cpu"))  # megatron-core's weight init draws from its RNG tracker
    shapes = []
    for flags in json.load(sys.stdin):
        args = parse_args(flags)
        args.device_resolved = "cpu"
        args.padded_vocab_size = padded_vocab_size(args, build_tokenizer(args))
        model = model_provider(args, transformer_config(args))
        shapes.append({name: list(p.shape) for name, p in model.named_parameters()})
    print(json.dumps(shapes))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
