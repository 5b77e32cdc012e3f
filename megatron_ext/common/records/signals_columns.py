"""The signals log as columns, parsed a block at a time without a record object per line.

Why: the plot reads every line of a log of millions (5 M iterations: ~2.6 GiB), and
``json.loads`` plus a :class:`SignalRecord` per line costs several µs each in CPython (> 25 s at
5 M) and a few hundred bytes of objects each (the old plot: 14 GiB at 5 M). The writer's lines
have one fixed shape: one key per :class:`SignalRecord` field, in field order, compact
separators (``JsonlAppender``). One regular expression generated from the dataclass matches a
whole line and captures only the columns asked for, and numpy converts the captured bytes in
bulk (its string-to-float cast rounds correctly, as ``json.loads`` does).

Two shapes are the writer's: every field, or every field but the :data:`APPENDED` ones (a
log written before they existed; a missing one reads as its default). A line of neither (torn,
foreign, a gap line, a field this version does not know) goes through ``json.loads`` and
:func:`record_of` as a full read parses it, and joins the columns at its place: the fast path
is only a faster way to the same values, never a guess. The per-source fields are read as
columns too (:mod:`megatron_ext.common.records.signals_sources`). No Megatron imports here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field, fields

import numpy as np

from megatron_ext.common.gap_log import GAP_KEY, is_gap
from megatron_ext.common.io import json_safe
from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.signals_seek import record_of
from megatron_ext.common.records.signals_sources import SourceColumns, floats, parse_sources

try:  # built by setup.py where a C compiler is present; the numpy path gives the same values
    from megatron_ext.common.records import _scan
except ImportError:
    _scan = None

# What the plot and a detector replay read (a detector reads no other field).
COLUMNS = (
    "iteration",
    "attempt",
    "consumed_samples",
    "lm_loss",
    "max_local_loss",
    "max_loss_dp_rank",
    "grad_norm",
    "params_norm",
    "update_ratio",
    "lr",
    "loss_scale",
    "max_attention_logit",
    "skipped_iter",
    "log_z",
    "update_skipped",
)
INTEGERS = {"iteration", "attempt", "consumed_samples"}
# The fields holding a flat JSON object (name -> number); adjacent in SignalRecord's order.
NESTED = ("bucket_grad_norms", "lm_loss_by_dataset", "tokens_by_dataset")
BOOLEANS = {"skipped_iter", "update_skipped"}
# SignalRecord's last fields, appended after logs were written without them: a line without
# them is an older writer's, and reads them as their defaults (None, False).
APPENDED = ("log_z", "update_skipped")
_DEFAULTS = {f.name: f.default for f in fields(SignalRecord) if f.name in APPENDED}


def _line_pattern(wanted: tuple[str, ...]) -> re.Pattern[bytes]:
    parts = []
    for f in fields(SignalRecord):
        if f.name == "job_id":
            value = r'"(?:[^"\\\n]|\\.)*"'
        elif f.name in NESTED:
            value = r"\{[^{}\n]*\}"
        else:  # a number, null, true/false, or "nan"/"inf" (json_safe's non-finite floats)
            value = r'[-+.\w]*|"[-\w]*"'
        parts.append(f'"{f.name}":' + (f"({value})" if f.name in wanted else f"(?:{value})"))
    base = ",".join(parts[: len(parts) - len(APPENDED)])
    # One more group: the appended fields' text, empty on an older writer's line.
    appended = "((?:," + ",".join(parts[len(parts) - len(APPENDED) :]) + ")?)"
    return re.compile(("^\\{" + base + appended + "\\}$").encode(), re.MULTILINE)


_PATTERN = _line_pattern(COLUMNS)
_ORDER = [f.name for f in fields(SignalRecord) if f.name in COLUMNS]
_DEFAULT_TOKENS = {n: json.dumps(v).encode() for n, v in _DEFAULTS.items()}


@dataclass
class Block:
    """One block's records as columns (``present``: False where a field was null), the gap
    lines (with the row they precede) and the lines that were not records."""

    values: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    gaps: list[tuple[int, dict]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    slow_lines: int = 0  # lines that went through json.loads
    # Each member's loss and tokens per row (parse_block(sources=True)); None: no row has any.
    sources: SourceColumns | None = None

    def __len__(self) -> int:
        return len(self.values["iteration"])


def _tokens(record: SignalRecord) -> tuple[bytes, ...]:
    """A record's columns as the writer spells them (the fast path's captures)."""
    return tuple(json.dumps(json_safe(getattr(record, n))).encode() for n in _ORDER)


def _slow(data: bytes, offset: int, block: Block) -> list[tuple[bytes, ...]]:
    rows: list[tuple[bytes, ...]] = []
    start = 0
    for line in data.split(b"\n"):
        where, start = offset + start, start + len(line) + 1
        if not line.strip():
            continue
        match = _PATTERN.fullmatch(line)
        if match:
            rows.append(_filled(match.groups()))
            continue
        block.slow_lines += 1
        try:
            raw = json.loads(line)
        except ValueError:
            block.problems.append(f"byte {where} (torn)")
            continue
        if isinstance(raw, dict) and is_gap(raw):
            block.gaps.append((len(rows), raw[GAP_KEY]))
            continue
        try:
            rows.append(_tokens(record_of(raw)))
        except TypeError as exc:
            block.problems.append(f"byte {where} ({exc})")
    return rows


_TAIL = len(_ORDER) - len(APPENDED)  # the appended fields' group (see _line_pattern)


def _filled(groups: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """A match's captures in _ORDER: an older writer's missing appended fields (an empty
    appended group) as their defaults."""
    if groups[_TAIL]:
        return groups[:_TAIL] + groups[_TAIL + 1 :]
    return groups[:_TAIL] + tuple(_DEFAULT_TOKENS[n] for n in _ORDER[_TAIL:])


_NAMES = [f.name for f in fields(SignalRecord)]
# The nested objects' keys add colons: count the keys after them from the end of the line.
_NESTED = _NAMES.index(NESTED[0])
assert _NAMES[_NESTED : _NESTED + len(NESTED)] == list(NESTED), "nested fields must be adjacent"
assert tuple(_NAMES[-len(APPENDED) :]) == APPENDED, "APPENDED are SignalRecord's last fields"
_SHAPES = (_NAMES, _NAMES[: -len(APPENDED)])  # the writer's line, an older writer's
WIDTH = 24  # bytes of the longest number token (a float's repr: -2.2250738585072014e-308)
_WORDS = 4  # 8-byte words read after a colon: the token and the byte that must end it
_STEPS = np.arange(WIDTH)
# name -> two arrays per line: (tokens, lengths) from the numpy path, (values, present) from C.
Columns = dict[str, tuple[np.ndarray, np.ndarray]]


def _words(buf: np.ndarray) -> np.ndarray:
    """``buf`` as 8-byte words starting at every byte (a strided view: no copy). Gathering a
    few words per line moves 8 bytes an element; a byte-wise gather of the same window cost
    3x as much, and was most of a block's time."""
    return np.ndarray((len(buf) - 7,), dtype=np.uint64, buffer=buf, strides=(1,))


def _has_key(words: np.ndarray, colon: np.ndarray, key: bytes) -> bool:
    """Whether ``key`` ends just before every ``colon``, compared a word at a time from the
    key's start, the last word aligned on the colon (overlapping the one before it when the key
    is not a multiple of 8 bytes long); a key shorter than a word is compared with the bytes
    after it masked off. A key that would start before the block does not match."""
    if (colon < len(key)).any():
        return False
    if len(key) < 8:
        pad = bytes(8 - len(key))
        mask = np.frombuffer(b"\xff" * len(key) + pad, np.uint64)[0]
        word = words[colon - len(key)] & mask
        return bool((word == np.frombuffer(key + pad, np.uint64)[0]).all())
    for offset in sorted({*range(0, len(key) - 8, 8), len(key) - 8}):
        expected = np.frombuffer(key[offset : offset + 8], np.uint64)[0]
        if (words[colon - len(key) + offset] != expected).any():
            return False
    return True


def _integers(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Non-negative integer tokens by digit arithmetic (numpy's bytes-to-int cast calls
    Python's ``int`` per value: 240 ns); numpy's cast where a token is not up to 18 plain
    digits, so a bad value still fails as it did."""
    digits = tokens.view(np.uint8).reshape(len(tokens), WIDTH)
    top = int(lengths.max(initial=0))
    values = digits[:, :top].astype(np.int64) - ord("0")
    inside = _STEPS[:top] < lengths[:, None]
    if top > 18 or not lengths.all() or ((values < 0) | (values > 9))[inside].any():
        return tokens.astype(np.int64)
    total = np.zeros(len(tokens), dtype=np.int64)
    for column in range(top):
        grows = inside[:, column]
        total[grows] = total[grows] * 10 + values[grows, column]
    return total


def _vectorised(data: bytes, names: Collection[str]) -> Columns | None:
    """The columns' tokens (NUL-padded, ``S24``) and their lengths, of a block whose every
    line is the writer's, found with array operations only; None when any line is not (then
    lines are matched one by one). A line qualifies when each column's key sits where the
    field order puts it (the k-th ``":`` of the line, counted from the end after the nested
    objects) and its value ends within WIDTH bytes; anything else (a torn line, a string
    holding a key, a foreign line) fails that check."""
    if not data.endswith(b"\n"):
        return None
    buf = np.frombuffer(data + bytes(8 * _WORDS + 8), dtype=np.uint8)
    marks = np.flatnonzero((buf == ord(":")) | (buf == 10))  # one pass finds both
    newline = buf[marks] == 10
    ends, colons = marks[newline], marks[~newline]
    colons = colons[buf[colons - 1] == ord('"')]
    # Colons before each line's end (both sorted: one search per line, not per colon).
    before_end = np.searchsorted(colons, ends)
    first = np.r_[0, before_end[:-1]]  # the line's first colon
    counts = before_end - first
    words = _words(buf)
    for shape in _SHAPES:
        if not (counts < len(shape)).any():
            tokens = _located(words, colons, first, counts, names, shape)
            if tokens is not None:
                return _defaults(tokens, names, shape, len(ends))
    return None


def _located(
    words: np.ndarray,
    colons: np.ndarray,
    first: np.ndarray,
    counts: np.ndarray,
    names: Collection[str],
    shape: list[str],
) -> Columns | None:
    """:func:`_vectorised`'s tokens where every line has the fields ``shape``; None if not."""
    tokens = {}
    for index, name in enumerate(shape):
        if name not in names:
            continue
        at = first + index if index <= _NESTED else first + counts - (len(shape) - index)
        colon = colons[at]
        if not _has_key(words, colon, f'"{name}"'.encode()):
            return None
        window = np.stack([words[colon + 1 + 8 * k] for k in range(_WORDS)], axis=1)
        window = window.view(np.uint8)[:, : WIDTH + 1]
        stops = (window == ord(",")) | (window == ord("}"))
        if not stops.any(axis=1).all():
            return None
        lengths = stops.argmax(axis=1)
        token = window[:, :WIDTH] * (lengths[:, None] > _STEPS)
        tokens[name] = (np.ascontiguousarray(token).view(f"S{WIDTH}").ravel(), lengths)
    return tokens


def _defaults(tokens: Columns, names: Collection[str], shape: list[str], lines: int) -> Columns:
    """The appended columns an older writer's lines lack, as their default's tokens."""
    for name in APPENDED:
        if name in names and name not in shape:
            token = _DEFAULT_TOKENS[name]
            tokens[name] = (np.full(lines, token, dtype=f"S{WIDTH}"), np.full(lines, len(token)))
    return tokens


# A qualifying line holds a `":` per field and its newline: an upper bound on a block's lines.
_MIN_LINE = 2 * len(_SHAPES[-1]) + 1
_KINDS = {"int": (0, np.int64), "float": (1, np.float64), "bool": (2, np.bool_)}


def _kind(name: str) -> str:
    return "int" if name in INTEGERS else "bool" if name in BOOLEANS else "float"


def compiled(data: bytes, names: Collection[str]) -> Columns | None:
    """The columns' (values, present) of a block whose every line qualifies as in
    :func:`_vectorised`, located and converted by the C scanner (``_scan.c``: one pass, no
    GIL); None where it is not built or any line does not qualify (the numpy path decides)."""
    if _scan is None or not data.endswith(b"\n"):
        return None
    capacity = len(data) // _MIN_LINE + 1
    for shape in _SHAPES:  # an older writer's block is refused at its first line
        specs, arrays = [], {}
        for index, name in enumerate(shape):
            if name in names:
                code, dtype = _KINDS[_kind(name)]
                values = np.empty(capacity, dtype=dtype)
                present = np.empty(capacity if code == 1 else 0, dtype=np.bool_)
                specs.append((index, f'"{name}"'.encode(), code, values, present))
                arrays[name] = (values, present)
        lines = _scan.scan(data, len(shape), _NESTED, tuple(specs), capacity)
        if lines >= 0:
            break
    else:
        return None
    columns = {
        name: (
            values[:lines].copy(),
            present[:lines].copy() if len(present) else np.ones(lines, dtype=bool),
        )
        for name, (values, present) in arrays.items()
    }
    for name in APPENDED:  # an older writer's lines: the defaults
        if name in names and name not in columns:
            value = _DEFAULTS[name]
            columns[name] = (
                np.full(lines, np.nan if value is None else value),
                np.full(lines, value is not None),
            )
    return columns


def parse_block(
    data: bytes, offset: int, names: Collection[str] = COLUMNS, sources: bool = False
) -> Block:
    """Parse whole lines ``data`` (read from byte ``offset``) into the columns ``names`` (some
    of :data:`COLUMNS`; the iteration and attempt always), in line order; ``sources``: also
    the per-source fields (:attr:`Block.sources`)."""
    block = Block({}, {})
    names = {"iteration", "attempt", *names}
    aligned = _columns(block, data, offset, names)
    if sources:
        it, attempt = block.values["iteration"], block.values["attempt"]
        block.sources = parse_sources(data, it, attempt, aligned)
    return block


def _columns(block: Block, data: bytes, offset: int, names: set[str]) -> bool:
    """:func:`parse_block`'s columns: by the C scanner, else the numpy path, else line by
    line. Whether each line of ``data`` is a row, in order (no line by line)."""
    columns = compiled(data, names)
    if columns is not None:
        for name in [n for n in _ORDER if n in names]:
            block.values[name], block.present[name] = columns[name]
        return True
    found = _vectorised(data, names)
    aligned = found is not None
    if found is None:
        rows = [_filled(r) for r in _PATTERN.findall(data)]
        aligned = len(rows) == data.count(b"\n") + (not data.endswith(b"\n") and bool(data))
        if not aligned:
            rows = _slow(data, offset, block)  # some line is not the writer's shape
        columns = list(zip(*rows)) if rows else [() for _ in _ORDER]
        found = {
            name: (np.array(column, dtype=np.bytes_) if column else np.array([], dtype="S1"), None)
            for name, column in zip(_ORDER, columns)
        }
    for name in [n for n in _ORDER if n in names]:
        tokens, lengths = found[name]
        if name in INTEGERS:
            block.values[name] = (
                tokens.astype(np.int64) if lengths is None else _integers(tokens, lengths)
            )
            block.present[name] = np.ones(len(tokens), dtype=bool)
        elif name in BOOLEANS:
            block.values[name] = tokens == b"true"
            block.present[name] = np.ones(len(tokens), dtype=bool)
        else:
            block.values[name], block.present[name] = floats(name, tokens)
    return aligned


def replay_records(block: Block, rows: np.ndarray) -> list[SignalRecord]:
    """Records of ``rows`` with the fields a detector reads (a replay's input: the columns and
    the per-source fields when the block has them); the others
    (job id, wall time, bucket norms, ...) are not read by it and are left empty."""
    lists = {}
    for name in _ORDER:
        values = block.values[name][rows].tolist()
        if name not in INTEGERS and name not in BOOLEANS:
            present = block.present[name][rows]
            if not present.all():
                values = [v if p else None for v, p in zip(values, present.tolist())]
            if name == "max_loss_dp_rank":
                values = [None if v is None else int(v) for v in values]
        lists[name] = values
    records = [
        SignalRecord(job_id="", wall_time=0.0, skipped_samples=0, **dict(zip(_ORDER, row)))
        for row in zip(*(lists[n] for n in _ORDER))
    ]
    if block.sources is not None:  # the detector's per-source baselines read them
        for row, record in zip(rows.tolist(), records):
            record.lm_loss_by_dataset, record.tokens_by_dataset = block.sources.dicts(row)
    return records
