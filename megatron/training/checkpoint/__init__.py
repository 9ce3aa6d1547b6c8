"""checkpoint/: saving and loading, in Megatron-LM's torch_dist layout, one job a module:

- ``checkpointing``: ``save_checkpoint`` and ``load_checkpoint``, each read top to bottom;
- ``load_plan``: which checkpoint a load takes, whether its format loads here, what becomes of each
  kind of state; ``integrity``: the proof that a directory is complete, and the choice among them;
- ``state_dict``: the torch_dist state dict under Megatron-LM's keys (the model's part, the RNG
  states, how dist_checkpointing writes and reads it); ``saved_args``: the args kept in it;
- ``optimizer_state``: the optimizer's part of a load, in whichever form it was saved;
  ``crossing``: either optimizer from the other's form; ``torch_dist_ranges``: element ranges of
  the torch_dist files read straight from disk for it;
- the offloaded optimizer state: ``offload_files`` (where the files lie, what each records, writing
  them, one position's read by name) and ``offloaded_state`` (``SavedOffloadState``: reading them
  back by this run's parameters, whatever layout wrote them);
- ``async_save``: background saves (--async-save).

May import: ``errors``, ``runtime``, ``model``, ``data``, and ``mlp_offload``'s face and its
``mlp_offload.checkpoint`` file format. Not ``offload/``: the facade hands in its shards
(``runtime.optimizer_interface.OffloadedOptimizerCheckpoint``) and the engines are read and written
through the engine's face.
"""
