"""Turn JSONL (one JSON object per line) into megatron-core indexed-dataset files (.bin/.idx).

Takes Megatron-LM's options and writes the files its tools/preprocess_data.py writes:

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix /data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 8

writes /data/corpus_text_document.bin/.idx (_sentence instead of _document with
--split-sentences). Without --tokenizer-type it uses our byte-level tokenizer. EOD ends each
document only with --append-eod, as in Megatron-LM. With --partitions N the input (a glob is
allowed) is cut into N files, each tokenized by its own pool of --workers/N processes, and the
N results are merged into the one output.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.errors import UserError  # noqa: E402
from megatron.training.data.tokenizers import add_tokenizer_arguments, build_tokenizer  # noqa: E402

IMAP_CHUNK = 32  # lines handed to a worker at a time, as Megatron-LM does


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_tokenizer_arguments(p.add_argument_group("tokenizer"))
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file (with --partitions > 1: a glob of them)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output each")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (needs nltk)")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep newlines")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="end each document with the EOD token")
    g.add_argument("--lang", default="english", help="the nltk punkt language for --split-sentences")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.{bin,idx}")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=_positive_int, default=1,
                   help="tokenizing processes in all (Megatron-LM requires it; 1 here if not given)")
    g.add_argument("--partitions", type=_positive_int, default=1, help="input pieces tokenized at once")
    g.add_argument("--log-interval", type=_positive_int, default=1000, help="documents between progress lines")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: contiguous pieces, so the merged order is the input's")
    args = p.parse_args(argv)
    if args.partitions == 1 and not os.path.isfile(args.input):
        p.error(f"argument --input: {args.input} is not a file")
    if args.partitions > 1 and not glob.glob(args.input):
        p.error(f"argument --input: no file matches {args.input}")
    if args.workers % args.partitions:
        p.error(f"argument --workers: {args.workers} is not divisible by --partitions {args.partitions}")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        p.error(f"argument --output-prefix: directory {out_dir} does not exist")
    return p, args


class Encoder:
    """Tokenizes one JSON line per call, in a pool worker (the tokenizer is built once per worker)."""

    def __init__(self, args):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.args)
        Encoder.splitter = sentence_splitter(self.args) if self.args.split_sentences else None

    def encode(self, numbered_line):
        """(ids per key, sequence lengths per key, bytes read), or (None, error, line number)."""
        line_no, line = numbered_line
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return None, f"line {line_no} is not JSON ({err.msg})", line_no
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in record:
                return None, f"line {line_no} has no key {key!r} (see --json-keys)", line_no
            text = record[key]
            pieces = text if isinstance(text, list) else self._sentences(str(text))
            doc, seq_lens = [], []
            for piece in pieces:
                piece_ids = Encoder.tokenizer.tokenize(piece)
                if piece_ids:
                    doc.extend(piece_ids)
                    seq_lens.append(len(piece_ids))
            if doc and self.args.append_eod:
                doc.append(Encoder.tokenizer.eod)
                seq_lens[-1] += 1
            ids[key], lens[key] = doc, seq_lens
        return ids, lens, len(line)

    def _sentences(self, text: str):
        return [text] if Encoder.splitter is None else Encoder.splitter.tokenize(text)


def sentence_splitter(args):
    """nltk's punkt sentence splitter, from local data only (nothing is downloaded)."""
    try:
        import nltk
    except ImportError:
        raise UserError("--split-sentences: needs the nltk package (pip install nltk) and its punkt data")
    try:
        splitter = nltk.data.load(f"tokenizers/punkt/{args.lang}.pickle")
    except LookupError:
        raise UserError(f"--split-sentences: no nltk punkt data for {args.lang!r} here (nothing is "
                        "downloaded: run nltk.download('punkt') where there is internet, set NLTK_DATA)")
    if args.keep_newlines:
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=_newline_keeping_vars(nltk)())
    return splitter


def _newline_keeping_vars(nltk):
    """Punkt language variables whose sentence end does not swallow the newlines after it."""
    class KeepNewlines(nltk.tokenize.punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # any space, newlines included, stays with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next word
            ))"""
    return KeepNewlines


def output_names(prefix: str, key: str, level: str):
    base = f"{prefix}_{key}_{level}"
    return base + ".bin", base + ".idx"


def encode_file(args, input_path: str, output_prefix: str, workers: int) -> int:
    """Tokenize one JSONL file into OUTPUT_PREFIX_<key>_<level>.bin/.idx; returns documents written."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    level = "sentence" if args.split_sentences else "document"
    dtype = DType.optimal_dtype(build_tokenizer(args).vocab_size)
    builders = {key: IndexedDatasetBuilder(output_names(output_prefix, key, level)[0], dtype=dtype)
                for key in args.json_keys}
    encoder = Encoder(args)
    started, read_bytes, docs = time.time(), 0, 0
    with _open_text(input_path) as lines, multiprocessing.Pool(workers, initializer=encoder.initializer) as pool:
        numbered = ((n, line) for n, line in enumerate(lines, 1) if line.strip())
        for ids, lens, size in pool.imap(encoder.encode, numbered, IMAP_CHUNK):
            if ids is None:
                raise UserError(f"--input: {input_path} {lens}")
            for key in args.json_keys:
                builders[key].add_document(ids[key], lens[key])
            docs += 1
            read_bytes += size
            if docs % args.log_interval == 0:
                elapsed = max(time.time() - started, 1e-9)
                print(f"Processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                      f"{read_bytes / elapsed / 2**20:.2f} MB/s).", file=sys.stderr, flush=True)
    for key in args.json_keys:
        builders[key].finalize(output_names(output_prefix, key, level)[1])
    return docs


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def split_into_partitions(args):
    """Cut the input files into --partitions files next to the output; returns their paths.

    Lines go round-robin, or in contiguous blocks with --keep-sequential-samples, as Megatron-LM
    distributes them.
    """
    inputs = sorted(glob.glob(args.input))
    paths = [f"{args.output_prefix}_{i}.jsonl" for i in range(args.partitions)]
    per_partition = None
    if args.keep_sequential_samples:
        total = sum(1 for path in inputs for _ in _open_text(path))
        per_partition = max(1, math.ceil(total / args.partitions))
    outs = [open(path, "w", encoding="utf-8") for path in paths]
    try:
        line_no = 0
        for path in inputs:
            with _open_text(path) as f:
                for line in f:
                    index = (line_no // per_partition if per_partition else line_no % args.partitions)
                    outs[min(index, args.partitions - 1)].write(line if line.endswith("\n") else line + "\n")
                    line_no += 1
    finally:
        for out in outs:
            out.close()
    return paths


def _encode_partition(args, input_path, output_prefix, workers, results):
    try:
        results.put((output_prefix, encode_file(args, input_path, output_prefix, workers), None))
    except UserError as err:
        results.put((output_prefix, 0, str(err)))


def encode_partitions(args) -> int:
    """Each partition in a process of its own, then merged in partition order (Megatron-LM's merge)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    inputs = split_into_partitions(args)
    prefixes = [f"{args.output_prefix}_{i}" for i in range(args.partitions)]
    results = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_encode_partition,
                                     args=(args, path, prefix, args.workers // args.partitions, results))
             for path, prefix in zip(inputs, prefixes)]
    for proc in procs:
        proc.start()
    outcomes = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    errors = [error for _, _, error in outcomes if error]
    if errors:
        raise UserError(errors[0])
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"a partition process failed (exit codes {[p.exitcode for p in procs]})")

    level = "sentence" if args.split_sentences else "document"
    dtype = DType.optimal_dtype(build_tokenizer(args).vocab_size)
    for key in args.json_keys:
        bin_path, idx_path = output_names(args.output_prefix, key, level)
        builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
        for prefix in prefixes:
            builder.add_index(f"{prefix}_{key}_{level}")
        builder.finalize(idx_path)
    for path, prefix in zip(inputs, prefixes):  # the pieces are in the merged files now
        os.remove(path)
        for key in args.json_keys:
            for piece in output_names(prefix, key, level):
                os.remove(piece)
    return sum(docs for _, docs, _ in outcomes)


def main(argv=None) -> int:
    _parser, args = parse_args(argv)
    try:
        build_tokenizer(args)  # a bad tokenizer flag fails here, once, before any worker starts
        if args.split_sentences:
            sentence_splitter(args)
        docs = (encode_file(args, args.input, args.output_prefix, args.workers) if args.partitions == 1
                else encode_partitions(args))
    except UserError as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    level = "sentence" if args.split_sentences else "document"
    for key in args.json_keys:
        print(f"wrote {args.output_prefix}_{key}_{level}.bin/.idx: {docs} documents")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
