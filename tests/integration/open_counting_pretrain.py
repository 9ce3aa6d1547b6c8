"""``pretrain_gpt.py`` with every real open of a saved offload file counted (a test's variant of it).

Counts Python's ``open`` audit events (``open()``, ``io.open``, ``os.open``: every way this code base
opens a file) whose path lies under $OPEN_COUNT_ROOT and ends in ``.offload`` (or is one's part file), and the footers
parsed, per file; writes them to $OPEN_COUNT_DIR/rank<RANK>.json when the run ends.
"""

import collections
import json
import os
import runpy
import sys

ROOT = os.path.realpath(os.environ["OPEN_COUNT_ROOT"])
opens, footers = collections.Counter(), collections.Counter()


def _saved_offload_file(path) -> bool:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    saved = isinstance(path, str) and (path.endswith(".offload") or ".offload.parts" + os.sep in path)  # or a part
    return saved and os.path.realpath(path).startswith(ROOT)


def _count_opens(event, args):
    if event == "open" and _saved_offload_file(args[0]):
        opens[os.path.relpath(os.path.realpath(args[0]), ROOT)] += 1


def _count_footer_reads():
    """Every footer is parsed by this one function of the file format (mlp_offload.checkpoint)."""
    import mlp_offload.checkpoint.state_file as fmt

    parse = fmt.footer_bytes

    def counted(path, *rest):
        footers[os.path.relpath(os.path.realpath(path), ROOT)] += 1
        return parse(path, *rest)

    fmt.footer_bytes = counted


def _write_counts():
    out = os.path.join(os.environ["OPEN_COUNT_DIR"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(out, "w") as f:
        json.dump({"opens": opens, "footers": footers}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _count_footer_reads()
    sys.addaudithook(_count_opens)
    try:
        runpy.run_path(os.path.join(sys.path[0], "pretrain_gpt.py"), run_name="__main__")
    finally:
        _write_counts()
