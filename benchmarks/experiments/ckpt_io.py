"""Save and load of one engine's offloaded state against the disk's O_DIRECT floor, measured in one
process, twice each, page cache dropped before every one; the second save goes to a file of its own beside
the first, as a run's checkpoints do (until 2026-12-02 it replaced the first, which measured slower). Usage: python3 benchmarks/experiments/ckpt_io.py
[DIR] [GB of state] (default /var/tmp/ckpt_io, 6); prints one line per measurement and writes them to
$OUT/ckpt_io.txt. (At 50addb4 it also timed the writer and reader with O_DIRECT refused, by patching the
engine's insides; benchmarks use the engine's face only, so that mode is gone: docs/benchmarks.md §15 keeps
its figures with the commit.)"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.io_floor import file_bandwidth  # noqa: E402
from mlp_offload import OffloadConfig, OffloadedAdamW, save_engine_state  # noqa: E402
from mlp_offload.checkpoint import load_engine_state  # noqa: E402


def drop_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        pass  # not root: the reads may come from memory (said below)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/var/tmp/ckpt_io")
    state_gb = float(sys.argv[2]) if len(sys.argv) > 2 else 6.0
    root.mkdir(parents=True, exist_ok=True)
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    floor = file_bandwidth(str(root), 4 << 30)
    say(f"O_DIRECT floor (benchmarks/io_floor.py, 8 threads, 4 GiB): write {floor['write_gbps']:.2f} GB/s, "
        f"read {floor['read_gbps']:.2f} GB/s")
    numel = int(state_gb * 1e9 / 12)
    cuda = torch.cuda.is_available()
    cfg = OffloadConfig(tiers=["host"], subgroup_size=100_000_000, adam_elems_per_s=1e9, run_id="ckpt_io",
                        pin_memory=cuda, device="cuda" if cuda else "cpu")
    paths = [str(root / f"state{k}.offload") for k in range(2)]
    with OffloadedAdamW(torch.randn(numel), cfg) as eng:
        eng.modify_state(lambda sg, p, m, v: (m.normal_(), v.uniform_()))  # every page written, no zeros
        for path in paths:  # the second beside the first, as a run's next checkpoint beside its last
            drop_cache()
            t = time.perf_counter()
            nbytes = save_engine_state(eng, path)
            save_s = time.perf_counter() - t
            drop_cache()
            t = time.perf_counter()
            load_engine_state(eng, path)
            load_s = time.perf_counter() - t
            say(f"save {nbytes / 1e9:.2f} GB in {save_s:.2f} s = {nbytes / save_s / 1e9:.2f} GB/s "
                f"({nbytes / save_s / 1e9 / floor['write_gbps']:.0%} of the floor); load {load_s:.2f} s = "
                f"{nbytes / load_s / 1e9:.2f} GB/s ({nbytes / load_s / 1e9 / floor['read_gbps']:.0%})")
    for path in paths:
        os.unlink(path)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ckpt_io.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
