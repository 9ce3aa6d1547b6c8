"""Storage alignment: O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical
block size. 4096 covers the devices in use (NVMe, SATA, virtio; Lustre and GPFS clients)."""

import torch

ALIGN = 4096


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return (nbytes + align - 1) // align * align


def align_down(nbytes: int, align: int = ALIGN) -> int:
    return nbytes // align * align


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` starting on an ALIGN boundary."""
    from .no_fork import unforked_zeros

    raw = unforked_zeros(nbytes + ALIGN)  # state snapshots: no child of the rank reads them
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift: shift + nbytes]
