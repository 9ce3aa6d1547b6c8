"""Turn JSONL ({"text": ...} per line) into megatron-core indexed-dataset files (.bin/.idx).

    python tools/preprocess_data.py --input examples/data/corpus.jsonl --output-prefix /tmp/corpus

writes /tmp/corpus_text_document.bin/.idx (Megatron-LM's naming), tokenized with the byte-level
tokenizer, one document per line, each ended by an EOD token unless --no-append-eod.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.{bin,idx}")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", choices=["ByteLevelTokenizer"], default="ByteLevelTokenizer")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"argument --input: {args.input} is not a file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        p.error(f"argument --output-prefix: directory {out_dir} does not exist")
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.training.data import ByteLevelTokenizer

    tokenizer = ByteLevelTokenizer()
    dtype = np.uint16  # 258 tokens fit
    builders, prefixes = {}, {}
    for key in args.json_keys:
        prefixes[key] = f"{args.output_prefix}_{key}_document"
        builders[key] = IndexedDatasetBuilder(prefixes[key] + ".bin", dtype=dtype)

    docs = tokens = 0
    with open(args.input, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                parser.error(f"argument --input: line {line_no} is not JSON ({e.msg})")
            for key in args.json_keys:
                if key not in record:
                    parser.error(f"argument --json-keys: line {line_no} has no key {key!r}")
                ids = tokenizer.tokenize(str(record[key]))
                if args.append_eod:
                    ids.append(tokenizer.eod)
                if not ids:
                    continue
                builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                tokens += len(ids)
            docs += 1
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
        print(f"wrote {prefixes[key]}.bin/.idx: {docs} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
