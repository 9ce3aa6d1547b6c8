"""No function of the engine or the training layer takes more than ``MOST`` parameters (``self`` and
``cls`` not counted; ``*args`` and ``**kwargs`` one each), except the kernels (``mlp_offload/kernels/``),
whose flat signatures are their launch interface. Related arguments travel as one small dataclass."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREES = ["mlp_offload", os.path.join("megatron", "training")]
EXEMPT = os.path.join("mlp_offload", "kernels")
MOST = 7


def parameters(node: ast.AST) -> list:
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def functions_over(most: int, path: str) -> list:
    """``path:line name(count)`` of each def or lambda in the file with more than ``most`` parameters."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    functions = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    return [f"{os.path.relpath(path, ROOT)}:{node.lineno} {getattr(node, 'name', 'lambda')}({len(parameters(node))})"
            for node in sorted(functions, key=lambda n: (n.lineno, n.col_offset)) if len(parameters(node)) > most]


def source_files():
    for tree in TREES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, tree)):
            if os.path.relpath(dirpath, ROOT).startswith(EXEMPT):
                continue
            yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def test_the_counter_counts_every_kind_of_parameter(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("class C:\n    def method(self, a, b, /, c, *d, e, f=1, **g):\n        pass\n"
                      "def plain(a, b, c, d, e, f, g):\n    pass\n"
                      "flat = lambda a, b, c, d, e, f, g, h: None\n")
    assert functions_over(6, str(sample)) == [f"{os.path.relpath(sample, ROOT)}:2 method(7)",
                                              f"{os.path.relpath(sample, ROOT)}:4 plain(7)",
                                              f"{os.path.relpath(sample, ROOT)}:6 lambda(8)"]
    assert functions_over(7, str(sample)) == [f"{os.path.relpath(sample, ROOT)}:6 lambda(8)"]


def test_no_function_outside_the_kernels_takes_more_than_seven_parameters():
    files = list(source_files())
    assert any(f.endswith(os.path.join("step", "loop.py")) for f in files)  # the walk reaches the code
    over = [found for path in files for found in functions_over(MOST, path)]
    assert not over, "more than 7 parameters (group related ones into a dataclass):\n" + "\n".join(over)
