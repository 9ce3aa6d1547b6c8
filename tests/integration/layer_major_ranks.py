"""A rank of tests/integration/test_layer_major_cpu.py: one training step's forward and backward on a tiny
GPT, by megatron-core's schedule and by the layer-major step (params resident; and params away while each
layer is released, its inputs kept in host memory), from the same params and batches; writes whether the
losses and every gradient buffer agree bit for bit to OUT/rank<N>.json.

    python layer_major_ranks.py OUT TP MICRO_BATCHES PRECISION [PP]   (each rank of a gloo launch on the CPU;
                                                          PRECISION: bf16, or fp32 for no --bf16; PP: stages)
LAYER_MAJOR_DEVICE=cuda runs it on GPUs (deterministic kernels: --deterministic-mode in LAYER_MAJOR_FLAGS)."""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).parent)]
from rank_world import join, pretrain_gpt  # noqa: E402
SEQ, VOCAB = 16, 64
DEVICE = os.environ.get("LAYER_MAJOR_DEVICE", "cpu")  # cuda: the same passes on a GPU (nccl), for the device


def _batches(count: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=generator)
        mask = (torch.rand(1, SEQ, generator=generator) > 0.2).float()  # some tokens not counted
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                        "position_ids": torch.arange(SEQ).unsqueeze(0)})
    return batches


def _grads(chunk) -> list:
    return [buffer.grad_data.clone() for buffer in chunk.buffers + chunk.expert_parallel_buffers]


class GuardedLayers:
    """Params away while released, as streamed params will be: each param's data is an empty tensor until
    ``bring_in`` puts it back, so a layer that ran while released would fail. Records the calls."""

    def __init__(self, layers):
        self.params = [list(layer.parameters()) for layer in layers]
        self.held = [[p.data for p in params] for params in self.params]
        self.calls = []
        for index in range(len(layers)):
            self._away(index)

    def step_started(self, backward: bool, passes: int = 1) -> None:
        self.calls.append(("start", backward))

    def finalizing(self, chunk):
        return contextlib.nullcontext()  # the grads stay in DDP's buffer

    def grads_complete(self) -> None:
        self.calls.append(("grads",))

    def step_ended(self) -> None:
        self.calls.append(("end",))

    def bring_in(self, layer: int) -> None:
        self.calls.append(("in", layer))
        for param, data in zip(self.params[layer], self.held[layer]):
            param.data = data

    def release(self, layer: int, after_backward: bool) -> None:
        self.calls.append(("out", layer, after_backward))
        self._away(layer)

    def _away(self, layer: int) -> None:
        for param in self.params[layer]:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def restore(self) -> None:
        for index in range(len(self.params)):
            self.bring_in(index)


def main(out: str, tp: int, micro_batches: int, precision: str, pp: int = 1) -> None:
    device = join(DEVICE)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.training.args.arguments import parse_args
    from megatron.training.model.configs import transformer_config
    from megatron.training.model.kept_inputs import HostKeptInputs
    from megatron.training.model.layer_major import LayerMajorStep, forward_backward_layer_major
    from megatron.training.training import build_model

    args = parse_args([
        "--num-layers", str(3 if pp == 1 else 2 * pp), "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "1",
        "--global-batch-size", str(micro_batches), "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--device", DEVICE, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--padded-vocab-size", str(VOCAB), *(["--bf16"] if precision == "bf16" else []),
        *os.environ.get("LAYER_MAJOR_FLAGS", "").split()])  # more flags, last wins
    args.device_resolved = DEVICE
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)
    config = transformer_config(args)
    steps = pretrain_gpt()
    model = build_model(args, config, steps.model_provider, device)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    batches = _batches(micro_batches, seed=7 + parallel_state.get_data_parallel_rank())  # DP ranks: their own data

    def run(schedule) -> tuple:
        model[0].zero_grad_buffer()
        reported = schedule(forward_step_func=steps.forward_step, data_iterator=iter(batches), model=model,
                            num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=1, forward_only=False)
        return [entry["lm loss"].tolist() for entry in reported], _grads(model[0])

    reference_losses, reference_grads = run(get_forward_backward_func())
    losses, grads = run(forward_backward_layer_major)
    gpt = model[0]
    while not hasattr(gpt, "decoder"):  # inside DDP (and Float16Module with bf16)
        gpt = gpt.module
    layers = gpt.decoder.layers
    guard = GuardedLayers(layers)
    streamed_losses, streamed_grads = run(LayerMajorStep(guard, lambda: HostKeptInputs(device)))
    calls = list(guard.calls)
    guard.restore()
    count = len(layers)
    expected_calls = [("start", True)] + [c for i in range(count) for c in (("in", i), ("out", i, False))]
    expected_calls += [c for i in reversed(range(count)) for c in (("in", i), ("out", i, True))]
    expected_calls += [("grads",), ("end",)]
    rank = torch.distributed.get_rank()
    result = {
        "streamed_losses": streamed_losses,
        "streamed_grads_equal": all(torch.equal(a, b) for a, b in zip(streamed_grads, reference_grads)),
        "calls_in_order": calls == expected_calls,
        "losses": losses, "reference_losses": reference_losses,
        "grads_equal": all(torch.equal(a, b) for a, b in zip(grads, reference_grads)),
        "max_grad_difference": max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference_grads)),
        "nonzero_grads": int(sum(int(torch.count_nonzero(g)) for g in grads)),
        "grad_elements": int(sum(g.numel() for g in grads)),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:6]))
