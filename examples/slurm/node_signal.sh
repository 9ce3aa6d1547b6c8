#!/usr/bin/env bash
# Run by job.sh through `srun --overlap`, once per node: send the signal (USR1) to this node's ranks,
# the children of the torchrun that node.sh started, and not to torchrun itself.
set -u
pidfile="$LOG_DIR/node$SLURM_PROCID/torchrun.pid"
if ! pkill "-$1" -P "$(cat "$pidfile")"; then
    echo "node_signal.sh: no rank found under the torchrun of $pidfile" >&2
    exit 1
fi
