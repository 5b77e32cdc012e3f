"""One JSONL line -> token ids, in a preprocess worker, with bounded memory.

Tokenizing a whole document in one call costs the ``tokenizers`` library about 120 bytes per
character (offsets, token strings, masks for every token), so a 50 MB document peaked at
7.8 GB. Long documents are therefore tokenized in windows of :data:`WINDOW_CHARS` characters
cut at pre-tokenizer boundaries, where BPE merges never reach across, so the ids are exactly
those of one call (checked by the tests). The ids travel as int32 arrays, not Python lists.

Stated bound, per process that tokenizes, above its start-up memory: under 6x the longest
input line (its bytes, its decoded text, the ids and their copies) plus 64 MiB (one window and
the tokenizer); measured about 4.5x + 50 MB (``benchmarks/preprocess_memory.py``,
BENCHMARKS.md; tests/faults checks the bound). Windowing applies when cutting is
provably exact: the tokenizer has a pre-tokenizer, no normalizer, and adds no special tokens
(``encode("")`` is empty); otherwise a document is tokenized in one call, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_ext.common.errors import Refusal
from megatron_ext.data.tokenizer import LoadedTokenizer

WINDOW_CHARS = 1 << 18


class EncodeError(Refusal, ValueError):
    """Bad input; the message names the file and line."""


def texts(line: bytes, path: Path, lineno: int, keys: list[str]) -> list[str]:
    """The values of ``keys`` in one JSONL line, or an :class:`EncodeError` naming it."""
    return fields(line, path, lineno, keys, None)[0]


def fields(
    line: bytes, path: Path, lineno: int, keys: list[str], id_key: str | None
) -> tuple[list[str], str | None]:
    """The values of ``keys`` and the record's id under ``id_key`` (a string or an integer,
    as text; None without ``id_key``), or an :class:`EncodeError` naming the line."""
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EncodeError(f"{where}: malformed JSON ({e}); fix or remove this line") from None
    if not isinstance(record, dict):
        raise EncodeError(f"{where}: expected a JSON object, got {type(record).__name__}")
    values = []
    for key in keys:
        if key not in record:
            raise EncodeError(
                f"{where}: missing key {key!r} (present: {sorted(record)}); "
                "choose the key with --json-keys"
            )
        if not isinstance(record[key], str):
            raise EncodeError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")
        values.append(record[key])
    if id_key is None:
        return values, None
    record_id = record.get(id_key)
    if isinstance(record_id, bool) or not isinstance(record_id, str | int):
        what = "missing" if id_key not in record else f"a {type(record_id).__name__}"
        raise EncodeError(
            f"{where}: the record's id {id_key!r} (--provenance-key) is {what}, not a string or "
            "an integer; give every record one, or name another field"
        )
    return values, str(record_id)


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

    def encode_line(
        self, line: bytes, path: Path, lineno: int, keys: list[str], id_key: str | None
    ) -> tuple[list[np.ndarray], str | None]:
        """Ids per key for one line (empty for a blank document), and the record's id."""
        values, record_id = fields(line, path, lineno, keys, id_key)
        encoded = [
            self.encode(text) if text.strip() else np.empty(0, dtype=np.int32) for text in values
        ]
        return encoded, record_id
