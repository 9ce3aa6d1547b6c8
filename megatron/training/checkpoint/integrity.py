"""Proof that a checkpoint directory is complete, and the choice of the checkpoint to resume from.

A save marks its new ``iter_N/`` with ``SAVE_IN_PROGRESS`` before any data goes in; once every
rank's files are on disk, rank 0 writes ``COMPLETE.json`` (the size of every file, the CRC32 of
every small one such as metadata but the offloaded state's and its part files, which check themselves, and
a CRC32 of itself) by rename, removes the in-progress marker,
and only then updates the tracker. A directory is therefore

- complete: ``COMPLETE.json`` is intact and every file it lists is there with its size (and CRC);
- incomplete: the in-progress marker without ``COMPLETE.json``: a save began and never ended.
  This is the only kind ever removed, by the save that reuses its name, with a line naming it;
- damaged: ``COMPLETE.json`` or a listed file fails its check: never used, never removed;
- unproven: neither marker (an older version's or upstream Megatron-LM's checkpoint): used only
  where the tracker names it (the tracker was always written last), never removed, set aside
  (renamed) if a save needs its name.

Complete ones are removed only where the run asks (--save-retain-interval, Megatron-LM's flag: those at multiples of
it and the newest stay; in the directory of --non-persistent-ckpt-type global, only the newest stays). Once a
checkpoint is complete and named by the tracker, rank 0 retires the earlier complete ones at other iterations. Each
is first renamed to a hidden name beside it (one atomic step: from then on no listing sees it, so no load resumes
from a half-removed directory), then removed by a thread of its own, so training does not wait on a parallel file
system's deletes. A run that stops while removing leaves the hidden names, and the next retirement removes them too.
Checkpoints after the one just saved (a run resumed from an earlier one) and symbolic links (someone's pointer to a
checkpoint kept elsewhere) are never touched.

The tracker is a hint, not the proof: when it is missing, unreadable or older than the newest
complete checkpoint, the newest complete one is used and the loader says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from mlp_offload import fsync_path
from mlp_offload.checkpoint import STATE_FILE_SUFFIX, human_bytes, is_part_path

TRACKER = "latest_checkpointed_iteration.txt"
IN_PROGRESS = "SAVE_IN_PROGRESS"
COMPLETE = "COMPLETE.json"
CRC_LIMIT_BYTES = 64 << 20  # files up to this size (metadata, common state) get a CRC32 in the proof,
# but for offloaded state files, which check themselves as they load: reading one for a CRC is one more open
RECORD_DIR = "resume_check"  # each rank's record of the save for the resume check (resume_check)
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's directory for them inside --save (and --load)
NEWEST_ONLY = 0  # the retain interval of the non-persistent directory: every earlier complete checkpoint retires

COMPLETE_STATE, INCOMPLETE, DAMAGED, UNPROVEN, MISSING = "complete", "incomplete", "damaged", "unproven", "missing"


@dataclass
class DirStatus:
    state: str
    detail: str = ""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_dirs(root: str) -> Dict[int, str]:
    found = {}
    for name in _listdir(root):
        match = _ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found[int(match.group(1))] = os.path.join(root, name)
    return found


# -- writing the proof (rank 0) ------------------------------------------------------------------
def mark_in_progress(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    _write_durably(os.path.join(path, IN_PROGRESS), json.dumps({"started": time.time(), "pid": os.getpid()}))


def mark_complete(path: str, iteration: int) -> int:
    """Write ``COMPLETE.json`` for what ``path`` holds now; returns the checkpoint's bytes."""
    files = {}
    for rel, size in _files(path):
        proven = size <= CRC_LIMIT_BYTES and not (rel.endswith(STATE_FILE_SUFFIX) or is_part_path(rel))
        crc = _crc_file(os.path.join(path, rel)) if proven else None
        files[rel] = [size, crc]
    body = {"format": 1, "iteration": iteration, "written": time.time(), "files": files}
    _write_durably(os.path.join(path, COMPLETE), _signed(body))
    os.unlink(os.path.join(path, IN_PROGRESS))
    fsync_path(path)
    return sum(size for size, _ in files.values())


def part_bytes(path: str) -> Dict[str, int]:
    """The bytes on disk of ``path``'s parts, the proof and the in-progress marker left out: "offloaded"
    (the offload files and their linked parts), "records" (the resume check's), "torch_dist" (the rest)."""
    found = {"torch_dist": 0, "offloaded": 0, "records": 0}
    for rel, size in _files(path):
        if rel.endswith(STATE_FILE_SUFFIX) or is_part_path(rel):
            found["offloaded"] += size
        else:
            found["records" if rel.startswith(RECORD_DIR + os.sep) else "torch_dist"] += size
    return found


def write_tracker(root: str, iteration: int) -> None:
    _write_durably(os.path.join(root, TRACKER), str(iteration))


# -- reading it ----------------------------------------------------------------------------------
def status(path: str) -> DirStatus:
    if not os.path.isdir(path):
        return DirStatus(MISSING)
    proof = os.path.join(path, COMPLETE)
    if not os.path.exists(proof):
        if os.path.exists(os.path.join(path, IN_PROGRESS)):
            return DirStatus(INCOMPLETE, "a save began there and did not finish")
        return DirStatus(UNPROVEN, f"no {COMPLETE} (written by an older version or another program?)")
    try:
        with open(proof) as f:
            body = _verified(f.read())
    except (OSError, ValueError, KeyError, TypeError) as err:
        return DirStatus(DAMAGED, f"{proof} is unreadable: {err}")
    for rel, (size, crc) in body["files"].items():
        file = os.path.join(path, rel)
        try:
            actual = os.path.getsize(file)
        except OSError:
            return DirStatus(DAMAGED, f"{file} is missing")
        if actual != size:
            return DirStatus(DAMAGED, f"{file} has {actual} bytes, {size} when it was saved")
        if crc is not None and _crc_file(file) != crc:
            return DirStatus(DAMAGED, f"{file} does not match its checksum")
    return DirStatus(COMPLETE_STATE)


def _markers(path: str) -> DirStatus:
    """What a directory's markers claim, unverified (COMPLETE_STATE: it has a proof to check)."""
    if os.path.exists(os.path.join(path, COMPLETE)):
        return DirStatus(COMPLETE_STATE)
    return status(path)  # no proof: the markers alone decide, nothing is read


def read_tracker(root: str) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None), or (None, why it cannot be used)."""
    path = os.path.join(root, TRACKER)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None, f"{path} is missing"
    except OSError as err:
        return None, f"{path} cannot be read: {err}"
    if not text.isdigit():
        return None, f"{path} holds {text[:40]!r}, not an iteration number"
    return int(text), None


def choose_checkpoint(root: str) -> Tuple[Optional[int], List[str]]:
    """The iteration to resume from (None: start fresh) and what the user should be told.

    Raises ValueError (with the message) where starting fresh would ignore a checkpoint that may
    be good: a damaged or unproven one with no complete one to use instead.
    """
    dirs = iteration_dirs(root)
    # Verifying a proof reads its small files: newest first, and only until one holds (older
    # checkpoints are not read at every start). The others are told apart by their markers alone.
    states = {it: _markers(path) for it, path in dirs.items()}
    verified = set()
    for it in sorted(dirs, reverse=True):
        if states[it].state == COMPLETE_STATE:
            states[it] = status(dirs[it])
            verified.add(it)
            if states[it].state == COMPLETE_STATE:
                break
    tracked, tracker_problem = read_tracker(root)
    if tracked in dirs and states[tracked].state == COMPLETE_STATE and tracked not in verified:
        states[tracked] = status(dirs[tracked])  # older than the newest good one: not verified above
    notes = []
    usable = {it for it, st in states.items() if st.state == COMPLETE_STATE}
    if tracked is not None:
        st = states.get(tracked, DirStatus(MISSING))
        if st.state == UNPROVEN:
            usable.add(tracked)  # the tracker, written last by every version, vouches for it
        elif st.state != COMPLETE_STATE:
            notes.append(f"the tracker names iteration {tracked}, but {checkpoint_dir(root, tracked)} is "
                         f"{st.state}{': ' + st.detail if st.detail else ''}; it is not used")
    for it in sorted(dirs):
        if states[it].state == DAMAGED:
            notes.append(f"{dirs[it]} is damaged ({states[it].detail}); it is not used and left in place")
    if not usable:
        blocking = [it for it in sorted(dirs) if states[it].state in (DAMAGED, UNPROVEN)]
        if blocking:
            it = blocking[-1]
            remedy = (f"to use it, write {it} into {os.path.join(root, TRACKER)}" if states[it].state == UNPROVEN
                      else "restore it from a copy")
            raise ValueError(
                f"{dirs[it]} is {states[it].state} ({states[it].detail}) and no complete checkpoint is there "
                f"to resume from; {remedy}, or move it out of {root} to start fresh")
        return None, notes
    chosen = max(usable)
    if tracked != chosen:
        why = tracker_problem or f"the tracker names iteration {tracked}"
        notes.append(f"resuming from {dirs[chosen]}, the newest complete checkpoint ({why})")
    return chosen, notes


# -- making room for a save (rank 0) ---------------------------------------------------------------
def clear_for_save(root: str, iteration: int) -> Tuple[bool, List[str]]:
    """Make ``iter_N`` ready for a new save. Returns (save needed, lines to print): False where a
    complete checkpoint of that iteration exists (it is never rewritten in place)."""
    path = checkpoint_dir(root, iteration)
    st = status(path)
    if st.state == COMPLETE_STATE:
        return False, [f"{path} is already a complete checkpoint: not rewritten"]
    if st.state == INCOMPLETE:
        shutil.rmtree(path)
        return True, [f"removed incomplete checkpoint {path} (an interrupted save: {IN_PROGRESS} without {COMPLETE})"]
    if st.state in (DAMAGED, UNPROVEN):
        aside = f"{path}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(path, aside)
        return True, [f"moved {path} ({st.state}: {st.detail}) to {aside} to save iteration {iteration} there"]
    return True, []


# -- retiring complete ones (--save-retain-interval; rank 0) -------------------------------------------
RETIRING = ".retiring_"  # the prefix of a retired checkpoint's hidden name, until it is removed

_removals: List[threading.Thread] = []  # started by this process and maybe not yet done (finish_retiring())
_in_hand: set = set()  # hidden directories this process's removals are removing: not swept as leftovers


def non_persistent_root(args, base: Optional[str]) -> Optional[str]:
    """Where --non-persistent-ckpt-type global's checkpoints go: --non-persistent-global-ckpt-dir, else
    non_persistent/ inside ``base`` (--save for a save, --load for a resume); None where that type is off."""
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        return None
    if args.non_persistent_global_ckpt_dir:
        return args.non_persistent_global_ckpt_dir
    return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None


def to_retire(root: str, iteration: int, retain_interval: int) -> List[Tuple[int, str]]:
    """(iteration, directory) of the checkpoints in ``root`` that the one at ``iteration`` retires: complete (by
    their markers; others stay as the module's docstring says), earlier, not at a multiple of ``retain_interval``
    (any, with ``NEWEST_ONLY``), and not a symbolic link."""
    return sorted((it, path) for it, path in iteration_dirs(root).items()
                  if it < iteration and not retained(it, retain_interval)
                  and not os.path.islink(path) and _markers(path).state == COMPLETE_STATE)


def retained(iteration: int, retain_interval: Optional[int]) -> bool:
    """Whether a complete checkpoint stays once a newer one is complete (``to_retire``'s rule, for one)."""
    return retain_interval is None or (retain_interval != NEWEST_ONLY and iteration % retain_interval == 0)


def _retention_flag(retain_interval: int) -> str:
    return "--non-persistent-save-interval" if retain_interval == NEWEST_ONLY else "--save-retain-interval"


def retire(root: str, iteration: int, retain_interval: Optional[int], say=None) -> Optional[threading.Thread]:
    """On the rank that writes the tracker, once the checkpoint at ``iteration`` is complete: the checkpoints it
    retires renamed out of sight now, then removed with any left from an earlier run by a thread (returned; None
    where there was nothing to remove). ``say`` gets one line when they are gone, or one per failure."""
    if retain_interval is None:
        return None
    say = say or _say
    hidden, failed = [], []
    for it, path in to_retire(root, iteration, retain_interval):
        target = os.path.join(root, f"{RETIRING}{os.path.basename(path)}_{os.getpid()}")
        try:
            os.rename(path, target)
            hidden.append((it, target))
        except OSError as err:
            failed.append(f"{path}: {err.strerror or err}")
    for problem in failed:
        say(f"> {_retention_flag(retain_interval)}: could not retire {problem}; it stays")
    left = [os.path.join(root, name) for name in _listdir(root)
            if name.startswith(RETIRING) and os.path.join(root, name) not in _in_hand | {t for _, t in hidden}]
    if not hidden and not left:
        return None
    _in_hand.update([t for _, t in hidden] + left)
    thread = threading.Thread(target=_remove, args=(root, iteration, retain_interval, hidden, left, say),
                              name="checkpoint-retention", daemon=True)
    thread.start()
    _removals.append(thread)
    return thread


def finish_retiring(say=None) -> None:
    """Wait for this process's removals (the run's end: no hidden directory left behind by its exit)."""
    say = say or _say
    pending = [t for t in _removals if t.is_alive()]
    if pending:
        say("> waiting for the retired checkpoints' removal to end")
    for thread in pending:
        thread.join()
    _removals.clear()


def _remove(root: str, iteration: int, retain_interval: int, hidden: List[Tuple[int, str]], left: List[str],
            say) -> None:
    started, freed, errors = time.perf_counter(), 0, []
    for path in [p for _, p in hidden] + left:
        freed += _tree_bytes(path)
        remove_tree(path, lambda p, err: None if isinstance(err, FileNotFoundError) else errors.append(f"{p}: {err}"))
        _in_hand.discard(path)
    if hidden:
        iterations = ", ".join(str(it) for it, _ in hidden)
        also = f" and {len(left)} left by an earlier run" if left else ""
        why = ("the non-persistent directory keeps its newest" if retain_interval == NEWEST_ONLY else
               f"not multiples of --save-retain-interval {retain_interval}")
        say(f"> retired the checkpoints at iterations {iterations}{also} ({why}; the one at {iteration} is complete): "
            f"{human_bytes(freed)} removed from {root} in {time.perf_counter() - started:.1f} s")
    elif left:
        say(f"> removed {len(left)} checkpoint(s) an earlier run had begun to retire: {human_bytes(freed)} from {root}")
    for problem in errors[:1]:  # one line: a file system that refuses one file refuses the rest alike
        say(f"> {_retention_flag(retain_interval)}: {len(errors)} file(s) could not be removed, e.g. {problem}")


def remove_tree(path: str, failed) -> None:
    """shutil.rmtree, each failure to ``failed(path, exception)`` (its keyword changed in Python 3.12)."""
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _f, p, err: failed(p, err))
    else:
        shutil.rmtree(path, onerror=lambda _f, p, info: failed(p, info[1]))


def _tree_bytes(path: str) -> int:
    """The bytes of the files under ``path`` that this removal frees (a hard link's data stays with its other
    names, so only files with one link count)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if st.st_nlink == 1:
                total += st.st_size
    return total


def _say(line: str) -> None:
    print(line, flush=True)


# -- helpers -----------------------------------------------------------------------------------------
def _files(path: str):
    for dirpath, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if rel not in (IN_PROGRESS, COMPLETE):
                yield rel, os.path.getsize(full)


def _crc_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def _signed(body: dict) -> str:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, sort_keys=True)


def _verified(text: str) -> dict:
    outer = json.loads(text)
    body = outer["body"]
    if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != outer["crc32"]:
        raise ValueError("checksum mismatch: the proof was damaged or edited")
    return body


def _write_durably(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
