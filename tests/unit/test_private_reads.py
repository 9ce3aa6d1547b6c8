"""No module reads another's private attributes, tests included: every ``x._name`` (``x`` not ``self``
or ``cls``, the name not a dunder) and every ``from m import _name`` in the engine, the training layer,
the tools, the benchmarks and the tests is a finding, unless it reaches into code that is not ours
(the standard library, torch, megatron-core, nltk) and is named below with the reason. What one of our
modules needs of another it gets through a public, documented name, or a test checks it through
behaviour."""

from __future__ import annotations

import ast
import os
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREES = ["mlp_offload", "megatron", "tools", "benchmarks", "tests", "pretrain_gpt.py"]

# Privates of code that is not ours, each with why it is read.
EXTERNAL = {
    "os._exit": "the standard library's exit without the interpreter's cleanup (a signal handler, a forked child)",
    "sys._base_executable": "the standard library's interpreter behind a virtual environment",
    "sys._current_frames": "the standard library's documented frames of every thread (SIGQUIT's stacks)",
    "threading._shutdown": "the standard library: the warm-rank server runs an interpreter's exit by hand",
    "atexit._run_exitfuncs": "the standard library: the warm-rank server runs an interpreter's exit by hand",
    "parser._actions": "argparse keeps a parser's declared options there and has no public list of them",
    "parser._action_groups": "argparse keeps a parser's argument groups there and has no public list of them",
    "group._group_actions": "argparse keeps an argument group's options there and has no public list of them",
    "argparse._HelpAction": "argparse's class of its own -h/--help, which has no public name",
    "request._replace": "a namedtuple's public copy-with-changes (underscored so it clashes with no field)",
    "splitter._params": "nltk's trained punkt parameters, which its tokenizer takes",
    "torch.cuda._sleep": "torch's GPU spin of a given number of cycles (a benchmark of the launch queue)",
    "from torch.utils.cpp_extension import _get_build_directory": "torch's build directory of an extension",
    "from torch.distributed.distributed_c10d import _get_default_store": "torch's store of the default group",
    "from torch.distributed.checkpoint.filesystem import _StorageInfo":
        "torch's record of where an item lies in a checkpoint file, which its FileSystemReader reads back",
    "tokenizer._tokenizer": "megatron-core's text tokenizer keeps its library's tokenizer there",
    "from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2":
        "megatron-core's tiktoken pattern, which a test compares with ours",
    "DistributedOptimizer._copy_main_params_to_model_params": "a test's stand-in of megatron-core's own method",
}
# Files whose job is to hold the calls into megatron-core's privates in one place.
ISOLATING = {
    os.path.join("megatron", "training", "runtime", "core_private.py"): "the few private megatron-core calls",
    os.path.join("megatron", "training", "runtime", "cpu_compat.py"): "megatron-core's RNG tracker, patched "
                                                                       "for a CPU run",
}


def private_reads(source: str) -> List[str]:
    """``line: text`` of each private attribute read or private name imported in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _private(a.name)]
    return [f"{line}: {text}" for line, text in sorted(found)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def source_files():
    for tree in TREES:
        path = os.path.join(ROOT, tree)
        if os.path.isfile(path):
            yield path
            continue
        for dirpath, _, files in os.walk(path):
            yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def test_the_checker_finds_every_kind_of_private_read():
    source = ("class A:\n    def m(self, other):\n        return self._x, cls._y, other._z, self._a._b\n"
              "from m import _hidden, shown\nv = f()._p + d['k']._q + obj.__dict__ + obj.__len__()\n")
    assert private_reads(source) == ["3: other._z", "3: self._a._b", "4: from m import _hidden", "5: d['k']._q",
                                     "5: f()._p"]


def test_no_module_reads_another_modules_private_attributes():
    files = list(source_files())
    assert any(f.endswith(os.path.join("mlp_offload", "engine.py")) for f in files)  # the walk reaches the code
    wrong = []
    for path in files:
        rel = os.path.relpath(path, ROOT)
        if rel in ISOLATING:
            continue
        with open(path, encoding="utf-8") as f:
            wrong += [f"{rel}:{found}" for found in private_reads(f.read())
                      if found.split(": ", 1)[1] not in EXTERNAL]
    assert not wrong, "private attributes read from outside their module (give them a public name):\n" + \
        "\n".join(wrong)
