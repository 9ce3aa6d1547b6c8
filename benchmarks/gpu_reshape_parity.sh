#!/usr/bin/env bash
# One device call: the update time before and after the engine's reshaping, side by side.
# The same 1.03 B Llama shape and host (4 GB) + disk configuration as docs/benchmarks.md section 3,
# run twice each, alternating, from the old tree (carried in .old/, made by
#   git archive f7a20c2 | tar -x -C .old) and from this one.
# Needs megatron-core (and psutil) wheels in .whl/: device tool carry [".whl", ".old"].
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name --format=csv,noheader
DISK=${DISK:-/var/tmp/parity}; rm -rf "$DISK"; mkdir -p "$DISK/nvme"
ARGS="--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention --num-query-groups 4
 --vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --swiglu --normalization RMSNorm
 --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
 --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 4 --global-batch-size 4 --train-iters ${ITERS:-4}
 --lr 3e-4 --bf16 --mock-data --device cuda --log-interval 1 --seed 1234 --recompute-granularity full
 --offload-tiers host,nvme --offload-nvme-path $DISK/nvme --offload-host-cache-gb 4 --offload-io-threads 8
 --offload-bandwidths nvme=${BW:-2.0:2.0}"
T0=$SECONDS
for round in $(seq ${ROUNDS:-2}); do
  for tree in old new; do
    dir=$PWD; [ $tree = old ] && dir=$PWD/.old
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir torchrun --nproc_per_node 1 pretrain_gpt.py $ARGS \
        --loss-log "$OUT/$tree$round.jsonl") > "$OUT/$tree$round.log" 2>&1
    echo "$tree round $round done at $(( SECONDS - T0 )) s"
  done
done
python3 - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
updates = {"old": [], "new": []}
for tree in updates:
    for r in range(1, int(__import__("os").environ.get("ROUNDS", "2")) + 1):
        for line in open(f"{out}/{tree}{r}.log"):
            m = re.match(r"iteration +(\d+)/.*\| update ([0-9.]+)s \(pred ([0-9.]+)s\)", line)
            if m:
                print(f"{tree} round {r} iteration {m.group(1)}: update {m.group(2)} s, predicted {m.group(3)} s")
                if int(m.group(1)) > 1:  # the first step materializes the state: not steady
                    updates[tree].append(float(m.group(2)))
mean = {t: sum(u) / len(u) for t, u in updates.items() if u}
print("steady update, mean s:", {t: round(v, 3) for t, v in mean.items()})
if len(mean) == 2:
    print(f"new / old = {mean['new'] / mean['old']:.3f}")
same = all(open(f"{out}/old{r}.jsonl").read() == open(f"{out}/new{r}.jsonl").read()
           for r in range(1, int(__import__("os").environ.get("ROUNDS", "2")) + 1))
print("loss logs identical, old vs new:", same)
PY
rm -rf "$DISK"
