"""The planner's model of --offload-params host (megatron/training/offload/params_streaming.py), against a
reference written here: each layer's forward and backward take the longer of their compute and one copy of the
layer's params; the update adds the device-updated params' trips across the link; the GPU keeps two layers and
the params outside them. And the planner's recommendation tries the params in host memory and keeps them
resident where that is faster."""

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.offload.params_streaming import (StreamedParams, streamed_compute_seconds,
                                                        update_copies)
from tests.profiles import examples

from .test_plan_candidates import RUN_20B, run
from .test_plan_replay import H200_TFLOPS, planner


# 69 B (80 layers, hidden 8192) on one GPU of the x4 node (503 GiB host, 200 GiB disk), gb 64, fp8 moments, full
# recompute, a host tier of 75 GiB: everything but the optimizer state on the GPU, as a user would first write it.
RUN_69B_ONE_GPU = (
    "--gpus-per-node 1 --gpu-memory-gb 140.4 --host-memory-gb 503 --offload-nvme-capacity-gb 200 "
    "--offload-bandwidths nvme=1.7:1.6 --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
    "--num-attention-heads 64 --group-query-attention --num-query-groups 8 --seq-length 2048 "
    "--max-position-embeddings 2048 --global-batch-size 64 --micro-batch-size 1 --bf16 --grad-reduce-in-bf16 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --device cuda "
    "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 "
    "--offload-tiers gpu,host,nvme --offload-gpu-cache-gb auto --offload-host-cache-gb 75 "
    "--offload-nvme-path /nonexistent --offload-subgroup-size 100000000")


@settings(max_examples=examples(200))
@given(compute=st.floats(1e-3, 100.0), layers=st.integers(1, 128), layer_bytes=st.integers(1, 10**10),
       grad_bytes=st.sampled_from([0, 2, 4]), link=st.floats(1e9, 1e11))
def test_each_layer_takes_the_longer_of_its_compute_and_its_copies(compute, layers, layer_bytes, grad_bytes, link):
    layer_grads = layer_bytes // 2 * grad_bytes  # bf16 params: grads of grad_bytes each (0: grads resident)
    streamed = StreamedParams(device_bytes=0, host_bytes=layers * layer_bytes, layers=layers, layer_bytes=layer_bytes,
                              layer_grad_bytes=layer_grads)
    copy_in, copy_out = layer_bytes / link, layer_grads / link
    forward, backward = compute / layers / 4, compute / layers * 3 / 4  # full recompute: 1 of 4 passes forward
    # the backward's copies, params in and grads out, share one side stream
    reference = sum(max(forward, copy_in) + max(backward, copy_in + copy_out) for _ in range(layers))
    got = streamed_compute_seconds(compute, streamed, link)
    assert got == pytest.approx(reference, rel=1e-9)
    assert got >= compute * (1 - 1e-9) and got >= layers * (2 * copy_in + copy_out) * (1 - 1e-9)
    if copy_in + copy_out <= forward:  # every copy hides under its layer's compute
        assert got == pytest.approx(compute, rel=1e-9)



@settings(max_examples=examples(200))
@given(compute=st.floats(1e-3, 100.0), layers=st.integers(1, 64), layer_bytes=st.integers(1, 10**10),
       grad_bytes=st.sampled_from([0, 2, 4]), link=st.floats(1e9, 1e11), passes=st.integers(1, 8))
def test_in_passes_each_layer_comes_in_twice_a_pass_and_its_grads_back_after_the_first(
        compute, layers, layer_bytes, grad_bytes, link, passes):
    layer_grads = layer_bytes // 2 * grad_bytes
    streamed = StreamedParams(device_bytes=0, host_bytes=layers * layer_bytes, layers=layers, layer_bytes=layer_bytes,
                              layer_grad_bytes=layer_grads)
    copy_in, copy_out = layer_bytes / link, layer_grads / link
    forward, backward = compute / passes / layers / 4, compute / passes / layers * 3 / 4  # a pass's share
    one_pass = sum(max(forward, copy_in) + max(backward, copy_in + copy_out) for _ in range(layers))
    # after the first pass each layer's partial grads come back in, before its backward sums on them
    reference = passes * one_pass + (passes - 1) * layers * copy_out
    got = streamed_compute_seconds(compute, streamed, link, passes)
    assert got == pytest.approx(reference, rel=1e-9)
    assert got >= streamed_compute_seconds(compute, streamed, link) * (1 - 1e-9)  # never cheaper than one pass

def test_the_update_reads_the_params_in_series_and_writes_them_back_beside_it():
    streamed = StreamedParams(device_bytes=0, host_bytes=40 * 10**9, layers=40, layer_bytes=10**9)
    copies = update_copies(streamed, 50e9, 1.0, reads_high=True)
    assert (copies.in_series, copies.beside) == (pytest.approx(0.8), pytest.approx(0.8))
    assert copies.added_to(0.3) == pytest.approx(0.8 + 0.5)  # the way back outlasts the update by 0.5 s
    assert copies.added_to(5.0) == pytest.approx(0.8)  # a disk-bound update hides the way back
    without_high = update_copies(streamed, 50e9, 1.0, reads_high=False)
    assert without_high.in_series == 0.0 and without_high.added_to(0.0) == pytest.approx(0.8)
    assert update_copies(streamed, 50e9, 0.25, reads_high=True).added_to(0.0) == pytest.approx(0.4)  # CPU's: none
    assert update_copies(streamed, 50e9, 0.0, reads_high=True).added_to(0.0) == 0.0
    with_grads = StreamedParams(device_bytes=0, host_bytes=40 * 10**9, layers=40, layer_bytes=10**9,
                                grad_host_bytes=80 * 10**9)  # fp32 grads in host memory: read back in, in series
    assert update_copies(with_grads, 50e9, 1.0, reads_high=True).in_series == pytest.approx(2.4)


@pytest.fixture(scope="module")
def tool():
    return planner()


def test_the_plan_keeps_two_layers_on_the_gpu_and_every_param_in_host_memory(tool):
    host_budget = RUN_20B.replace("--offload-host-cache-gb 97", "--offload-host-cache-gb 56")
    code, resident = run(tool, f"--gpu-tflops {H200_TFLOPS} {RUN_20B}")
    code_host, streamed = run(tool, f"--gpu-tflops {H200_TFLOPS} {host_budget} --offload-params host")
    assert code == code_host == 0 and streamed["fits"], streamed["problems"]
    per_rank = resident["params_per_rank"]
    assert resident["gpu_bytes_per_rank"]["parameters"] == 2 * per_rank
    # 52 equal layers: two of them and the embedding, final norm and output layer
    layer = (per_rank - 2 * 32000 * 6144 - 6144) // 52
    assert streamed["gpu_bytes_per_rank"]["parameters"] == 2 * (2 * layer + per_rank - 52 * layer)
    assert streamed["host_bytes_per_node"]["host_params"] == 2 * per_rank
    assert streamed["predicted_iteration_s"] > resident["predicted_iteration_s"]  # at gb 1 the copies show


def test_70b_on_one_gpu_fits_only_with_grads_and_layer_inputs_in_host_memory_too(tool):
    """69 B (80 layers, hidden 8192) on one GPU beside 503 GiB of host memory, global batch 64: the bf16 grads alone
    overflow the GPU with the params in host memory; with the grads there too, the layer-major step's inputs of 80
    layers x 64 micro-batches (2 s h bytes each: 160 GiB) do; with them in host memory as well it fits, two layers'
    params and grads and two layers' inputs on the GPU, those 160 GiB beside the params, grads and state in host
    memory."""
    shape = f"{RUN_69B_ONE_GPU} --offload-params host"
    _, params_only = run(tool, f"--gpu-tflops {H200_TFLOPS} {shape}")
    _, grads = run(tool, f"--gpu-tflops {H200_TFLOPS} {shape} --offload-grads host")
    _, inputs = run(tool, f"--gpu-tflops {H200_TFLOPS} {shape} --offload-grads host --offload-activations host")
    for plan in (params_only, grads):
        assert not plan["fits"] and any("GPU memory" in p for p in plan["problems"])
    kept_inputs = 80 * 64 * 2 * 2048 * 8192
    assert grads["gpu_bytes_per_rank"]["activations"] > kept_inputs
    assert inputs["fits"], inputs["problems"]
    assert inputs["host_bytes_per_node"]["host_activations"] == kept_inputs
    assert inputs["gpu_bytes_per_rank"]["activations"] < kept_inputs / 10
    gpu = inputs["gpu_bytes_per_rank"]
    assert gpu["gradients"] == gpu["parameters"]  # bf16 grads: the same slots as the params'
    assert inputs["host_bytes_per_node"]["host_grads"] == inputs["host_bytes_per_node"]["host_params"]


def test_the_recommendation_for_69b_on_one_gpu_keeps_params_grads_and_layer_inputs_in_host_memory(tool):
    """The 69 B run as a user would first write it (everything but the state on the GPU): it does not fit, and the
    recommendation finds the one way that does among its candidates."""
    flags = f"--recommend --gpu-tflops {H200_TFLOPS} {RUN_69B_ONE_GPU}"
    _, got = run(tool, flags)
    assert not got["fits"]
    chosen = got["recommendation"]["chosen"]
    assert "params, grads and layer inputs in host memory" in chosen["candidate"], chosen["candidate"]
    assert all(f in chosen["flags"] for f in ("--offload-params", "--offload-grads", "--offload-activations"))
    fitting = [r for r in got["recommendation"]["candidates"] if r["fits"]]
    assert fitting and all("grads and layer inputs in host memory" in r["candidate"] for r in fitting)


def test_grads_in_host_memory_fit_at_two_data_parallel_ranks_and_refuse_a_weight_tied_across_stages(tool):
    """Params in host memory are gathered across data-parallel ranks through the device, and grads reduced from
    their device slots; the embedding's weight tied to the output layer on another pipeline stage is refused (its
    two stages' gradients would be summed in host memory)."""
    two = RUN_20B.replace("--gpus-per-node 1", "--gpus-per-node 2").replace("--global-batch-size 1",
                                                                            "--global-batch-size 2")
    code, got = run(tool, f"--gpu-tflops {H200_TFLOPS} {two} --offload-params host --offload-grads host")
    assert not any(p.startswith("--offload-") for p in got["problems"]), got["problems"]
    tied = two.replace("--untie-embeddings-and-output-weights", "") + " --pipeline-model-parallel-size 2"
    code, got = run(tool, f"--gpu-tflops {H200_TFLOPS} {tied} --offload-params host --offload-grads host")
    assert not got["fits"]
    assert any(p.startswith("--offload-grads host: not with the embedding tied") for p in got["problems"]), \
        got["problems"]


def test_the_recommendation_tries_params_in_host_memory_and_picks_the_faster(tool):
    """With full recompute it tries the params in host memory alone, with the layer inputs, and with the grads
    and the layer inputs; the resident params fit and are faster for this run."""
    code, got = run(tool, f"--recommend --gpu-tflops {H200_TFLOPS} {RUN_20B}")
    rows = got["recommendation"]["candidates"]
    in_host = [r for r in rows if "in host memory" in r["candidate"]]
    assert in_host and all(r["candidate"].startswith("recompute full") for r in in_host)
    for kind in ("params in host memory", "params and layer inputs in host memory",
                 "params, grads and layer inputs in host memory"):
        assert any(r["candidate"].endswith(kind) for r in in_host), kind
    chosen = got["recommendation"]["chosen"]
    assert "params in host memory" not in chosen["candidate"]  # resident fits and is faster here
    fastest_in_host = max((r["tokens_per_s"] for r in in_host if r["fits"]), default=0)
    assert chosen["tokens_per_s"] >= fastest_in_host


def test_layer_major_pipeline_stages_are_priced_one_after_the_other(tool):
    """At PP2 the layer-major step (--offload-activations host) runs stage 0's forward before stage 1's, and the
    backwards likewise: the step's compute is both stages' (2x a stage's), where megatron-core's 1F1B over 8
    micro-batches pays 1 + 1/8."""
    two = (RUN_20B.replace("--gpus-per-node 1", "--gpus-per-node 2")
           .replace("--global-batch-size 1", "--global-batch-size 8") + " --pipeline-model-parallel-size 2")
    code, pipelined = run(tool, f"--gpu-tflops {H200_TFLOPS} {two}")
    code_lm, layer_major = run(tool, f"--gpu-tflops {H200_TFLOPS} {two} --offload-activations host")
    assert code == code_lm == 0
    assert layer_major["predicted_compute_s"] == pytest.approx(pipelined["predicted_compute_s"] * 2 / (1 + 1 / 8),
                                                               rel=1e-9)


@settings(max_examples=examples(100))
@given(layers=st.integers(1, 96), microbatches=st.integers(1, 128), seq=st.sampled_from([512, 2048, 4096]),
       hidden=st.sampled_from([1024, 4096, 6144, 8192]), tp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       pp=st.sampled_from([1, 2]), device=st.sampled_from(["cuda", "cpu"]))
def test_the_layer_major_steps_inputs_go_to_host_memory_all_but_two_layers(layers, microbatches, seq, hidden, tp, sp,
                                                                           pp, device):
    """Each layer's input per micro-batch (2 s b h bytes, split over TP with sequence parallelism) is kept until its
    recompute: on the GPU, or with --offload-activations host in host memory (on a GPU in pinned blocks, which
    torch rounds up to a power of two), where two layers' stay on the GPU."""
    from types import SimpleNamespace

    from megatron.training.offload.activation_memory import layer_major_activation_bytes

    cfg = SimpleNamespace(hidden_size=hidden, num_attention_heads=16, tensor_model_parallel_size=tp,
                          sequence_parallel=sp and tp > 1, num_layers=layers * pp, pipeline_model_parallel_size=pp)
    args = SimpleNamespace(seq_length=seq, micro_batch_size=1, padded_vocab_size=32000, device=device)
    kept = 2 * seq * hidden / (tp if cfg.sequence_parallel else 1)
    block = 1 << (int(kept) - 1).bit_length() if device == "cuda" else kept
    on_gpu, none = layer_major_activation_bytes(args, cfg, microbatches, inputs_in_host=False)
    gpu, host = layer_major_activation_bytes(args, cfg, microbatches, inputs_in_host=True)
    assert none == 0
    assert host == int(layers * microbatches * block)
    assert on_gpu - gpu == pytest.approx(layers * microbatches * kept - 2 * microbatches * kept, abs=2)


def test_params_in_host_memory_are_there_once_at_start_up(tool):
    """DDP copies the params into a buffer committed as it is written and pinned in place after: at start-up the
    node holds them once. 35.11 B (89 layers of the 20.68 B shape) fits one H200 machine (125 GiB) with a host tier
    of 44 GiB, as it trained; with the params moved there twice (2 x 65.4 GiB) it would not. At 52 GiB the run was
    killed for host memory in its first step: the plan says DOES NOT FIT."""
    machine = ("--gpus-per-node 1 --gpu-memory-gb 140.4 --host-memory-gb 125 --offload-nvme-capacity-gb 60 "
               "--offload-bandwidths nvme=1.7:1.6 --gpu-adam-gelems 32.2 --gpu-streamed-gelems 11.2")
    model = RUN_20B[RUN_20B.index("--swiglu"):].replace("--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16",
                                                        "--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8")
    model = model.replace("--num-layers 52", "--num-layers 89") + " --offload-params host"
    trained = model.replace("--offload-gpu-cache-gb auto --offload-host-cache-gb 97",
                            "--offload-gpu-cache-gb 40 --offload-host-cache-gb 44")
    _, killed = run(tool, f"--gpu-tflops {H200_TFLOPS} {machine} "
                          f"{model.replace('--offload-host-cache-gb 97', '--offload-host-cache-gb 52')}")
    assert not killed["fits"] and any(p.startswith("host memory:") for p in killed["problems"]), killed["problems"]
    _, big = run(tool, f"--gpu-tflops {H200_TFLOPS} {machine} {trained}")
    assert big["fits"], big["problems"]
    assert 2 * big["host_bytes_per_node"]["host_params"] / 2**30 > 125 - 4


def test_70b_at_global_batch_64_in_passes_of_32_keeps_half_the_layer_inputs_and_frees_host_memory_for_state(tool):
    """--offload-microbatch-group 32 at global batch 64: each layer's inputs for 32 micro-batches at a time (80 GiB
    in host memory instead of 160), so a host tier of 150 GiB fits beside them; the layers' params cross twice a
    pass (under 32 micro-batches' compute) and their grads come back once."""
    shape = (f"{RUN_69B_ONE_GPU} --offload-params host --offload-grads host --offload-activations host"
             .replace("--offload-host-cache-gb 75", "--offload-host-cache-gb 150"))
    _, one_pass = run(tool, f"--gpu-tflops {H200_TFLOPS} {shape}")
    _, halves = run(tool, f"--gpu-tflops {H200_TFLOPS} {shape} --offload-microbatch-group 32")
    kept_inputs = 80 * 64 * 2 * 2048 * 8192
    assert not one_pass["fits"] and any(p.startswith("host memory:") for p in one_pass["problems"])
    assert halves["fits"], halves["problems"]
    assert halves["host_bytes_per_node"]["host_activations"] == kept_inputs // 2
    assert halves["predicted_compute_s"] > one_pass["predicted_compute_s"] * 0.999  # passes add copies, never less


def test_without_a_host_budget_the_suggestion_leaves_room_for_the_model_in_host_memory(tool):
    """No --offload-host-cache-gb with the params, grads and layer inputs in host memory: the suggested budget is
    80% of what the node has left beside them (less the gradient scratch), not of the whole node, and it fits."""
    flags = (f"{RUN_69B_ONE_GPU} --offload-params host --offload-grads host --offload-activations host"
             .replace("--offload-host-cache-gb 75 ", ""))
    _, got = run(tool, f"--gpu-tflops {H200_TFLOPS} {flags}")
    host = got["host_bytes_per_node"]
    model = host["host_params"] + host["host_grads"] + host["host_activations"]
    expected = int(((503 * 2**30 - model) * 0.8 - 2 * 100_000_000 * 4) / 2**30)
    assert got["offload_host_cache_gb"] == expected and got["fits"], got["problems"]
