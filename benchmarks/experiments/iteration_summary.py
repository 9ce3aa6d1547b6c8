"""One line per iteration of a training log: the iteration, its time, the offload update time (the host's
share under the overlap), the CPU's Adam, the device's update, the forward's wait for it and the
predicted iteration, where the console line gives them.
  python benchmarks/experiments/iteration_summary.py LOG"""

import re
import sys

FIELDS = {"elapsed time per iteration (ms)": "iter", "offload update time (ms)": "update",
          "offload adam time (ms)": "adam", "offload device update time (ms)": "device",
          "offload forward wait (ms)": "forward wait", "offload predicted iteration time (ms)": "predicted"}


def main(path: str) -> None:
    for line in open(path, errors="replace"):
        head = re.search(r"iteration\s+(\d+)/\s*(\d+)", line)
        if not head:
            continue
        parts = [f"it {head.group(1)}"]
        for field, short in FIELDS.items():
            found = re.search(re.escape(field) + r":\s*([0-9.]+)", line)
            if found:
                parts.append(f"{short} {found.group(1)}")
        print(" | ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1])
