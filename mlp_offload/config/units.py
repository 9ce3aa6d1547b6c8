"""Byte units, in one place: the engine's modules import them from here, code outside the engine from
its face (``mlp_offload``)."""

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9  # decimal gigabytes: rates and sizes as printed (GB/s)
