#!/usr/bin/env bash
# Sourced by experiments that run several largest_model.sh-style runs into $OUT/<name>/ with $OUT/<name>.console:
# summarize_runs PATTERN WIDTH LINES prints, per run, the console's lines matching PATTERN (WIDTH characters, the
# last LINES) and one line per iteration of its largest.log; pack_runs NAME puts all of $OUT in $OUT/NAME.tgz (the
# device tool brings back only a few files).
summarize_runs() {
  local f name
  for f in "$OUT"/*.console; do
    name=$(basename "$f" .console); echo "=== $name"
    grep -v -i warn "$f" | grep -E "$1" | cut -c1-"$2" | tail -"$3"
    [ -f "$OUT/$name/largest.log" ] && python3 benchmarks/experiments/iteration_summary.py "$OUT/$name/largest.log"
  done
}
pack_runs() {
  tar czf "/tmp/$1.tgz" -C "$OUT" . && mv "/tmp/$1.tgz" "$OUT/" && ls -la "$OUT/$1.tgz"
}
