"""benchmarks/code_equal.py: docstrings and comments do not count as code, anything else does; on this repository's
own history it tells a docstring-only commit from one that changed code."""

import pytest

from benchmarks import code_equal

BASE = '''"""Module doc."""
def f(x):
    """Doc."""
    return x + 1  # a comment
'''


def test_docstrings_and_comments_are_not_code():
    assert code_equal.code_of(BASE) == code_equal.code_of(BASE.replace("Doc.", "Other doc.").replace("a comment", "x"))
    assert code_equal.code_of(BASE) == code_equal.code_of(BASE.replace('    """Doc."""\n', ""))


def test_any_other_change_is_code():
    for changed in (BASE.replace("x + 1", "x + 2"), BASE.replace("return x + 1", "y = 'Doc.'\n    return x + 1"),
                    BASE + "g = 1\n"):
        assert code_equal.code_of(BASE) != code_equal.code_of(changed)


def test_on_this_history():
    if code_equal.git("cat-file", "-e", "4bdd40c~1") is None:
        pytest.skip("a clone without this repository's history")
    # b1c8d74 took pointers out of docstrings and comments only; 4bdd40c added --save-retain-interval's code.
    lines = code_equal.compare("b1c8d74~1", ["mlp_offload"], against="b1c8d74")
    assert len(lines) == 12 and all(line.endswith(": same code") for line in lines)
    lines = code_equal.compare("4bdd40c~1", ["megatron/training/checkpoint/integrity.py"], against="4bdd40c")
    assert lines == ["megatron/training/checkpoint/integrity.py: CODE DIFFERS"]
