"""What the resume check's digests add to an offloaded state's save and load: one engine's state
(host and nvme tiers, fp32 master, fp32 or fp8 moments) saved into a file and loaded back, with and
without a ``StateDigest`` on the writer and on the fill, each timed. Run it where the file tiers and
the checkpoint share a disk, as on a training node.

    python benchmarks/digest_cost.py --dir /path/on/the/disk [--gparams 0.25] [--moments fp32] [--beside-training]

With ``--beside-training`` each save runs on a thread of its own, as a background save does, while this thread
makes small torch calls as a training step's Python does (benchmarks/digest_rate.py): their rate and this
thread's voluntary switches during the save, against the same calls alone, show what the save's threads take
of the GIL with and without the digest.
"""

import argparse
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp_offload import ModelLink, OffloadConfig, OffloadedAdamW  # noqa: E402
from mlp_offload.checkpoint import StateFile, fill_engine  # noqa: E402
from mlp_offload.checkpoint import StateDigest, save_engine_state  # noqa: E402
from benchmarks.digest_rate import for_seconds, small_calls  # noqa: E402


def save_beside_calls(eng, path: str, digest):
    """(bytes saved, torch calls a second and voluntary switches of this thread meanwhile): the save on a thread."""
    saved = {}
    writer = threading.Thread(target=lambda: saved.update(nbytes=save_engine_state(eng, path, digest=digest)))
    writer.start()
    rate, switches = small_calls(lambda: not writer.is_alive())
    writer.join()
    return saved["nbytes"], rate, switches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--gparams", type=float, default=0.25, help="billions of parameters in the shard")
    parser.add_argument("--moments", default="fp32", choices=["fp32", "bf16", "fp8"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--beside-training", action="store_true",
                        help="each save on a thread of its own beside small torch calls on this one")
    args = parser.parse_args()
    if args.beside_training:
        torch.set_num_threads(1)  # the calls are one thread's, as the training thread's Python is
    numel = int(args.gparams * 1e9)
    nvme = os.path.join(args.dir, "digest-cost-nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = OffloadConfig(tiers=["host", "nvme"], paths={"nvme": nvme}, subgroup_size=50_000_000, run_id="digest-cost",
                        host_budget_bytes=4 << 30, bandwidths={"nvme": (2e9, 2e9)}, adam_elems_per_s=1e9,
                        state_dtypes=("fp32", args.moments, args.moments))
    segments = [(0, 0, numel)]
    pieces = [["w", 0, numel, 0]]
    path = os.path.join(args.dir, "digest-cost.offload")
    with OffloadedAdamW(torch.randn(numel), cfg, numel=numel, model=ModelLink(param_segments=segments)) as eng:
        for label, with_digest in [("without", False), ("with", True)] * args.repeats:
            digest = StateDigest.of_engine(eng, pieces) if with_digest else None
            os.sync()
            beside = ""
            if args.beside_training:
                alone = small_calls(for_seconds(2.0))
            started = time.perf_counter()
            if args.beside_training:
                nbytes, rate, switches = save_beside_calls(eng, path, digest)
                beside = (f"; small torch calls meanwhile {rate:.0f}/s against {alone[0]:.0f}/s alone "
                          f"({alone[0] / rate:.2f}x slower), {switches} voluntary switches")
            else:
                nbytes = save_engine_state(eng, path, digest=digest)
            save_s = time.perf_counter() - started
            os.sync()
            os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
            observed = StateDigest.of_engine(eng, pieces)
            started = time.perf_counter()
            with StateFile(path) as saved:
                fill_engine(eng, saved, observe=observed.observing if with_digest else None)
            load_s = time.perf_counter() - started
            same = "" if not with_digest else f", digests equal: {observed.result() == digest.result()}"
            print(f"{label:7s} digests: save {nbytes / 1e9:.2f} GB in {save_s:.2f} s "
                  f"({nbytes / 1e9 / save_s:.2f} GB/s), "
                  f"load in {load_s:.2f} s ({nbytes / 1e9 / load_s:.2f} GB/s){same}{beside}", flush=True)
    os.unlink(path)


if __name__ == "__main__":
    main()
