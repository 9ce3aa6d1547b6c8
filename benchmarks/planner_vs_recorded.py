"""The capacity planner (tools/plan_offload.py) against real GPU runs recorded in docs/results.

  python benchmarks/planner_vs_recorded.py > docs/results/plan_vs_recorded.md

Each case gives the planner the run's own flags (from the benchmark script that ran it) and the
rates the engine measured and logged in that run (disk bandwidths, CPU Adam), then sets its
prediction beside what the run's log measured. Runs on any machine: nothing is probed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")

LLAMA_1B = ("--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
            "--vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --swiglu --normalization RMSNorm "
            "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
            "--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 --global-batch-size 4 --bf16 --device cuda "
            "--recompute-granularity full --offload-tiers host,nvme --offload-nvme-path /var/tmp/trust/nvme "
            "--offload-host-cache-gb 4 --offload-io-threads 8")  # benchmarks/experiments/save_signal_resume.sh
LLAMA_9B = ("--num-layers 48 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --group-query-attention "
            "--num-query-groups 8 "
            "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
            "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1 --bf16 --device cuda "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--offload-tiers host,nvme --offload-nvme-path /var/tmp/offload_big --offload-host-cache-gb 70 "
            "--offload-subgroup-size 100000000 --offload-io-threads 8")  # benchmarks/experiments/largest_model.sh

CASES = [
    # (name, log file, pretrain flags, machine flags, iterations to average)
    ("1.03 G Llama, host 4 GB + disk, one H100 (2026-11-22)", "trust_h100_2026-11-22.log", LLAMA_1B,
     "--gpu-memory-gb 79 --host-memory-gb 128 --offload-nvme-capacity-gb 60", slice(1, 6)),
    ("8.77 G Llama, host 70 GB + disk, one H200 (2026-11-21)", "biggest_h200_2026-11-21.log", LLAMA_9B,
     "--gpu-memory-gb 139 --host-memory-gb 128 --offload-nvme-capacity-gb 60", slice(1, 2)),
]
ENGINE_LINE = re.compile(r"offload rank 0: (\d+) params in (\d+) subgroups; placement (\{[^}]*\}).*?adam ([\d.]+) "
                         r"Gelem/s; nvme r ([\d.]+) w ([\d.]+)(?: r\+w ([\d.]+))? GB/s.*?predicted update ([\d.]+)s "
                         r"\(adam ([\d.]+)s")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \| "
                       r"forward-backward \(ms\): ([\d.]+) \|.*?optimizer \(ms\): ([\d.]+)")


def recorded(log_path):
    text = open(log_path).read()
    engine = ENGINE_LINE.search(text)
    numel, adam_gelems, adam_s = int(engine.group(1)), float(engine.group(4)), float(engine.group(9))
    # The log gives Adam's rate and Adam plus conversion's time: the conversion rate follows.
    convert_gelems = numel / (adam_s - numel / (adam_gelems * 1e9)) / 1e9
    rates = ":".join(g for g in engine.group(5, 6, 7) if g)
    iterations = {}
    for m in ITERATION.finditer(text):  # the first run's iterations (a log may hold several runs)
        iterations.setdefault(int(m.group(1)), tuple(float(x) / 1e3 for x in m.group(2, 3, 4)))
    counted = re.search(r"model parameters \(all stages, one replica\): (\d+)", text)
    params = int(counted.group(1)) if counted else None  # not every log kept that line
    return {"numel": numel, "params": params, "subgroups": int(engine.group(2)), "placement": engine.group(3),
            "adam_gelems": adam_gelems, "convert_gelems": convert_gelems, "nvme": rates,
            "engine_predicted_update_s": float(engine.group(8)),
            "iterations": [iterations[k] for k in sorted(iterations)]}


def planned(flags, machine, rec):
    cmd = [sys.executable, os.path.join(REPO, "tools", "plan_offload.py"), "--json", *machine.split(),
           "--adam-gelems", f"{rec['adam_gelems']}", "--convert-gelems", f"{rec['convert_gelems']:.3f}",
           "--offload-bandwidths", f"nvme={rec['nvme']}", *flags.split()]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main():
    print("| run | placement planned / engine | update planned / engine's prediction / measured (s) "
          "| iteration planned / measured (s) | fwd+bwd planned / measured (s) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, log, flags, machine, steady in CASES:
        rec = recorded(os.path.join(RESULTS, log))
        plan = planned(flags, machine, rec)
        # The flags must still build the recorded network (the engine's shard is its DDP bucket, padded).
        shard = plan["optimizer_state_elements_per_rank"]
        if rec["params"] not in (None, plan["params_total"]) or not shard <= rec["numel"] < shard * 1.01 + 256:
            sys.exit(f"{name}: the plan counts {plan['params_total']} parameters ({shard} per rank), the run had "
                     f"{rec['params']} ({rec['numel']} per rank)")
        its = rec["iterations"][steady]
        mean = [sum(x[k] for x in its) / len(its) for k in range(3)]
        print(f"| {name} | {plan['placement']} / {rec['placement']} | {plan['predicted_update_s']:.2f} / "
              f"{rec['engine_predicted_update_s']:.2f} / {mean[2]:.2f} | {plan['predicted_iteration_s']:.2f} / "
              f"{mean[0]:.2f} | {plan['predicted_compute_s']:.2f} / {mean[1]:.2f} |")


if __name__ == "__main__":
    main()
