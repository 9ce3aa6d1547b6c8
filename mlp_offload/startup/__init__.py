"""startup/: an engine's start. Measuring and planning (``measure``: tiers, rates, placement,
prediction), the initial state in memory and the pipeline's buffers (``initial_state``), and the
engine's parts wired from its config (``wiring``). May import every engine module but the engine and
the checkpoint; only the engine imports it."""
