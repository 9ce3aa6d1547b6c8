"""The synchronous save's and the load's GB/s against the disk's floor of the same call, and whether each
is at least GOAL of it. Usage: python3 benchmarks/experiments/save_rate.py FLOOR_TXT SAVE_LOG LOAD_LOG
(determinism.sh's determinism_floor.txt, determinism_D1.log, determinism_DR.log): one line per save, one
per load, each part's GB/s where the line gives them."""

import re
import sys

GOAL = 0.80
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
RATE = rf"{NUMBER} GB in {NUMBER} s \({NUMBER} GB/s\)"


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def floor(text: str):
    found = re.search(rf"write {NUMBER} GB/s, read {NUMBER} GB/s", text)
    return (float(found.group(1)), float(found.group(2))) if found else (None, None)


def parts(line: str) -> str:
    """ "torch_dist 0.42 GB/s, offloaded optimizer state 0.56 GB/s" from a save's or a load's line."""
    named = []
    for name in ("torch_dist", "offloaded optimizer state"):
        found = re.search(rf"{name} {RATE}", line)
        if found:
            named.append(f"{name} {found.group(1)} GB in {found.group(2)} s ({found.group(3)} GB/s)")
    return "; ".join(named)


def verdict(what: str, found: tuple, floor_gbps, kind: str) -> str:
    """``found``: the line's GB, seconds and GB/s (the rate as printed: from the unrounded seconds)."""
    gb, seconds, rate = map(float, found)
    if floor_gbps is None:
        return f"{what}: {gb:.3f} GB in {seconds:.1f} s = {rate:.2f} GB/s (no {kind} floor measured)"
    share = rate / floor_gbps
    met = "met" if share >= GOAL else "NOT met"
    return (f"{what}: {gb:.3f} GB in {seconds:.1f} s = {rate:.2f} GB/s, {share:.0%} of the {kind} floor "
            f"{floor_gbps:.2f} GB/s: {met} (goal >= {GOAL:.0%})")


def main() -> None:
    write_floor, read_floor = floor(read(sys.argv[1]))
    for found in re.finditer(rf"> saved checkpoint at iteration (\d+) to \S+: {RATE}(.*)", read(sys.argv[2])):
        iteration, rest = found.group(1), found.group(5)
        print(verdict(f"synchronous save at {iteration}", found.groups()[1:4], write_floor, "write"))
        if parts(rest):
            print(f"  {parts(rest)}")
    load_log = read(sys.argv[3])
    reads = re.search(rf"> checkpoint read from \S+: {RATE}(.*)", load_log)
    for found in re.finditer(rf"> loading checkpoint from \S+: done, {RATE}", load_log):
        print(verdict("load", found.groups(), read_floor, "read"))
        if reads:
            print(f"  of it the reads {reads.group(1)} GB in {reads.group(2)} s; {parts(reads.group(4))}")


if __name__ == "__main__":
    main()
