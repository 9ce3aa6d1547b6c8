"""The resume check's digests (mlp_offload.checkpoint.digest): the digest against numpy over the raw
bits, in any chunking; what the checkpoint writer records against numpy over the bytes it wrote, for
the tier sets gpu,host,nvme and host,nvme, fp32 and remainder masters, fp32, bf16 and fp8 moments, sync
and background saves; a load's digests equal to the save's; and state broken on purpose (a moment's
bytes in the file with their CRC made right again, a master bit flipped as it enters each tier, an
element moved) named by parameter and tensor."""

import json
import os
import tempfile
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import ModelLink, OffloadConfig, OffloadedAdamW
from mlp_offload.checkpoint import MAGIC, TRAILER, StateFile, fill_engine, read_footer, stored_codecs
from mlp_offload.checkpoint import digest as digest_module
from mlp_offload.checkpoint.digest import TENSORS, StateDigest, as_pairs, digest, find_mismatch, indexed_digest
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.subgroups.partition import partition
from tests.profiles import examples

from .helpers import BETAS, EPS, LR, WD, ModelParams

U64 = np.uint64
SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def ref_digest(raw: bytes, itemsize: int, index) -> list:
    """numpy's digest of ``raw`` (elements of ``itemsize`` bytes at ``index``), from the definition: element
    i is lane i % L of word i // L (L elements of 4 bytes at most), its bits unsigned but in the top lane."""
    lanes = max(1, 4 // itemsize)
    signed = np.frombuffer(raw, dtype=SIGNED[itemsize]).astype(np.int64)
    unsigned = signed & ((1 << 8 * itemsize) - 1) if itemsize < 8 else signed
    i = np.asarray(index, dtype=np.int64)
    lane = i % lanes
    value = np.where(lane == lanes - 1, signed, unsigned).astype(U64) << (lane * 8 * itemsize).astype(U64)
    with np.errstate(over="ignore"):
        return [int(value.sum(dtype=U64)), int((value * (i // lanes + 1).astype(U64)).sum(dtype=U64))]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]


@settings(max_examples=examples(100), deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 5_000), first=st.integers(0, 2**40),
       cuts=st.lists(st.integers(0, 5_000), max_size=4), chunk=st.sampled_from([64, 1000, 1 << 17]),
       row=st.sampled_from([8, 32, 1024]), seed=st.integers(0, 2**31))
def test_the_digest_is_numpys_over_the_raw_bits_in_any_chunking(dtype, n, first, cuts, chunk, row, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(-2**62, 2**62, (n,), generator=gen, dtype=torch.int64).view(torch.uint8)[:n * dtype.itemsize]
    t = t.view(dtype) if n else torch.empty(0, dtype=dtype)
    want = ref_digest(tensor_bytes(t), t.element_size(), np.arange(first, first + n))
    with mock.patch.object(digest_module, "CHUNK", chunk), mock.patch.object(digest_module, "ROW", row):
        assert as_pairs([digest(t, first)]) == [want]
        bounds = sorted({0, n, *(c for c in cuts if c < n)})  # the same tensor in pieces: their sum
        pieces = [digest(t[a:b], first + a) for a, b in zip(bounds, bounds[1:])]
        assert as_pairs([sum(pieces, torch.zeros(2, dtype=torch.int64))]) == [want]


def test_the_digest_tells_apart_one_flipped_bit_and_two_swapped_elements():
    t = torch.randn(10_000)
    flipped, swapped = t.clone(), t.clone()
    flipped.view(torch.int32)[1234] ^= 1 << 17
    swapped[[10, 9000]] = swapped[[9000, 10]]
    pairs = as_pairs([digest(t), digest(flipped), digest(swapped)])
    assert pairs[0][0] != pairs[1][0] and pairs[0][1] != pairs[1][1]
    assert pairs[0][0] == pairs[2][0] and pairs[0][1] != pairs[2][1]  # the same sum, in another order


def test_indexed_digest_is_numpys():
    t = torch.randn(300)
    index = torch.randint(0, 2**40, (300,))
    assert as_pairs([indexed_digest(t, index)]) == [ref_digest(tensor_bytes(t), 4, index.numpy())]


# -- an engine's state, saved and loaded ------------------------------------------------------------
TIER_SETS = (["gpu", "host", "nvme"], ["host", "nvme"])


def _engine(root, name, tiers, numel, subgroup, remainders, moments, segments, init, host_slots=3):
    paths = {"nvme": os.path.join(root, name)}
    os.makedirs(paths["nvme"], exist_ok=True)
    slot = partition(numel, subgroup)[0].state_bytes  # fp32's: at least any format's
    cfg = OffloadConfig(
        tiers=list(tiers), paths=paths, subgroup_size=subgroup, run_id=name, pin_memory=False, device="cpu",
        gpu_budget_bytes=slot if "gpu" in tiers else None, host_budget_bytes=host_slots * slot,
        bandwidths={"nvme": (2e9, 1e9)}, adam_kernel="single", adam_elems_per_s=1e9, device_adam_elems_per_s=1e9,
        device_streamed_elems_per_s=1e9, update_on="cpu", param_remainders=remainders,
        state_dtypes=("fp32", moments, moments))
    model = ModelParams(init.clone())
    link = ModelLink(on_params_updated=model.on_params, param_high=model.source if remainders else None,
                     param_segments=segments)
    return OffloadedAdamW(init.clone() if remainders else init.float(), cfg, lr=LR, betas=BETAS, eps=EPS,
                          weight_decay=WD, numel=numel, model=link), model


def _pieces(segments):
    return [[f"p{k}", param_start, length, shard_start]
            for k, (shard_start, param_start, length) in enumerate(segments)]


def _block_starts(segments, block, start, end):
    """(shard element, parameter element) of each 8-bit block start in shard elements [start, end)."""
    found = []
    for shard_start, param_start, length in segments:
        for k in range(length):
            if (k == 0 or (param_start + k) % block == 0) and start <= shard_start + k < end:
                found.append((shard_start + k, param_start + k))
    return found


def file_digests(path, segments) -> dict:
    """Per piece and tensor, numpy's digest of what ``path`` holds, from its footer's offsets alone."""
    footer = read_footer(path)
    with open(path, "rb") as f:
        data = f.read()
    blockwise = "blocks" in footer
    sizes = {"fp32": 4, "bf16": 2, "rem16": 2}
    out = {}

    def add(name, key, raw, itemsize, index):
        pair = ref_digest(raw, itemsize, index)
        held = out.setdefault(name, {}).get(key, [0, 0])
        out[name][key] = [(a + b) % 2**64 for a, b in zip(held, pair)]

    for entry in footer["subgroups"]:
        start, end, at = entry["start"], entry["end"], entry["offset"]
        n = end - start
        regions = []
        for dtype in footer["dtypes"]:
            moment = blockwise and dtype != footer["dtypes"][0]
            size = n + (-n % 4) + 4 * entry["blocks"] if moment else n * sizes[dtype]
            regions.append((at, dtype))
            at += size
        starts = _block_starts(segments, footer["blocks"]["block"], start, end) if blockwise else []
        for k, (shard_start, param_start, length) in enumerate(segments):
            lo, hi = max(shard_start, start), min(shard_start + length, end)
            if lo >= hi:
                continue
            index = np.arange(param_start + lo - shard_start, param_start + hi - shard_start)
            for key, (offset, dtype) in zip(TENSORS, regions):
                width = 1 if blockwise and key != "master" else sizes[dtype]
                add(f"p{k}", key, data[offset + (lo - start) * width: offset + (hi - start) * width], width, index)
                if width == 1:
                    scales_at = offset + n + (-n % 4)
                    mine = [(b, p) for b, (s, p) in enumerate(starts) if lo <= s < hi]
                    raw = b"".join(data[scales_at + 4 * b: scales_at + 4 * b + 4] for b, _ in mine)
                    add(f"p{k}", f"{key} scales", raw, 4, [p for _, p in mine])
    return out


@st.composite
def cases(draw):
    numel = draw(st.integers(1_000, 12_000))
    cuts = sorted(draw(st.sets(st.integers(1, numel - 1), max_size=4)))
    bounds = [0, *cuts, numel]
    segments = [(a, draw(st.sampled_from([0, 0, 1, 300])), b - a) for a, b in zip(bounds, bounds[1:])]
    return dict(numel=numel, segments=segments, tiers=draw(st.sampled_from(TIER_SETS)),
                subgroup=draw(st.integers(-(-numel // 6), numel)),
                load_subgroup=draw(st.integers(-(-numel // 6), numel)),
                remainders=draw(st.booleans()), moments=draw(st.sampled_from(["fp32", "bf16", "fp8"])),
                background=draw(st.booleans()), seed=draw(st.integers(0, 3)))


def save_with_digests(root, case, steps=2, link=False):
    """An engine after ``steps`` steps, saved with its digests; returns (path, digests, model params).
    ``link``: the save takes the tier files on its file system by hard link (``checkpoint.parts``)."""
    gen = torch.Generator().manual_seed(case["seed"])
    init = torch.randn(case["numel"], generator=gen).to(torch.bfloat16)
    eng, model = _engine(root, "save", case["tiers"], case["numel"], case["subgroup"], case["remainders"],
                         case["moments"], case["segments"], init)
    path = os.path.join(root, "state.offload")
    with eng:
        for _ in range(steps):
            eng.grad_buffer.copy_((torch.randn(case["numel"], generator=gen) * 10).to(torch.bfloat16))
            eng.step()
        recorded = StateDigest.of_engine(eng, _pieces(case["segments"]))
        if case["background"]:
            write = start_background_save(eng, path, digest=recorded, link_tier_files=link)
            write.start()
            eng.grad_buffer.copy_(torch.randn(case["numel"], generator=gen).to(torch.bfloat16))
            eng.step()  # the update goes on beside the writer: the record stays the snapshot's
            write.wait()
            assert write.failure is None
        else:
            save_engine_state(eng, path, digest=recorded, link_tier_files=link)
        params = model.params.clone()
    return path, recorded.result(), params


def load_with_digests(root, case, path, params, edit=None):
    """A fresh engine filled from ``path`` (``edit(engine, callback)`` may wrap its fill); its load's digests."""
    eng, _ = _engine(root, "load", case["tiers"], case["numel"], case["load_subgroup"], case["remainders"],
                     case["moments"], case["segments"], params, case.get("host_slots", 3))
    observed = StateDigest.of_engine(eng, _pieces(case["segments"]))
    with eng, StateFile(path) as saved:
        fill_engine(eng, saved, observe=lambda fill: observed.observing(edit(eng, fill) if edit else fill))
        return observed.result()  # before the engine is closed, as the resume check takes it


@settings(max_examples=examples(25), deadline=None, derandomize=True, print_blob=True)
@given(case=cases())
def test_the_writer_records_what_it_wrote_and_a_load_sees_the_same(case):
    with tempfile.TemporaryDirectory() as root:
        path, recorded, params = save_with_digests(root, case)
        assert recorded == file_digests(path, case["segments"])
        assert load_with_digests(root, case, path, params) == recorded


def fixed_case(**over):
    return {**dict(numel=9_000, segments=[(0, 0, 4_000), (4_000, 300, 5_000)], tiers=["gpu", "host", "nvme"],
                   subgroup=2_000, load_subgroup=3_000, remainders=False, moments="fp8", background=False, seed=1),
            **over}


def flip_stored_byte(path, subgroup: int, tensor: int, byte: int) -> int:
    """Flip one bit of byte ``byte`` of stored tensor ``tensor`` (0 master, 1 exp_avg, 2 exp_avg_sq) of the
    file's ``subgroup``-th subgroup and make its CRC right again, as a writer that wrote other bytes
    than it meant to would; returns the region's first byte in the file."""
    footer = read_footer(path)
    entry = footer["subgroups"][subgroup]
    n, codecs = entry["end"] - entry["start"], stored_codecs(footer)
    sizes = [c.stored_bytes(n, entry.get("blocks")) for c in codecs]
    at = entry["offset"] + sum(sizes[:tensor])
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[at + byte] ^= 0x40
        entry["crc"][tensor] = zlib.crc32(bytes(data[at: at + sizes[tensor]]))
        body = json.dumps(footer).encode()
        end = len(data) - TRAILER.size - TRAILER.unpack(data[-TRAILER.size:])[1]  # where the footer starts
        f.seek(0)
        f.truncate()
        f.write(bytes(data[:end]) + body + TRAILER.pack(MAGIC, len(body), zlib.crc32(body)))
    return at


def test_a_moment_edited_in_the_file_with_its_crc_made_right_is_named(tmp_path):
    """What the CRCs cannot see: one byte of the second parameter's exp_avg_sq codes."""
    case = fixed_case()
    path, recorded, params = save_with_digests(str(tmp_path), case)
    flip_stored_byte(path, -1, 2, 5)  # the last subgroup: all of it is p1
    loaded = load_with_digests(str(tmp_path), case, path, params)
    assert find_mismatch(recorded, loaded)[:2] == ("p1", "exp_avg_sq")


REMAINDERS = fixed_case(moments="fp32", remainders=True, load_subgroup=1_500, host_slots=6)


@pytest.fixture(scope="module")
def saved_with_remainders(tmp_path_factory):
    root = tmp_path_factory.mktemp("remainders")
    return (root, *save_with_digests(str(root), REMAINDERS))


@pytest.mark.parametrize("tier", ["gpu", "host", "nvme"])
def test_a_master_bit_flipped_as_it_enters_each_tier_is_named(saved_with_remainders, tier):
    """A fill that puts one wrong bit into a subgroup the loading engine holds in ``tier``."""
    case = REMAINDERS
    root, path, recorded, params = saved_with_remainders
    flipped_at = []

    def flip_in(eng, fill):
        held = [i for i, t in enumerate(eng.placement.tier_of) if t == tier]
        assert held, eng.placement.tier_of

        def flipped(sg, master, *moments):
            fill(sg, master, *moments)
            if sg.index == held[-1]:
                master.view(torch.int16)[7] ^= 1
                flipped_at.append(sg.start + 7)
        return flipped

    loaded = load_with_digests(str(root), case, path, params, edit=flip_in)
    owner = next(f"p{k}" for k, (a, _, n) in enumerate(case["segments"]) if a <= flipped_at[0] < a + n)
    assert find_mismatch(recorded, loaded)[:2] == (owner, "master")


def test_a_cpu_digest_takes_no_intra_op_pool_for_its_chunks(monkeypatch):
    """The CPU's row and column sums run on the calling thread alone (beside training, a digest's reductions
    must not take every core of the rank's pool): no torch reduction of more than a chunk's row count, and
    the pair still numpy's."""
    values = torch.randint(-2**31, 2**31 - 1, (3 * digest_module.CHUNK + 77,), dtype=torch.int64).to(torch.int32)
    expected = digest(values).tolist()
    real_sum = torch.sum

    def small_sums_only(t, *args, **kwargs):
        assert t.numel() <= max(digest_module.CHUNK // digest_module.ROW, digest_module.ROW), \
            f"a torch reduction over {t.numel()} elements"
        return real_sum(t, *args, **kwargs)

    monkeypatch.setattr(torch, "sum", small_sums_only)
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: small_sums_only(t, *a, **k))
    assert digest(values).tolist() == expected
    words = values.numpy().astype(np.int64)
    k = np.arange(1, words.size + 1, dtype=np.int64)
    assert [v & ((1 << 64) - 1) for v in expected] == [int(words.sum(dtype=U64)) & ((1 << 64) - 1),
                                                          int((words.astype(U64) * k.astype(U64)).sum(dtype=U64))]
