"""``megatron-ext preprocess``: JSONL -> Megatron ``.bin``/``.idx`` indexed datasets.

Mirrors Megatron-LM's ``tools/preprocess_data.py`` (same ``{prefix}_{key}_document`` names,
EOD appended to every document, dtype from ``DType.optimal_dtype``), but can train its own
tokenizer offline, reports bad input as ``file:line``, skips and counts empty documents, and
never leaves half-written outputs: everything is written to temporary names and renamed into
place only after the whole input was processed.

Megatron (and with it torch) is imported lazily inside :func:`_write_datasets` because worker
processes are spawned and re-import this module; a module-level import would cost each worker
seconds of start-up.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tqdm import tqdm

from megatron_ext.data.tokenizer import (
    TOKENIZER_FILE,
    LoadedTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

PROG = "megatron-ext preprocess"


class PreprocessError(Exception):
    """Bad input or arguments; the message is meant for the user, no traceback needed."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (kept close to Megatron's ``tools/preprocess_data.py``)."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Convert JSONL documents to Megatron .bin/.idx indexed datasets."
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE.jsonl",
        help="JSONL files, one JSON object per line; blank lines are ignored",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys to extract; each becomes PREFIX_KEY_document.{bin,idx}",
    )
    p.add_argument("--output-prefix", required=True, help="output path prefix")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="existing Hugging Face tokenizer dir (tokenizer.json + config)",
    )
    tok.add_argument(
        "--train-tokenizer", action="store_true", help="train a byte-level BPE on the input first"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="upper bound on the trained vocabulary (default: %(default)s)",
    )
    p.add_argument(
        "--tokenizer-out",
        type=Path,
        help="where --train-tokenizer saves it (default: PREFIX_tokenizer)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument(
        "--chunksize",
        type=int,
        default=64,
        help="lines sent to a worker at a time (default: %(default)s)",
    )
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the EOD token (default: on)",
    )
    return p


def _texts(line: bytes, path: Path, lineno: int, keys: list[str]) -> list[str]:
    """The values of ``keys`` in one JSONL line, or a :class:`PreprocessError` naming it."""
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreprocessError(f"{where}: malformed JSON ({e}); fix or remove this line") from None
    if not isinstance(record, dict):
        raise PreprocessError(f"{where}: expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in keys:
        if key not in record:
            raise PreprocessError(
                f"{where}: missing key {key!r} (present: {sorted(record)}); "
                "choose the key with --json-keys"
            )
        if not isinstance(record[key], str):
            raise PreprocessError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")
        texts.append(record[key])
    return texts


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines of ``path`` with 1-based line numbers (bytes: sizes drive progress)."""
    with path.open("rb") as f:
        yield from ((n, line) for n, line in enumerate(f, 1) if line.strip())


_worker_tokenizer: LoadedTokenizer | None = None


def _init_worker(tokenizer_dir: Path) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_dir)


def _encode(item: tuple[int, bytes], path: Path, keys: list[str]) -> tuple[int, list[list[int]]]:
    """Token ids per key for one line (empty list for a blank document), plus its byte size."""
    lineno, line = item
    texts = _texts(line, path, lineno, keys)
    return len(line), [_worker_tokenizer.encode(t) if t.strip() else [] for t in texts]


@contextmanager
def _mapper(workers: int, chunksize: int, tokenizer_dir: Path) -> Iterator[Callable]:
    """An order-preserving ``map``: in-process for one worker, else a process pool.

    Workers are spawned, not forked: the parent may already run Rust (tokenizers) and torch
    thread pools, and forking a multi-threaded process can deadlock.
    """
    if workers == 1:
        _init_worker(tokenizer_dir)
        yield map
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_dir,)) as pool:
        yield partial(pool.imap, chunksize=chunksize)


@dataclass
class _Stats:
    documents: int = 0
    tokens: int = 0
    skipped: int = 0


def _write_datasets(
    args: argparse.Namespace, tokenizer_dir: Path, tokenizer: LoadedTokenizer
) -> dict[str, tuple[_Stats, str]]:
    """Encode all inputs and write one dataset per key; return stats and prefix per key."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    tmp = {key: f"{p}.tmp{os.getpid()}" for key, p in prefixes.items()}
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(tmp[key] + ".bin", dtype=dtype) for key in prefixes}
    stats = {key: _Stats() for key in prefixes}
    eod = [tokenizer.eod_id] if args.append_eod else []
    total_bytes = sum(path.stat().st_size for path in args.input)
    try:
        with (
            _mapper(args.workers, args.chunksize, tokenizer_dir) as mapper,
            tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                file=sys.stderr,
                disable=None,
                desc="preprocess",
            ) as bar,
        ):
            for path in args.input:
                encode = partial(_encode, path=path, keys=args.json_keys)
                for size, ids_per_key in mapper(encode, _lines(path)):
                    bar.update(size)
                    for key, ids in zip(args.json_keys, ids_per_key, strict=True):
                        if not ids:
                            stats[key].skipped += 1
                            continue
                        builders[key].add_document(ids + eod, [len(ids) + len(eod)])
                        stats[key].documents += 1
                        stats[key].tokens += len(ids) + len(eod)
        for key, builder in builders.items():
            builder.finalize(tmp[key] + ".idx")
        for key, prefix in prefixes.items():
            for ext in (".bin", ".idx"):
                os.replace(tmp[key] + ext, prefix + ext)
    finally:
        for key, builder in builders.items():
            builder.data_file.close()  # no-op after finalize(); needed before removing on error
            for ext in (".bin", ".idx"):
                Path(tmp[key] + ext).unlink(missing_ok=True)
    return {key: (stats[key], prefixes[key]) for key in prefixes}


def _prepare_tokenizer(args: argparse.Namespace) -> tuple[Path, LoadedTokenizer]:
    """The tokenizer dir to use and the tokenizer in it, training and saving one first if
    asked to (training reads all inputs, so bad lines are reported before anything is saved)."""

    def texts() -> Iterator[str]:
        for path in args.input:
            for lineno, line in _lines(path):
                yield from (t for t in _texts(line, path, lineno, args.json_keys) if t.strip())

    tokenizer_dir = args.tokenizer_dir
    try:
        if args.train_tokenizer:
            tokenizer_dir = args.tokenizer_out or Path(f"{args.output_prefix}_tokenizer")
            if (tokenizer_dir / TOKENIZER_FILE).exists():
                # Retraining would silently invalidate datasets already tokenized with it.
                raise PreprocessError(
                    f"{tokenizer_dir} already holds a tokenizer; reuse it with --tokenizer-dir "
                    f"{tokenizer_dir} or delete it to retrain"
                )
            train_bpe_tokenizer(texts(), tokenizer_dir, vocab_size=args.vocab_size)
        return tokenizer_dir, load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, ValueError) as e:  # bad --tokenizer-dir or --vocab-size
        raise PreprocessError(str(e)) from None


def _check_args(args: argparse.Namespace) -> None:
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        raise PreprocessError(f"input file(s) not found: {', '.join(missing)}")
    if args.workers < 1 or args.chunksize < 1:
        raise PreprocessError("--workers and --chunksize must be >= 1")
    if not args.train_tokenizer and args.tokenizer_out is not None:
        raise PreprocessError("--tokenizer-out only applies with --train-tokenizer")


def main(argv: list[str] | None = None) -> int:
    """Run the preprocessing CLI; return 0 on success, 1 on bad input (message on stderr)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        _check_args(args)
        tokenizer_dir, tokenizer = _prepare_tokenizer(args)
        results = _write_datasets(args, tokenizer_dir, tokenizer)
    except PreprocessError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    for key, (s, prefix) in results.items():
        print(
            f"{key}: {s.documents} documents, {s.tokens} tokens, {s.skipped} empty skipped, "
            f"{seconds:.1f} s -> {prefix}.bin/.idx (tokenizer: {tokenizer_dir}, "
            f"vocab {tokenizer.vocab_size}, eod {tokenizer.eod_id})"
        )
    return 0
