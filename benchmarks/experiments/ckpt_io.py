"""Save and load of one engine's offloaded state against the disk's O_DIRECT floor, measured in one
process: the checkpoint writer and reader as they are (O_DIRECT, threads) and through the page cache
(the same code with O_DIRECT refused, as on a file system without it), each twice, page cache dropped
before every one. Usage: python3 benchmarks/experiments/ckpt_io.py [DIR] [GB of state] (default
/var/tmp/ckpt_io, 6); prints one line per measurement and writes them to $OUT/ckpt_io.txt."""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.io_floor import file_bandwidth  # noqa: E402
from mlp_offload import OffloadConfig, OffloadedAdamW, direct_reader, direct_writer  # noqa: E402
from mlp_offload.checkpoint import load_engine_state  # noqa: E402
from mlp_offload.checkpoint_write import save_engine_state  # noqa: E402


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
    path = str(root / "state.offload")
    with OffloadedAdamW(torch.randn(numel), cfg) as eng:
        eng.modify_state(lambda sg, p, m, v: (m.normal_(), v.uniform_()))  # every page written, no zeros
        for mode in ("direct", "page cache", "direct", "page cache"):
            direct = mode == "direct"
            opened = direct_writer._open_direct
            direct_writer._open_direct = opened if direct else (lambda p: None)
            real_open = os.open
            if not direct:  # the reader's O_DIRECT open refused as a file system without it would
                direct_reader.os.open = lambda p, flags, *a: (_ for _ in ()).throw(OSError(22, "no O_DIRECT")) \
                    if flags & os.O_DIRECT else real_open(p, flags, *a)
            try:
                drop_cache()
                t = time.perf_counter()
                nbytes = save_engine_state(eng, path)
                save_s = time.perf_counter() - t
                drop_cache()
                t = time.perf_counter()
                load_engine_state(eng, path)
                load_s = time.perf_counter() - t
            finally:
                direct_writer._open_direct = opened
                direct_reader.os.open = real_open
            say(f"{mode:>10}: save {nbytes / 1e9:.2f} GB in {save_s:.2f} s = {nbytes / save_s / 1e9:.2f} GB/s "
                f"({nbytes / save_s / 1e9 / floor['write_gbps']:.0%} of the floor); load {load_s:.2f} s = "
                f"{nbytes / load_s / 1e9:.2f} GB/s ({nbytes / load_s / 1e9 / floor['read_gbps']:.0%})")
    os.unlink(path)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ckpt_io.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
