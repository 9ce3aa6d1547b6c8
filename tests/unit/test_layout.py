"""The code's map stays as docs/design.md draws it.

- No import cycle among the modules of ``megatron/`` or ``mlp_offload/``, counting imports inside
  functions too (so none can be hidden there).
- ``megatron/training/``'s sub-packages import one way only: each may import the ones before it in
  LAYERS, never one after it.
- Code outside the engine imports only its face: ``mlp_offload`` and ``mlp_offload.checkpoint``.
- ``megatron/training/`` itself holds only the loop and the base module; every other module lives
  in a sub-package.
- ``megatron/training/checkpoint/`` holds at most CHECKPOINT_FILES_AT_MOST files (its ``__init__.py``
  counted), so it cannot silently regrow near-synonym modules.
- The engine reads no environment: its config is a pure function of its arguments (the adapter
  reads the environment and fills the config's fields).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = "megatron.training"
# bottom to top; a module of a layer may import its own layer and those before it
LAYERS = ["errors|flag_types", "runtime", "model", "data", "checkpoint", "offload", "metrics", "args", "hf", "training|initialize"]
# flag_types: the flags' value types, a leaf beside errors (which re-exports them; the options table imports them)
TOP_LEVEL_ALLOWED = {"__init__.py", "errors.py", "flag_types.py", "training.py", "initialize.py"}
ENGINE_FACE = {"mlp_offload", "mlp_offload.checkpoint"}
OUTSIDE_ENGINE = ["megatron", "tools", "benchmarks", "pretrain_gpt.py"]
# issue 40: it had grown to 18 modules with near-synonym names; 13: resume_check; 14: torch_dist_read_ahead;
# 15: save_agreement (the save's steps across ranks, out of checkpointing when it passed 400 lines)
CHECKPOINT_FILES_AT_MOST = 15


def module_files(top: str) -> Dict[str, str]:
    """dotted module name -> file, for every .py under ``top`` (a package folder or a file)."""
    out = {}
    path = os.path.join(ROOT, top)
    if os.path.isfile(path):
        return {top[:-3]: path}
    for dirpath, _, files in os.walk(path):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def imports_of(name: str, path: str, known: Set[str]) -> List[str]:
    """Every module ``path`` imports anywhere in its text (functions included), resolved to the
    deepest known module: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append(sub if sub in known else base)
    return found


def graph(tops) -> Dict[str, Set[str]]:
    files = {}
    for top in tops:
        files.update(module_files(top))
    known = set(files)
    edges = {}
    for name, path in files.items():
        deps = set()
        for imp in imports_of(name, path, known):
            while imp and imp not in known:  # a.b.name -> a.b
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        edges[name] = deps
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    rest = module[len(TRAINING) + 1:].split(".")[0] if module != TRAINING else ""
    for i, names in enumerate(LAYERS):
        if rest in names.split("|"):
            return i
    raise AssertionError(f"{module}: not in any layer of {LAYERS}")


ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(source: str) -> List[str]:
    """Each place ``source`` touches the process environment: ``os.environ``/``os.getenv`` (under
    any name ``os`` is imported as) or those names imported from ``os``."""
    tree = ast.parse(source)
    os_names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for a in node.names if a.name == "os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in os_names \
                and node.attr in ENVIRONMENT:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in ENVIRONMENT]
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_environment_reads_are_found():
    """The checker itself: every spelling is reported, other uses of os are not."""
    source = ("import os\nimport os as o\nfrom os import getenv, path\n"
              "a = os.environ.get('X')\nb = o.getenv('Y')\nc = os.path.join('a')\nd = environ\n")
    assert environment_reads(source) == ["line 3: from os import getenv", "line 4: os.environ",
                                         "line 5: o.getenv"]
    assert environment_reads("import os\nos.makedirs('x')\n") == []


def test_engine_reads_no_environment():
    wrong = []
    for name, path in module_files("mlp_offload").items():
        with open(path, encoding="utf-8") as f:
            wrong += [f"{name} {where}" for where in environment_reads(f.read())]
    assert wrong == []


def test_cycles_are_found():
    """The checker itself: a cycle of three is reported, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("top", ["megatron", "mlp_offload"])
def test_no_import_cycle(top):
    assert cycles(graph([top])) == []


def test_sub_packages_import_one_way():
    wrong = []
    for module, deps in graph(["megatron"]).items():
        if module == TRAINING or not module.startswith(TRAINING + "."):
            continue
        for dep in deps:
            if dep.startswith(TRAINING + ".") and layer_of(dep) > layer_of(module):
                wrong.append(f"{module} imports {dep}")
    assert wrong == []


def test_outside_code_imports_only_the_engine_face():
    wrong = []
    for top in OUTSIDE_ENGINE:
        for name, path in module_files(top).items():
            for imp in imports_of(name, path, set()):
                if imp.startswith("mlp_offload") and imp not in ENGINE_FACE:
                    wrong.append(f"{name} imports {imp}")
    assert wrong == []


def test_training_modules_live_in_sub_packages():
    folder = os.path.join(ROOT, "megatron", "training")
    loose = sorted(f for f in os.listdir(folder) if f.endswith(".py") and f not in TOP_LEVEL_ALLOWED)
    assert loose == []
    for entry in sorted(os.listdir(folder)):
        sub = os.path.join(folder, entry)
        if os.path.isdir(sub) and entry != "__pycache__":
            init = os.path.join(sub, "__init__.py")
            assert os.path.isfile(init), f"{entry}/ has no __init__.py"
            with open(init, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read()))
            assert doc and "May import" in doc, f"{entry}/__init__.py must say what lives there and what it may import"
            assert any(entry in names.split("|") for names in LAYERS), f"{entry}/ is in no layer of LAYERS"


def test_the_checkpoint_package_stays_small():
    folder = os.path.join(ROOT, "megatron", "training", "checkpoint")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert "__init__.py" in files  # the count is of this package's files, not of an empty folder
    assert len(files) <= CHECKPOINT_FILES_AT_MOST, (
        f"megatron/training/checkpoint/ holds {len(files)} .py files, at most {CHECKPOINT_FILES_AT_MOST} "
        f"(__init__.py counted): fold the new one into the module whose job it serves: {files}")


ENGINE_TOP_LEVEL_MOST = 12  # .py files directly in mlp_offload/; the rest lives in its sub-packages
ENGINE_FRONT_MOST_LINES = 350  # engine.py: the torch-shaped front; the wiring lives in startup/


def test_the_engine_keeps_a_short_top_level_and_a_small_front():
    folder = os.path.join(ROOT, "mlp_offload")
    top = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert "engine.py" in top and len(top) <= ENGINE_TOP_LEVEL_MOST, top
    with open(os.path.join(folder, "engine.py"), encoding="utf-8") as f:
        lines = len(f.read().splitlines())
    assert lines <= ENGINE_FRONT_MOST_LINES, f"engine.py has {lines} lines"
