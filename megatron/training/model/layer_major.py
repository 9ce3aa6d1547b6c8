"""A training step's forward and backward over its micro-batches in layer-major order: each transformer
layer runs for every micro-batch before the next layer starts, in the forward and again (recomputed,
then backpropagated) in the backward. It is the order in which a layer whose params live off the GPU
is brought in once per step instead of once per micro-batch (docs/design.md, "Params, grads and
activations beyond HBM"). pretrain_gpt.py runs it with --offload-activations host (``step_schedule``).

What it computes is what megatron-core's no-pipelining schedule computes with full recompute of every
layer (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``): the same
per-(layer, micro-batch) operations, each parameter's gradient summed over micro-batches 1..G in the same
order, the loss through megatron-core's own ``forward_step``/``backward_step`` (its scaling by the
micro-batch count or the token count). Its model's own forward is used twice per micro-batch, with the
decoder block's forward stood in for: once to capture the block's input and arguments (the embedding's
graph), once to run the head (final norm, output layer, loss) on the block's output.

Two seams for what moves: ``LayerResidency`` is told when each layer's params are needed (brought in
once for the forward over every micro-batch, once for the backward) and when its gradients are complete;
``KeptInputs`` holds each layer's inputs between its forward and its recompute (``HostKeptInputs``: in host
memory, prefetched a layer ahead). Resident params and inputs kept in place are today's megatron-core.

With pipeline stages (one model chunk each), each stage runs its layers layer-major over every micro-batch,
then sends the micro-batches' outputs on (megatron-core's ``P2PCommunicator``); the backward comes back the same
way, last stage first. Each (layer, micro-batch) operation and each gradient's sum over micro-batches 1..G is
the one megatron-core's 1F1B schedule does; a stage waits for the one before it (GPipe's order), where 1F1B
overlaps them.

Limits, each refused in one line by ``layer_major_refusal``: one model chunk per stage (no virtual pipeline),
full recompute of single layers, dropout 0 (its RNG would be drawn in another order), no fp8. With the
embedding tied to the output layer, the shared weight's two gradients reach its fp32 ``main_grad`` one by
one (the output layer's in the head, the embedding's at the end), where megatron-core's single backward
first sums them in the weight's own dtype: equal up to that rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Protocol

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_model_type

from megatron.training.errors import UserError
from megatron.training.runtime.progress import print_rank0
from megatron.training.model.host_grads import host_grads_refusal, tied_across_stages
from megatron.training.model.host_params import HostParams, decoder_of, host_params_refusal
from megatron.training.model.kept_inputs import HostKeptInputs, KeptInputs, NoKeptInputs, side_stream
from megatron.training.model.layer_params import stage_layer_counts
from megatron.training.model.pipeline_stage import PipelineStage
from megatron.training.model.sizes import kept_input_bytes


class _BlockInputCaptured(Exception):
    """Raised by the stand-in decoder to stop the model's forward once the block's input is known."""


@dataclass
class _MicroBatch:
    batch: object  # what the data iterator gave, handed to forward_step_func again for the head
    block_input: Optional[torch.Tensor] = None  # the embedding's output, with its graph
    layer_kwargs: Optional[dict] = None  # what the block passes each layer besides hidden_states
    hidden: Optional[torch.Tensor] = None  # the current layer's input (forward) or output gradient (backward)


def layer_major_refusal(config, num_model_chunks: int) -> Optional[str]:
    """Why this configuration cannot run layer-major (one line), or None."""
    if num_model_chunks != 1:
        return (f"layer-major steps need one model chunk per pipeline stage ({num_model_chunks}: "
                "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank)")
    if config.recompute_granularity != "full" or config.recompute_method != "uniform" \
            or config.recompute_num_layers != 1:
        return ("layer-major steps recompute each layer in the backward: they need --recompute-granularity full "
                "--recompute-method uniform --recompute-num-layers 1")
    if config.hidden_dropout or config.attention_dropout:
        return (f"layer-major steps need dropout 0 (--hidden-dropout {config.hidden_dropout}, "
                f"--attention-dropout {config.attention_dropout})")
    if config.fp8:
        return "layer-major steps do not run fp8 layers yet"
    return None


class LayerResidency(Protocol):
    """Where a layer's params are while the step does not use them: ``bring_in`` before the layer runs
    for the micro-batches (in the forward, and again for its recompute and backward), ``release`` after;
    ``after_backward``: the layer's backward over the pass's micro-batches is done (its gradient complete after
    the last pass). ``step_started`` (``backward``: whether the step has one; ``passes``: how many times the step
    runs the layers, once per group of micro-batches) comes before the embedding runs, ``step_ended`` after the
    last gradient is reduced: the params outside the layers are needed in between. ``finalizing(chunk)``: the
    context megatron-core's finalize runs in (leaving out what the residency reduced itself)."""

    def step_started(self, backward: bool, passes: int = 1) -> None: ...

    def bring_in(self, layer: int) -> None: ...

    def release(self, layer: int, after_backward: bool) -> None: ...

    def grads_complete(self) -> None: ...

    def step_ended(self) -> None: ...

    def finalizing(self, chunk) -> ContextManager: ...


class ResidentLayers:
    """Every layer's params stay where they are (in HBM, as megatron-core keeps them)."""

    def finalizing(self, chunk) -> ContextManager:
        return contextlib.nullcontext()

    def grads_complete(self) -> None:
        pass

    def step_started(self, backward: bool, passes: int = 1) -> None:
        pass

    def bring_in(self, layer: int) -> None:
        pass

    def release(self, layer: int, after_backward: bool) -> None:
        pass

    def step_ended(self) -> None:
        pass


class LayerMajorStep:
    """megatron-core's ``get_forward_backward_func()`` interface, layer-major (module docstring), with
    each layer's params brought in and released by ``residency`` and its inputs kept by ``kept_inputs``
    (made per step by ``kept_inputs_factory``); returns what each micro-batch's loss function reported."""

    def __init__(self, residency: Optional[LayerResidency] = None,
                 kept_inputs_factory: Callable[[], KeptInputs] = KeptInputs, group: Optional[int] = None):
        self.residency = residency or ResidentLayers()
        self.kept_inputs_factory = kept_inputs_factory
        self.group = group  # micro-batches per pass over the layers (None: every micro-batch of the step)

    def __call__(self, *, forward_step_func: Callable, data_iterator, model: list, num_microbatches: int,
                 forward_only: bool = False, **schedule_keywords) -> List[dict]:
        chunk = model[0]
        config = get_model_config(chunk)
        refusal = layer_major_refusal(config, len(model))
        if refusal is not None:
            raise ValueError(refusal)
        stage = PipelineStage(config, schedule_keywords)  # (its sequence length and micro-batch size)
        iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        block = decoder_of(chunk)
        # (a middle pipeline stage may have no data: its forward_step_func is handed None)
        micro = [_MicroBatch(next(iterator) if iterator is not None else None) for _ in range(num_microbatches)]
        size = self.group or num_microbatches
        passes = [micro[start:start + size] for start in range(0, num_microbatches, size)]
        self.residency.step_started(backward=not forward_only, passes=len(passes))
        try:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                reported, total_tokens = [], None
                for first, group in zip(range(0, num_microbatches, size), passes):
                    run = _Pass(micro, first, group, reported)
                    tokens = self._pass(forward_step_func, chunk, config, block, run, forward_only, stage)
                    total_tokens = tokens if total_tokens is None else total_tokens + tokens
                if not forward_only:
                    self.residency.grads_complete()
                    if config.finalize_model_grads_func is not None:
                        with self.residency.finalizing(chunk):
                            config.finalize_model_grads_func(
                                [chunk], total_tokens if config.calculate_per_token_loss else None)
                return reported
        finally:
            self.residency.step_ended()

    def _pass(self, forward_step_func, chunk, config, block, run: "_Pass", forward_only: bool,
              stage: PipelineStage) -> torch.Tensor:
        """The layers' forward, the head and the layers' backward over one group of the step's micro-batches
        (its gradients summed into those of the passes before); returns its tokens."""
        micro = run.group
        for mb in micro:  # the embedding (with its graph kept for the backward's end), or the stage before's output
            received = None if stage.first else stage.receive_forward()
            _set_input_tensor(chunk, received)  # (the model's forward takes its sequence length from it)
            mb.block_input, mb.layer_kwargs = _block_input(forward_step_func, chunk, block, mb.batch)
            # (a later stage's block input is what came in: kept only as layer 0's input, where the step keeps it)
            mb.hidden = (mb.block_input if stage.first else received).detach()
        kept = self._forward_layers(block, micro, NoKeptInputs() if forward_only else self.kept_inputs_factory())
        if stage.last:
            total_tokens = self._head(forward_step_func, chunk, config, run, not forward_only, stage.first)
        else:
            total_tokens = torch.zeros([], dtype=torch.int, device=micro[0].hidden.device)
            for mb in micro:
                stage.send_forward(mb.hidden)
        if forward_only:
            return total_tokens
        if not stage.last:
            for mb in micro:
                mb.hidden = stage.receive_backward()
        _scale_moe_aux_losses(config, run.step_size, micro[0].hidden.device)
        self._backward_layers(block, run, kept, config)
        for m, mb in zip(run.indices, micro):  # the embedding's backward, or the input's gradient to the stage before
            if stage.first:
                with _sync_unless(run.is_last(m), config):
                    torch.autograd.backward(mb.block_input, mb.hidden)
            else:
                stage.send_backward(mb.hidden)
        for mb in micro:  # what the pass kept of its micro-batches is not needed by the next
            mb.block_input = mb.hidden = mb.layer_kwargs = None
        return total_tokens

    def _forward_layers(self, block, micro: List[_MicroBatch], kept: KeptInputs) -> KeptInputs:
        with torch.no_grad():
            for index, layer in enumerate(block.layers):
                kept.put(index, [mb.hidden for mb in micro])
                self.residency.bring_in(index)
                for mb in micro:
                    mb.hidden = layer(hidden_states=mb.hidden, **mb.layer_kwargs)[0]
                self.residency.release(index, after_backward=False)
        return kept

    @staticmethod
    def _head(forward_step_func, chunk, config, run: "_Pass", backward: bool, first_stage: bool) -> torch.Tensor:
        """Final norm, output layer and loss per micro-batch, through megatron-core's own forward_step and
        backward_step (their loss scaling by the step's micro-batch count); each micro-batch's gradient into the
        block's output. (A later stage's model is handed the block's output as its input tensor: its forward
        sizes the rotary embedding by it.)"""
        block = decoder_of(chunk)
        total_tokens = torch.zeros([], dtype=torch.int, device=run.group[0].hidden.device)
        for m, mb in zip(run.indices, run.group):
            block_output = mb.hidden.detach().requires_grad_(backward)
            with _sync_unless(run.is_last(m), config), \
                    _stand_in(block, lambda *a, **k: _final_norm(block, block_output)):
                output, tokens = schedules.forward_step(
                    forward_step_func, iter([mb.batch]), chunk, run.step_size, None if first_stage else block_output,
                    run.reported, config, 1,
                    is_first_microbatch=m == 0, current_microbatch=m)
                total_tokens += tokens
                if backward:
                    schedules.backward_step(None, output, None, get_model_type(chunk), config)
            mb.hidden = block_output.grad
        return total_tokens

    def _backward_layers(self, block, run: "_Pass", kept: KeptInputs, config) -> None:
        """Each layer, last first: recomputed from its kept input and backpropagated, micro-batch by
        micro-batch, its params' gradients summed over them in order."""
        for index in reversed(range(len(block.layers))):
            layer, inputs = block.layers[index], kept.take(index)
            self.residency.bring_in(index)
            for m, input_, mb in zip(run.indices, inputs, run.group):
                layer_input = input_.detach().requires_grad_()
                with _sync_unless(run.is_last(m), config), torch.enable_grad():
                    layer_output = layer(hidden_states=layer_input, **mb.layer_kwargs)[0]
                    torch.autograd.backward(layer_output, mb.hidden)
                mb.hidden = layer_input.grad
            self.residency.release(index, after_backward=True)


@dataclass
class _Pass:
    """One pass over the layers: the step's micro-batches ``micro`` from ``first`` on, ``group`` of them; what the
    loss function reports goes on ``reported``, the step's."""
    micro: List[_MicroBatch]
    first: int
    group: List[_MicroBatch]
    reported: list

    @property
    def indices(self) -> range:
        return range(self.first, self.first + len(self.group))

    @property
    def step_size(self) -> int:
        return len(self.micro)

    def is_last(self, m: int) -> bool:
        """Whether micro-batch ``m`` is the step's last (DDP's sync runs in its backward only)."""
        return m == len(self.micro) - 1


forward_backward_layer_major = LayerMajorStep()  # params resident, inputs kept where they were made


def step_schedule(model, inputs_in_host: bool, params_in_host: bool, grads_in_host: bool = False,
                  asked_by: Optional[str] = None, forward_only: bool = False, group: Optional[int] = None):
    """A step's forward and backward (or forward only): megatron-core's schedule, or the layer-major step
    keeping layer inputs in host memory (``inputs_in_host``) and bringing in params that live there
    (``params_in_host``, and their grads with ``grads_in_host``; one step object per model, whose device slots
    are made once), in passes of ``group`` micro-batches."""
    if not params_in_host and (forward_only or not inputs_in_host):
        return get_forward_backward_func()
    step = _STEPS.get(id(model[0]))
    if step is None:
        device = getattr(model[0], "compute_device", None) or next(model[0].parameters()).device
        stream = side_stream(device) if inputs_in_host else None  # one for every pass of the run
        inputs = (lambda: HostKeptInputs(device, stream)) if inputs_in_host else KeptInputs
        step = LayerMajorStep(HostParams.of_chunk(model[0], device, grads_in_host) if params_in_host else None,
                              inputs, group)
        _STEPS[id(model[0])] = step
    return step


_STEPS: Dict[int, LayerMajorStep] = {}  # by model chunk (training keeps its model for the whole run)


def check_step_schedule(args, config, inputs_in_host: bool, params_in_host: bool, grads_in_host: bool,
                        asked_by: Optional[str], group: Optional[int] = None) -> None:
    """A configuration the layer-major step cannot run, asked for by the flag ``asked_by`` (grads, params or
    inputs in host memory): one line naming it, before the model is built."""
    if not params_in_host and not inputs_in_host and not grads_in_host:
        if group is not None:
            raise UserError("--offload-microbatch-group: needs the layer-major step (--offload-activations host or "
                            "--offload-params host)")
        return
    refusal = layer_major_refusal(config, args.virtual_pipeline_model_parallel_size or 1)
    if refusal is None and (params_in_host or grads_in_host):
        refusal = host_params_refusal(args)
    if refusal is None and grads_in_host:
        refusal = host_grads_refusal(params_in_host, config, tied_across_stages(args))
    if refusal is not None:
        raise UserError(f"{asked_by}: {refusal}")
    layers = max(stage_layer_counts(config))  # the stage with the most layers keeps the most inputs
    steps = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    micro = min(group or steps, steps)
    kept = kept_input_bytes(args.seq_length, args.micro_batch_size, config)
    each = (f"for all {micro} micro-batches of a step" if micro == steps else
            f"for {micro} micro-batches at a time (the step's {steps} in {-(-steps // micro)} passes)")
    print_rank0(f"> layer-major step: each layer's input kept for its recompute {each}, "
                f"{layers * micro * kept / 2**30:.2f} GiB per rank in "
                f"{'host memory (--offload-activations host)' if inputs_in_host else 'GPU memory'} ({layers} layers x "
                f"{micro} x {kept / 2**20:.1f} MiB)" + (", pipeline stages in turn" if config.pipeline_model_parallel_size > 1
                                                     else ""))


def _block_input(forward_step_func, chunk, block, batch):
    """The decoder block's input (the embedding's output, with its graph) and the per-layer arguments
    the block derives from its own (rotary embeddings, masks), from the model's own forward."""
    captured = {}

    def capture(hidden_states, **kwargs):
        captured.update(hidden=hidden_states, kwargs=kwargs)
        raise _BlockInputCaptured

    with _stand_in(block, capture), contextlib.suppress(_BlockInputCaptured):
        forward_step_func(iter([batch]), chunk)
    kwargs = captured["kwargs"]
    layer_kwargs = {name: kwargs.get(name) for name in ("attention_mask", "context", "context_mask",
                                                         "rotary_pos_emb", "attention_bias", "packed_seq_params",
                                                         "padding_mask")}
    layer_kwargs["inference_context"] = None
    return captured["hidden"], layer_kwargs


def _scale_moe_aux_losses(config, step_size: int, device: torch.device) -> None:
    """The scale of the MoE layers' aux-loss gradients that megatron-core's forward_step sets on every pipeline
    stage (the main loss's: the grad scaler's, per micro-batch of the step): here on the stages the head runs
    on, and no less on the others, which run no forward_step (left unset, their aux losses would count whole)."""
    if config.num_moe_experts is None:
        return
    ones = torch.ones(1, device=device)
    scale = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    MoEAuxLossAutoScaler.set_loss_scale(scale if config.calculate_per_token_loss else scale / step_size)


def _set_input_tensor(chunk, tensor: Optional[torch.Tensor]) -> None:
    """What megatron-core's schedule hands a later pipeline stage's model before its forward."""
    if tensor is not None:
        get_attr_wrapped_model(chunk, "set_input_tensor")([tensor])


def _final_norm(block, hidden: torch.Tensor) -> torch.Tensor:
    return block.final_layernorm(hidden) if block.final_layernorm is not None else hidden


@contextlib.contextmanager
def _stand_in(obj, replacement, method: str = "forward"):
    """``obj``'s ``method`` replaced for the duration (an instance attribute over the method)."""
    setattr(obj, method, replacement)
    try:
        yield
    finally:
        delattr(obj, method)


def _sync_unless(is_last: bool, config):
    """DDP's gradient sync only in the last micro-batch's backward, as megatron-core's schedule does."""
    return contextlib.nullcontext() if is_last or config.no_sync_func is None else config.no_sync_func()
