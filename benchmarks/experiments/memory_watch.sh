# Sourced by experiments: memory peaks, host used (free -m) and GPU used (nvidia-smi), sampled every
# second while $OUT/.watch exists (the GPU: the first of CUDA_VISIBLE_DEVICES); the latest peaks are in $2 (default $OUT/.peak), prefixed with $1.
# With $3 (a directory), also the peak growth of its file system's used space (df) since the start.
watch_memory() {  # $1: label, $2: file, $3: a directory whose disk to watch
  local file=${2:-$OUT/.peak} dir=${3:-}
  touch "$OUT/.watch"
  ( peak_h=0; peak_g=0; peak_d=0; base_d=0
    [ -n "$dir" ] && base_d=$(df --output=used -BM "$dir" | tail -1 | tr -dc 0-9)
    while [ -e "$OUT/.watch" ]; do
      h=$(free -m | awk '/^Mem:/{print $3}'); [ "$h" -gt "$peak_h" ] && peak_h=$h
      if command -v nvidia-smi >/dev/null; then
        g=$(nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i ${CUDA_VISIBLE_DEVICES%%,*}} --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ "${g:-0}" -gt "$peak_g" ] && peak_g=$g
      fi
      disk=""
      if [ -n "$dir" ]; then
        d=$(( $(df --output=used -BM "$dir" | tail -1 | tr -dc 0-9) - base_d )); [ "$d" -gt "$peak_d" ] && peak_d=$d
        disk=", peak disk growth ${peak_d} MiB"
      fi
      echo "$1 peak host used ${peak_h} MiB, peak GPU used ${peak_g} MiB$disk" > "$file"; sleep 1
    done ) &
}
