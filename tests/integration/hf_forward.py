"""Our forward on imported checkpoints, as a rank of a CPU launch (launch.launch_command's script):
each model is built by pretrain_gpt.py's provider and training's build_model from its
``model_args.txt``, its weights loaded with ``--finetune --load CKPT`` as the training layer loads them, and
run forward-only through megatron-core's pipeline schedule on the given tokens; the logits,
gathered over TP, are saved by the last stage's first TP rank.

    hf_forward.py OUT.pt TOKENS.pt CKPT_DIR:TP:PP:EP [CKPT_DIR:TP:PP:EP ...]

each model at its own layout (data-parallel over the ranks TP x PP leaves; megatron-core's MoE layers
take no TP on CPU, EP instead). OUT.pt: {"CKPT_DIR:TP:PP:EP": logits [batch, seq, padded vocab] in fp32}.
HF_FORWARD_DEVICE=cuda runs it on GPUs (benchmarks/experiments/hf_8b.sh), HF_FORWARD_FLAGS adds flags
(e.g. --bf16).
"""

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).parent)]
from rank_world import join, pretrain_gpt  # noqa: E402


DEVICE = os.environ.get("HF_FORWARD_DEVICE", "cpu")


def logits_of(ckpt: str, tokens: torch.Tensor, tp: int, pp: int, ep: int):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.training.args.arguments import parse_args
    from megatron.training.checkpoint.load_plan import plan_load
    from megatron.training.checkpoint.state_dict import load_model, model_state, sharding_metadata
    from megatron.training.model.configs import transformer_config
    from megatron.training.training import build_model

    batch, seq = tokens.shape
    flags = Path(ckpt, "model_args.txt").read_text().split()
    args = parse_args([*flags, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                       "--expert-model-parallel-size", str(ep),
                       "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--seq-length", str(seq),
                       "--train-iters", "1", "--lr", "0", "--mock-data", "--device", DEVICE, "--tokenizer-type",
                       "NullTokenizer", "--vocab-size", "1", "--finetune", "--load", ckpt,
                       "--transformer-impl", "local",
                       *os.environ.get("HF_FORWARD_FLAGS", "").split()])
    args.device_resolved = DEVICE
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    config = transformer_config(args)
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    model = build_model(args, config, pretrain_gpt().model_provider, device)
    tokens = tokens.to(device)
    plan = plan_load(ckpt, None, args)  # the loader's own choice and checks; then its model part
    load_model(model, dist_checkpointing.load(model_state(model, sharding_metadata()), plan.path))
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)

    def step(data_iterator, chunk):
        next(data_iterator)
        output = chunk(tokens, positions, None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        stored = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=model,
                                             num_microbatches=1, seq_length=seq, micro_batch_size=batch,
                                             forward_only=True)
    result = None
    saves = parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 0
    if parallel_state.is_pipeline_last_stage():
        local = stored[0]["logits"]
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        if saves and parallel_state.get_tensor_model_parallel_rank() == 0:
            result = torch.cat(parts, dim=-1).float().cpu()
    parallel_state.destroy_model_parallel()
    return result


def main(argv) -> None:
    out, tokens_file, *specs = argv
    join(DEVICE)
    tokens = torch.load(tokens_file)
    results = {}
    for spec in specs:
        ckpt, tp, pp, ep = spec.rsplit(":", 3)
        logits = logits_of(ckpt, tokens, int(tp), int(pp), int(ep))
        if logits is not None:
            results[spec] = logits
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)  # each model's holder may be another rank
    if torch.distributed.get_rank() == 0:
        torch.save({k: v for part in gathered for k, v in part.items()}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
