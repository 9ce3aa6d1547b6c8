"""copy_to_host: device-to-host copies through two pinned buffers, piece by piece (tiers.to_host)."""

import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload.tiers import to_host
from mlp_offload.tiers.no_fork import aligned_empty
from tests.profiles import examples

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def copy_through_two_buffers(src: torch.Tensor, piece: int):
    """copy_in_pieces with CPU buffers standing in for the pinned pair; returns dst and the calls made."""
    dst = torch.zeros_like(src)
    buffers = [torch.full((piece,), 0xEE, dtype=torch.uint8) for _ in range(2)]
    calls, in_buffer = [], [None, None]  # which part each buffer holds, not yet landed

    def move(k, part):
        assert in_buffer[k] is None, "a buffer was moved into before its last part landed"
        buffers[k][:part.numel()].copy_(part)
        in_buffer[k] = part.numel()
        calls.append(("move", k, part.numel()))

    def land(k, target):
        assert in_buffer[k] == target.numel()
        target.copy_(buffers[k][:target.numel()])
        in_buffer[k] = None
        calls.append(("land", k, target.numel()))
    to_host.copy_in_pieces(dst, src, piece, move, land)
    return dst, calls


@settings(max_examples=examples(40), deadline=None, derandomize=True, print_blob=True)
@given(numel=st.integers(0, 5000), piece=st.integers(1, 700))
def test_pieces_through_two_buffers_land_every_byte_in_order(numel, piece):
    src = torch.randint(0, 256, (numel,), dtype=torch.uint8)
    dst, calls = copy_through_two_buffers(src, piece)
    assert torch.equal(dst, src)
    pieces = -(-numel // piece)
    assert [c[0] for c in calls].count("move") == pieces == [c[0] for c in calls].count("land")
    # one part lands while the next moves: after the first move, each move comes before the previous land
    if pieces >= 2:
        assert [c[0] for c in calls[:3]] == ["move", "move", "land"]
    assert [c[1] for c in calls if c[0] == "move"] == [n % 2 for n in range(pieces)]


def test_without_a_gpu_it_is_a_plain_copy():
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.empty_like(src)
    to_host.copy_to_host(dst, src)
    assert torch.equal(dst, src)


@pytest.fixture
def piece_counts(monkeypatch):
    """The pieces each copy through the pinned pair was cut into (one entry a copy; none for a plain copy_)."""
    counts, real = [], to_host.copy_in_pieces

    def counted(dst, src, piece, move, land):
        counts.append(-(-src.numel() // piece))
        real(dst, src, piece, move, land)
    monkeypatch.setattr(to_host, "copy_in_pieces", counted)
    return counts


@needs_cuda
@pytest.mark.parametrize("numel", [1, to_host.PIECE // 4 - 3, to_host.PIECE // 4, 3 * to_host.PIECE // 4 + 5])
def test_on_cuda_device_to_pageable_host_through_pinned_pieces(numel, piece_counts):
    src = torch.randn(numel, device="cuda")
    dst = aligned_empty(numel * 4).view(torch.float32)  # pageable, never forked: a snapshot's staging buffer
    assert not dst.is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        to_host.copy_to_host(dst, src)
    assert torch.equal(dst, src.cpu())
    assert piece_counts == [-(-numel * 4 // to_host.PIECE)]  # the pinned pair carried it, not a plain copy_


@needs_cuda
def test_on_cuda_other_pairs_copy_as_torch_does(piece_counts):
    src = torch.randn(64, 3, device="cuda")
    for dst in (torch.empty(3, 64).t(), torch.empty(64, 3, dtype=torch.float64), torch.empty(64, 3, device="cuda")):
        to_host.copy_to_host(dst, src)  # not contiguous, another dtype, on the device: copy_ as given
        assert torch.equal(dst.cpu().to(src.dtype), src.cpu())
    assert piece_counts == []


@needs_cuda
def test_on_cuda_a_fork_beside_a_thread_that_copied_leaves_the_child_whole():
    """torch_dist's writer forks while the checkpoint's threads live: a child that freed their pinned
    buffers would make a CUDA call and abort."""
    import os
    import threading
    copied, finish = threading.Event(), threading.Event()

    def copier():
        to_host.copy_to_host(aligned_empty(4096 * 4).view(torch.float32), torch.randn(4096, device="cuda"))
        copied.set()
        finish.wait()
    thread = threading.Thread(target=copier)
    thread.start()
    try:
        assert copied.wait(60)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the forked child ended with status {status}"
    finally:
        finish.set()
        thread.join()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")
def test_a_staging_buffer_is_asked_for_huge_pages_and_left_out_of_children():
    """A snapshot's staging buffer is filled beside training: its mapping carries MADV_HUGEPAGE ("hg": a fault per
    2 MiB where the kernel grants it) and MADV_DONTFORK ("dc"), as /proc/self/smaps shows them."""
    buf = aligned_empty(8 << 20)
    at = buf.data_ptr()
    flags, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and all(c in "0123456789abcdef-" for c in fields[0]):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= at < hi
            elif inside and line.startswith("VmFlags:"):
                flags = fields[1:]
                break
    assert flags is not None and "hg" in flags and "dc" in flags, flags
