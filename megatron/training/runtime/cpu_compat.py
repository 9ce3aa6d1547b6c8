"""Adapt megatron-core 0.16.1's CUDA assumptions so that training runs on CPU with gloo.

megatron-core allocates buffers with ``device=torch.cuda.current_device()`` or ``device='cuda'``,
keeps its RNG tracker in CUDA generator state, and checks ``Tensor.type()`` against
``'torch.cuda.*Tensor'`` strings. None of that has a CPU branch. ``apply()`` (called once from
``initialize`` when the device is CPU) makes three narrow changes:

1. In the megatron-core modules listed in ``_MODULES`` only, the module-global name ``torch`` is
   replaced by a proxy that forwards everything to the real ``torch`` except: ``torch.cuda``'s
   device/stream/sync/RNG calls answer for the CPU, and tensor factories turn ``device='cuda'``
   into ``device='cpu'``. Other modules, and torch itself, are untouched.
2. The tensor-parallel RNG tracker keeps CPU generator states (``random._get/_set_cuda_rng_state``).
3. The few constructors/functions that test ``Tensor.type()`` strings run with CPU tensors
   reporting their CUDA type names, so fp16/bf16/fp32 parameters are classified as on a GPU;
   the one that calls ``Tensor.cuda()`` (embedding tying for PP) runs with it as a no-op.

Nothing here changes numerics: the same ops run, only on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types

import torch

_APPLIED = False
_CPU = torch.device("cpu")

# module -> why it needs the proxy (its CUDA-only call sites on our training path)
_MODULES = {
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor on current_device(); norm/stat tensors on 'cuda'",
    "megatron.core.tensor_parallel.random": "RNG tracker reads/seeds torch.cuda generator state",
    "megatron.core.tensor_parallel.layers": "weights and TP grad buffers allocated on current_device()",
    "megatron.core.tensor_parallel.mappings": "TP gather/scatter outputs allocated on current_device()",
    "megatron.core.tensor_parallel.utils": "split/gather helpers allocate on current_device()",
    "megatron.core.transformer.module": "a scratch tensor on current_device()",
    "megatron.core.transformer.transformer_layer": "layer buffers on current_device()",
    "megatron.core.transformer.attention": "attention buffers on current_device()",
    "megatron.core.transformer.dot_product_attention": "mask/scratch buffers on current_device()",
    "megatron.core.transformer.utils": "attention-mask helpers on 'cuda'",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq/get_emb on current_device()",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "MLA's YaRN inv_freq on current_device()",
    "megatron.core.models.gpt.gpt_model": "position/mtp buffers on current_device()",
    "megatron.core.distributed.param_and_grad_buffer": "_ParamAndGradBuffer allocates on current_device()",
    "megatron.core.distributed.distributed_data_parallel": "streams, synchronize, empty_cache, buffers on current_device()",
    "megatron.core.optimizer.optimizer": "MixedPrecisionOptimizer found_inf/_scale_one tensors on 'cuda'",
    "megatron.core.optimizer.distrib_optimizer": "load_state_dict allocates state shards on current_device()",
    "megatron.core.optimizer.clip_grads": "grad-norm scratch tensors on 'cuda'",
    "megatron.core.optimizer.grad_scaler": "loss-scale tensors on 'cuda'",
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens on 'cuda'",
    "megatron.core.pipeline_parallel.p2p_communication": "PP shape/recv buffers on current_device(), synchronize",
    "megatron.core.pipeline_parallel.utils": "streams and tensors on 'cuda'",
    "megatron.core.rerun_state_machine": "loss-check tensors on 'cuda', reads torch.cuda RNG state",
    "megatron.core.parallel_state": "barrier device_ids=current_device(), synchronize",
    "megatron.core.dist_checkpointing.exchange_utils": "shard exchange buffers on 'cuda'",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "save-metadata tensors on current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "writer's preload calls torch.cuda.synchronize()",
    "megatron.core.dist_checkpointing.strategies.async_utils": "--async-save: synchronize, done-flags on current_device()",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "calls torch.cuda.synchronize()",
    "megatron.core.transformer.moe.token_dispatcher": "alltoall dispatcher: a D2H stream, its events and syncs",
    "megatron.core.transformer.moe.moe_utils": "aux-loss tracker and capacity tensors on 'cuda'",
    "megatron.core.transformer.moe.router": "router weights and expert bias on current_device()",
    "megatron.core.transformer.moe.experts": "expert weights allocated on current_device()",
    "megatron.core.transformer.moe.shared_experts": "shared-expert gate on current_device()",
    "megatron.core.timers": "Timer start/stop call torch.cuda.synchronize(); rank gather on current_device()",
}


def _to_cpu(device):
    """'cuda', 'cuda:N', torch.device('cuda'), or an int index -> CPU; anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA context
        return fn(*args, **kwargs)

    return wrapper


class _NullStream:
    """Stands in for torch.cuda.Stream: waits and syncs are no-ops on CPU (work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    # One CPU "stream": the MoE dispatcher compares streams to decide whether to wait.
    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    """A recorded event on a _NullStream: already complete."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _CudaShim(types.ModuleType):
    """torch.cuda as seen by a proxied module: CPU answers for device, stream, sync and RNG."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: _CPU
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.Stream = _NullStream
        self.stream = lambda s=None: contextlib.nullcontext()
        self.current_stream = lambda *a, **k: _NullStream()
        self.default_stream = lambda *a, **k: _NullStream()
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.random.default_generator.manual_seed(seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor",
              "zeros_like", "ones_like", "empty_like", "full_like", "rand", "randn", "randint")


class _TorchProxy(types.ModuleType):
    """torch for one megatron-core module: identical except for ``cuda`` and device kwargs."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaShim()
        for name in _FACTORIES:
            setattr(self, name, _redirect_device(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    # The tracker's "cuda" state becomes the CPU default generator's state.
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cuda_type_name(real_type):
    @functools.wraps(real_type)
    def type_(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name  # a cast, or already CUDA: unchanged
        return name.replace("torch.", "torch.cuda.", 1)

    return type_


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    real = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name(real)
    try:
        yield
    finally:
        torch.Tensor.type = real


@contextlib.contextmanager
def _tensor_cuda_is_noop():
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real


def _within(context, fn):
    """fn, run inside a fresh ``context()`` on every call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat__ = True
    return wrapper


def _with_cuda_type_names(fn):
    return _within(_cpu_tensors_report_cuda_types, fn)


class _DropCpuRngWarning(logging.Filter):
    """fork() warns when the CPU generator moves inside it; on CPU that generator *is* the tracked one."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply() -> None:
    """Install the CPU redirections (idempotent). Call only for CPU runs, before building models."""
    global _APPLIED
    if _APPLIED:
        return
    proxy = _TorchProxy()
    for name in _MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy

    from megatron.core.tensor_parallel import random as tp_random

    # The RNG tracker forks/restores generator state around TP-region init and dropout.
    tp_random._get_cuda_rng_state = _cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(tp_random.__name__).addFilter(_DropCpuRngWarning())

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # These classify params by Tensor.type() == 'torch.cuda.{Half,BFloat16,Float}Tensor'.
    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_type_names(
        distrib_optimizer.DistributedOptimizer.__init__)
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__)
    # Asserts grads are 'torch.cuda.FloatTensor'; optimizer.py imported it by name.
    clipped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clipped
    optimizer.clip_grad_by_total_norm_fp32 = clipped

    from megatron.core.transformer.moe import token_dispatcher

    # The alltoall dispatcher's split sizes become numpy arrays as they leave the GPU; already on the
    # CPU they stayed tensors, which all_to_all_single does not take as split sizes.
    token_dispatcher.maybe_move_tensor_to_cpu = _splits_as_numpy(token_dispatcher.maybe_move_tensor_to_cpu)

    from megatron.core.models.common.language_module.language_module import LanguageModule

    # PP>1 ties the first/last stage embeddings via weight.data.cuda() + all-reduce.
    LanguageModule.setup_embeddings_and_output_layer = _within(
        _tensor_cuda_is_noop, LanguageModule.setup_embeddings_and_output_layer)
    _APPLIED = True


def _splits_as_numpy(move):
    @functools.wraps(move)
    def wrapper(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapper


def define_missing_te_names() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm is not None`` but defines the name only
    when transformer-engine imports: without TE (any device) the router's first forward raises
    NameError. Defining it as None selects the torch.mm path the code has for that case."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

