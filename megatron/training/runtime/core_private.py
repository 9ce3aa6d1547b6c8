"""Every private megatron-core 0.16.1 call of the training layer, in one place, each with the reason
no public entry point serves. A megatron-core upgrade checks this file first.

(``runtime/cpu_compat`` is apart: it adapts megatron-core's CUDA assumptions on a CPU device by
replacing module globals, not by calling private functions.)
"""

from __future__ import annotations

import contextlib

from megatron.core import optimizer as _core_optimizer
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.training.runtime.host_memory import host_zeros_to_pin, pin_in_place


def gbuf_range_map(buffer):
    """A DDP buffer's per-bucket shard ranges for this data-parallel rank. Why private: the offload
    facade needs exactly DistributedOptimizer's ranges (so the shard and the param all-gather are
    its own) without building a DistributedOptimizer; no public function returns them."""
    return DistributedOptimizer._build_gbuf_range_map(buffer)


def optimizer_group_ranges(param_groups, gbuf_ranges):
    """The param order DistributedOptimizer gives its inner optimizer. Why private: the facade's
    grad norms must follow that order to be bit-identical; it is computed only here."""
    return DistributedOptimizer._build_optimizer_group_ranges(param_groups, gbuf_ranges)


def param_groups_and_buffers(model_chunks, config, filter_fn, buffer_name="buffers"):
    """megatron-core's parameter groups (weight decay, LR multipliers) and DDP buffers. Why private:
    ``get_megatron_optimizer`` builds them and an optimizer in one call; the facade needs the groups
    with its own optimizer."""
    return _core_optimizer._get_param_groups_and_buffers(
        model_chunks, model_chunk_offset=0, config=config, config_overrides=None, filter_fn=filter_fn,
        buffer_name=buffer_name)


def main_param_and_optimizer_states(opt, param) -> dict:
    """The fp32 master param and Adam moments of one param in megatron-core's DistributedOptimizer.
    Why private: its public state_dict gathers whole buckets; crossing a checkpoint between the
    offloaded form and megatron-core's own fills them in bounded pieces."""
    return opt._get_main_param_and_optimizer_states(param)


def set_main_param_and_optimizer_states(opt, param, states: dict) -> None:
    """The setter to ``main_param_and_optimizer_states`` (precision-aware optimizer: it scales
    whole tensors, so no in-place piecewise fill). Why private: as above."""
    opt._set_main_param_and_optimizer_states(param, states)


def checkpoint_results_queue_started() -> bool:
    """Whether dist_checkpointing's writers' results queue exists. Why private: megatron-core starts
    it lazily on the first save, from whatever thread saves; no public hook starts it."""
    return filesystem_async._results_queue is not None


def set_checkpoint_results_queue(queue) -> None:
    """Start that queue ourselves (a Manager with PDEATHSIG, from the main thread). Why private: as above."""
    filesystem_async._results_queue = queue


def reset_grad_accumulation(ddp_chunk) -> None:
    """``DistributedDataParallel.zero_grad_buffer`` without zeroing the grads themselves: the
    per-iteration flags and bucket-group state only. Why private: with the update under the next
    forward the offload step zeroes each grad range as its update reads it, and zeroing the buffer
    here would race those reads; megatron-core has no public call for the rest of the reset."""
    for param in ddp_chunk.params_with_grad:
        param.grad_added_to_main_grad = False
    for bucket_group in ddp_chunk.bucket_groups + ddp_chunk.expert_parallel_bucket_groups:
        bucket_group.reset()


def install_timer(timers, name: str, timer, log_level: int) -> None:
    """Put ``timer`` in megatron-core's ``Timers`` under ``name``. Why private: ``Timers`` builds its
    own ``Timer``s, which synchronize the whole device at start and stop; a timer around a step whose
    update runs on under the next forward must not, and there is no public way to give it another."""
    timers._timers[name] = timer
    timers._log_levels[name] = log_level


@contextlib.contextmanager
def param_buffers_in_host_memory(pin: bool, grads_too: bool = False):
    """While DDP builds its buffers: each param buffer in host memory (pinned where ``pin``), and with
    ``grads_too`` each grad buffer (--offload-params host, --offload-grads host); else where megatron-core puts
    it. Why private: DDP allocates both on the current device and takes no argument for where; 0.16.1 allocates
    a buffer's params first, then its grads, each with ``torch.zeros`` in ``_ParamAndGradBuffer.__init__``, so
    those calls are the ones moved (``model.host_params.check_buffers_placed`` checks the result)."""
    module = param_and_grad_buffer
    buffer_class, real_init, real_torch = module._ParamAndGradBuffer, module._ParamAndGradBuffer.__init__, module.torch
    to_host: list = []  # of the coming torch.zeros calls, in order: whether each goes to host memory
    to_pin: list = []  # host buffers to pin once DDP has copied the params in

    class _Torch:
        def __getattr__(self, name):
            return getattr(real_torch, name)

        @staticmethod
        def zeros(*args, **kwargs):
            if to_host and to_host.pop(0):
                if pin:  # pinned in place after the copies in: the params are never in host memory twice
                    to_pin.append(host_zeros_to_pin(args[0], kwargs["dtype"]))
                    return to_pin[-1]
                kwargs["device"] = "cpu"
            return real_torch.zeros(*args, **kwargs)

    def init(self, *args, **kwargs):
        ddp_config = kwargs.get("ddp_config", args[0] if args else None)
        to_host[:] = ([True] if ddp_config.use_distributed_optimizer else []) + [grads_too]
        real_init(self, *args, **kwargs)
        to_host.clear()
        for buffer in to_pin:
            pin_in_place(buffer, "--offload-params host")
        to_pin.clear()

    module.torch, buffer_class.__init__ = _Torch(), init
    try:
        yield
    finally:
        module.torch, buffer_class.__init__ = real_torch, real_init
