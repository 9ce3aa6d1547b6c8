#!/usr/bin/env bash
# Sourced by experiments: since_launch prefixes each line of its input with the seconds since it started
# (the time to the first steady iteration, issue 31).
since_launch() { python3 -u -c 'import sys, time
t0 = time.time()
for line in sys.stdin: sys.stdout.write(f"[{time.time() - t0:7.1f} s] {line}")'; }
