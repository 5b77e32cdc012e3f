"""``megatron-ext preprocess``: JSONL or Parquet -> Megatron ``.bin``/``.idx``, as Megatron-LM's
``tools/preprocess_data.py`` plus an offline tokenizer, the provenance sidecar and nothing
half-written (docs/data.md). Megatron is imported late: spawned workers re-import this module.
"""

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megatron_ext.common.errors import Refusal, report
from megatron_ext.common.io import check_writable, remove_durably, rename_durably
from megatron_ext.common.records.pair import append_fingerprint, publish
from megatron_ext.common.records.provenance import SUFFIX, Recorder
from megatron_ext.data.encode import EncodeError, encode_chunk, fields, worker_pool
from megatron_ext.data.shards import entry, is_parquet, records
from megatron_ext.data.tokenizer import (
    TOKENIZER_FILE,
    LoadedTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

PROG = "megatron-ext preprocess"


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class PreprocessError(Refusal):
    """Bad input or arguments; the message is meant for the user, no traceback needed."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (kept close to Megatron's ``tools/preprocess_data.py``)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Convert JSONL or Parquet documents to Megatron .bin/.idx indexed datasets.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE",
        help="JSONL files (one JSON object per line; blank lines are ignored) or Parquet files "
        "(.parquet: one row per document, the keys are columns)",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys (Parquet: columns) to extract; each becomes PREFIX_KEY_document.{bin,idx}",
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
        help="write PREFIX_KEY_document.prov: each document's file and line and byte offset "
        "(Parquet: row and row group) (default: on)",
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


@dataclass
class _Output:
    """One key's dataset under its temporary name: builder, provenance and counts."""

    prefix: str
    recorder: Recorder
    builder: Any = None
    documents: int = 0
    tokens: int = 0
    skipped: int = 0

    @property
    def tmp(self) -> str:
        return f"{self.prefix}.tmp{os.getpid()}"

    def add(self, document: np.ndarray, source: tuple[int, int, int, str | None] | None) -> None:
        self.builder.add_document(document, [len(document)])
        if source is not None:
            self.recorder.add(*source)
        self.documents += 1
        self.tokens += len(document)

    def finish(self, provenance: bool) -> None:
        self.builder.finalize(self.tmp + ".idx")
        append_fingerprint(self.tmp + ".idx", self.tmp + ".bin")
        if provenance:
            self.recorder.write(self.tmp + SUFFIX, self.tmp + ".idx")

    def publish(self, provenance: bool) -> None:
        # An old sidecar goes first: a kill below leaves none, never one of the old pair.
        remove_durably(self.prefix + SUFFIX)
        publish(self.tmp, self.prefix)
        if provenance:
            rename_durably(self.tmp + SUFFIX, self.prefix + SUFFIX)

    def clean_up(self) -> None:
        if self.builder is not None:
            # A no-op after finalize(); on an error it may flush into the full disk again.
            with contextlib.suppress(OSError):
                self.builder.data_file.close()
        for ext in (".bin", ".idx", SUFFIX):
            Path(self.tmp + ext).unlink(missing_ok=True)


def _encode_into(args: argparse.Namespace, outputs: dict[str, _Output], eod: np.ndarray) -> None:
    """Tokenize every input (with a progress bar over its bytes) into ``outputs``."""
    total = sum(path.stat().st_size for path in args.input)
    progress = tqdm(
        total=total, unit="B", unit_scale=True, file=sys.stderr, disable=None, desc="preprocess"
    )
    columns = [*args.json_keys, *([args.provenance_key] if args.provenance_key else [])]
    with worker_pool(args.workers, args.chunksize, args.tokenizer_dir) as mapper, progress as bar:
        for shard, path in enumerate(args.input):
            encode = partial(
                encode_chunk, path=path, keys=args.json_keys, id_key=args.provenance_key
            )
            for line, offset, size, ids_per_key, record_id in mapper(
                encode, records(path, columns)
            ):
                bar.update(size)
                source = (shard, line, offset, record_id) if args.provenance else None
                for key, ids in zip(args.json_keys, ids_per_key, strict=True):
                    if ids.size:
                        outputs[key].add(np.concatenate([ids, eod]), source)
                    else:
                        outputs[key].skipped += 1
            if is_parquet(path):  # rows carry no byte count: the file at once
                bar.update(path.stat().st_size)


def _write_datasets(args: argparse.Namespace, tokenizer: LoadedTokenizer) -> dict[str, _Output]:
    """Encode all inputs and publish one dataset per key; return each key's output."""
    say(
        f"tokenizing {len(args.input)} file(s) with {args.workers} worker(s) -> "
        + ", ".join(f"{args.output_prefix}_{key}_document.bin/.idx" for key in args.json_keys)
    )
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    outputs = {
        key: _Output(
            f"{args.output_prefix}_{key}_document",
            Recorder(args.input, args.provenance_key, entry),
        )
        for key in args.json_keys
    }
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    eod = np.asarray([tokenizer.eod_id] if args.append_eod else [], dtype=np.int32)
    try:
        for output in outputs.values():
            output.builder = IndexedDatasetBuilder(output.tmp + ".bin", dtype=dtype)
        _encode_into(args, outputs, eod)
        empty = [key for key, output in outputs.items() if not output.documents]
        if empty and not args.allow_empty:
            raise PreprocessError(
                f"no non-empty document for --json-keys {' '.join(empty)} in "
                f"{' '.join(map(str, args.input))}: nothing to train on. Check the input and "
                "the keys, or pass --allow-empty to write an empty dataset anyway"
            )
        for output in outputs.values():
            output.finish(args.provenance)
        for output in outputs.values():
            output.publish(args.provenance)
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
        for output in outputs.values():
            output.clean_up()
    return outputs


def _texts(args: argparse.Namespace) -> Iterator[str]:
    """Every non-blank value of ``--json-keys`` in the inputs, in order."""
    for path in args.input:
        for lineno, _, line in records(path, args.json_keys):
            values = fields(line, path, lineno, args.json_keys, None)[0]
            yield from (t for t in values if t.strip())


def _prepare_tokenizer(args: argparse.Namespace) -> LoadedTokenizer:
    """The tokenizer in ``args.tokenizer_dir``, training and saving one there first if asked to
    (training reads all inputs, so bad lines are reported before anything is saved)."""
    tokenizer_dir = args.tokenizer_dir
    try:
        if args.train_tokenizer:
            if (tokenizer_dir / TOKENIZER_FILE).exists():
                # Retraining would silently invalidate datasets already tokenized with it.
                raise PreprocessError(
                    f"{tokenizer_dir} already holds a tokenizer; reuse it with --tokenizer-dir "
                    f"{tokenizer_dir} or delete it to retrain"
                )
            size = sum(path.stat().st_size for path in args.input) / 2**20
            say(
                f"training a byte-level BPE tokenizer (vocab <= {args.vocab_size}) on "
                f"{len(args.input)} file(s), {size:.1f} MiB..."
            )
            start = time.perf_counter()
            train_bpe_tokenizer(
                _texts(args), tokenizer_dir, args.vocab_size, show_progress=sys.stderr.isatty()
            )
            say(f"tokenizer trained in {time.perf_counter() - start:.1f} s -> {tokenizer_dir}")
        return load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, ValueError) as e:  # bad --tokenizer-dir or --vocab-size
        raise PreprocessError(str(e)) from None


def _check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` and a file in it now, before any work, or refuse."""
    try:
        check_writable(directory)
    except OSError as exc:
        raise PreprocessError(
            f"{what} {directory} is not writable ({exc.strerror or exc}); choose another "
            "location or fix its permissions"
        ) from None


def _check_args(args: argparse.Namespace) -> None:
    if missing := [str(p) for p in args.input if not p.is_file()]:
        raise PreprocessError(f"input file(s) not found: {', '.join(missing)}")
    if args.workers < 1 or args.chunksize < 1:
        raise PreprocessError("--workers and --chunksize must be >= 1")
    if not args.train_tokenizer and args.tokenizer_out is not None:
        raise PreprocessError("--tokenizer-out only applies with --train-tokenizer")
    if args.provenance_key is not None and not args.provenance:
        raise PreprocessError("--provenance-key records ids in the sidecar; drop --no-provenance")
    if repeated := next((k for k in args.json_keys if args.json_keys.count(k) > 1), None):
        # One dataset per key: each of its documents would be written into it twice.
        raise PreprocessError(f"--json-keys names {repeated!r} twice; give each key once")
    _check_writable(Path(args.output_prefix).absolute().parent, "the output directory")
    if args.train_tokenizer:  # --tokenizer-dir is the one trained (they are exclusive)
        args.tokenizer_dir = args.tokenizer_out or Path(f"{args.output_prefix}_tokenizer")
        if args.tokenizer_dir.exists() and not args.tokenizer_dir.is_dir():
            raise PreprocessError(
                f"{args.tokenizer_dir}, where --train-tokenizer saves the tokenizer (a "
                "directory), is a file; choose another --tokenizer-out"
            )
        _check_writable(args.tokenizer_dir.absolute().parent, "the tokenizer output directory")
    if not args.allow_empty and next(_texts(args), None) is None:
        raise PreprocessError(
            f"the input ({' '.join(map(str, args.input))}) holds no document with text under "
            f"--json-keys {' '.join(args.json_keys)}; pass --allow-empty to write an empty "
            "dataset anyway"
        )


class _Terminated(Exception):
    """SIGTERM arrived: an internal control-flow signal to unwind and remove temporary files."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    """Run the preprocessing CLI; return 0 on success, 1 on bad input (message on stderr)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _check_args(args)
        tokenizer = _prepare_tokenizer(args)
        outputs = _write_datasets(args, tokenizer)
    except (PreprocessError, EncodeError) as e:
        return report(e, f"{PROG}: error")
    except _Terminated:
        say("stopped by SIGTERM; nothing was published and the temporary files were removed")
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - start
    for key, s in outputs.items():
        print(
            f"{key}: {s.documents} documents, {s.tokens} tokens, {s.skipped} empty skipped, "
            f"{seconds:.1f} s -> {s.prefix}.bin/.idx{'/.prov' if args.provenance else ''} "
            f"(tokenizer: {args.tokenizer_dir}, vocab {tokenizer.vocab_size}, "
            f"eod {tokenizer.eod_id})"
        )
    return 0
