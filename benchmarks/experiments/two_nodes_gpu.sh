#!/usr/bin/env bash
# Two nodes of two GPUs (fake SLURM, examples/slurm/multi_node.sbatch) against one torchrun of four GPUs: losses bit for bit.
# 1.03 B Llama shape, TP2 x DP2 (the tensor-parallel pair inside a node), global batch 8, bf16 moments, offload
# tiers gpu,host,nvme,pfs with small gpu and host budgets so that every tier holds state, fixed tier bandwidths
# (the same placement in both runs). The pfs path is one shared directory with job-scoped tokens
# (--offload-token-scope pfs=job); nvme is each node's own directory (node.sh: the node's TMPDIR).
#  ONE: torchrun --nproc_per_node 4 on the four GPUs.
#  TWO: multi_node.sbatch with SLURM's variables set as sbatch sets them; tests/integration/fake_slurm's srun
#       starts node.sh twice (node ranks 0 and 1), each node with its own TMPDIR and CUDA_VISIBLE_DEVICES
#       (0,1 and 2,3: FAKE_NODE_GPUS), as SLURM's GPU binding does; two torchrun agents, --nnodes 2.
# Prints a PASS/FAIL line and rank 0's job and node lines (hosts, I/O tokens per node / per job).
# Why TP2 x DP2: each TP and DP collective has two members, so its sums are the same bits whatever algorithm
# NCCL picks for the two layouts (in TWO each process sees only its node's two GPUs). The grad norm's
# all-reduce spans all four ranks: on a FAIL, see whether the grad norms part first (they are printed).
#   bash benchmarks/run_gpu.sh two_nodes_gpu      (device tool, kind nvidia-h200-x4, carry [".whl"]; about 3 min)
#   DRY_RUN=1 bash benchmarks/experiments/two_nodes_gpu.sh      (tiny shape, 2 x 2 CPU processes)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONWARNINGS=ignore
PY=${PYTHON:-python3}
ITERS=${ITERS:-5}
DISK=${DISK:-/var/tmp/two_nodes}; rm -rf "$DISK"; mkdir -p "$DISK/pfs" "$DISK/one_node" "$DISK/bin"
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --seq-length 32 --max-position-embeddings 32"
  DEVICE="--device cpu"; GPU_GB=0.00005; HOST_GB=0.0002; SUB=3000; LIMIT=240; NODE_GPUS=""; VOCAB=1024
  export OMP_NUM_THREADS=1
else
  SHAPE="--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --num-query-groups 4
    --seq-length 2048 --max-position-embeddings 2048"
  # 1.03 B at 6 B/param, a quarter per rank (TP2 x DP2): 1.5 GB in 26 subgroups of 60 MB; about 6 in HBM, 10 in
  # host memory beside the pipeline's buffers, the rest split between nvme and pfs (0.3 GB each per rank).
  DEVICE="--device cuda"; GPU_GB=${GPU_GB:-0.4}; HOST_GB=${HOST_GB:-0.9}; SUB=10000000; LIMIT=${LIMIT:-240}
  NODE_GPUS="0,1 2,3"; VOCAB=32000
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
fi
df -h "$DISK" | cat
MODEL="$SHAPE --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
  --vocab-size $VOCAB --micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 2
  --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data --seed 1234 --log-interval 1
  --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 $DEVICE"
OFFLOAD="--offload-tiers gpu,host,nvme,pfs --offload-gpu-cache-gb $GPU_GB --offload-host-cache-gb $HOST_GB
  --offload-subgroup-size $SUB --offload-bandwidths nvme=2:1,pfs=2:1 --offload-pfs-path $DISK/pfs
  --offload-token-scope pfs=job --offload-io-threads 4"
keep() { grep -v -i warn "$1" | grep -E "> (job:|node )|token|offload rank 0|iteration +[0-9]|rror|Killed|PASS|FAIL" | cut -c1-400; }

echo "== ONE: one node, torchrun --nproc_per_node 4"
# shellcheck disable=SC2086
timeout "$LIMIT" torchrun --nproc_per_node 4 --master_port "${PORT:-29531}" pretrain_gpt.py $MODEL $OFFLOAD \
  --offload-nvme-path "$DISK/one_node" --train-iters "$ITERS" --loss-log "$OUT/two_nodes_one.jsonl" > "$OUT/.one.log" 2>&1
echo "ONE exit $?"; keep "$OUT/.one.log" | tee "$OUT/two_nodes_one.log"

echo "== TWO: two nodes of two, examples/slurm/multi_node.sbatch"
# job.sh and node.sh call `python`: where only python3 exists, one on PATH for them.
command -v python > /dev/null || ln -s "$(command -v "$PY")" "$DISK/bin/python"
mkdir -p "$DISK/submit" "$DISK/slurm_log"
JOB_ID=31337
if [ -n "$NODE_GPUS" ]; then  # once training runs: each GPU's memory in use (each node on its own two)
  ( for _ in $(seq "$LIMIT"); do [ -s "$OUT/two_nodes_two.jsonl" ] && break; sleep 1; done
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | sed 's/^/GPU memory in use during TWO: /' \
      > "$OUT/two_nodes_gpus.txt" ) &
  WATCH=$!
fi
# shellcheck disable=SC2086
timeout "$LIMIT" env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u SLURM_PROCID -u SLURM_STEP_ID \
  PATH="$DISK/bin:$PWD/tests/integration/fake_slurm:$PATH" MLP_OFFLOAD_NO_SETUP=1 MLP_OFFLOAD_REPO="$PWD" \
  SLURM_SUBMIT_DIR="$DISK/submit" SLURM_JOB_ID=$JOB_ID SLURM_JOB_NAME=two-nodes SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 \
  SLURM_JOB_NODELIST=localhost GPUS_PER_NODE=2 MASTER_PORT="${PORT2:-29532}" PFS_ROOT="$DISK/pfs" \
  FAKE_SLURM_LOG="$DISK/slurm_log" FAKE_NODE_ROOT="$DISK/nodes" FAKE_RUNNING_JOBS=$JOB_ID FAKE_NODE_GPUS="$NODE_GPUS" \
  MODEL_ARGS="$MODEL" OFFLOAD_ARGS="$OFFLOAD" \
  bash examples/slurm/multi_node.sbatch --train-iters "$ITERS" --loss-log "$OUT/two_nodes_two.jsonl" \
  > "$OUT/.two.log" 2>&1
echo "TWO exit $?"; keep "$OUT/.two.log" | tee "$OUT/two_nodes_two.log"
# The iteration lines come from the last rank (node 1), which only its own log under LOG_DIR holds.
grep -rh -E "iteration +[0-9]+/" "$DISK/submit/logs/$JOB_ID/node1" | cut -c1-200 | tee -a "$OUT/two_nodes_two.log"
[ -n "$NODE_GPUS" ] && wait "$WATCH" && cat "$OUT/two_nodes_gpus.txt"
echo "node-local directories left: $(find "$DISK/nodes" -maxdepth 2 -name "mlp_offload.*" | wc -l)" \
     "| pfs swap namespaces left: $(find "$DISK/pfs" -maxdepth 2 -path "*mlp_offload/*" | wc -l)"

$PY - "$OUT" "$ITERS" <<'PY' | tee "$OUT/two_nodes_losses.txt"
import json, pathlib, sys
out, iters = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def losses(name):
    path = out / f"two_nodes_{name}.jsonl"
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
one, two = losses("one"), losses("two")
for it in sorted(one.keys() | two.keys()):
    print(f"iteration {it} (loss, grad norm): one node {one.get(it)!r}  two nodes {two.get(it)!r}  {'==' if one.get(it) == two.get(it) else '!='}")
ok = len(one) == iters and one == two
print(f"{'PASS' if ok else 'FAIL'}: two nodes of two vs one node of four, {len(two)}/{len(one)} iterations,",
      "losses and grad norms bit-identical" if ok else "different or missing")
PY
rm -f "$OUT/.one.log" "$OUT/.two.log"; rm -rf "$DISK"
