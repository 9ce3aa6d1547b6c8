"""Storage alignment: O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical
block size. 4096 covers the devices in use (NVMe, SATA, virtio; Lustre and GPFS clients). Sizes in
the config are checked against it; aligned buffers are made by ``tiers.no_fork.aligned_empty``."""

ALIGN = 4096


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return (nbytes + align - 1) // align * align


def align_down(nbytes: int, align: int = ALIGN) -> int:
    return nbytes // align * align
