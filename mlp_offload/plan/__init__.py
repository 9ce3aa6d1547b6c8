"""plan/: measuring and deciding, before any state moves: the rates (tier probes, Adam and device
update rates, and their cache), the placement policy, the per-step traffic model (schedule), the
predicted update time, and the capacity plan of a shard without an engine. It imports only the
engine's config, subgroups, gradients, update kernels and tiers; the start-up, pipeline, relocation
and engine import it, never the other way."""
