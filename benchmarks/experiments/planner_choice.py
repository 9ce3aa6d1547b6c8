"""The planner's recommendation as flags, for an experiment script that runs what the planner picks.

  python benchmarks/experiments/planner_choice.py PLAN.json FLAGS_OUT [TOP]

PLAN.json is ``tools/plan_offload.py --recommend --json`` output. Prints the TOP (default 6) fastest
candidates that fit, the chosen one beside the flags as given, and writes the chosen flags to FLAGS_OUT
one per line (for bash's ``mapfile``), less --global-batch-size (the script sets it) and
--offload-bandwidths (the training's engine probes its own disk), and to FLAGS_OUT.tflops the TFLOP/s the
candidate was planned at (--gpu-tflops scaled by its recompute's work), which planning the chosen flags
again needs: --gpu-tflops as given holds for the flags as given. Exit 1 where nothing fits.
"""

import json
import sys

DROPPED = {"--global-batch-size": 1, "--offload-bandwidths": 1}  # flag -> values after it


def chosen_flags(flags):
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
        elif f.split("=", 1)[0] in DROPPED:
            skip = DROPPED[f] if "=" not in f else 0
        else:
            out.append(f)
    return out


def main(plan_path, flags_out, top=6):
    plan = json.load(open(plan_path))
    advice = plan["recommendation"]
    gb = advice["global_batch_size"]
    rows = advice["candidates"]
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: -r["tokens_per_s"])
    print(f"planner, global batch {gb}: {len(fitting)} of {len(rows)} candidates fit; the fastest:")
    for r in fitting[:top]:
        print(f"  {r['candidate']}: {r['tokens_per_s']:,.0f} tokens/s (iteration {r['predicted_iteration_s']:.3f} s)")
    as_given = (f"{plan['tokens_per_s'][str(gb)]:,.0f} tokens/s, iteration {plan['predicted_iteration_s']:.3f} s"
                if plan["fits"] else "does not fit")
    chosen = advice["chosen"]
    if chosen is None:
        print(f"planner chose nothing: no candidate fits (as given: {as_given}: {'; '.join(plan['problems'])[:400]})")
        return 1
    print(f"planner chose: {chosen['candidate']}: {chosen['tokens_per_s']:,.0f} tokens/s, iteration "
          f"{chosen['predicted_iteration_s']:.3f} s (as given: {as_given})")
    with open(flags_out, "w") as f:
        f.write("\n".join(chosen_flags(chosen["flags"])) + "\n")
    with open(flags_out + ".tflops", "w") as f:
        f.write(f"{chosen['gpu_tflops']:.6g}\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.split("\n\n")[1].strip())
    sys.exit(main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:])))
