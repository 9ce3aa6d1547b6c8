"""offload/: the adapter between megatron-core and the engine — the optimizer facade
(``optimizer``), how it is built from the flags (``factory``, ``flags``), this rank's shard of the
DDP buckets as the engine's index space (``shard_layout``), the GPU gradient source, the per-node
facts printed at start-up (``job_facts``) and the capacity planner behind tools/plan_offload.py.

May import: ``errors``, ``runtime``, ``model``, ``data``, ``checkpoint``, and ``mlp_offload``'s face.
"""
