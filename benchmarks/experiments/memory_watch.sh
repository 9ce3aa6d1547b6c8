# Sourced by experiments: memory peaks, host used (free -m) and GPU used (nvidia-smi), sampled every
# second while $OUT/.watch exists; the latest peaks are in $2 (default $OUT/.peak), prefixed with $1.
watch_memory() {  # $1: label, $2: file
  local file=${2:-$OUT/.peak}
  touch "$OUT/.watch"
  ( peak_h=0; peak_g=0
    while [ -e "$OUT/.watch" ]; do
      h=$(free -m | awk '/^Mem:/{print $3}'); [ "$h" -gt "$peak_h" ] && peak_h=$h
      if command -v nvidia-smi >/dev/null; then
        g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ "${g:-0}" -gt "$peak_g" ] && peak_g=$g
      fi
      echo "$1 peak host used ${peak_h} MiB, peak GPU used ${peak_g} MiB" > "$file"; sleep 1
    done ) &
}
