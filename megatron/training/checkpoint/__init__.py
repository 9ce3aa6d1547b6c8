"""checkpoint/: saving and loading, in Megatron-LM's torch_dist layout — ``checkpointing`` (save and
``load_checkpoint``), the load plan (``load_plan``) and one loader per kind of state (``loaders``),
the model's part (``model_state``), figures and lines across ranks (``across_ranks``), the format and
strategies, the proof of completeness (``integrity``), RNG states, the args kept in a checkpoint
(``saved_args``), background saves, and the offloaded optimizer state: written per rank
(``offloaded_state``), indexed once per load (``saved_offload``) and read back whole, by name or by
global region whatever layout wrote it (``offload_reader``, ``param_geometry``), or crossed to and
from megatron-core's own form (``crossing``, ``torch_dist_ranges``, ``megatron_adam_state``).

May import: ``errors``, ``runtime``, ``model``, ``data``, and ``mlp_offload``'s face and its
``mlp_offload.checkpoint`` file format. Not ``offload/``: the facade hands in its objects.
"""
