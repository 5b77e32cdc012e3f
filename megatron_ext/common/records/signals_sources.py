"""The signals log's per-source fields as columns: one per blend member, a block at a time.

Why: every run records ``lm_loss_by_dataset`` and ``tokens_by_dataset`` by default (one member
for a single dataset), and reading them with ``json.loads`` (two per line) was most of a
1 M-iteration plot's time. A writer's block names the same members in every line (a blend's
members are in every global batch of a real run), so one regular expression made for those
members matches each line's two objects and captures only the numbers, and numpy converts
them in bulk, as the other columns are (:mod:`megatron_ext.common.records.signals_columns`).

Lines are matched to rows by order, which needs a block whose every line is the writer's
(one of each object per line: a key can only be a key, since a quote inside a JSON string is
escaped). Anything else (a member missing from some lines, a torn or foreign line, a gap
line) is read the old way, ``json.loads`` on the lines that have the fields, and joins the
columns by (iteration, attempt): the fast path is only a faster way to the same values.
No Megatron imports here.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import numpy as np

from megatron_ext.common.records.signals_seek import KEY

_NON_FINITE = {b'"nan"': np.nan, b'"inf"': np.inf, b'"-inf"': -np.inf}
_NON_FINITE |= {b'"NaN"': np.nan, b'"Infinity"': np.inf, b'"-Infinity"': -np.inf}
# A writer's per-source fields (flat objects: no braces inside; the loss object non-empty).
_FIELDS = re.compile(rb'"lm_loss_by_dataset":(\{"[^{}\n]*\}),"tokens_by_dataset":(\{[^{}\n]*\})')
_KEYS = re.compile(rb'("(?:[^"\\\n]|\\.)*"):')
_MARK = b'"lm_loss_by_dataset":{"'  # a non-empty loss object; once per line at most


def floats(name: str, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Number tokens (bytes: a JSON number, ``null`` or a quoted non-finite) as floats, and
    False where null; ValueError names ``name`` on anything else."""
    if not len(tokens):
        return np.array([], dtype=np.float64), np.array([], dtype=bool)
    first = tokens.view(np.uint8).reshape(len(tokens), -1)[:, 0]
    null, quoted = first == ord("n"), first == ord('"')
    values = np.full(len(tokens), np.nan)
    number = ~(null | quoted)
    values[number] = tokens[number].astype(np.float64)
    for index in np.flatnonzero(quoted):
        token = bytes(tokens[index])
        if token not in _NON_FINITE:
            raise ValueError(f"a signals record holds {token.decode()} for {name}, not a number")
        values[index] = _NON_FINITE[token]
    return values, ~null


@dataclass
class SourceColumns:
    """Each member's loss and tokens, one row per record of a block (``has_*``: False where
    a record does not name the member, or names it with null)."""

    names: list[str]  # in the writer's order (of first appearance, when lines differ)
    losses: np.ndarray  # (rows, members) float64
    has_loss: np.ndarray  # (rows, members) bool
    tokens: np.ndarray  # (rows, members) int64
    has_tokens: np.ndarray  # (rows, members) bool

    def __len__(self) -> int:
        return len(self.losses)

    def take(self, rows: np.ndarray) -> SourceColumns:
        return SourceColumns(
            self.names,
            self.losses[rows],
            self.has_loss[rows],
            self.tokens[rows],
            self.has_tokens[rows],
        )

    def members(self) -> np.ndarray:
        """How many members each row has a loss for (a blend record has more than one)."""
        return self.has_loss.sum(axis=1)

    def dicts(self, row: int) -> tuple[dict[str, float], dict[str, int]]:
        """Row ``row`` as a record holds it: (lm_loss_by_dataset, tokens_by_dataset)."""
        losses, has_loss = self.losses[row].tolist(), self.has_loss[row].tolist()
        tokens, has_tokens = self.tokens[row].tolist(), self.has_tokens[row].tolist()
        return (
            {n: v for n, v, h in zip(self.names, losses, has_loss) if h},
            {n: v for n, v, h in zip(self.names, tokens, has_tokens) if h},
        )


def _empty(rows: int, names: list[str]) -> SourceColumns:
    shape = (rows, len(names))
    return SourceColumns(
        names,
        np.full(shape, np.nan),
        np.zeros(shape, dtype=bool),
        np.zeros(shape, dtype=np.int64),
        np.zeros(shape, dtype=bool),
    )


def _widen(columns: SourceColumns, names: list[str]) -> SourceColumns:
    """``columns`` over ``names`` (a superset, in order): absent members are absent."""
    if columns.names == names:
        return columns
    out = _empty(len(columns), names)
    index = [names.index(n) for n in columns.names]
    out.losses[:, index], out.has_loss[:, index] = columns.losses, columns.has_loss
    out.tokens[:, index], out.has_tokens[:, index] = columns.tokens, columns.has_tokens
    return out


def concat(
    first: SourceColumns | None, second: SourceColumns | None, rows: tuple[int, int]
) -> SourceColumns | None:
    """Two blocks' columns one after the other (``rows``: their lengths; None: no member)."""
    if first is None and second is None:
        return None
    parts = [c if c is not None else _empty(n, []) for c, n in zip((first, second), rows)]
    names = list(dict.fromkeys(parts[0].names + parts[1].names))
    parts = [_widen(p, names) for p in parts]
    return SourceColumns(
        names,
        np.concatenate([p.losses for p in parts]),
        np.concatenate([p.has_loss for p in parts]),
        np.concatenate([p.tokens for p in parts]),
        np.concatenate([p.has_tokens for p in parts]),
    )


@functools.lru_cache(maxsize=64)
def _homogeneous(loss_keys: tuple[bytes, ...], token_keys: tuple[bytes, ...]) -> re.Pattern:
    """Both objects with exactly these keys, in this order, capturing the values."""

    def body(keys: tuple[bytes, ...]) -> bytes:
        return b",".join(re.escape(k) + rb":([^,{}\n]*)" for k in keys)

    return re.compile(
        rb'"lm_loss_by_dataset":\{'
        + body(loss_keys)
        + rb'\},"tokens_by_dataset":\{'
        + body(token_keys)
        + rb"\}"
    )


def _fast(data: bytes, rows: int) -> SourceColumns | None:
    """The columns of a block of ``rows`` writer's lines that all name the same members in
    the same order; None where they do not (or a value is not a number)."""
    first = _FIELDS.search(data)
    if first is None:
        return None
    loss_keys, token_keys = (tuple(_KEYS.findall(first[k])) for k in (1, 2))
    found = _homogeneous(loss_keys, token_keys).findall(data)
    if len(found) != rows:
        return None
    table = np.array(found, dtype=np.bytes_).reshape(rows, len(loss_keys) + len(token_keys))
    table = np.ascontiguousarray(table.T)  # one contiguous row per captured value
    names = [json.loads(k) for k in loss_keys]
    token_names = [json.loads(k) for k in token_keys]
    if len(set(names)) != len(names) or len(set(token_names)) != len(token_names):
        return None  # a repeated key: json.loads keeps the last one
    try:
        loss = [floats(n, table[k]) for k, n in enumerate(names)]
        tokens = table[len(names) :].astype(np.int64)
    except ValueError:
        return None
    columns = _empty(rows, names)
    for k, (values, present) in enumerate(loss):
        columns.losses[:, k], columns.has_loss[:, k] = values, present
    columns = _widen(columns, list(dict.fromkeys(names + token_names)))
    for k, name in enumerate(token_names):
        index = columns.names.index(name)
        columns.tokens[:, index], columns.has_tokens[:, index] = tokens[k], True
    return columns


def _keyed(data: bytes) -> dict[tuple[int, int], tuple[dict, dict]]:
    """(iteration, attempt) -> the two objects, by ``json.loads``, of the lines that have
    per-source fields (a torn or foreign line does not match, as it does not in the columns)."""
    found: dict[tuple[int, int], tuple[dict, dict]] = {}
    for match in _FIELDS.finditer(data):
        key = KEY.match(data, data.rfind(b"\n", 0, match.start()) + 1)
        if key is None:
            continue
        try:
            losses, tokens = json.loads(match[1]), json.loads(match[2])
            found[int(key[1]), int(key[2])] = (
                {k: float(v) for k, v in losses.items() if v is not None},
                {k: int(v) for k, v in tokens.items()},
            )
        except (ValueError, TypeError, AttributeError):
            continue
    return found


def parse_sources(
    data: bytes, iterations: np.ndarray, attempts: np.ndarray, aligned: bool
) -> SourceColumns | None:
    """The per-source columns of the block ``data`` whose records (in order) have these
    iterations and attempts; ``aligned``: every line of ``data`` is one of those records, in
    order (the columns' fast path read it). None when no line has per-source fields."""
    if _MARK not in data:  # a literal search: a log without per-source fields
        return None
    if aligned:  # one match per row: each line holds the loss object once at most
        columns = _fast(data, len(iterations))
        if columns is not None:
            return columns
    found = _keyed(data)
    names = list(dict.fromkeys(n for losses, tokens in found.values() for n in [*losses, *tokens]))
    columns = _empty(len(iterations), names)
    index = {n: k for k, n in enumerate(names)}
    for row, key in enumerate(zip(iterations.tolist(), attempts.tolist())):
        if key in found:
            losses, tokens = found[key]
            for name, value in losses.items():
                columns.losses[row, index[name]], columns.has_loss[row, index[name]] = value, True
            for name, value in tokens.items():
                columns.tokens[row, index[name]], columns.has_tokens[row, index[name]] = value, True
    return columns
