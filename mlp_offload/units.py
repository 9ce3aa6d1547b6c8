"""Byte units, in one place for the engine (the Megatron layer keeps its own in runtime/host_memory)."""

MiB = 1 << 20
GiB = 1 << 30
