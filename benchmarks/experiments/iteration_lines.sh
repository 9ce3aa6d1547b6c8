# Sourced by experiments: iteration_lines LOG prints one short line per training iteration of LOG: its number,
# elapsed time, the offload update time, the engine's predicted iteration time and the model TFLOP/s per GPU
# (where the line has them).
iteration_lines() {
  grep -E "iteration +[0-9]+/" "$1" | while read -r line; do
    echo "$(grep -o 'iteration *[0-9]*/' <<<"$line" | head -1) $(grep -o 'elapsed time per iteration (ms): [0-9.]*\|offload update time (ms): [0-9.]*\|offload predicted iteration time (ms): [0-9.]*\|throughput per GPU (TFLOP/s/GPU): [0-9.]*' <<<"$line" | paste -sd' ')"
  done
}
