"""metrics/: one record per iteration and per evaluation (``records``), handed to the console line
(``console``), TensorBoard, W&B and the engine's telemetry file (``sinks``); the engine's figures
by name (``offload_figures``); megatron-core's timers for the loop (``timers``); a run's sinks built from its flags (``run_metrics``).

May import: ``errors``, ``runtime``, ``model``, ``data``, ``checkpoint``, ``offload``, ``mlp_offload``'s face.
"""
