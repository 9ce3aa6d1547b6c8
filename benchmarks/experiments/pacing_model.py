"""Where this tree's pacer would place a save's bytes beside a tier that is busy for its update and quiet for its
forward and backward (a model of the rule, not a measurement): the bytes moved beside the tier's I/O per step.

    PYTHONPATH=TREE python benchmarks/experiments/pacing_model.py --gb 18.3 --disk-gbps 2.2 --step-s 5.2 \
        --busy 0.75 --steps-to-due 14

The tier is the unit tests' ``StepsTier``: one busy span a step (as the update window makes an update), no gaps.
One writer moves all the bytes, in 32 MiB chunks each taking the disk's time, at the cap of one writer.
"""

from __future__ import annotations

import argparse
import sys

from tests.unit.test_writer_pacing import paced_write_beside_steps


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, required=True, help="the save's bytes through the disk, GB")
    parser.add_argument("--disk-gbps", type=float, required=True)
    parser.add_argument("--step-s", type=float, required=True)
    parser.add_argument("--busy", type=float, required=True, help="of each step, the tier's busy share (its update)")
    parser.add_argument("--steps-to-due", type=int, required=True, help="steps from the save to the due time")
    args = parser.parse_args(argv[1:])
    chunk = 32 << 20
    total = int(args.gb * 1e9) // chunk * chunk
    elapsed, beside, moved, pacer = paced_write_beside_steps(total, chunk, args.disk_gbps * 1e9, args.busy,
                                                             args.steps_to_due, step_s=args.step_s)
    steps = [i for i, m in enumerate(moved) if m]
    print(f"{total / 1e9:.1f} GB in {elapsed:.1f} s ({elapsed / args.step_s:.1f} steps; due at {args.steps_to_due}): "
          f"{pacer.idle_bytes / 1e9:.1f} GB in the quiet spells, {pacer.capped_bytes / 1e9:.1f} GB beside the updates")
    print("per step, GB beside the update / moved: " +
          ", ".join(f"{i + 1}: {beside[i] / 1e9:.2f}/{moved[i] / 1e9:.2f}" for i in steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
