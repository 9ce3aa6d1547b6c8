"""A paced checkpoint writer's reads of file-held subgroups (mlp_offload/checkpoint/tier_reads.py): cut into pieces
of whole tier blocks, each read checked against its own blocks' CRCs, each waiting its turn on the pacer (never a
whole subgroup at once), and the save's bytes and digests those of a synchronous save."""

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import read_footer, tier_reads
from mlp_offload.checkpoint.digest import StateDigest
from mlp_offload.checkpoint.state_file import StateFile
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.tiers.files import FileIo, FileTier, TierDataError, TierOwner
from mlp_offload.tiers.host import HostMemory

from .helpers import bf16_grads, fast_config, run_steps

BLOCK = 64 * 1024  # the tiers' block in fast_config
NUMEL = 70_001


def reference_blocks(sizes, block):
    """(block number, extent, offset in it, bytes) of each block, as a file tier writes an extent's from its start."""
    out, number = [], 0
    for k, n in enumerate(sizes):
        for pos in range(0, n, block):
            out.append((number, k, pos, min(block, n - pos)))
            number += 1
    return out


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5 * 4096), min_size=1, max_size=4), block_pages=st.integers(1, 3),
       piece_blocks=st.integers(0, 4))
def test_pieces_are_whole_blocks_numbered_as_the_tier_numbers_them(sizes, block_pages, piece_blocks):
    block = 4096 * block_pages
    piece = block * piece_blocks  # 0: less than a block, still a block a piece
    extents = [(10_000_000 * k, torch.arange(n, dtype=torch.uint8)) for k, n in enumerate(sizes)]
    pieces = list(tier_reads.tier_pieces(extents, block, piece))
    # every block once, in order, each in the piece that starts at its number or covers it
    covered = []
    for first, (offset, buf) in pieces:
        k = offset // 10_000_000
        pos = offset - 10_000_000 * k
        assert pos % block == 0 and buf.numel() <= max(piece, block)
        assert buf.data_ptr() == extents[k][1].data_ptr() + pos  # a view of the extent's buffer, not a copy
        for j, at in enumerate(range(pos, pos + buf.numel(), block)):
            covered.append((first + j, k, at, min(block, pos + buf.numel() - at)))
    assert covered == reference_blocks(sizes, block)


def tier_with_file(tmp_path, nbytes):
    (tmp_path / "tier").mkdir()
    tier = FileTier("nvme", str(tmp_path / "tier"), TierOwner("t", 0), FileIo(BLOCK, 2, op_threads=2))
    data = HostMemory(None, pin=False).allocate(nbytes, "data")
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    tier.submit_write("k", [(0, data)]).result()
    return tier, data


def test_a_pieces_crcs_are_its_own_blocks_so_damage_in_a_later_piece_is_found_and_named(tmp_path):
    tier, data = tier_with_file(tmp_path, 4 * BLOCK)
    out = HostMemory(None, pin=False).allocate(4 * BLOCK, "out")
    try:
        for first, piece in tier_reads.tier_pieces([(0, out)], BLOCK, 2 * BLOCK):
            tier.submit_read("k", [piece], background=True, first_block=first).result()
        assert torch.equal(out, data)
        with pytest.raises(TierDataError, match="checksum mismatch"):  # the second piece checked as the first
            tier.submit_read("k", [(2 * BLOCK, out[2 * BLOCK:])], background=True).result()
        with open(tier.path_of("k"), "r+b") as f:  # one byte of block 3 changed
            f.seek(3 * BLOCK + 5)
            byte = f.read(1)
            f.seek(3 * BLOCK + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        tier.submit_read("k", [(0, out[:2 * BLOCK])], background=True, first_block=0).result()  # blocks 0-1 intact
        with pytest.raises(TierDataError, match=f"block at byte {3 * BLOCK} "):
            tier.submit_read("k", [(2 * BLOCK, out[2 * BLOCK:])], background=True, first_block=2).result()
    finally:
        tier.close()


class RecordingPacer:
    """A pacer that records each turn's bytes and the thread that asked (the tier reads' or the writes')."""

    def __init__(self, pacer):
        self.pacer, self.turns = pacer, []

    def wait_turn(self, nbytes):
        self.turns.append((threading.current_thread().name, nbytes))
        self.pacer.wait_turn(nbytes)

    def __getattr__(self, name):
        return getattr(self.pacer, name)


def test_a_paced_writer_reads_linked_tier_files_for_the_digest_a_piece_a_turn(tmp_path, monkeypatch):
    """Pieces of one tier block: each turn of the writer's is at most a piece (the subgroup went in one turn
    before); the checkpoint's bytes and digest are a synchronous save's."""
    monkeypatch.setattr(tier_reads, "PIECE", BLOCK)
    sync_path, paced_path = str(tmp_path / "sync.offload"), str(tmp_path / "paced.offload")
    params = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    with OffloadedAdamW(params, fast_config(tmp_path / "a", tiers=["nvme"])) as eng:
        run_steps(eng, bf16_grads(0, 2, NUMEL))
        pieces = [("w", 0, NUMEL, 0)]
        sync_digest = StateDigest.of_engine(eng, pieces)
        save_engine_state(eng, sync_path, digest=sync_digest, link_tier_files=True)
        paced_digest = StateDigest.of_engine(eng, pieces)
        write = start_background_save(eng, paced_path, digest=paced_digest, link_tier_files=True)
        assert write.pacer is not None  # the checkpoint shares the nvme tier's device
        recorder = write.pacer = RecordingPacer(write.pacer)
        linked_subgroups = [eng.subgroups[i] for i in write.snapshot.on_tier]  # the nvme-held ones
        write.start()
        write.wait()
        assert write.failure is None
    assert any("part" in e for e in read_footer(paced_path)["subgroups"])  # linked tier files
    assert max(sg.state_bytes for sg in linked_subgroups) > BLOCK  # a subgroup is more than a piece
    reads = [n for thread, n in recorder.turns if thread.startswith("mlp-checkpoint-tier-read")]
    assert reads and max(reads) <= BLOCK
    assert sum(reads) == sum(sg.state_bytes for sg in linked_subgroups)  # each linked subgroup read once, whole
    assert paced_digest.result() == sync_digest.result()
    with StateFile(sync_path) as a, StateFile(paced_path) as b:
        assert [e.get("crc") for e in a.footer["subgroups"]] == [e.get("crc") for e in b.footer["subgroups"]]
