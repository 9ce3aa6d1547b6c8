#!/usr/bin/env bash
# One device call (issue 12): upstream Megatron-LM (tag core_v0.16.1, its megatron/training and
# pretrain_gpt.py exported to the ignored .upstream/, never committed; megatron-core from the carried
# 0.16.1 wheel) trains a tiny Llama-style GPT on tests/data/upstream_gpt and writes torch_dist
# checkpoints at iterations 4 and 8. Then, from upstream's iteration-4 checkpoint:
#   ours resumes to 8 without offload and with host+nvme offload;
#   ours also trains 1..8 from scratch and resumes from its own iteration 4. Logs and the iteration-4 checkpoint come back in $OUT.
# Prepare here:  git -C <Megatron-LM mirror> archive core_v0.16.1 megatron pretrain_gpt.py gpt_builders.py \
#   model_provider.py | tar -x -C .upstream && rm -rf .upstream/megatron/core
# Run there:     bash benchmarks/run_gpu.sh upstream_checkpoint   (carry .whl, .whl-upstream and .upstream;
#   .whl-upstream: pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions for cp312)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$PWD
# Upstream's training imports megatron.rl, which needs pydantic (carried in .whl-upstream; only upstream sees it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-upstream .whl-upstream/*.whl || exit 1
# Upstream runs `make` in megatron/core/datasets at start; the wheel ships the helpers built, no Makefile.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
UPSTREAM_DATA=$REPO/tests/data/upstream_gpt . benchmarks/experiments/upstream_flags.sh
UPSTREAM_ONLY="--transformer-impl local --legacy-tokenizer --no-gradient-accumulation-fusion --no-masked-softmax-fusion
 --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm"
W=/tmp/upstream_work; rm -rf $W; mkdir -p $W/nvme
# Upstream must not see this repo's megatron/training: run from .upstream with only the wheel on the path.
upstream() { (cd "$REPO/.upstream" && PYTHONPATH=/tmp/site:/tmp/site-upstream torchrun --nproc_per_node 1 --master-port 29511 \
  pretrain_gpt.py $UPSTREAM_COMMON $UPSTREAM_ONLY "$@"); }
ours() { PYTHONPATH=/tmp/site:$REPO torchrun --nproc_per_node 1 --master-port 29512 pretrain_gpt.py \
  $UPSTREAM_COMMON --device cuda "$@"; }

echo "== upstream 1..8"
upstream --data-cache-path $W/cache-up --save $W/up > $OUT/upstream_train.log 2>&1; echo "exit $?"
grep -E "iteration +[0-9]+/|saved checkpoint" $OUT/upstream_train.log | cut -c1-200
[ -d $W/up/iter_0000004 ] || { grep -E "Error|error" $OUT/upstream_train.log | tail -20; exit 1; }
mkdir -p $W/up4 && cp -r $W/up/iter_0000004 $W/up4/ && echo 4 > $W/up4/latest_checkpointed_iteration.txt
tar -czf $OUT/upstream_gpt_iter4.tar.gz -C $W up4; ls -la $OUT/upstream_gpt_iter4.tar.gz; find $W/up4 | head -30

# Upstream resuming its own checkpoint is not run: at core_v0.16.1 without apex or transformer-engine
# (torch's Adam), DistributedOptimizer.state_dict() asserts on the empty state before the first step
# (docs/results/upstream_checkpoint_h100_2026-11-22/upstream_resume.log).
echo "== ours resumes 4..8 from upstream's checkpoint, no offload"
ours --data-cache-path $W/cache-ours --load $W/up4 --save $W/ours_plain --loss-log $OUT/ours_plain.jsonl \
  > $OUT/ours_plain.log 2>&1; echo "exit $?"; grep -E "iteration +[0-9]+/|error|loaded" $OUT/ours_plain.log | cut -c1-200
echo "== ours resumes 4..8 from upstream's checkpoint, host+nvme offload"
ours --data-cache-path $W/cache-ours2 --load $W/up4 --save $W/ours_offload --loss-log $OUT/ours_offload.jsonl \
  --offload-tiers host,nvme --offload-host-cache-gb 0.002 --offload-nvme-path $W/nvme --offload-subgroup-size 20000 \
  > $OUT/ours_offload.log 2>&1; echo "exit $?"; grep -E "iteration +[0-9]+/|error|loaded" $OUT/ours_offload.log | cut -c1-200
echo "== ours 1..8 from scratch, then ours resumes 4..8 from its own checkpoint (the GPU's run-to-run baseline)"
ours --data-cache-path $W/cache-ours3 --save $W/ours --loss-log $OUT/ours_scratch.jsonl > $OUT/ours_scratch.log 2>&1; echo "exit $?"
mkdir -p $W/ours4 && cp -r $W/ours/iter_0000004 $W/ours4/ && echo 4 > $W/ours4/latest_checkpointed_iteration.txt
ours --data-cache-path $W/cache-ours4 --load $W/ours4 --save $W/ours_resumed --loss-log $OUT/ours_own_resumed.jsonl \
  > $OUT/ours_own_resumed.log 2>&1; echo "exit $?"
grep -E "^error" $OUT/ours_*.log
python3 benchmarks/upstream_losses.py $OUT | tee $OUT/summary.md
# At most 8 files come back: the logs travel as one archive.
(cd $OUT && tar -czf logs.tar.gz *.log *.jsonl && rm -f *.log *.jsonl)
