"""How fast host memory can be pinned for the optimizer state (issue 31: the start-up's largest part):
anonymous mmap + cudaHostRegister as the host tier does it, then with transparent huge pages asked for
(MADV_HUGEPAGE), then also with the pages faulted in first by torch's threads (zero_), each on a fresh
mapping of GB gigabytes. Prints GB/s per way and the kernel's THP setting."""

import mmap
import sys
import time

import torch

GB = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
nbytes = int(GB * 1e9)
try:
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError:
    thp = "unknown"
print(f"transparent_hugepage: {thp}; torch threads {torch.get_num_threads()}")


def pin(huge: bool, prefault: bool) -> float:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_DONTFORK)
    if huge:
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    t0 = time.perf_counter()
    if prefault:
        raw.zero_()
    t1 = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0))
    t2 = time.perf_counter()
    assert code == 0, code
    torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())
    del raw
    region.close()
    print(f"huge pages {huge!s:5} prefault {prefault!s:5}: {GB:.0f} GB in {t2 - t0:.2f} s "
          f"({GB / (t2 - t0):.2f} GB/s; fault {t1 - t0:.2f} s, register {t2 - t1:.2f} s)", flush=True)
    return t2 - t0


for huge, prefault in ((False, False), (True, False), (False, True), (True, True)):
    pin(huge, prefault)
