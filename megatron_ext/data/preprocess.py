"""``megatron-ext preprocess``: JSONL -> Megatron ``.bin``/``.idx`` indexed datasets.

Mirrors Megatron-LM's ``tools/preprocess_data.py`` (same ``{prefix}_{key}_document`` names,
EOD appended to every document, dtype from ``DType.optimal_dtype``), but can train its own
tokenizer offline, reports bad input as ``file:line``, skips and counts empty documents, and
never leaves half-written outputs: everything is written to temporary names and published
only after the whole input was processed, as a pair no reader can see mixed
(:mod:`megatron_ext.common.records.pair`). Beside each pair it writes the provenance sidecar
(``PREFIX.prov``, :mod:`megatron_ext.common.records.provenance`): every document's file, line, byte
offset and, with ``--provenance-key``, the record's id, so a document an incident names can be
removed from the raw shards (``megatron-ext blocklist apply``).

Failures end fast with a message, and remove the temporary files: a worker that dies (an
OOM kill) breaks the pool at once instead of leaving the parent waiting for its results
forever; SIGTERM and a full disk stop the run cleanly. An input without any document, or an
output directory that cannot be written, is refused before any work (``--allow-empty`` writes
an empty dataset on purpose). Long documents are tokenized in windows
(:mod:`megatron_ext.data.encode`, with the memory bound stated there).

Megatron (and with it torch) is imported lazily inside :func:`_write_datasets` because worker
processes are spawned and re-import this module; a module-level import would cost each worker
seconds of start-up.
"""

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_ext.common.errors import Refusal, report
from megatron_ext.common.io import remove_durably, rename_durably
from megatron_ext.common.records.pair import append_fingerprint, publish
from megatron_ext.common.records.provenance import SUFFIX, Recorder
from megatron_ext.data.encode import EncodeError, texts
from megatron_ext.data.tokenizer import (
    TOKENIZER_FILE,
    LoadedTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from megatron_ext.data.workers import encode_chunk, worker_pool

PROG = "megatron-ext preprocess"


class PreprocessError(Refusal):
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
        "--allow-empty",
        action="store_true",
        help="write a dataset even when the input holds no document (refused by default)",
    )
    p.add_argument(
        "--provenance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write PREFIX_KEY_document.prov: each document's file, line and byte offset "
        "(default: on)",
    )
    p.add_argument(
        "--provenance-key",
        metavar="KEY",
        help="also record each record's id, the value of this JSON field (a string or integer)",
    )
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the EOD token (default: on)",
    )
    return p


def _lines(
    path: Path, positions: deque[tuple[int, int]] | None = None
) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines of ``path`` with 1-based line numbers (bytes: sizes drive progress);
    each one's (line, byte offset) is also appended to ``positions``, for the provenance of
    the results that come back in the same order."""
    offset = 0
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                if positions is not None:
                    positions.append((n, offset))
                yield n, line
            offset += len(line)


@dataclass
class _Stats:
    documents: int = 0
    tokens: int = 0
    skipped: int = 0


def _write_datasets(
    args: argparse.Namespace, tokenizer_dir: Path, tokenizer: LoadedTokenizer
) -> dict[str, tuple[_Stats, str]]:
    """Encode all inputs and write one dataset per key; return stats and prefix per key."""
    print(
        f"{PROG}: tokenizing {len(args.input)} file(s) with {args.workers} worker(s) -> "
        + ", ".join(f"{args.output_prefix}_{key}_document.bin/.idx" for key in args.json_keys),
        file=sys.stderr,
        flush=True,
    )
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    tmp = {key: f"{p}.tmp{os.getpid()}" for key, p in prefixes.items()}
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders: dict[str, IndexedDatasetBuilder] = {}
    stats = {key: _Stats() for key in prefixes}
    recorders = {key: Recorder(args.input, args.provenance_key) for key in prefixes}
    eod = np.asarray([tokenizer.eod_id] if args.append_eod else [], dtype=np.int32)
    total_bytes = sum(path.stat().st_size for path in args.input)
    try:
        for key in prefixes:
            builders[key] = IndexedDatasetBuilder(tmp[key] + ".bin", dtype=dtype)
        with (
            worker_pool(args.workers, args.chunksize, tokenizer_dir) as mapper,
            tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                file=sys.stderr,
                disable=None,
                desc="preprocess",
            ) as bar,
        ):
            for shard, path in enumerate(args.input):
                positions: deque[tuple[int, int]] = deque()
                encode = partial(
                    encode_chunk, path=path, keys=args.json_keys, id_key=args.provenance_key
                )
                for size, ids_per_key, record_id in mapper(encode, _lines(path, positions)):
                    bar.update(size)
                    line, offset = positions.popleft()
                    for key, ids in zip(args.json_keys, ids_per_key, strict=True):
                        if not ids.size:
                            stats[key].skipped += 1
                            continue
                        document = np.concatenate([ids, eod])
                        builders[key].add_document(document, [len(document)])
                        if args.provenance:
                            recorders[key].add(shard, line, offset, record_id)
                        stats[key].documents += 1
                        stats[key].tokens += len(document)
        empty = [key for key in prefixes if not stats[key].documents]
        if empty and not args.allow_empty:
            raise PreprocessError(
                f"no non-empty document for --json-keys {' '.join(empty)} in "
                f"{' '.join(map(str, args.input))}: nothing to train on. Check the input and "
                "the keys, or pass --allow-empty to write an empty dataset anyway"
            )
        for key, builder in builders.items():
            builder.finalize(tmp[key] + ".idx")
            append_fingerprint(tmp[key] + ".idx", tmp[key] + ".bin")
            if args.provenance:
                recorders[key].write(tmp[key] + SUFFIX, tmp[key] + ".idx")
        for key, prefix in prefixes.items():
            # An old sidecar goes first: a kill below leaves none, never one of the old pair.
            remove_durably(prefix + SUFFIX)
            publish(tmp[key], prefix)
            if args.provenance:
                rename_durably(tmp[key] + SUFFIX, prefix + SUFFIX)
    except BrokenProcessPool:
        raise PreprocessError(
            "a tokenizer worker process died (killed by the OOM killer or a signal); nothing "
            "was published and the temporary files were removed. Rerun with fewer --workers "
            "or more memory"
        ) from None
    except OSError as exc:
        raise PreprocessError(
            f"writing the dataset failed: {exc.strerror or exc} "
            f"({exc.filename or args.output_prefix}); nothing was published and the temporary "
            "files were removed. Free space (or fix the permissions) and rerun"
        ) from None
    finally:
        for builder in builders.values():
            # A no-op after finalize(); on an error it may flush into the full disk again.
            with contextlib.suppress(OSError):
                builder.data_file.close()
        for key in prefixes:
            for ext in (".bin", ".idx", SUFFIX):
                Path(tmp[key] + ext).unlink(missing_ok=True)
    return {key: (stats[key], prefixes[key]) for key in prefixes}


def _train_tokenizer(corpus: Iterator[str], out: Path, args: argparse.Namespace) -> None:
    """Train the BPE, saying so: it reads every input once and takes seconds to minutes."""
    size = sum(path.stat().st_size for path in args.input) / 2**20
    print(
        f"{PROG}: training a byte-level BPE tokenizer (vocab <= {args.vocab_size}) on "
        f"{len(args.input)} file(s), {size:.1f} MiB...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    train_bpe_tokenizer(corpus, out, vocab_size=args.vocab_size, show_progress=sys.stderr.isatty())
    print(
        f"{PROG}: tokenizer trained in {time.perf_counter() - start:.1f} s -> {out}",
        file=sys.stderr,
        flush=True,
    )


def _prepare_tokenizer(args: argparse.Namespace) -> tuple[Path, LoadedTokenizer]:
    """The tokenizer dir to use and the tokenizer in it, training and saving one first if
    asked to (training reads all inputs, so bad lines are reported before anything is saved)."""

    def corpus() -> Iterator[str]:
        for path in args.input:
            for lineno, line in _lines(path):
                yield from (t for t in texts(line, path, lineno, args.json_keys) if t.strip())

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
            _train_tokenizer(corpus(), tokenizer_dir, args)
        return tokenizer_dir, load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, ValueError) as e:  # bad --tokenizer-dir or --vocab-size
        raise PreprocessError(str(e)) from None


def _check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` and a file in it now, before any work, or refuse."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".megatron-ext-write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PreprocessError(
            f"{what} {directory} is not writable ({exc.strerror or exc}); choose another "
            "location or fix its permissions"
        ) from None


def _has_documents(args: argparse.Namespace) -> bool:
    """Whether any input line holds a non-blank value (stops at the first one)."""
    for path in args.input:
        for lineno, line in _lines(path):
            if any(t.strip() for t in texts(line, path, lineno, args.json_keys)):
                return True
    return False


def _check_args(args: argparse.Namespace) -> None:
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        raise PreprocessError(f"input file(s) not found: {', '.join(missing)}")
    if args.workers < 1 or args.chunksize < 1:
        raise PreprocessError("--workers and --chunksize must be >= 1")
    if not args.train_tokenizer and args.tokenizer_out is not None:
        raise PreprocessError("--tokenizer-out only applies with --train-tokenizer")
    if args.provenance_key is not None and not args.provenance:
        raise PreprocessError("--provenance-key records ids in the sidecar; drop --no-provenance")
    _check_writable(Path(args.output_prefix).absolute().parent, "the output directory")
    if args.train_tokenizer:
        out = args.tokenizer_out or Path(f"{args.output_prefix}_tokenizer")
        _check_writable(out.absolute().parent, "the tokenizer output directory")
    if not args.allow_empty and not _has_documents(args):
        raise PreprocessError(
            f"the input ({' '.join(map(str, args.input))}) holds no document with text under "
            f"--json-keys {' '.join(args.json_keys)}; pass --allow-empty to write an empty "
            "dataset anyway"
        )


class _Terminated(Exception):
    """SIGTERM arrived: unwind so every temporary file is removed.

    An internal control-flow signal (``main`` reports it and exits 128 + SIGTERM), not a
    refusal, so it is no :class:`~megatron_ext.common.errors.MegatronExtError`."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    """Run the preprocessing CLI; return 0 on success, 1 on bad input (message on stderr)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _check_args(args)
        tokenizer_dir, tokenizer = _prepare_tokenizer(args)
        results = _write_datasets(args, tokenizer_dir, tokenizer)
    except (PreprocessError, EncodeError) as e:
        return report(e, f"{PROG}: error")
    except _Terminated:
        print(
            f"{PROG}: stopped by SIGTERM; nothing was published and the temporary files were "
            "removed",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - start
    for key, (s, prefix) in results.items():
        print(
            f"{key}: {s.documents} documents, {s.tokens} tokens, {s.skipped} empty skipped, "
            f"{seconds:.1f} s -> {prefix}.bin/.idx{'/.prov' if args.provenance else ''} "
            f"(tokenizer: {tokenizer_dir}, "
            f"vocab {tokenizer.vocab_size}, eod {tokenizer.eod_id})"
        )
    return 0
