"""runtime/: the process a rank runs in — SIGTERM and save-and-exit signals, child processes that die
with the rank, SLURM's variables, megatron-core adapted to a CPU device, Megatron-LM's per-iteration
hooks (profiler, GC), progress lines for long steps, and what the loop and checkpoints ask of an
optimizer (``optimizer_interface``).

May import: ``errors`` and the engine's face (``mlp_offload``). Every other sub-package may import it.
"""
