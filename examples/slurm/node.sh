#!/usr/bin/env bash
# One node of the job, started by srun once per node (job.sh): torchrun with one rank per GPU and a
# static rendezvous at MASTER_ADDR:MASTER_PORT, this node's rank being this task's SLURM_PROCID.
# The node's local "nvme" tier directory is made first and removed at the end, however torchrun ended.
# Arguments: pretrain_gpt.py's.
set -uo pipefail
NODE_RANK="$SLURM_PROCID"
NNODES="$SLURM_NTASKS"
LOCAL_DIR="${NODE_LOCAL_ROOT:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}}}/mlp_offload.$SLURM_JOB_ID"
mkdir -p "$LOCAL_DIR" || exit 2
# Every rank's output goes to its own file under LOG_DIR/node<N>/; only global rank 0's also to the
# job's output (local rank 0 of node 0; a local rank that does not exist silences the other nodes).
FILTER=0
if [ "$NODE_RANK" != 0 ]; then FILTER="$GPUS_PER_NODE"; fi
# SLURM's --signal reaches every process of the step, torchrun and its workers included: this shell
# only has to outlive them, so it can remove the node's files after the save.
trap 'interrupted=1; echo "node $NODE_RANK ($(hostname)): SIGTERM; the ranks save a checkpoint and exit" >&2' TERM
torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --log-dir "$LOG_DIR/node$NODE_RANK" --tee 3 --local-ranks-filter "$FILTER" \
    pretrain_gpt.py "$@" --offload-nvme-path "$LOCAL_DIR" &
pid=$!
# Where node_signal.sh finds this node's torchrun (the ranks are its children).
mkdir -p "$LOG_DIR/node$NODE_RANK" && echo "$pid" > "$LOG_DIR/node$NODE_RANK/torchrun.pid"
while :; do
    interrupted=0 status=0
    wait "$pid" || status=$?
    [ "$interrupted" = 1 ] || break  # else a trapped signal ended the wait, not torchrun: wait again
done
rm -rf "$LOCAL_DIR"
exit "$status"
