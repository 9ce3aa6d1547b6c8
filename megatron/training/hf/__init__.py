"""Hugging Face checkpoints in and out (tools/hf_checkpoint.py): which families map and how
(``families``), their tensors to and from megatron-core's (``tensor_map``), what a model's torch_dist
checkpoint holds (``layout``), both file formats a tensor at a time (``files``), and the streaming
import and export (``convert``). Neither transformers nor safetensors is needed: safetensors files
are read and written here (its format is a JSON header and the raw bytes), so no file is ever mapped
or held whole; transformers is what loads the export (and what the tests compare against).

May import every layer below it (errors, runtime, model, checkpoint, args: it builds the model from the
flags it derives); only tools/hf_checkpoint.py and tests import it."""
