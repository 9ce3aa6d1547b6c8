"""Peak host memory of tools/hf_checkpoint.py's import and export on a Llama-3.1 8 B shape.

    python benchmarks/hf_memory.py --work DIR [--shape 8b|tiny] [--keep]

Writes a Hugging Face directory of that shape with random bf16 weights (a tensor at a time: this
script holds one tensor, never the model), imports it into DIR/ckpt, exports that to DIR/export,
checks a few exported tensors against the originals byte for byte, and prints each step's peak
resident memory (the child process's ru_maxrss, from wait4) and its time. DIR needs about three
times the model's bytes (16 GB each at 8 B). The figures go to docs/benchmarks.md.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPES = {  # Llama-3.1 8 B, and a tiny one of the same form for a dry run
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}


def llama_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 500000.0, "dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, **shape}


def tensor_shapes(cfg: dict) -> dict:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def write_random_model(hf_dir: str, shape_name: str) -> dict:
    import torch

    from megatron.training.hf.files import SafetensorsWriter

    os.makedirs(hf_dir, exist_ok=True)
    cfg = llama_config(SHAPES[shape_name])
    shapes = tensor_shapes(cfg)
    writer = SafetensorsWriter(hf_dir, {n: (torch.bfloat16, s) for n, s in shapes.items()}, int(5e9))
    gen = torch.Generator().manual_seed(0)
    for name, s in shapes.items():
        writer.write(name, torch.randn(s, generator=gen, dtype=torch.bfloat16) * 0.02)
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


def measured(command) -> tuple:
    """(peak resident GB, seconds) of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    return usage.ru_maxrss * 1024 / 1e9, time.perf_counter() - started


def same_bytes(original: str, exported: str, names) -> bool:
    import torch

    from megatron.training.hf.files import SafetensorsReader

    a, b = SafetensorsReader(original), SafetensorsReader(exported)
    try:
        return all(a.read(n).view(torch.uint8).equal(b.read(n).view(torch.uint8)) for n in names)
    finally:
        a.close()
        b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="a directory with room for three copies of the model")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--keep", action="store_true", help="leave the three directories in place")
    args = parser.parse_args()
    hf_dir, ckpt, export = (os.path.join(args.work, n) for n in ("hf", "ckpt", "export"))
    for d in (hf_dir, ckpt, export):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    cfg = write_random_model(hf_dir, args.shape)
    print(f"wrote a random {args.shape} Llama-3.1 shape to {hf_dir} in {time.perf_counter() - t0:.0f} s", flush=True)
    tool = [sys.executable, os.path.join(REPO, "tools", "hf_checkpoint.py")]
    rss_in, s_in = measured([*tool, "import", hf_dir, ckpt])
    rss_out, s_out = measured([*tool, "export", ckpt, export])
    last = cfg["num_hidden_layers"] - 1
    checked = ["model.embed_tokens.weight", "lm_head.weight", f"model.layers.{last}.self_attn.k_proj.weight",
               f"model.layers.{last}.mlp.up_proj.weight"]
    identical = same_bytes(hf_dir, export, checked)
    shards = [os.path.join(hf_dir, n) for n in os.listdir(hf_dir) if n.endswith(".safetensors")]
    model_gb = sum(os.path.getsize(path) for path in shards) / 1e9
    print(f"model {model_gb:.2f} GB | import: peak RSS {rss_in:.2f} GB, {s_in:.0f} s | export: peak RSS "
          f"{rss_out:.2f} GB, {s_out:.0f} s | exported tensors byte-identical ({len(checked)} checked): {identical}")
    if not args.keep:
        for d in (hf_dir, ckpt, export):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
