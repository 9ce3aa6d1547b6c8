"""DeepSpeed ZeRO-3 optimizer offload (NVMe or CPU) on a Hugging Face Llama: the peer we compare with.

One process per GPU: a plain `python3` run is one rank; under torchrun ZeRO-3 partitions the model
and optimizer state over all ranks (data parallel), and DeepSpeed puts each rank's swap files in
its own NVMESWAP/optimizer/rank<r>/ below the one --nvme-path. Random tokens (fixed seed + rank),
bf16, gradient checkpointing, AdamW. Per iteration rank 0 writes one JSON line: iteration, loss
(rank 0's micro-batches), total_s, forward_s, backward_s, step_s (each phase between
torch.cuda.synchronize() calls); at the end the exact DeepSpeed config as JSON.

  source benchmarks/experiments/peer_env.sh   # libaio + wheels
  python3 benchmarks/peers_deepspeed.py --offload nvme --nvme-path /var/tmp/ds --iters 3
  torchrun --nproc_per_node 4 benchmarks/peers_deepspeed.py --offload nvme --nvme-path /var/tmp/ds

--dry-run (no GPU needed) validates the config with DeepSpeed's own parser and builds the model
on the CPU at the given size, then exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# DeepSpeed's op builder cannot parse the image's "9.0a"; must be set before deepspeed is imported.
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29611"), ("RANK", "0"),
                   ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
    os.environ.setdefault(key, value)  # a plain `python3` run is a one-rank job

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shape import LlamaShape, add_shape_flags, shape_from_args  # noqa: E402

DEFAULT_SHAPE = LlamaShape(layers=4, hidden=256, ffn=688, heads=8, kv_heads=4, vocab=32000, seq=256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, DEFAULT_SHAPE)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None,
                   help="default: --micro-batch x world size (no accumulation)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--offload", choices=["nvme", "cpu"], default="nvme")
    p.add_argument("--offload-param", choices=["none", "cpu"], default="none",
                   help="ZeRO-Infinity's offload_param: the bf16 params in pinned CPU memory between uses")
    p.add_argument("--nvme-path", default="/var/tmp/offload/ds")
    p.add_argument("--buffer-count", type=int, default=16, help="4 trips an assertion with pipelining")
    p.add_argument("--sub-group-size", type=float, default=1e8)
    p.add_argument("--no-grad-ckpt", action="store_true")
    p.add_argument("--log-file", default=None,
                   help="also write the JSON lines (and the config) here; not --log: torchrun calls that ambiguous")
    p.add_argument("--dry-run", action="store_true", help="validate config + build the model on CPU, no training")
    args = p.parse_args(argv)
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.rank = int(os.environ["RANK"])
    args.global_batch = args.global_batch or args.micro_batch * args.world_size
    if args.global_batch % (args.micro_batch * args.world_size):
        p.error(f"--global-batch must be a multiple of --micro-batch x world size ({args.world_size})")
    return args


def ds_config(args) -> dict:
    """The DeepSpeed config: ZeRO-3, bf16, AdamW, optimizer state on NVMe (or pinned CPU memory), the params in
    pinned CPU memory with --offload-param cpu."""
    if args.offload == "nvme":
        offload = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True,
                   "buffer_count": args.buffer_count, "pipeline_read": True, "pipeline_write": True}
    else:
        offload = {"device": "cpu", "pin_memory": True}
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.global_batch // (args.micro_batch * args.world_size),
        "gradient_clipping": args.clip_grad,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": args.weight_decay}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(args.sub_group_size),
            "offload_optimizer": offload,
            **({"offload_param": {"device": "cpu", "pin_memory": True}} if args.offload_param == "cpu" else {}),
            "contiguous_gradients": True,
            "overlap_comm": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.offload == "nvme":
        # "thread_count" of older releases is "intra_op_parallelism" in 0.19.x.
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False,
                         "overlap_events": True, "intra_op_parallelism": 1}
    return config


def llama_config(shape: LlamaShape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa",
    )


def count_params(model) -> int:
    # Under ZeRO-3 a parameter's local tensor is empty; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def emit(record: dict, log) -> None:
    if int(os.environ["RANK"]) != 0:
        return  # rank 0 speaks for the job
    line = json.dumps(record)
    print(line, flush=True)
    if log:
        log.write(line + "\n")
        log.flush()


def dry_run(args, shape, config) -> None:
    import deepspeed  # noqa: F401  (the import itself is part of the check)
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import LlamaForCausalLM

    parsed = DeepSpeedConfig(config)
    zero = parsed.zero_config
    print(f"DeepSpeedConfig accepted: stage {zero.stage}, offload_optimizer {zero.offload_optimizer}, "
          f"offload_param {zero.offload_param}, "
          f"aio {parsed.aio_config}, bf16 {parsed.bfloat16_config.enabled}, train_batch {parsed.train_batch_size}", flush=True)
    model = LlamaForCausalLM(llama_config(shape))
    n = count_params(model)
    print(json.dumps({"parameters": n, "expected": shape.num_params()}), flush=True)
    assert n == shape.num_params(), (n, shape.num_params())
    ids = torch_randint(shape, args.micro_batch, args.seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    print(json.dumps({"cpu_forward_backward_loss": loss.item()}), flush=True)


def torch_randint(shape, batch, seed, device="cpu"):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (batch, shape.seq), generator=g).to(device)


def train(args, shape, config, log) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(args.seed)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before NCCL starts: one GPU per rank
    deepspeed.init_distributed(dist_backend="nccl")
    if args.offload == "nvme":
        os.makedirs(args.nvme_path, exist_ok=True)

    t0 = time.perf_counter()
    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841  makes from_config build under zero.Init
    model = AutoModelForCausalLM.from_config(llama_config(shape), dtype=torch.bfloat16)
    if not args.no_grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = count_params(model)
    emit({"parameters": n, "expected": shape.num_params(), "build_s": time.perf_counter() - t0}, log)

    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    emit({"initialize_s": time.perf_counter() - t0}, log)

    accum = args.global_batch // (args.micro_batch * args.world_size)
    gen = torch.Generator().manual_seed(args.seed + args.rank)  # each data-parallel rank its own tokens
    device = torch.device("cuda", torch.cuda.current_device())
    for iteration in range(1, args.iters + 1):
        fwd = bwd = step = 0.0
        losses = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(0, shape.vocab, (args.micro_batch, shape.seq), generator=gen).to(device)
            t = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            fwd += time.perf_counter() - t
            t = time.perf_counter()
            engine.backward(loss)
            torch.cuda.synchronize()
            bwd += time.perf_counter() - t
            t = time.perf_counter()
            engine.step()  # only the last micro-batch's call runs the optimizer
            torch.cuda.synchronize()
            step += time.perf_counter() - t
            losses.append(loss.item())
        total = time.perf_counter() - start
        emit({"iteration": iteration, "loss": sum(losses) / len(losses), "total_s": total,
              "forward_s": fwd, "backward_s": bwd, "step_s": step,
              "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9}, log)
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = shape_from_args(args)
    config = ds_config(args)
    log = open(args.log_file, "w") if args.log_file and args.rank == 0 else None
    if args.rank == 0:
        print(f"model {shape.as_dict()} | offload_optimizer {args.offload} | offload_param {args.offload_param} | "
              f"world size {args.world_size}",
              flush=True)
    if args.dry_run:
        dry_run(args, shape, config)
    else:
        train(args, shape, config, log)
    emit({"deepspeed_config": config}, log)


if __name__ == "__main__":
    main()
