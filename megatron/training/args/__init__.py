"""args/: the command line — ``arguments.parse_args`` gathers Megatron-LM's flags (``megatron``),
the checkpoint flags (``checkpoint``) and the ``--offload-*`` flags (``offload``), checks them
across flags and fills what they imply. Each package keeps the checks of its own flags
(``model.virtual_pipeline``, ``model.kernels``, ``data.lr_schedule``, ``data.tokenizers``);
this package calls them.

May import every other sub-package; only the loop (``training``, ``initialize``) imports it.
"""
