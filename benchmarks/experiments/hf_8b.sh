#!/usr/bin/env bash
# Hugging Face in and out at 8 B (issue 51): a Llama-3.1 8 B shape with random weights made by transformers
# on the device, imported (tools/hf_checkpoint.py), fine-tuned 20 iterations with offload (fp8 moments,
# tiers gpu,host,nvme), exported, and the export's logits in transformers compared with ours, both in bf16.
#   bash benchmarks/run_gpu.sh hf_8b                      (device tool, kind nvidia-h200; carry [".whl"]: .whl/hf
#                                                          holds transformers 5.23.0 and the cp312 wheels it needs)
#   HF_SHAPE=tiny bash benchmarks/experiments/hf_8b.sh    (the CPU dry run: a tiny shape, host,nvme tiers)
# Fill .whl/hf where pip reaches an index: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
#   -d .whl/hf transformers==5.23.0 huggingface-hub==1.33.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.5.9
# The disk holds at most two 16 GB copies at once (the Hugging Face directory goes once imported, the import
# once trained from); the run saves its weights only (--no-save-optim) for the same reason. Prints each step's
# time and peak host memory, the losses, and the logits' differences; all of it lands in $OUT/hf_8b.txt.
# Past one call's 600 s, split it in two calls on the same (warm) machine: STOP_AFTER=train, then FROM=export.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SHAPE=${HF_SHAPE:-8b}
W=${HF_WORK:-/var/tmp/hf_8b}
FROM=${FROM:-build}
[ "$FROM" = build ] && { rm -rf "$W"; mkdir -p "$W/nvme"; }
if ! python3 -c "import sys, transformers; sys.exit(transformers.__version__ != '5.23.0')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/hf/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "$SHAPE" = tiny ]; then
  DEVICE=cpu; SEQ=64; ITERS=${ITERS:-3}; TIERS="host,nvme --offload-host-cache-gb 0.001"; SUB=20000; SAVE_OPTIM=""
  RECOMPUTE=""
else
  DEVICE=cuda; SEQ=${SEQ:-2048}; ITERS=${ITERS:-20}; SUB=100000000; SAVE_OPTIM="--no-save-optim"
  TIERS="gpu,host,nvme --offload-gpu-cache-gb auto --offload-host-cache-gb ${HOST_GB:-48}"
  RECOMPUTE="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
fi
exec > >(tee -a "$OUT/hf_8b.txt") 2>&1
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
free -g | head -2; df -h "$W" | tail -1
# Seconds and peak resident memory of one step (its child's ru_maxrss through wait4).
step() {
  local name=$1; shift
  python3 - "$name" "$@" <<'EOF'
import os, subprocess, sys, time
name, command = sys.argv[1], sys.argv[2:]
started = time.perf_counter()
proc = subprocess.Popen(command)
_, status, usage = os.wait4(proc.pid, 0)
code = os.waitstatus_to_exitcode(status)
print(f"== {name}: exit {code}, {time.perf_counter() - started:.0f} s, peak host RSS {usage.ru_maxrss / 1e6:.2f} GB", flush=True)
sys.exit(code)
EOF
}

if [ "$FROM" = build ]; then
cat > "$W/build.py" <<'EOF'
import sys, torch, transformers
shape, out = sys.argv[1:]
sizes = (dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=512) if shape == "tiny" else
         dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=128256))
rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
config = transformers.LlamaConfig(**sizes, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=rope,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(out, max_shard_size="5GB")
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
EOF
step "build a random $SHAPE Llama-3.1 with transformers" python3 "$W/build.py" "$SHAPE" "$W/hf" || exit 1
du -sh "$W/hf"
step "import" python3 tools/hf_checkpoint.py import "$W/hf" "$W/ckpt" || exit 1
cat "$W/ckpt/model_args.txt" | tr '\n' ' '; echo
rm -rf "$W/hf"
step "fine-tune $ITERS iterations from the import, offload $TIERS, fp8 moments" \
  torchrun --nproc_per_node 1 --master_port ${PORT:-29531} pretrain_gpt.py $(cat "$W/ckpt/model_args.txt") \
  --finetune --load "$W/ckpt" --save "$W/run" $SAVE_OPTIM --train-iters $ITERS --seq-length $SEQ \
  --micro-batch-size 1 --global-batch-size 1 --lr 1e-5 --bf16 --grad-reduce-in-bf16 --mock-data --seed 1234 \
  --device $DEVICE --log-interval 1 $RECOMPUTE --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 \
  --offload-tiers $TIERS --offload-nvme-path "$W/nvme" --offload-subgroup-size $SUB --loss-log "$OUT/hf_8b_loss.jsonl" \
  || exit 1
cp "$W/ckpt/model_args.txt" "$W/run/"  # our forward below builds the model from it
rm -rf "$W/nvme"
[ "${STOP_AFTER:-}" = train ] && { echo "stopped after training: FROM=export goes on from $W"; exit 0; }
fi
step "export" python3 tools/hf_checkpoint.py export "$W/run" "$W/export" || exit 1
rm -rf "$W/ckpt"  # the export found config.json in it (the run's --load): no longer needed
ls -la "$W/export"
python3 -c "
import torch; torch.manual_seed(7)
torch.save(torch.randint(0, $( [ "$SHAPE" = tiny ] && echo 512 || echo 128256 ), (1, 128)), '$W/tokens.pt')"
HF_FORWARD_DEVICE=$DEVICE HF_FORWARD_FLAGS=--bf16 step "our forward, bf16" torchrun --nproc_per_node 1 \
  --master_port ${PORT:-29532} tests/integration/hf_forward.py "$W/ours.pt" "$W/tokens.pt" "$W/run:1:1:1" || exit 1
cat > "$W/compare.py" <<'EOF'
import sys, torch, transformers
work, device = sys.argv[1:]
tokens = torch.load(f"{work}/tokens.pt")
ours = next(iter(torch.load(f"{work}/ours.pt").values()))
model = transformers.AutoModelForCausalLM.from_pretrained(f"{work}/export", dtype=torch.bfloat16).to(device).eval()
with torch.no_grad():
    theirs = model(tokens.to(device)).logits.float().cpu()
ours = ours[..., : theirs.shape[-1]]
diff = (ours - theirs).abs()
scale = theirs.abs().max().item()
agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
p, q = torch.log_softmax(theirs, -1), torch.log_softmax(ours, -1)
kl = (p.exp() * (p - q)).sum(-1).mean().item()
print(f"logits, {tokens.numel()} tokens: max |ours - transformers| {diff.max().item():.4g}, mean {diff.mean().item():.4g}, "
      f"logits' scale {scale:.4g} (max diff / scale {diff.max().item() / scale:.3g}); same top-1 token at "
      f"{agree * 100:.1f}% of positions; KL(transformers || ours) {kl:.3g} nats per token")
EOF
step "transformers' forward of the export, bf16, and the comparison" python3 "$W/compare.py" "$W" "$DEVICE" || exit 1
python3 -c "
import json; rows = [json.loads(l) for l in open('$OUT/hf_8b_loss.jsonl')]
print('losses:', ' '.join(f\"{r['loss']:.3f}\" for r in rows))"
df -h "$W" | tail -1
rm -rf "$W"
