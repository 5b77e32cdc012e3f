"""``megatron-ext provenance``: the provenance sidecar of a dataset Megatron built, and what a
sidecar says.

    megatron-ext provenance rebuild --dataset data/web_text_document --input web-0.jsonl \\
        web-1.jsonl --provenance-key id --tokenizer-dir tok/
    megatron-ext provenance show --dataset data/web_text_document --document 83

``rebuild``: from the same input files in the same order (JSONL, or Parquet: one document per
row); the document count must match and ``--verify`` documents are re-tokenised and compared
with the ``.bin``, the first mismatch refused with nothing written. ``show``: a sidecar's
shards and the raw record of given documents, once it is checked against today's ``.idx``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from megatron_ext.common.errors import Refusal, report
from megatron_ext.common.records.pair import DTYPES, PairError, check_pair
from megatron_ext.common.records.provenance import (
    SUFFIX,
    ProvenanceError,
    Recorder,
    open_sidecar,
    place,
    write_sidecar,
)
from megatron_ext.data import shards
from megatron_ext.data.checks import index_arrays
from megatron_ext.data.encode import EncodeError, fields
from megatron_ext.data.tokenizer import load_tokenizer

PROG = "megatron-ext provenance"
DEFAULT_VERIFY = 256
PREVIEW = 8  # tokens shown of each side of a mismatch


class RebuildError(Refusal):
    """The inputs are not what built the dataset (or cannot be read); nothing was written."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    rebuild = commands.add_parser("rebuild", help="write PREFIX.prov for a dataset Megatron built")
    show = commands.add_parser("show", help="a sidecar's shards and documents' raw records")
    for sub in (rebuild, show):
        sub.add_argument("--dataset", required=True, metavar="PREFIX", help="as in --data-path")
    rebuild.add_argument(
        "--input",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE",
        help="the JSONL or Parquet files the dataset was built from, in the order they were read",
    )
    rebuild.add_argument(
        "--json-key", default="text", help="the key this dataset's text came from (default: text)"
    )
    rebuild.add_argument("--provenance-key", metavar="KEY", help="record each record's id too")
    rebuild.add_argument(
        "--tokenizer-dir",
        required=True,
        type=Path,
        help="the Hugging Face tokenizer dir the dataset was tokenized with (for --verify)",
    )
    rebuild.add_argument(
        "--verify",
        type=int,
        default=DEFAULT_VERIFY,
        metavar="N",
        help="documents re-tokenised and compared with the .bin (default: %(default)s; all "
        "when N is at least the document count)",
    )
    show.add_argument("--document", type=int, nargs="*", default=[], help="documents to show")
    show.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return parser


def _scan(inputs: list[Path], key: str, id_key: str | None) -> tuple[Recorder, np.ndarray]:
    """Every record (non-blank line, Parquet row) of the inputs, in order, as a recorder of
    sources, and which of them have no text under ``key`` (``preprocess`` adds no document)."""
    recorder, empty = Recorder(inputs, id_key, shards.entry), bytearray()
    columns = [key, *([id_key] if id_key else [])]
    for shard, path in enumerate(inputs):
        for number, offset, line in shards.records(path, columns):
            values, record_id = fields(line, path, number, [key], id_key)
            recorder.add(shard, number, offset, record_id)
            empty.append(not values[0].strip())
    return recorder, np.frombuffer(empty, np.uint8).astype(bool)


def _records_of(
    prefix: str, starts: np.ndarray, empty: np.ndarray, inputs: list[Path]
) -> np.ndarray:
    """Which input record (index among the non-blank lines) each document came from."""
    documents, records = len(starts) - 1, len(empty)
    if documents == records:  # Megatron: one document per line, empty or not
        return np.arange(records)
    with_text = np.flatnonzero(~empty)
    if documents == len(with_text) and int(starts[-1]) == documents:  # megatron-ext preprocess
        return with_text
    raise RebuildError(
        f"{prefix}.idx holds {documents} documents, but {' '.join(map(str, inputs))} hold "
        f"{records} records ({len(with_text)} with text): these are not the files the dataset "
        "was built from (one missing, added or changed); nothing was written"
    )


def _differ(tokens: list[int], ids: list[int], eod: int) -> int | None:
    """Where the ``.bin``'s tokens stop matching the record's ids (None: they match, with or
    without a final EOD, as preprocess_data.py's --append-eod decides)."""
    if tokens in (ids, [*ids, eod]):
        return None
    return next(
        (k for k, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids))
    )


def _verify(
    prefix: str, args: argparse.Namespace, recorder: Recorder, record_of: np.ndarray
) -> tuple[int, int]:
    """Re-tokenise ``--verify`` documents spread over the dataset (of those with tokens);
    refuse the first mismatch. (Documents compared, documents with tokens.)"""
    code, lengths, pointers, starts = index_arrays(prefix)
    dtype = np.dtype(DTYPES[code])
    counts = np.diff(np.asarray(starts, dtype=np.int64))
    candidates = np.flatnonzero(counts > 0)
    wanted = max(0, min(args.verify, len(candidates)))
    if not wanted:
        return 0, len(candidates)
    picks = candidates[np.unique(np.linspace(0, len(candidates) - 1, wanted).round().astype(int))]
    try:
        tokenizer = load_tokenizer(args.tokenizer_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise RebuildError(f"--tokenizer-dir: {exc}") from None
    tokens_of = np.memmap(prefix + ".bin", dtype, "r")
    for document in picks.tolist():
        first, last = int(starts[document]), int(starts[document + 1])
        tokens = np.concatenate(
            [
                tokens_of[int(pointers[s]) // dtype.itemsize :][: int(lengths[s])]
                for s in range(first, last)
            ]
        ).tolist()
        record = int(record_of[document])
        path, line = args.input[recorder.shard[record]], int(recorder.line[record])
        raw = shards.record_at(path, line, int(recorder.byte[record]), [args.json_key])
        text = fields(raw, path, line, [args.json_key], None)[0][0]
        ids = tokenizer.encode(text)
        at = _differ(tokens, ids, tokenizer.eod_id)
        if at is not None:
            raise RebuildError(
                f"document {document} of {prefix} (sequence {first}) is not {path}:{line}: the "
                f".bin holds {len(tokens)} tokens, {tokens[at : at + PREVIEW]} from token {at}, "
                f"that record tokenizes to {len(ids)}, {ids[at : at + PREVIEW]} there. The input "
                "files, their order or the tokenizer differ from what built this dataset (or it "
                "was built with --split-sentences); nothing was written"
            )
    return len(picks), len(candidates)


def rebuild(args: argparse.Namespace) -> int:
    """Scan the inputs, map every sequence to its record, verify a sample, write the sidecar."""
    if missing := [str(p) for p in args.input if not p.is_file()]:
        raise RebuildError(f"input file(s) not found: {', '.join(missing)}")
    check_pair(args.dataset)
    recorder, empty = _scan(args.input, args.json_key, args.provenance_key)
    starts = index_arrays(args.dataset)[3]
    record_of = _records_of(args.dataset, starts, empty, args.input)
    verified, tokenized = _verify(args.dataset, args, recorder, record_of)
    # Each sequence's record: a document's sequences all come from its line.
    per_sequence = np.repeat(record_of, np.diff(np.asarray(starts, dtype=np.int64)))
    columns = (
        np.frombuffer(recorder.shard, np.uint32)[per_sequence],
        np.frombuffer(recorder.line, np.uint64)[per_sequence],
        np.frombuffer(recorder.byte, np.uint64)[per_sequence],
    )
    ids = None
    if args.provenance_key is not None:
        ends = np.frombuffer(recorder.id_end, np.uint64).astype(np.int64)
        begins, blob = np.concatenate(([0], ends[:-1])), memoryview(recorder.blob)
        parts = [blob[b:e] for b, e in zip(begins[per_sequence], ends[per_sequence])]
        ids = (np.cumsum([len(p) for p in parts], dtype=np.uint64), b"".join(parts))
    write_sidecar(
        args.dataset + SUFFIX,
        args.dataset + ".idx",
        files=[shards.entry(path) for path in args.input],
        id_key=args.provenance_key,
        columns=columns,
        ids=ids,
        checked=True,
    )
    print(
        f"{args.dataset}{SUFFIX}: {len(per_sequence)} sequences of {len(record_of)} documents "
        f"from {len(args.input)} file(s)"
        + (f", ids under {args.provenance_key!r}" if args.provenance_key else "")
        + f"; {verified} of its {tokenized} documents with tokens re-tokenised: equal to the .bin"
    )
    return 0


def show(args: argparse.Namespace) -> int:
    """A checked sidecar's shards and the raw records of ``--document``."""
    check_pair(args.dataset)
    provenance = open_sidecar(args.dataset, checked=True)
    if provenance is None:
        raise ProvenanceError(
            f"no {args.dataset}{SUFFIX}: preprocess with megatron-ext preprocess, or write one "
            "with megatron-ext provenance rebuild"
        )
    documents = [{"document": d, "source": provenance.source(d)} for d in args.document]
    if args.json:
        answer = {"dataset": args.dataset, "sequences": provenance.sequences}
        answer |= {"id_key": provenance.id_key, "files": provenance.files, "documents": documents}
        print(json.dumps(answer, indent=1))
        return 0
    ids = f"ids under {provenance.id_key!r}" if provenance.id_key else "no ids"
    print(
        f"{provenance.path}: {provenance.sequences} sequences from {len(provenance.files)} "
        f"file(s), {ids}; describes today's {args.dataset}.idx"
    )
    print("\n".join(f"  {f['path']} ({f['size']} bytes)" for f in provenance.files))
    for entry in documents:
        source = entry["source"]
        print(
            f"document {entry['document']}: {place(source)}"
            + (f" (id {source['id']})" if source["id"] is not None else "")
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``megatron-ext provenance``; refusals print their reason and return 1."""
    args = build_parser().parse_args(argv)
    try:
        return rebuild(args) if args.command == "rebuild" else show(args)
    except (RebuildError, EncodeError, PairError, ProvenanceError) as exc:
        return report(exc, f"{PROG} {args.command}: refused")
