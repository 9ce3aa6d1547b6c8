"""Loss per iteration of upstream Megatron-LM's logs and this repo's loss logs, side by side
(used by benchmarks/experiments/upstream_checkpoint.sh; argument: the folder holding the logs)."""

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def upstream_losses(path: Path) -> dict:
    if not path.exists():
        return {}
    return {int(m.group(1)): float(m.group(2)) for m in map(LINE.search, path.read_text().splitlines()) if m}


def our_losses(path: Path) -> dict:
    if not path.exists():
        return {}
    return {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def main(folder: Path) -> None:
    columns = {
        "upstream 1..8": upstream_losses(folder / "upstream_train.log"),
        "ours resumed": our_losses(folder / "ours_plain.jsonl"),
        "ours resumed, offload": our_losses(folder / "ours_offload.jsonl"),
        "ours 1..8": our_losses(folder / "ours_scratch.jsonl"),
        "ours resumed from its own": our_losses(folder / "ours_own_resumed.jsonl"),
    }
    print("| iteration | " + " | ".join(columns) + " |")
    print("| ---: |" + " ---: |" * len(columns))
    for it in range(1, 9):
        cells = [f"{c[it]:.6E}" if it in c else "" for c in columns.values()]
        print(f"| {it} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
