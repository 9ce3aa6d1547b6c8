"""What DeepSpeed ZeRO-3 needs to train a Llama shape on one GPU, by DeepSpeed's own estimator
(``estimate_zero3_model_states_mem_needs_all_cold``: params, gradients and optimizer state, no activations), and
the largest shape of the same width it holds on a machine: the peer's side of issue 50's "30 B against
DeepSpeed with offload_param and offload_optimizer". Its NVMe optimizer offload is priced as the fp32 master and
both fp32 moments on the disk (12 bytes per parameter, what its swapper writes), beside what the estimator
gives for the params and grads with offload_param to CPU.

    PYTHONPATH=<deepspeed installed> python benchmarks/deepspeed_capacity.py --layers 60 --hidden 6656 --ffn 17920 \\
        --heads 52 --kv-heads 4 --host-gb 128 --disk-gb 64
(needs deepspeed importable: tools/fetch_device_wheels.sh builds its wheel; installs with --target anywhere)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shape import LlamaShape, add_shape_flags, shape_from_args  # noqa: E402

GB = 1e9
DEFAULT = LlamaShape(layers=52, hidden=6144, ffn=16384, heads=48, kv_heads=8, vocab=32000, seq=2048)
# Of the estimator's 18 bytes per parameter in host memory with both offloads: 12 are the optimizer's (fp32
# master, exp_avg, exp_avg_sq: its CPU Adam keeps all three in fp32), which offload_optimizer nvme puts on the disk.
ESTIMATE_BYTES, OPTIMIZER_BYTES = 18, 12


def largest_layer_params(shape: LlamaShape) -> int:
    """The largest single module ZeRO-3 gathers at once: the embedding (or output layer) or one layer."""
    per_layer = (shape.num_params() - 2 * shape.vocab * shape.hidden - shape.hidden) // shape.layers
    return max(shape.vocab * shape.hidden, per_layer)


def needs(shape: LlamaShape) -> dict:
    """Bytes DeepSpeed needs with offload_param cpu and offload_optimizer cpu (its estimator, zero_init, one GPU),
    and with offload_optimizer nvme instead (the optimizer's share of the host figure moved to the disk)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(shape.num_params(), largest_layer_params(shape),
                                                        num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                                        cpu_offload_params=True, zero_init=True)
    optimizer_share = cpu * OPTIMIZER_BYTES / ESTIMATE_BYTES
    return {"cpu/cpu": {"host": cpu, "disk": 0, "gpu": gpu},
            "cpu/nvme": {"host": cpu - optimizer_share, "disk": shape.num_params() * OPTIMIZER_BYTES, "gpu": gpu}}


def fitting(shape: LlamaShape, host_gb: float, disk_gb: float, gpu_gb: float) -> list:
    """The offload settings whose needs the machine holds."""
    return [way for way, n in needs(shape).items()
            if n["host"] <= host_gb * GB and n["disk"] <= disk_gb * GB and n["gpu"] <= gpu_gb * GB]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, DEFAULT)
    p.add_argument("--host-gb", type=float, default=128.0)
    p.add_argument("--disk-gb", type=float, default=64.0)
    p.add_argument("--gpu-gb", type=float, default=139.0)
    args = p.parse_args(argv)
    shape = shape_from_args(args)
    print(f"{shape.num_params() / 1e9:.2f} B params ({shape.layers} layers, hidden {shape.hidden}); machine: host "
          f"{args.host_gb:g} GB, disk {args.disk_gb:g} GB, GPU {args.gpu_gb:g} GB")
    for way, n in needs(shape).items():
        print(f"  offload_param/offload_optimizer {way}: host {n['host'] / GB:.1f} GB, disk {n['disk'] / GB:.1f} GB, "
              f"GPU {n['gpu'] / GB:.1f} GB (model states, no activations)")
    layers = shape.layers
    while layers > 0 and not fitting(dataclasses.replace(shape, layers=layers), args.host_gb, args.disk_gb,
                                     args.gpu_gb):
        layers -= 1
    if layers:
        smaller = dataclasses.replace(shape, layers=layers)
        print(f"  the most layers of this width it holds here: {layers} ({smaller.num_params() / 1e9:.2f} B, "
              f"{' and '.join(fitting(smaller, args.host_gb, args.disk_gb, args.gpu_gb))})")
    else:
        print("  no layer count of this width fits here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
