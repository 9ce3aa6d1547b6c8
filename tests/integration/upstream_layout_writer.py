"""Rewrite one of this repo's plain checkpoints the way Megatron-LM's save_checkpoint lays out a
torch_dist checkpoint (run under torchrun with the training flags, plus ``--upstream-out DIR``).

Written from a reading of upstream's megatron/training/checkpointing.py (generate_state_dict,
get_rng_state, _build_sharded_state_dict_metadata), independently of this repo's checkpointing
module except for loading the source: keys 'args' (upstream's Namespace names, the data position
in consumed_train_samples), 'checkpoint_version' 3.0, 'iteration', 'model' (the unwrapped model's
sharded_state_dict), 'optimizer' (dp_reshardable), 'opt_param_scheduler', 'rng_state' (a
ShardedObject over (pp, tp), one state, replica_id the DP rank), 'num_floating_point_operations_so_far';
the tracker file and no completeness proof (upstream writes none).
"""

import argparse
import os
import random
import sys

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt  # noqa: E402
from megatron.training.checkpoint import checkpointing  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.args.arguments import parse_args  # noqa: E402
from megatron.training.data.datasets import build_tokenizer, padded_vocab_size  # noqa: E402
from megatron.training.initialize import initialize  # noqa: E402


def upstream_args(args, consumed):
    return argparse.Namespace(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, group_query_attention=False, num_query_groups=1,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, normalization=args.normalization,
        swiglu=args.swiglu, add_bias_linear=True, untie_embeddings_and_output_weights=False,
        padded_vocab_size=args.padded_vocab_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        data_parallel_size=parallel_state.get_data_parallel_world_size(), data_parallel_random_init=False,
        consumed_train_samples=consumed, consumed_valid_samples=0, no_save_optim=None, no_save_rng=None,
        use_distributed_optimizer=True, ckpt_format="torch_dist", iteration=None, bf16=args.bf16, fp16=args.fp16)


def rng_state():
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", [state], (parallel_state.get_pipeline_model_parallel_world_size(),
                                                parallel_state.get_tensor_model_parallel_world_size()),
                         (pp, tp), replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def main():
    argv = sys.argv[1:]
    out = argv[argv.index("--upstream-out") + 1]
    del argv[argv.index("--upstream-out"): argv.index("--upstream-out") + 2]
    args = parse_args(argv)
    args.device_obj = initialize(args)
    args.padded_vocab_size = padded_vocab_size(args, build_tokenizer(args))
    model = training.build_model(args, training.transformer_config(args), pretrain_gpt.model_provider,
                                 args.device_obj)
    optimizer = training.build_optimizer(args, model)
    scheduler = training.build_scheduler(args, optimizer)
    iteration, consumed = checkpointing.load_checkpoint(args.load, model, optimizer, scheduler, args)

    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    unwrapped = model[0].module.module  # DDP -> Float16Module -> GPTModel, as upstream's unwrap_model
    state = {"args": upstream_args(args, consumed), "checkpoint_version": 3.0, "iteration": iteration,
             "model": unwrapped.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = rng_state()
    state["num_floating_point_operations_so_far"] = 12345
    path = os.path.join(out, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
