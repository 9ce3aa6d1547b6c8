"""The resume check: a load must give each rank the params and optimizer state its save recorded,
bit for bit, whether or not training itself is deterministic.

At a save each rank records, in ``iter_N/resume_check/rankRRRRR.json`` (covered by the checkpoint's
proof, checkpoint_integrity), the digests (``mlp_offload.checkpoint.digest``) of its model params
(where they are: on the GPU, hashed there) and of its offloaded optimizer state, every tier of it,
per parameter and state tensor, as stored (a master kept as remainders as those, 8-bit moments as
codes and scales). The state's digests come from the checkpoint writer, from the tensors it writes
(for --async-save, the snapshot it writes); nothing is read twice. At a load the same digests are
taken from what the engines' fill callbacks write and from the model's params once loaded, and
compared with the record: one line on rank 0 when every rank matches, else one UserError naming
the first rank and tensor that differs.

Digests are per rank: a load at another layout (PP, TP, DP or world size) compares nothing and says
so; an optimizer resharded, converted between forms or into other stored formats is not compared
(the params are). megatron-core's own optimizer's state is read by dist_checkpointing and not
digested here.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint.offload_files import param_names, shard_pieces
from megatron.training.checkpoint.state_dict import rank_coordinates
from megatron.training.errors import UserError
from megatron.training.runtime.optimizer_interface import OffloadedOptimizerCheckpoint
from megatron.training.runtime.progress import print_rank0
from mlp_offload.checkpoint import human_bytes
from mlp_offload.checkpoint.digest import StateDigest, as_pairs, digest, find_mismatch

RECORD_DIR = "resume_check"
FORMAT = 1
SHOWN = 3  # differences the error names (the first ones by rank); the others are counted


def record_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, RECORD_DIR, f"rank{rank:05d}.json")


def param_digests(model) -> Tuple[Dict[str, Dict[str, List[int]]], int]:
    """{name: {"param": digest}} of the model chunks' params, hashed where they live; and their bytes."""
    names = param_names(model)
    params = [p for chunk in model for p in chunk.parameters()]
    pairs = as_pairs([digest(p.detach()) for p in params])
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
        self.params, self.param_bytes = param_digests(model)
        names = param_names(model)
        self.shards = _engine_shards(optimizer)
        self.steps = {shard.kind: shard.engine.steps_done for shard in self.shards}
        self.engines = {shard.kind: StateDigest.of_engine(shard.engine, shard_pieces(shard, names))
                        for shard in self.shards}

    def write(self, checkpoint_dir: str) -> None:
        optimizer = {kind: {"steps_done": self.steps[kind], "formats": d.formats, "bytes": d.nbytes,
                            "tensors": d.result()} for kind, d in self.engines.items()}
        shape, place = rank_coordinates()
        record = {"format": FORMAT, "iteration": self.iteration, "world_size": torch.distributed.get_world_size(),
                  "layout": [list(shape), list(place)], "params": self.params, "param_bytes": self.param_bytes,
                  "optimizer": optimizer}
        path = record_path(checkpoint_dir, torch.distributed.get_rank())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


class ResumeCheck:
    """One rank's side of the check at a load of ``checkpoint_dir``: its record read first, the
    engines' fills observed (``observer``), then ``finish`` compares and reports for all ranks.
    Not ``enabled`` (--no-resume-check): nothing is read, observed or said."""

    def __init__(self, checkpoint_dir: str, enabled: bool = True):
        self.where, self.enabled = checkpoint_dir, enabled
        self.rank = torch.distributed.get_rank()
        self.saved, self.skipped = self._read_record() if enabled else (None, "--no-resume-check")
        self.observed: Dict[str, Tuple[object, StateDigest]] = {}  # kind -> (shard, its load's digests)
        self.optimizer_skipped: Optional[str] = None

    def _read_record(self) -> Tuple[Optional[dict], Optional[str]]:
        path = record_path(self.where, self.rank)
        try:
            with open(path) as f:
                record = json.load(f)
        except FileNotFoundError:
            return None, f"{self.where} records no digests (saved by an older version or another program)"
        except (OSError, ValueError) as err:
            raise UserError(f"--load {self.where}: {path} is unreadable ({err}); the resume check cannot run: "
                            f"restore the checkpoint from a copy") from None
        shape, place = rank_coordinates()
        saved_shape, saved_place = record.get("layout", [[], []])
        world = torch.distributed.get_world_size()
        if record.get("world_size") != world or saved_shape != list(shape) or saved_place != list(place):
            return None, (f"it was saved by {_ranks(record.get('world_size'))} at {_layout(saved_shape)}, this run "
                          f"has {_ranks(world)} at {_layout(shape)}; digests are per rank")
        return record, None

    def skip_optimizer(self, why: str) -> None:
        """The optimizer state is not compared, for this reason (the params still are)."""
        self.optimizer_skipped = self.optimizer_skipped or why

    def observer(self, shard, model) -> Optional[Callable]:
        """A wrapper for ``shard``'s fill callback that digests what the fill writes (None where the
        shard's state cannot be compared: the reason is kept)."""
        if self.saved is None:
            return None
        saved = self.saved["optimizer"].get(shard.kind)
        if saved is None:
            self.skip_optimizer(f"the save recorded no digests of its {shard.kind} optimizer state")
            return None
        formats = [c.describe() for c in shard.engine.state_codecs]
        if formats != saved["formats"]:
            self.skip_optimizer(f"it is stored as {'/'.join(saved['formats'])} in the checkpoint and as "
                                f"{'/'.join(formats)} in this run")
            return None
        observed = StateDigest.of_engine(shard.engine, shard_pieces(shard, param_names(model)))
        self.observed[shard.kind] = (shard, observed)
        return observed.observing

    def finish(self, model, optimizer_loaded: bool) -> None:
        """Compare this rank's params and observed state with its record; then, with every rank's
        verdict: one line on rank 0, or a UserError on every rank naming the first difference."""
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
        params, nbytes = param_digests(model)
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
            found = find_mismatch(saved["tensors"], observed.result())
            if found:
                differ(f"tensor {_display(found[0])} {found[1]}", found[2], found[3])
            nbytes += observed.nbytes
        return differs, nbytes

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
        what = "params and optimizer state"
        why_not = next((v["optimizer_skipped"] for v in compared if v["optimizer_skipped"]), None)
        if why_not:
            what = "params"
        line = f"> resume check: {what} of {_ranks(len(compared))} match their save at iteration {iteration} " \
               f"(digest of {human_bytes(sum(v['bytes'] for v in verdicts))})"
        if why_not:
            line += f"; the optimizer state was not compared: {why_not}"
        if len(compared) < len(verdicts):
            line += f"; {_ranks(len(verdicts) - len(compared))} not compared: {verdicts[0]['skipped']}"
        print_rank0(line)


def _display(name: str) -> str:
    """An offload file's parameter name as the model names it (its chunk where there are several)."""
    chunk, _, rest = name.partition(".")
    while rest.startswith("module."):  # the wrappers' (DDP, Float16Module)
        rest = rest[len("module."):]
    return rest if chunk == "0" else f"{rest} (model chunk {chunk})"


def _ranks(n) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _layout(shape) -> str:
    return " ".join(f"{name}={size}" for name, size in zip(("PP", "TP", "DP"), shape)) if len(shape) == 3 else "?"


def _hex(pair) -> str:
    return "none" if pair is None else ":".join(f"{v:016x}" for v in pair)
