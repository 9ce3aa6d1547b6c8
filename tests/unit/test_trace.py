"""The engine's optional Chrome-trace timeline (OffloadConfig.trace_path)."""

import json

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadedAdamW

from .helpers import fast_config

TIERS = ("nvme", "pfs")


def run_steps(cfg, numel=60_000, steps=3):
    gen = torch.Generator().manual_seed(0)
    calls = []
    eng = OffloadedAdamW(torch.randn(numel, generator=gen), cfg,
                         model=ModelLink(grad_dtype=torch.bfloat16,
                                         on_params_updated=lambda lo, hi, p: calls.append(lo)))
    records = []
    try:
        for _ in range(steps):
            eng.grad_buffer.copy_(torch.randn(numel, generator=gen).to(torch.bfloat16))
            records.append(eng.step())
    finally:
        eng.close()
    # Reads prefetched for the next step finished during close: their bytes are in the counters
    # but in no step record yet.
    records.append(type(records[0])(step=-1, tiers=eng.take_traffic()))
    return records, calls


def test_trace_matches_the_engine_counters(tmp_path):
    path = tmp_path / "out" / "trace.json"
    cfg = fast_config(tmp_path, list(TIERS), trace_path=str(path), rank=3, cache_alternating=False)
    records, calls = run_steps(cfg)
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    assert not list(path.parent.glob("*.tmp"))
    events = doc["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(meta) + len(spans) == len(events)
    lanes = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {"rank 3"}
    assert lanes[0] == "compute"
    for e in spans:
        assert e["pid"] == 3 and e["tid"] in lanes and e["dur"] >= 0
        assert isinstance(e["ts"], float) and isinstance(e["name"], str)

    for tier in TIERS:
        for kind in ("read", "write"):
            ios = [e for e in spans if e["name"] == kind and e["args"]["tier"] == tier]
            assert ios, (tier, kind)
            assert all(lanes[e["tid"]].startswith(f"{tier} io ") for e in ios)
            counted = sum(getattr(r.tiers[tier], f"{kind}_bytes") for r in records)
            assert sum(e["args"]["bytes"] for e in ios) == counted, (tier, kind)
        # Events on one lane never overlap (one operation at a time per operation thread).
        for tid in {e["tid"] for e in spans if e["args"].get("tier") == tier and e["tid"] != 0}:
            lane = sorted((e["ts"], e["dur"]) for e in spans if e["tid"] == tid)
            assert all(a + d <= b + 1.0 for (a, d), (b, _) in zip(lane, lane[1:])), lanes[tid]

    compute = [e for e in spans if e["tid"] == 0]
    subgroups = len(calls) // 3
    for name in ("adam", "gradients", "params callback"):
        assert len([e for e in compute if e["name"] == name]) == len(calls), name
    assert {e["args"]["step"] for e in compute if e["name"] == "adam"} == {1, 2, 3}
    assert subgroups == 6
    assert any(e["name"] == "read wait" for e in compute)


def test_no_trace_without_path(tmp_path):
    cfg = fast_config(tmp_path, list(TIERS))
    assert cfg.trace_path is None
    run_steps(cfg, numel=20_000, steps=1)
    assert [p for p in tmp_path.rglob("*.json*")] == []
