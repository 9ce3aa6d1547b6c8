"""telemetry/: what the engine reports of its work. Per-step records, each tier's traffic and the
prediction beside them (``traffic``); the optional Chrome-trace timeline (``trace``). May import the
file tiers' operation results only; the pipeline, the step and the engine import it."""
