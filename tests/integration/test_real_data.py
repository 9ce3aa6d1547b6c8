"""tools/preprocess_data.py on the shipped corpus, then a short DP=2 run on the result."""

import json
import math
import subprocess
import sys

from launch import REPO, losses, run_pretrain


def test_preprocess_and_train(tmp_path):
    corpus = REPO / "examples" / "data" / "corpus.jsonl"
    # A slice keeps preprocessing fast; the full corpus works the same way.
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(corpus.read_text().splitlines(keepends=True)[:150]))
    prefix = tmp_path / "corpus"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"),
                           "--input", str(sample), "--output-prefix", str(prefix),
                           "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = f"{prefix}_text_document"
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"corpus_text_document{ext}").stat().st_size > 0

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(data)
    assert len(ds.document_indices) - 1 == 150
    first = json.loads(sample.read_text().splitlines()[0])["text"]
    assert bytes(ds[0][:-1].tolist()).decode() == first and ds[0][-1] == 256  # bytes + EOD

    records = run_pretrain(tmp_path / "run", [
        "--tokenizer-type", "ByteLevelTokenizer", "--data-path", data, "--data-cache-path", str(tmp_path / "cache"), "--lr", "3e-3",
        "--eval-interval", "4", "--eval-iters", "1"], train_iters=8, mock_data=False)
    values = losses(records)
    assert len(values) == 8 and all(math.isfinite(v) for v in values)
    assert values[-1] < values[0] - 0.3, values
    out = (tmp_path / "run" / "loss-0.out").read_text()
    assert " validation loss at iteration 8 | lm loss value: " in out
