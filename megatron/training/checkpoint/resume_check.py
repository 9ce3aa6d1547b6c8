"""The resume check: a load must give each rank the params and optimizer state its save recorded,
bit for bit, whether or not training itself is deterministic.

At a save each rank records, in ``iter_N/resume_check/ppPPP_tpTTT_dpDDD.json`` (covered by the
checkpoint's proof, checkpoint_integrity), the digests (``mlp_offload.checkpoint.digest``) of its model
params (where they are: on the GPU, hashed there) and of its offloaded optimizer state, every tier of
it, per parameter and state tensor, as stored (a master kept as remainders as those, 8-bit moments as
codes and scales). The state's digests come from the checkpoint writer, from the tensors it writes
(for --async-save, the snapshot it writes); nothing is read twice. At a load the same digests are
taken from what the engines' fill callbacks write and from the model's params once loaded, and
compared with the records: one line on rank 0 when every rank matches, else one UserError naming the
first ranks and tensors that differ.

A parameter's digests index its elements by their place in the parameter, so they add up over the
data-parallel ranks that hold its pieces: a load at another DP size compares each (pp, tp) position's
sums (``ResumeCheck``). At another PP, TP, VPP or EP size nothing is compared, and the line says so;
an optimizer converted between forms or into other stored formats is not compared (the params are).
megatron-core's own optimizer's state is read by dist_checkpointing and not digested here.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron.training.checkpoint.integrity import RECORD_DIR
from megatron.training.checkpoint.offload_files import param_names, shard_pieces
from megatron.training.checkpoint.state_dict import rank_coordinates
from megatron.training.errors import UserError
from megatron.training.runtime.optimizer_interface import OffloadedOptimizerCheckpoint
from megatron.training.runtime.progress import model_device, print_rank0
from mlp_offload.checkpoint import (MASK, TENSORS, StateDigest, add_pairs, as_pairs, find_mismatch, human_bytes,
                                    is_blockwise, tensor_digest)

FORMAT = 1
SHOWN = 3  # differences the error names (the first ones by rank); the others are counted


def record_path(checkpoint_dir: str, place) -> str:
    """The record of the rank at (pp, tp, dp) position ``place``."""
    p, t, d = place
    return os.path.join(checkpoint_dir, RECORD_DIR, f"pp{p:03d}_tp{t:03d}_dp{d:03d}.json")


RECORD_NAME = re.compile(r"pp(\d+)_tp(\d+)_dp(\d+)\.json")


def run_layout(model) -> dict:
    """What decides which state a rank holds: the grid's sizes, model chunks per rank, the EP size."""
    shape, _ = rank_coordinates()
    return {"pp": shape[0], "tp": shape[1], "dp": shape[2], "chunks": len(model),
            "ep": parallel_state.get_expert_model_parallel_world_size()}


def param_digests(model) -> Tuple[Dict[str, Dict[str, List[int]]], int]:
    """{name: {"param": digest}} of the model chunks' params, hashed where they live; and their bytes."""
    names = param_names(model)
    params = [p for chunk in model for p in chunk.parameters()]
    pairs = as_pairs([tensor_digest(p.detach()) for p in params])
    return ({names[p]: {"param": pair} for p, pair in zip(params, pairs)},
            sum(p.numel() * p.element_size() for p in params))


def _engine_shards(optimizer) -> list:
    return list(optimizer.shards) if isinstance(optimizer, OffloadedOptimizerCheckpoint) else []


class SaveDigests:
    """What one rank's save records: its params' digests now, its engines' as their writers add them
    (``engines``: kind -> StateDigest, handed to the writers); ``write`` once the writers are done.
    ``optimizer``: None where the save keeps no optimizer state (--no-save-optim)."""

    def __init__(self, model, optimizer, iteration: int):
        self.iteration = iteration
        self.layout = run_layout(model)
        self.params, self.param_bytes = param_digests(model)
        names = param_names(model)
        self.shards = _engine_shards(optimizer)
        self.steps = {shard.kind: shard.engine.steps_done for shard in self.shards}
        self.engines = {shard.kind: StateDigest.of_engine(shard.engine, shard_pieces(shard, names))
                        for shard in self.shards}

    def write(self, checkpoint_dir: str) -> None:
        optimizer = {kind: {"steps_done": self.steps[kind], "formats": d.formats, "bytes": d.nbytes,
                            "tensors": d.result()} for kind, d in self.engines.items()}
        _, place = rank_coordinates()
        record = {"format": FORMAT, "iteration": self.iteration, "world_size": torch.distributed.get_world_size(),
                  "layout": self.layout, "place": list(place), "params": self.params,
                  "param_bytes": self.param_bytes, "optimizer": optimizer}
        path = record_path(checkpoint_dir, place)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


class ResumeCheck:
    """One rank's side of the check at a load of ``checkpoint_dir``: the records it compares with read
    first, the engines' fills observed (``observer``), then ``finish`` compares and reports for all
    ranks. At the saved layout each rank compares with its own record; where only the data-parallel
    size changed, its params with those of a saved rank at its (pp, tp) position, and the dense
    optimizer state per parameter summed over the position's data-parallel ranks, old and new
    (element-wise formats: 8-bit moments are requantized where a new cut splits a block). Not
    ``enabled`` (--no-resume-check): nothing is read, observed or said."""

    def __init__(self, checkpoint_dir: str, model, enabled: bool = True):
        self.where, self.enabled = checkpoint_dir, enabled
        self.rank = torch.distributed.get_rank()
        _, self.place = rank_coordinates()
        self.saved: Optional[dict] = None  # the record this rank compares its params and steps with
        self.position: List[dict] = []  # with another DP size: every saved record of this (pp, tp) position
        self.skipped = "--no-resume-check"
        if enabled:
            self.skipped = self._read_records(run_layout(model))
        self.observed: Dict[str, Tuple[object, StateDigest]] = {}  # kind -> (shard, its load's digests)
        self.optimizer_skipped: Optional[str] = None
        self.loaded_params: Optional[Tuple[Dict[str, Dict[str, List[int]]], int]] = None

    def params_loaded(self, model) -> None:
        """Digest the params as the load read them, before a conversion re-derives them from the masters
        (the split into remainders rounds half away from zero, megatron-core's cast to nearest even)."""
        if self.saved is not None:
            self.loaded_params = param_digests(model)

    def _read_records(self, layout: dict) -> Optional[str]:
        """Read what this rank compares with; the reason where it compares nothing."""
        p, t, d = self.place
        listed = self._listed()
        if not listed:
            return f"{self.where} records no digests (saved by an older version or another program)"
        first = self._record((p, t, 0)) or self._record(listed[0])
        saved = first["layout"]
        same_grid = all(saved.get(k) == layout[k] for k in ("pp", "tp", "chunks", "ep"))
        world = torch.distributed.get_world_size()
        if same_grid and saved.get("dp") == layout["dp"] and first.get("world_size") == world:
            self.saved = self._record((p, t, d))
            return None if self.saved else f"the record of PP/TP/DP position {(p, t, d)} is missing"
        if not same_grid or self._record((p, t, 0)) is None:
            return (f"it was saved at {_layout(saved)}, this run is at {_layout(layout)}; the records name positions "
                    f"of that layout")
        self.saved = first
        self.position = [self._record((p, t, k)) for k in range(saved["dp"])]
        if any(record is None for record in self.position):
            return f"the records of PP {p} TP {t} are incomplete"
        return None

    def _listed(self) -> List[Tuple[int, int, int]]:
        """The positions whose records the checkpoint holds."""
        try:
            names = os.listdir(os.path.join(self.where, RECORD_DIR))
        except FileNotFoundError:
            return []
        found = [RECORD_NAME.fullmatch(n) for n in names]
        return sorted(tuple(int(v) for v in m.groups()) for m in found if m)

    def _record(self, place) -> Optional[dict]:
        path = record_path(self.where, place)
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise UserError(f"--load {self.where}: {path} is unreadable ({err}); the resume check cannot run: "
                            f"restore the checkpoint from a copy") from None

    def skip_optimizer(self, why: str) -> None:
        """The optimizer state is not compared, for this reason (the params still are)."""
        self.optimizer_skipped = self.optimizer_skipped or why

    def observer(self, shard, model) -> Optional[Callable]:
        """A wrapper for ``shard``'s fill callback that digests what the fill writes (None where the
        shard's state cannot be compared: the reason is kept)."""
        if self.saved is None:
            return None
        saved = self.saved["optimizer"].get(shard.kind)
        formats = [c.describe() for c in shard.engine.state_codecs]
        if saved is None:
            self.skip_optimizer(f"the save recorded no digests of its {shard.kind} optimizer state")
        elif formats != saved["formats"]:
            self.skip_optimizer(f"it is stored as {'/'.join(saved['formats'])} in the checkpoint and as "
                                f"{'/'.join(formats)} in this run")
        elif self.position and shard.kind != "dense":
            self.skip_optimizer("the experts' state moved to other data-parallel ranks (local names differ by EP rank)")
        elif self.position and is_blockwise(shard.engine.state_codecs):
            self.skip_optimizer("8-bit moments are requantized where the new data-parallel split cuts a block")
        else:
            observed = StateDigest.of_engine(shard.engine, shard_pieces(shard, param_names(model)))
            self.observed[shard.kind] = (shard, observed)
            return observed.observing
        return None

    def finish(self, model, optimizer_loaded: bool) -> None:
        """Compare this rank's params and observed state with the records; then, with every rank's
        verdict: one line on rank 0, or a UserError on every rank naming the first differences."""
        if not self.enabled:
            return
        verdict = {"rank": self.rank, "differs": [], "bytes": 0, "skipped": self.skipped,
                   "optimizer_skipped": self.optimizer_skipped if optimizer_loaded else "it was not loaded"}
        if self.saved is not None:
            verdict["differs"], verdict["bytes"] = self._compare(model)
        verdicts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(verdicts, verdict)
        self._report(verdicts)

    def _compare(self, model) -> Tuple[List[str], int]:
        iteration = self.saved["iteration"]
        params, nbytes = self.loaded_params or param_digests(model)
        differs = []

        def differ(what: str, saved, now) -> None:
            differs.append(f"rank {self.rank}, {what} differs from its save at iteration {iteration} "
                           f"(digest {_hex(saved)} vs {_hex(now)})")

        found = find_mismatch(self.saved["params"], params)
        if found:
            differ(f"model param {_display(found[0])}", found[2], found[3])
        for kind, (shard, observed) in self.observed.items():
            saved = self.saved["optimizer"][kind]
            if shard.engine.steps_done != saved["steps_done"]:
                differs.append(f"rank {self.rank}, the Adam step count of its {kind} optimizer state is "
                               f"{shard.engine.steps_done}, its save at iteration {iteration} recorded "
                               f"{saved['steps_done']}")
            if self.position:
                found = self._position_mismatch(kind, shard, observed.result(), model)
                what = "tensor {} {} (its data-parallel ranks' pieces together)"
            else:
                found = find_mismatch(saved["tensors"], observed.result())
                what = "tensor {} {}"
            if found:
                differ(what.format(_display(found[0]), found[1]), found[2], found[3])
            nbytes += observed.nbytes
        return differs, nbytes

    def _position_mismatch(self, kind: str, shard, mine: dict, model):
        """With another DP size: each parameter's digests summed over this (pp, tp) position's ranks,
        saved and now, compared; the first that differs (told by the position's first rank only)."""
        names = sorted(param_names(model).values())
        local = torch.tensor([[_as_int64(mine.get(n, {}).get(k, [0, 0])) for k in TENSORS] for n in names],
                             dtype=torch.int64, device=model_device(model))
        torch.distributed.all_reduce(local, group=shard.dp_group)  # int64 sums wrap: mod 2**64, as digests add
        now = {n: {k: [v & MASK for v in pair] for k, pair in zip(TENSORS, row)}
               for n, row in zip(names, local.tolist())}
        saved: Dict[str, Dict[str, List[int]]] = {}
        for record in self.position:
            for name, tensors in record["optimizer"].get(kind, {}).get("tensors", {}).items():
                for key, pair in tensors.items():
                    held = saved.setdefault(name, {}).setdefault(key, [0, 0])
                    saved[name][key] = add_pairs(held, pair)
        for name in names:
            for key in TENSORS:
                saved.setdefault(name, {}).setdefault(key, [0, 0])
        found = find_mismatch(saved, now)
        return found if shard.dp_group.rank() == 0 else None

    def _report(self, verdicts: List[dict]) -> None:
        differs = [line for v in verdicts for line in v["differs"]]
        if differs:
            ranks = sorted({v["rank"] for v in verdicts if v["differs"]})
            shown = "; ".join(differs[:SHOWN])
            more = f"; {len(differs) - SHOWN} more (ranks {ranks})" if len(differs) > SHOWN else ""
            raise UserError(f"resume check: {shown}{more}: --load {self.where} does not give back what was saved; "
                            f"resume from another checkpoint and report this")
        compared = [v for v in verdicts if v["skipped"] is None]
        if not compared:
            print_rank0(f"> resume check: skipped: {verdicts[0]['skipped']}")
            return
        iteration = self.saved["iteration"] if self.saved else "?"
        why_not = next((v["optimizer_skipped"] for v in compared if v["optimizer_skipped"]), None)
        what = "params" if why_not else "params and optimizer state"
        resharded = " (the optimizer state per parameter over each position's data-parallel ranks)" \
            if self.position and not why_not else ""
        line = (f"> resume check: {what} of {_ranks(len(compared))} match their save at iteration {iteration}"
                f"{resharded} (digest of {human_bytes(sum(v['bytes'] for v in verdicts))})")
        if why_not:
            line += f"; the optimizer state was not compared: {why_not}"
        if len(compared) < len(verdicts):
            line += f"; {_ranks(len(verdicts) - len(compared))} not compared: " + \
                next(v["skipped"] for v in verdicts if v["skipped"])
        print_rank0(line)


def _as_int64(pair) -> List[int]:
    """A digest's two unsigned 64-bit halves as the signed integers an int64 tensor holds."""
    return [v - (1 << 64) if v >= 1 << 63 else v for v in pair]


def _display(name: str) -> str:
    """An offload file's parameter name as the model names it (its chunk where there are several)."""
    chunk, _, rest = name.partition(".")
    while rest.startswith("module."):  # the wrappers' (DDP, Float16Module)
        rest = rest[len("module."):]
    return rest if chunk == "0" else f"{rest} (model chunk {chunk})"


def _ranks(n) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _layout(layout: dict) -> str:
    words = [f"{key.upper()}={layout.get(key)}" for key in ("pp", "tp", "dp")]
    if layout.get("chunks", 1) != 1:
        words.append(f"VPP={layout['chunks']}")
    if layout.get("ep", 1) != 1:
        words.append(f"EP={layout['ep']}")
    return " ".join(words)


def _hex(pair) -> str:
    return "none" if pair is None else ":".join(f"{v:016x}" for v in pair)
