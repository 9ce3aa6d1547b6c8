"""Writing one engine's state into a checkpoint file (the format: ``checkpoint.state_file``), from a snapshot.

Synchronously (``save_engine_state``: training waits) or by a thread while training goes on
(``start_background_save`` -> ``BackgroundStateWrite``). Both write a ``StateSnapshot`` the same
way: each subgroup at its own offset (byte offsets follow from the element ranges, so the writer
may go in the order the next update needs and still lay the file out in element order), the
footer, the trailer, fsync, rename. Subgroups held in files are read through their tier (their
block CRCs checked), two at a time, so the next read overlaps this write; each subgroup is written by
``tiers.direct_io`` (O_DIRECT from a staging buffer, threads), at disk speed rather than the page cache's;
in a background save its CRCs and writes are made by a helper process, off the training process.
Given a ``digest.StateDigest``, a thread beside the writer adds each subgroup's tensors to it while the
writer copies them out (the resume check's record of the save, from what is written and nothing
read again).

With ``link_tier_files``, a file-held subgroup on the checkpoint's file system is not copied: the
checkpoint takes its tier file by hard link (``parts``), and only its footer entry is written. A
digest then costs a read of the linked file (no write), through the tier, its block CRCs checked, by a thread
of its own while the other subgroups are written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from .file_blocks import snapshot_blocks
from .digest import StateDigest
from .file_format import MAGIC, TRAILER, CheckpointSaveError
from .pacing import DiskPacer, pace_save
from .parts import PartLinks
from .state_file import human_bytes, state_file_bytes, subgroups_file_bytes
from .tier_reads import TierReads
from ..tiers.direct_io import DirectRegionWriter, pwrite_all
from ..engine import OffloadedAdamW
from ..faults import fault_point
from ..snapshot import StateSnapshot
from ..tiers.files import fsync_path

log = logging.getLogger("mlp_offload")


def save_engine_state(engine: OffloadedAdamW, path: str, metadata: Optional[dict] = None,
                      digest: Optional[StateDigest] = None, link_tier_files: bool = False) -> int:
    """Stream the engine's state into ``path`` now; returns bytes written. On failure the partial
    ``.tmp`` file is removed and a file already at ``path`` is left as it was. ``link_tier_files``:
    tier files on the checkpoint's file system are taken by hard link (``parts``), not copied."""
    snapshot = _snapshot(engine, link_files=False)  # nothing changes the state before this returns
    try:
        return write_snapshot(snapshot, path, metadata, digest, link_tier_files)
    finally:
        snapshot.release()


def start_background_save(engine: OffloadedAdamW, path: str, metadata: Optional[dict] = None,
                          digest: Optional[StateDigest] = None, link_tier_files: bool = False,
                          next_save_in_s: Optional[float] = None) -> "BackgroundStateWrite":
    """Snapshot the engine's state now (cheap: see snapshot) for a thread that writes it into
    ``path`` once ``start()``ed, while the engine goes on stepping. Where the tier's file system
    has no hard links the state is written now instead (the handle is then already done).
    ``link_tier_files``: the snapshot's links of tier files go into the checkpoint (``parts``);
    ``next_save_in_s``: when the next save comes, which a paced writer is to be done before (pacing)."""
    try:
        snapshot = _snapshot(engine, link_files=True)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        log.warning("the offload tiers' file system refused a hard link (%s): the offloaded state is written "
                    "synchronously", err.strerror or err)
        return BackgroundStateWrite.finished_now(engine, path, metadata, digest, link_tier_files)
    short = _tier_short_of_space(snapshot, engine.config.resolved_ranks_sharing_node())
    if short:
        snapshot.cancel()
        log.warning("%s: the offloaded state is written synchronously", short)
        return BackgroundStateWrite.finished_now(engine, path, metadata, digest, link_tier_files)
    write = BackgroundStateWrite(snapshot, path, metadata, digest, link_tier_files)
    write.pacer = pace_save(engine, snapshot, path, link_tier_files, digest is not None, next_save_in_s)
    return write


def _snapshot(engine: OffloadedAdamW, link_files: bool) -> StateSnapshot:
    """The engine's snapshot, with where its shard's params lie (8-bit moments' blocks, for the footer)."""
    snapshot = engine.snapshot(link_files=link_files)
    snapshot.shard_params = engine.blocks.params if engine.blocks is not None else None
    return snapshot


def _tier_short_of_space(snapshot: StateSnapshot, ranks: int) -> Optional[str]:
    """While the writer reads the linked files, the updates write those subgroups to new ones: a
    tier may need their bytes twice (for every rank of the node, as start-up counts)."""
    needed: Dict[str, list] = {}
    for i, copy in snapshot.on_tier.items():
        entry = needed.setdefault(copy.tier.name, [copy.tier, 0])
        entry[1] += snapshot.subgroups[i].state_bytes * ranks
    for name, (tier, nbytes) in needed.items():
        if tier.free_bytes() < nbytes:
            return (f"tier {name} has {human_bytes(tier.free_bytes())} free, a background save needs "
                    f"{human_bytes(nbytes)} there for the files the next updates rewrite meanwhile")
    return None


class BackgroundStateWrite:
    """One rank's offloaded state being written by a thread. ``done()`` never blocks; ``wait()``
    joins; ``failure`` is the exception that stopped it (None once it succeeded)."""

    def __init__(self, snapshot: Optional[StateSnapshot], path: str, metadata: Optional[dict],
                 digest: Optional[StateDigest] = None, link_tier_files: bool = False):
        self.snapshot = snapshot
        self.path = path
        self.metadata = metadata
        self.digest = digest
        self.link_tier_files = link_tier_files
        self.nbytes = subgroups_file_bytes(snapshot.subgroups) if snapshot else 0
        self.write_s = 0.0
        self.pacer: Optional[DiskPacer] = None  # where a file tier shares the checkpoint's disk (pacing)
        self.failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mlp-checkpoint-writer", daemon=True)

    @classmethod
    def finished_now(cls, engine: OffloadedAdamW, path: str, metadata: Optional[dict],
                     digest: Optional[StateDigest] = None, link_tier_files: bool = False) -> "BackgroundStateWrite":
        handle = cls(None, path, metadata, digest)
        started = time.perf_counter()
        handle.nbytes = save_engine_state(engine, path, metadata, digest, link_tier_files)
        handle.write_s = time.perf_counter() - started
        return handle

    @property
    def paused_s(self) -> float:
        """What holding the update back for this write has cost training so far."""
        return self.snapshot.paused_s if self.snapshot else 0.0

    def start(self) -> None:
        if self.snapshot is not None:
            self._thread.start()

    def done(self) -> bool:
        return self.snapshot is None or (self._thread.ident is not None and not self._thread.is_alive())

    def wait(self) -> None:
        if self.snapshot is not None and self._thread.ident is not None:
            self._thread.join()

    def cancel(self) -> None:
        """Stop writing (the run is failing): the partial file is removed; the engine steps freely."""
        if self.snapshot is not None:
            self.snapshot.cancel()
            self.wait()

    def _run(self) -> None:
        started = time.perf_counter()
        self.snapshot.writer_starts()
        try:
            self.nbytes = write_snapshot(self.snapshot, self.path, self.metadata, self.digest, self.link_tier_files,
                                         self.pacer, beside_training=True)
            if self.pacer is not None:
                log.info("offloaded state %s paced: %s", self.path, self.pacer.report())
        except BaseException as err:  # reported by the finalize step, on every rank
            self.failure = err
        finally:
            self.snapshot.release()
            self.write_s = time.perf_counter() - started


def write_snapshot(snapshot: StateSnapshot, path: str, metadata: Optional[dict],
                   digest: Optional[StateDigest] = None, link_tier_files: bool = False,
                   pacer: Optional[DiskPacer] = None, beside_training: bool = False) -> int:
    """Write ``snapshot`` into ``path`` (via ``path.tmp``, fsynced, renamed); returns its bytes.
    ``digest``: each subgroup's tensors are added to it as they are written. ``link_tier_files``:
    tier files on ``path``'s file system become part files (linked, fsynced before the rename).
    ``pacer``: the state held in memory is copied aside first, then each chunk waits its turn (pacing).
    ``beside_training``: training steps while this writes, so the CRCs and writes go to a helper process
    (``tiers.write_helper``), away from the training thread."""
    tmp = path + ".tmp"
    parts = PartLinks(path, snapshot.steps_done) if link_tier_files else None
    try:
        size = _write(snapshot, tmp, metadata, digest, parts, pacer, beside_training)
        fault_point("save-offload-commit")  # parts linked and durable, the state file not yet renamed
        os.replace(tmp, path)
        fsync_path(os.path.dirname(os.path.abspath(path)))
        if parts is not None:
            parts.commit_done()
    except BaseException as err:
        _remove(tmp)
        if parts is not None:
            parts.discard()
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointSaveError(
                f"{path}: {err.strerror or err} while saving the offloaded optimizer state: "
                f"{human_bytes(subgroups_file_bytes(snapshot.subgroups))} needed for this file, "
                f"{human_bytes(free_bytes(path))} free; the partial file was removed") from err
        raise
    linked = parts.linked_bytes if parts is not None else 0
    log.info("offloaded state %s: %s linked from the tiers' files, %s written", path, human_bytes(linked),
             human_bytes(size))
    return size


def _link_parts(snapshot: StateSnapshot, parts: Optional[PartLinks]) -> Dict[int, dict]:
    """Subgroup -> its footer ``part``: the file-held subgroups the checkpoint takes by hard link."""
    linked = {}
    for i, copy in sorted(snapshot.on_tier.items()) if parts is not None else ():
        part = parts.link(copy.tier, copy.key, snapshot.subgroups[i])
        if part is not None:
            linked[i] = part
    if linked:
        parts.sync()
    return linked


def unlinked_bytes(snapshot: StateSnapshot, linked: Dict[int, dict], digest: bool) -> int:
    """What the file-held subgroups a link refused add to a paced write planned with links: each is
    written, and read (without a digest; with one, its read was planned already)."""
    return sum(state_file_bytes(sg.numel, sg.codecs, sg.blocks) + (0 if digest else sg.state_bytes)
               for sg in (snapshot.subgroups[i] for i in snapshot.on_tier if i not in linked))


def _write(snapshot: StateSnapshot, tmp: str, metadata: Optional[dict], digest: Optional[StateDigest],
           parts: Optional[PartLinks] = None, pacer: Optional[DiskPacer] = None, beside_training: bool = False) -> int:
    with snapshot.device_reads():  # the device-held state copied out beside the training's stream
        if pacer is not None:  # first, before the links' fsyncs: the next update finds its copies made
            started = time.perf_counter()
            pacer.staged_bytes = snapshot.stage_ahead()
            pacer.staged_s = time.perf_counter() - started  # what the copy aside may cost the steps beside it
            pacer.yield_to_first(snapshot.check_cancelled)  # the flushes due first have the quiet spells
        linked = _link_parts(snapshot, parts)
        if pacer is not None and parts is not None:
            pacer.expect(unlinked_bytes(snapshot, linked, digest is not None))
        return _write_state(snapshot, tmp, metadata, digest, linked, pacer, beside_training)


def _write_state(snapshot: StateSnapshot, tmp: str, metadata: Optional[dict], digest: Optional[StateDigest],
                 linked: Dict[int, dict], pacer: Optional[DiskPacer], beside_training: bool) -> int:
    offsets, end = {}, 0
    for sg in snapshot.subgroups:  # element order: where each subgroup's bytes go (a part's: none here)
        offsets[sg.index] = end
        if sg.index not in linked:
            end += state_file_bytes(sg.numel, sg.codecs, sg.blocks)
    crcs = {}  # subgroup -> a function giving its tensors' CRC32s once the writer has them
    reads = TierReads(snapshot, skip=linked, pacer=pacer)
    adding = threading.Lock()  # a digest adds one subgroup at a time, from either thread
    # A linked subgroup is read only for the digest: on a thread of its own, while the others are written.
    linked_digests = _LinkedDigests(snapshot, linked, digest, adding, pacer) if digest is not None and linked else None
    with open(tmp, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="mlp-checkpoint-digest") as beside:
        fd = f.fileno()
        writer = DirectRegionWriter(fd, tmp, pace=pacer.wait_turn if pacer is not None else None,
                                    helper=beside_training)
        try:
            for i in snapshot.order:
                snapshot.check_cancelled()
                if i in linked:
                    continue  # its part file is the checkpoint's; done with once its digest is
                views = snapshot.take(i) if i in snapshot.memory else reads.get(i)
                digesting = None
                try:  # the state is copied out before put returns: the update may have it back at once
                    tensors = views.narrow(snapshot.subgroups[i])
                    if digest is not None:  # by a thread of its own, while put copies the same tensors out
                        digesting = beside.submit(_add_to_digest, snapshot, digest, adding, snapshot.subgroups[i],
                                                  tensors)
                    crcs[i] = writer.put(offsets[i], tensors)
                finally:
                    if digesting is not None:
                        digesting.result()  # before the update or the next read may change the tensors
                    snapshot.done_with(i)
                fault_point("save-offload")
            writer.finish()
            if linked_digests is not None:
                linked_digests.wait()
        finally:
            writer.close()
            reads.close()
            if linked_digests is not None:
                linked_digests.stop()
        for i in sorted(linked):
            snapshot.done_with(i)
            fault_point("save-offload")
        entries = [{"start": sg.start, "end": sg.end, "offset": offsets[sg.index], "part": linked[sg.index]}
                   if sg.index in linked else
                   {"start": sg.start, "end": sg.end, "offset": offsets[sg.index], "crc": crcs[sg.index]()}
                   for sg in snapshot.subgroups]
        fields = {"numel": snapshot.numel, "steps_done": snapshot.steps_done, "subgroups": entries,
                  "dtypes": [c.describe() for c in snapshot.codecs], "metadata": metadata or {}}
        blocks = snapshot_blocks(snapshot)
        if blocks is not None:  # 8-bit moments: what rebuilds every region's size and blocks
            fields["blocks"] = blocks.to_json()
            for entry, sg in zip(entries, snapshot.subgroups):
                entry["blocks"] = sg.blocks
        footer = json.dumps(fields).encode()
        pwrite_all(fd, footer + TRAILER.pack(MAGIC, len(footer), zlib.crc32(footer)), end)
        os.fsync(fd)
        return end + len(footer) + TRAILER.size


def _add_to_digest(snapshot: StateSnapshot, digest: StateDigest, adding: threading.Lock, sg, tensors) -> None:
    with adding, snapshot.device_reads():  # its thread's device reads are done when it returns
        digest.add(sg, tensors)


class _LinkedDigests:
    """The digest of the subgroups the checkpoint takes by hard link (``linked``), read through their
    tiers by a thread of its own while the writer writes the other subgroups, so those reads and the
    writes share the disk at once rather than one after the other. ``adding``: the lock every
    addition to ``digest`` takes."""

    def __init__(self, snapshot: StateSnapshot, linked, digest: StateDigest, adding: threading.Lock,
                 pacer: Optional[DiskPacer] = None):
        self.snapshot, self.digest, self.adding = snapshot, digest, adding
        self.reads = TierReads(snapshot, skip=set(snapshot.on_tier) - set(linked), pacer=pacer)
        self.stopped = threading.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mlp-checkpoint-linked")
        self._done = self._thread.submit(self._run)

    def _run(self) -> None:
        for i in self.reads.ids:
            if self.stopped.is_set():
                return
            self.snapshot.check_cancelled()
            sg = self.snapshot.subgroups[i]
            _add_to_digest(self.snapshot, self.digest, self.adding, sg, self.reads.get(i).narrow(sg))

    def wait(self) -> None:
        self._done.result()  # its error (a failed read) is the save's

    def stop(self) -> None:
        """Whatever happened to the writer: the thread ends before the snapshot is released."""
        self.stopped.set()
        self.reads.close()  # a read in pieces stops after its piece in flight
        self._thread.shutdown(wait=True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def free_bytes(path: str) -> int:
    """Bytes free to this user on the file system that holds ``path`` (its nearest existing directory's, where
    it is not made yet)."""
    at = os.path.abspath(path)
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    st = os.statvfs(at)
    return st.f_bavail * st.f_frsize
