"""The optimizer's part of a load, in whichever form the load plan found it:

- its own form: megatron-core's optimizer from the torch_dist files (read with the rest), or the
  offload engines from the offload files (``OffloadedStateLoad``, through ``offloaded_state``'s reader,
  beside the torch_dist read where it needs nothing of it), one call either way;
- converted from the other form (crossing), in pieces of at most --ckpt-convert-memory-mb;
- not at all (--no-load-optim, --finetune): the optimizer starts from the loaded weights.

megatron-core's own optimizers load without apex or transformer-engine here: the torch Adam(W)
step count needs two fix-ups then (``prepare_fresh_optimizer_for_load``, ``restore_adam_steps``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

from megatron.training.checkpoint.crossing import fill_distributed_optimizer, load_into_engine, saved_small_objects
from megatron.training.checkpoint.load_plan import FROM_DISTRIBUTED, FROM_OFFLOADED, SAME_FORM, LoadPlan
from megatron.training.checkpoint.offload_files import offloaded_state_bytes
from megatron.training.checkpoint.offloaded_state import SavedOffloadState
from megatron.training.model.host_params import gather_params
from megatron.training.runtime.concurrent import ConcurrentCall
from megatron.training.runtime.progress import MemoryGrowth, print_rank0, slowest_rank
from mlp_offload.checkpoint import Quantized, fill_engine, is_blockwise, moments_change, stored_codecs

log = logging.getLogger("mlp_offload")


def optimizer_template(plan: LoadPlan, optimizer, model_template: dict, metadata) -> dict:
    """What the optimizer takes from the torch_dist files. Its own form is read with the rest; from
    megatron-core's form, only the small objects (the step, the grad scaler): the conversion reads
    the large tensors by itself, in pieces."""
    if plan.optimizer == FROM_DISTRIBUTED:
        saved = plan.common.get("args")
        scaled = bool(getattr(saved, "fp16", False) or getattr(saved, "loss_scale", None))
        return {"plain_optimizer": saved_small_objects(optimizer, scaled and optimizer.grad_scaler is not None)}
    if plan.optimizer != SAME_FORM:
        return {}
    if not plan.run_offloaded:
        prepare_fresh_optimizer_for_load(optimizer)
    return {"optimizer": optimizer.sharded_state_dict(model_template, is_loading=True, metadata=metadata)}


def load_optimizer(plan: LoadPlan, optimizer, model, state: dict, args, check,
                   offloaded: Optional["OffloadedStateLoad"] = None) -> None:
    """Do what the plan says for the optimizer, ``state`` being what the torch_dist read gave.
    ``check``: the load's resume_check.ResumeCheck, which digests what the engines' fills write.
    ``offloaded``: the offload engines' fill, started beside the torch_dist read (else made here)."""
    if torch.cuda.is_available():
        # The model's weights were just copied in on the current stream; the offload engine reads and
        # writes them (the masters' high halves) on a stream of its own, which must see them landed.
        torch.cuda.synchronize()
    if plan.optimizer is None:
        optimizer.reload_model_params()  # the master copy starts from the loaded weights
    elif plan.optimizer == SAME_FORM and not plan.run_offloaded:
        optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(optimizer, state["optimizer"])
        check.skip_optimizer("megatron-core's optimizer state is read by dist_checkpointing, not digested")
    elif plan.optimizer == SAME_FORM:
        (offloaded or OffloadedStateLoad(plan, optimizer, model, check)).finish()
    elif plan.optimizer == FROM_OFFLOADED:
        check.skip_optimizer("it was converted from the offloaded form")
        prepare_fresh_optimizer_for_load(optimizer)  # the target's own state: allocated before the conversion
        max_bytes = args.ckpt_convert_memory_mb << 20
        # half of the pieces' memory for the offload files' reader, half for a piece in flight
        with SavedOffloadState(plan.path, plan.offload_meta.get("steps_done"), model, max_bytes // 2) as saved:
            _convert("the offloaded form", plan.path, args, model, lambda: fill_distributed_optimizer(
                megatron_optimizers(optimizer), saved, plan.offload_meta, max_bytes))
    else:  # FROM_DISTRIBUTED
        check.skip_optimizer("it was converted from megatron-core's distributed optimizer form")
        check.params_loaded(model)  # the conversion's split may round this rank's params anew
        _convert("megatron-core's distributed optimizer form", plan.path, args, model,
                 lambda: load_into_engine(optimizer, plan.path, state["plain_optimizer"],
                                          args.ckpt_convert_memory_mb << 20))
        gather_model_params(optimizer.shards, model)  # with remainders the split may have set this rank's params


def _convert(source: str, path: str, args, model, conversion) -> None:
    """Run ``conversion()`` and say how long it took and how much memory it added at most."""
    started, growth = time.perf_counter(), MemoryGrowth()
    conversion()
    grown = growth.peak_bytes()
    seconds, grown_mb = slowest_rank([time.perf_counter() - started, -1 if grown is None else grown / 2**20], model)
    memory = "" if grown_mb < 0 else f"; memory grew by at most {grown_mb:.0f} MB on any rank meanwhile"
    print_rank0(f"> optimizer state converted from {source} in {path} in {seconds:.1f} s, in pieces of at most "
                f"{args.ckpt_convert_memory_mb} MB (--ckpt-convert-memory-mb){memory}")


# -- megatron-core's own optimizers, without apex or transformer-engine ------------------------------
def megatron_optimizers(optimizer) -> list:
    """megatron-core's optimizers in ``optimizer``: a ChainedOptimizer's parts, or itself; none for
    the offload facade, whose state is no torch optimizer's."""
    if isinstance(optimizer, ChainedOptimizer):
        return optimizer.chained_optimizers
    return [optimizer] if isinstance(optimizer, MegatronOptimizer) else []


def prepare_fresh_optimizer_for_load(optimizer) -> None:
    """Give a never-stepped torch Adam(W) the 'step' entries its state_dict() asserts on.

    Without apex/transformer-engine, megatron-core's init_state_fn creates exp_avg/exp_avg_sq but
    no 'step', and DistributedOptimizer.state_dict() then fails while building the load template.
    The placeholder value is overwritten by load_state_dict from the checkpoint.
    """
    for opt in megatron_optimizers(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def restore_adam_steps(optimizer, loaded) -> None:
    """Put the checkpoint's Adam step back, one tensor per param, after a load.

    Without apex/TE two things go wrong in DistributedOptimizer's load path: the dp_reshardable
    param state carries 'step' as a LocalNonpersistentObject, so load copies the *template's*
    placeholder step over the restored one; and load_state_dict puts ONE step tensor in every
    param's state, which torch keeps aliased, so each step would bump it once per param.
    The true step is in the loaded param_groups.
    """
    chained = megatron_optimizers(optimizer)
    states = [loaded] if len(chained) == 1 else [loaded[k] for k in sorted(loaded)]
    for opt, opt_state in zip(chained, states):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        groups = opt_state.get("optimizer", {}).get("param_groups", []) if isinstance(opt_state, dict) else []
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


# -- the offload engines, from a checkpoint -----------------------------------------------------------
class OffloadedStateLoad:
    """The offload engines filled from the checkpoint's offload files, each of the facade's shards
    (``kind``, ``engine``, ``layout``, ``dp_group``, ``grad_scaler``) from its own file as saved or each
    parameter slice from whichever old ranks held it. ``start()`` runs the fill on a thread beside
    megatron-core's read of the torch_dist files where it needs nothing of theirs (every shard from
    its own file, its master stored as this engine keeps it: the model's params are neither read nor
    set), so the disk serves both at once; ``finish()`` waits for it (or fills now), loads the grad
    scalers and gathers the model's params where the masters set them. ``check``: a
    resume_check.ResumeCheck, which observes the fills of engines loaded as saved."""

    def __init__(self, plan: LoadPlan, optimizer, model, check):
        self.shards, self.model, self.check, self.meta = optimizer.shards, model, check, plan.offload_meta
        self.saved = SavedOffloadState(plan.path, plan.offload_meta.get("steps_done"), model)
        self.nbytes = offloaded_state_bytes(self.shards)
        self.seconds = 0.0
        self.beside = False  # whether it ran beside the torch_dist read
        self._thread: Optional[ConcurrentCall] = None

    def start(self) -> bool:
        """Begin the fill on a thread where it may go beside the torch_dist read; False where it may not."""
        if not all(self._fills_without_model(shard) for shard in self.shards):
            return False
        observers = [self.check.observer(shard, self.model) for shard in self.shards]  # on this thread
        self._thread = ConcurrentCall(self._fill, observers)
        self.beside = True
        return True

    def finish(self) -> None:
        try:
            if self._thread is not None:
                _, self.seconds = self._thread.result()
            else:
                started = time.perf_counter()
                self._fill([self.check.observer(shard, self.model) for shard in self.shards])
                self.seconds = time.perf_counter() - started
        finally:
            self.saved.close()
        # A checkpoint saved with one shard (no experts' optimizer, or EP 1) has one scaler: the dense shard's.
        for shard, scaler in zip(self.shards, self.meta["grad_scalers"]):
            if shard.grad_scaler is not None and scaler:
                shard.grad_scaler.load_state_dict(scaler)
        gather_model_params(self.shards, self.model)

    def wait_quietly(self) -> None:
        """The load failed elsewhere: let the thread end before the engines are touched again."""
        if self._thread is not None:
            self._thread.wait_quietly()
        self.saved.close()

    def _fill(self, observers) -> None:
        for shard, observe in zip(self.shards, observers):
            _load_engine(shard, self.saved, observe)

    def _fills_without_model(self, shard) -> bool:
        own = self.saved.whole_file(shard.kind, shard.dp_group.size())
        if own is None:
            return False
        return stored_codecs(own.footer)[0].needs_high == bool(shard.engine.config.param_remainders)


def _load_engine(shard, saved: SavedOffloadState, observe) -> None:
    """One engine from ``saved``: its own file as saved, or resharded by parameter; ``observe``: the
    resume check's wrapper of its fill (None: not observed)."""
    dp_size = shard.dp_group.size()
    own = saved.whole_file(shard.kind, dp_size)
    first = torch.distributed.get_rank() == 0
    notice = moments_change(saved.saved_codecs(shard.kind), shard.engine.state_codecs)
    if own is not None:
        fill_engine(shard.engine, own, notice=False, observe=observe)
        if notice and first:
            log.warning("offloaded %sstate: %s", "expert " if shard.kind == "experts" else "", notice)
        return
    layout = shard.layout
    mine = sorted((a, b, layout.param_slice[param], param) for param, (a, b) in layout.param_flat_range.items())

    def fill(sg, *outs):
        for out in outs:
            out.zero_()  # bucket padding holds no parameter
        for a, b, offset, param in mine:
            lo, hi = max(a, sg.start), min(b, sg.end)
            if lo < hi:
                saved.read(shard.kind, param, offset + lo - a, offset + hi - a,
                           [out[lo - sg.start: hi - sg.start] for out in outs])

    eight_bit = is_blockwise(shard.engine.state_codecs)
    callback = _eight_bit_fill(shard, saved, mine) if eight_bit else fill
    shard.engine.load_state(callback if observe is None else observe(callback), steps_done=saved.steps_done)
    if first:
        log.info("offloaded %sstate resharded from %s%s", "expert " if shard.kind == "experts" else "",
                 saved.describe_change(shard.kind, dp_size), f" ({notice})" if notice else "")


def _eight_bit_fill(shard, saved: SavedOffloadState, mine):
    """The engine's load callback for 8-bit moments: each parameter's piece of a subgroup through
    ``saved.read_eight_bit``, into the subgroup's codes and scales under its own blocks."""
    engine = shard.engine
    codecs, params, block = engine.state_codecs, engine.blocks.params, engine.blocks.block

    def fill(sg, master, *moments):
        for out in (master, *moments):
            out.zero_()  # bucket padding holds no parameter (codes and scales of zero: zeros)
        layout = params.layout(sg.start, sg.end, block)
        targets = [codec.split(raw, sg.numel, sg.blocks) for raw, codec in zip(moments, codecs[1:])]
        for a, b, offset, param in mine:
            lo, hi = max(a, sg.start), min(b, sg.end)
            if lo < hi:
                first, last = layout.block_span(lo - sg.start, hi - sg.start)
                pieces = [Quantized(t.codes[lo - sg.start: hi - sg.start], t.scales[first:last], t.fmt)
                          for t in targets]
                saved.read_eight_bit(shard.kind, param, offset + lo - a, offset + hi - a,
                                     master[lo - sg.start: hi - sg.start], pieces, layout.span(first, last))

    return fill


def gather_model_params(shards, model) -> None:
    """After a load into the engines: where masters are stored as remainders, a load from an fp32
    master set this rank's shard of the model's params from it (half-away rounding); every rank
    gets them."""
    if any(shard.engine.config.param_remainders for shard in shards):
        gather_params(model, force_sync=True)
