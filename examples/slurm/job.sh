# Sourced by single_node.sbatch and multi_node.sbatch in the batch shell; `run_job "$@"` runs the job.
#
# Settings (environment variables; the sbatch scripts set the model, the rest has defaults):
#   PFS_ROOT          directory on the shared parallel file system (required): the "pfs" offload tier,
#                     with one namespace per job step inside (mlp_offload/<job>.<step>/rank<r>/)
#   CKPT              checkpoint directory, --save and --load (default: $PFS_ROOT/ckpt/$SLURM_JOB_NAME)
#   NODE_LOCAL_ROOT   where each node's "nvme" tier goes (default: the job's local scratch,
#                     $SLURM_TMPDIR, else $TMPDIR, else /tmp; resolved on each node); a directory
#                     mlp_offload.<job id> is made there and removed when the node's torchrun ends
#   GPUS_PER_NODE     ranks per node (default: the allocation's $SLURM_GPUS_ON_NODE)
#   HOST_CACHE_GB     --offload-host-cache-gb per rank (default 24)
#   PFS_TOKEN_SCOPE   node (default) or job: who takes turns on the PFS (docs/user_guide.md, "On a SLURM cluster")
#   SIGNAL_LEAD_S     seconds between #SBATCH --signal=TERM@N and the time limit (default 600; keep equal)
#   EXIT_SIGNAL       TERM (default) or USR1: with torch < 2.12 use USR1 and #SBATCH --signal=B:USR1@N
#                     (torchrun < 2.12 SIGKILLs its workers 30 s after a SIGTERM, whatever the save needs)
#   LOG_DIR           per-rank logs (default: $SLURM_SUBMIT_DIR/logs/<job id>)
#   MODEL_ARGS, OFFLOAD_ARGS, MASTER_PORT   replace the defaults; MLP_OFFLOAD_NO_SETUP=1 skips tools/setup_env.sh

run_job() {
    cd "$REPO"
    if [ "${MLP_OFFLOAD_NO_SETUP:-0}" != 1 ]; then
        # shellcheck disable=SC1091
        source tools/setup_env.sh
    fi
    : "${PFS_ROOT:?set PFS_ROOT to a directory on the shared parallel file system}"
    : "${MODEL_ARGS:?the sbatch script sets MODEL_ARGS}"
    mkdir -p "$PFS_ROOT"
    export PFS_ROOT NODE_LOCAL_ROOT="${NODE_LOCAL_ROOT:-}"
    export CKPT="${CKPT:-$PFS_ROOT/ckpt/${SLURM_JOB_NAME:-mlp_offload}}"
    export LOG_DIR="${LOG_DIR:-${SLURM_SUBMIT_DIR:-$REPO}/logs/$SLURM_JOB_ID}"
    export GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    if ! [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: GPUS_PER_NODE='$GPUS_PER_NODE': no GPU count in the allocation; ask for #SBATCH --gpus-per-node=N or set GPUS_PER_NODE" >&2
        return 2
    fi
    # Rendezvous: the first node of the allocation hosts it, on a port of this job's own.
    # (No pipe into head: under pipefail, scontrol's SIGPIPE on a long node list would end the job.)
    local hosts
    hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
    MASTER_ADDR="${hosts%%$'\n'*}"
    MASTER_PORT="${MASTER_PORT:-$(python -c "from megatron.training.runtime.slurm_env import job_port; print(job_port($SLURM_JOB_ID, 15))")}"
    export MASTER_ADDR MASTER_PORT
    # torchrun SIGKILLs its workers this long after passing SLURM's SIGTERM on: longer than the lead
    # time, so the checkpoint save that SIGTERM starts (--exit-signal-handler) can finish. torch < 2.12
    # ignores this and allows 30 s (measured on torch 2.11: docs/benchmarks.md); there, signal the ranks
    # alone with another signal and --exit-signal SIGUSR1 (docs/user_guide.md, "Time limits and preemption").
    local lead="${SIGNAL_LEAD_S:-600}"
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((lead + 60))}"
    # srun does not inherit sbatch's --cpus-per-task (SLURM >= 22.05): pass it on.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
    export OFFLOAD_ARGS="${OFFLOAD_ARGS:---offload-tiers host,nvme,pfs --offload-host-cache-gb ${HOST_CACHE_GB:-24} --offload-pfs-path $PFS_ROOT --offload-token-scope pfs=${PFS_TOKEN_SCOPE:-node}}"
    # Swap files of this chain's earlier jobs that died (node crash, SIGKILL) are removed first.
    python tools/offload_clean.py --slurm --delete "$PFS_ROOT"
    echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x $GPUS_PER_NODE GPU(s), rendezvous $MASTER_ADDR:$MASTER_PORT, checkpoints $CKPT, per-rank logs $LOG_DIR"
    local status=0 signal_args=()
    if [ "${EXIT_SIGNAL:-TERM}" = USR1 ]; then
        # torch < 2.12: SLURM warns this shell alone (#SBATCH --signal=B:USR1@N); it passes SIGUSR1 to
        # the ranks of every node, never to torchrun, which would SIGKILL them 30 s into their save.
        signal_args=(--exit-signal SIGUSR1)
        trap 'interrupted=1; srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash examples/slurm/node_signal.sh USR1' USR1
    fi
    # In the background, waited for: bash runs a trap only between commands, and srun is one long one.
    # shellcheck disable=SC2086
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        bash examples/slurm/node.sh $MODEL_ARGS --save "$CKPT" --load "$CKPT" --exit-signal-handler \
        "${signal_args[@]}" $OFFLOAD_ARGS "$@" &
    local srun_pid=$!
    while :; do
        interrupted=0 status=0
        wait "$srun_pid" || status=$?  # (not a bare wait: errexit would end the script on its status)
        [ "$interrupted" = 1 ] || break  # else a trapped signal ended the wait, not srun: wait again
    done
    if [ "$status" -ne 0 ]; then
        # A rank's one-line error sits in its own log; bring the first one here.
        grep -rh -m 1 "^error: " "$LOG_DIR" 2>/dev/null | head -n 1 >&2 || true
        echo "job $SLURM_JOB_ID failed (exit $status): per-rank logs in $LOG_DIR. The next job of the chain" \
             "resumes from the last complete checkpoint in $CKPT and removes this job's swap files on" \
             "$PFS_ROOT; to do that by hand: python tools/offload_clean.py --slurm --delete $PFS_ROOT" >&2
    fi
    return "$status"
}
