"""A tier kind's name is spelled in at most three modules: its class's, the kinds' (``tiers.kinds``, where
each ``TierKind`` is made; the classes take their names from it) and the flags a user types. Every other
module asks the kind (``kind_of(name).in_device_memory``, ``.resident``, ``.budget_field``) or uses the
constants built from it.

"Spelled" means, in a string literal of the sources (docstrings and comments are prose and do not
count): the name itself (``"gpu"``), the name quoted inside a message (``"add 'host' or ..."``), a flag
built on it (``"--offload-nvme-path"``) or a path field named after it (``"pfs_path"``). Config field
and flag destination names (``gpu_budget_bytes``, ``offload_host_cache_gb``) are names of fields, not of
tiers, and do not count.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from typing import Dict, List, Set

import pytest
from hypothesis import assume, given, settings, strategies as st

from mlp_offload import DEVICE_MEMORY, HOST_MEMORY, MEMORY_KINDS, OffloadConfig, kind_of
from tests.profiles import examples

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["mlp_offload", "megatron", "tools"]
TIER_NAMES = ("gpu", "host", "nvme", "pfs")
MAX_MODULES = 3

# Where each name may be spelled, and why.
ALLOWED: Dict[str, Dict[str, str]] = {
    "gpu": {
        "mlp_offload/tiers/kinds.py": "its TierKind (DEVICE_MEMORY), which tiers.device.DeviceMemory is named by",
        "megatron/training/offload/options.py": "the flags a user types (--offload-gpu-*, --offload-update gpu): "
                                                "their one table, which errors re-exports to every layer",
    },
    "host": {
        "mlp_offload/tiers/kinds.py": "its TierKind (HOST_MEMORY), which tiers.host.HostMemory is named by",
        "megatron/training/offload/options.py": "the flags a user types (--offload-host-cache-gb)",
    },
    "nvme": {},  # file tiers are any name with a path: nvme and pfs are only examples in prose
    "pfs": {},
}
# The same word in another meaning: a machine's host name in records other processes read back.
OTHER_MEANING = {
    ("mlp_offload/tiers/housekeeping.py", "host"): "the swap namespace owner record's machine name",
    ("mlp_offload/plan/probe_cache.py", "host"): "the probe cache entry's machine name",
    ("megatron/training/offload/job_facts.py", "host"): "a rank's machine name among the job's facts",
}


def spells(text: str, name: str) -> bool:
    """Whether the literal ``text`` spells the tier name ``name`` (see the module's docstring)."""
    return (text == name or re.search(rf"[\"'`]{name}[\"'`]", text) is not None
            or f"--offload-{name}-" in text or re.search(rf"\b{name}_path\b", text) is not None)


def literals(source: str) -> List[str]:
    """Every string literal of ``source`` but its docstrings (a string alone as a statement),
    f-strings as their literal pieces."""
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


@functools.lru_cache(maxsize=None)
def spelled_in(tops) -> Dict[str, Set[str]]:
    """tier name -> the modules (paths from the repository root) whose literals spell it."""
    found: Dict[str, Set[str]] = {name: set() for name in TIER_NAMES}
    for top in tops:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as handle:
                    texts = literals(handle.read())
                module = os.path.relpath(path, ROOT).replace(os.sep, "/")
                for name in TIER_NAMES:
                    if (module, name) not in OTHER_MEANING and any(spells(t, name) for t in texts):
                        found[name].add(module)
    return found


def test_the_checker_finds_spellings_and_not_prose():
    source = ('"""Docstring: the "gpu" tier and --offload-nvme-path are prose."""\n'
              'def f(tier):\n'
              '    """The \'host\' tier, in prose."""\n'
              '    a = tier == "gpu"\n'
              '    b = f"add \'host\' or a file tier, {tier}"\n'
              '    c = "--offload-nvme-path"\n'
              '    d = "pfs_path"\n'
              '    e = "gpu_budget_bytes and host memory and offload_host_cache_gb"\n')
    texts = literals(source)
    assert [n for n in TIER_NAMES if any(spells(t, n) for t in texts)] == ["gpu", "host", "nvme", "pfs"]
    assert not any(spells(t, n) for t in literals(source.split("    a =")[0]) for n in TIER_NAMES)
    assert not any(spells("gpu_budget_bytes and host memory and offload_host_cache_gb", n) for n in TIER_NAMES)


@pytest.mark.parametrize("name", TIER_NAMES)
def test_a_tier_name_is_spelled_only_where_allowed(name):
    assert len(ALLOWED[name]) <= MAX_MODULES
    modules = spelled_in(tuple(SOURCES))[name]
    assert sorted(modules - set(ALLOWED[name])) == [], f"{name!r} spelled outside {sorted(ALLOWED[name])}"


def test_the_kinds_are_the_names_the_config_lists():
    """The names users type are those of before the kinds (checked against the literals here)."""
    assert (DEVICE_MEMORY.name, HOST_MEMORY.name) == ("gpu", "host")
    assert [k.name for k in MEMORY_KINDS] == ["gpu", "host"]  # fastest first: placement fills in this order


# The rules the config, placement and planner used on names before the kinds, written out independently.
def reference_kind(name: str):
    resident = name in ("gpu", "host")
    return resident, name == "gpu", {"gpu": "gpu_budget_bytes", "host": "host_budget_bytes"}.get(name)


names = st.one_of(st.sampled_from(TIER_NAMES + ("ssd", "gpu0", "Host", "hbm")),
                  st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8))


@settings(max_examples=examples(200))
@given(name=names)
def test_kind_of_answers_as_the_name_rules_did(name):
    kind = kind_of(name)
    assert (kind.resident, kind.in_device_memory, kind.budget_field) == reference_kind(name)
    assert kind.needs_path == (not kind.resident) and kind.name == name


@settings(max_examples=examples(100))
@given(files=st.lists(st.sampled_from(["nvme", "pfs", "ssd", "scratch"]), unique=True, max_size=3),
       gpu=st.booleans(), host=st.booleans(), gpu_bytes=st.one_of(st.none(), st.integers(0, 1 << 40)),
       host_bytes=st.integers(1, 1 << 40), order=st.randoms(use_true_random=False))
def test_the_config_sorts_and_sizes_tiers_as_before(files, gpu, host, gpu_bytes, host_bytes, order):
    tiers = files + (["gpu"] if gpu else []) + (["host"] if host else [])
    assume(tiers and not (tiers == ["gpu"] and gpu_bytes is None))  # the config refuses those
    order.shuffle(tiers)
    cfg = OffloadConfig(tiers=list(tiers), paths={t: "/tmp" for t in files}, host_budget_bytes=host_bytes,
                        gpu_budget_bytes=gpu_bytes if gpu else None, gpu_budget_auto=gpu and gpu_bytes is None)
    assert cfg.file_tiers == [t for t in tiers if t not in ("gpu", "host")]
    assert cfg.resident_tiers == [t for t in ("gpu", "host") if t in tiers]
    assert cfg.budget_of("host") == host_bytes
    if gpu:
        assert cfg.budget_of("gpu") == (0 if gpu_bytes is None else gpu_bytes)
    for t in files:
        with pytest.raises(KeyError):
            cfg.budget_of(t)
