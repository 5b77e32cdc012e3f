"""Records -> token ids for ``megatron-ext preprocess``: parsing, windowed encoding with bounded
memory (BENCHMARKS.md "preprocess") and the order-preserving worker pool. Spawned workers import
this module, so it stays free of Megatron and torch imports.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from itertools import batched
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.errors import Refusal
from megatron_ext.data.tokenizer import LoadedTokenizer, load_tokenizer

WINDOW_CHARS = 1 << 18


class EncodeError(Refusal, ValueError):
    """Bad input; the message names the file and line."""


def lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset, line) of each non-blank line of ``path``."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, offset, line
            offset += len(line)


def _parsed(line: bytes | dict, where: str) -> Any:
    """A JSONL line's value (a Parquet row is already a dict)."""
    if isinstance(line, dict):
        return line
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EncodeError(f"{where}: malformed JSON ({e}); fix or remove this line") from None


def fields(
    line: bytes | dict, path: Path, lineno: int, keys: list[str], id_key: str | None
) -> tuple[list[str], str | None]:
    """The values of ``keys`` and the record's id under ``id_key`` (a string or an integer,
    as text; None without ``id_key``) in a JSONL line or a Parquet row (numbered from 1), or
    an :class:`EncodeError` naming it."""
    where = f"{path}:{lineno}" if isinstance(line, bytes) else f"{path} row {lineno - 1}"
    record = _parsed(line, where)
    if not isinstance(record, dict):
        raise EncodeError(f"{where}: expected a JSON object, got {type(record).__name__}")
    values = []
    for key in keys:
        if key not in record:
            raise EncodeError(
                f"{where}: missing key {key!r} (present: {sorted(record)}); "
                "choose the key with --json-keys (--json-key in `provenance rebuild`)"
            )
        if not isinstance(record[key], str):
            raise EncodeError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")
        values.append(_unicode(record[key], key, where))
    if id_key is None:
        return values, None
    record_id = record.get(id_key)
    if isinstance(record_id, bool) or not isinstance(record_id, str | int):
        what = "missing" if id_key not in record else f"a {type(record_id).__name__}"
        raise EncodeError(
            f"{where}: the record's id {id_key!r} (--provenance-key) is {what}, not a string or "
            "an integer; give every record one, or name another field"
        )
    return values, _unicode(str(record_id), id_key, where)


def _unicode(value: str, key: str, where: str) -> str:
    """``value``, refused when it holds a lone surrogate (JSON's ``\\ud83d`` of a cut emoji):
    valid JSON, but no UTF-8 tokenizer or sidecar can take it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EncodeError(
            f"{where}: {key!r} is not valid Unicode (a lone surrogate "
            f"{value[exc.start]!r} at character {exc.start}); fix or remove this record"
        ) from None
    return value


class Encoder:
    """A tokenizer that encodes long texts window by window when that is exact."""

    def __init__(self, tokenizer: LoadedTokenizer, window: int = WINDOW_CHARS) -> None:
        inner = tokenizer.tokenizer
        self.tokenizer = tokenizer
        self.window = window
        self.windowed = (
            inner.pre_tokenizer is not None
            and inner.normalizer is None
            and inner.encode("").ids == []
        )

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

    def _cut(self, text: str, start: int) -> int:
        """The start of the last pre-token inside ``text[start:start+window]`` (growing the
        window while a single pre-token fills it), or the end of the text."""
        width = self.window
        while start + width < len(text):
            pieces = self.tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str(
                text[start : start + width]
            )
            if len(pieces) > 1:
                return start + pieces[-1][1][0]
            width *= 2
        return len(text)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (int32), identical to one ``encode`` call."""
        if not self.windowed or len(text) <= self.window:
            return self._ids(text)
        parts, start = [], 0
        while start < len(text):
            end = self._cut(text, start)
            parts.append(self._ids(text[start:end]))
            start = end
        return np.concatenate(parts)


_worker_encoder: Encoder | None = None


def _init_worker(tokenizer_dir: Path) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(load_tokenizer(tokenizer_dir))


def encode_chunk(
    chunk: tuple[tuple[int, int, bytes | dict], ...],
    path: Path,
    keys: list[str],
    id_key: str | None,
) -> list[tuple[int, int, int, list[np.ndarray], str | None]]:
    """(number, locator, bytes read, ids per key (empty for a blank document), record id) of
    each ``(number, locator, record)`` of a chunk (a JSONL line or a Parquet row)."""
    assert _worker_encoder is not None
    encoded = []
    for number, locator, record in chunk:
        values, record_id = fields(record, path, number, keys, id_key)
        ids = [_worker_encoder.encode(t) if t.strip() else np.empty(0, np.int32) for t in values]
        size = len(record) if isinstance(record, bytes) else 0
        encoded.append((number, locator, size, ids, record_id))
    return encoded


@contextmanager
def worker_pool(workers: int, chunksize: int, tokenizer_dir: Path) -> Iterator[Callable]:
    """An order-preserving map over chunks: in-process for one worker, else spawned processes
    with at most ``2 x workers`` chunks in flight. A ``ProcessPoolExecutor``: a dead worker
    fails every pending result with ``BrokenProcessPool`` where ``Pool`` would wait forever."""
    if workers == 1:
        _init_worker(tokenizer_dir)
        yield lambda fn, items: (r for chunk in batched(items, chunksize) for r in fn(chunk))
        return
    executor = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer_dir,),
    )

    def ordered(fn: Callable, items: Iterator[tuple]) -> Iterator:
        pending: deque[Future] = deque()
        for chunk in batched(items, chunksize):
            pending.append(executor.submit(fn, chunk))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()

    try:
        yield ordered
    except BaseException:
        # An error or SIGTERM is stopping us: cancel queued chunks and end the workers now.
        executor.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():
            child.terminate()
        raise
    executor.shutdown(wait=True)
