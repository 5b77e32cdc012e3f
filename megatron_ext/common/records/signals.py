"""The per-step signals log (docs/signals.md): one JSON line per iteration, append-only.

A restart appends under the log's last ``attempt`` + 1 and readers take the latest attempt per
iteration; a write failure leaves a gap line (:mod:`~megatron_ext.common.gap_log`). Non-finite
values are ``null``, named in a ``non_finite`` object. Readers: :func:`read_signals` (whole),
:class:`SignalsLog` (seeks by bisection), :func:`parse_block` (columns, via pyarrow).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

from megatron_ext.common.errors import Refusal
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.gap_log import GAP_KEY, GapLog, is_gap
from megatron_ext.common.io import from_json, read_jsonl


@dataclass
class SignalRecord:
    """What one training iteration looked like (``None``: not measured in this run)."""

    iteration: int  # 1-indexed, as Megatron logs it
    attempt: int  # 1 for the first launch writing this log, +1 per restart
    job_id: str
    wall_time: float  # seconds since the epoch when the iteration was logged
    consumed_samples: int
    skipped_samples: int
    lm_loss: float | None
    z_loss: float | None = None
    max_local_loss: float | None = None  # the worst DP rank's token-averaged loss
    max_loss_dp_rank: int | None = None
    grad_norm: float | None = None  # pre-clip, as Megatron computes it
    bucket_grad_norms: dict[str, float] = field(default_factory=dict)
    # Per blend member: its samples' token-weighted pure-CE loss and loss tokens (docs/signals.md).
    lm_loss_by_dataset: dict[str, float] = field(default_factory=dict)
    tokens_by_dataset: dict[str, int] = field(default_factory=dict)
    params_norm: float | None = None
    update_ratio: float | None = None  # ||Δθ|| / ||θ||
    lr: float | None = None
    loss_scale: float | None = None
    num_zeros: float | None = None
    max_attention_logit: float | None = None
    skipped_iter: bool = False  # the optimizer skipped the update (inf/NaN grads)
    nan_iter: bool = False
    # Appended later (older logs lack them): --log-output-z, --spike-skip-update.
    log_z: float | None = None
    update_skipped: bool = False
    # --log-layer-norms: per layer entry, the gradient, weight and update L2 norms.
    layer_grad_norms: dict[str, float] = field(default_factory=dict)
    layer_param_norms: dict[str, float] = field(default_factory=dict)
    layer_update_norms: dict[str, float] = field(default_factory=dict)
    # Stragglers: the step's slowest rank by busy time against its DP peers' median (seconds);
    # the rank and node named once over --straggler-factor x median for --straggler-steps.
    slowest_rank: int | None = None
    slowest_step_time: float | None = None
    median_step_time: float | None = None
    straggler_rank: int | None = None
    straggler_node: str | None = None
    # --recovery-iters, after a rollback's resume: update number, lr factor, clip (docs/signals.md).
    recovery: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The line's object: non-finite floats as null, named under :data:`NON_FINITE`."""
        line, marks = _without_non_finite(asdict(self))
        if marks:
            line[NON_FINITE] = marks
        return line


NON_FINITE = "non_finite"
_FIELDS = {f.name for f in fields(SignalRecord)}


def _without_non_finite(value: Any) -> tuple[Any, Any]:
    """``value`` with non-finite floats as None, and what they were (None: there were none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, str(value)
    if not isinstance(value, dict):
        return value, None
    clean, marks = {}, {}
    for key, item in value.items():
        clean[key], mark = _without_non_finite(item)
        if mark is not None:
            marks[key] = mark
    return clean, marks or None


def record_of(raw: Any) -> SignalRecord:
    """A parsed line as a record; TypeError names what makes it foreign."""
    if not isinstance(raw, dict):
        raise TypeError("not a JSON object")
    raw = dict(raw)
    marks = raw.pop(NON_FINITE, None)
    if set(raw) - _FIELDS:
        raise TypeError(f"unknown fields {sorted(set(raw) - _FIELDS)}")
    values = from_json(raw)  # an older writer's "nan"
    if not isinstance(marks, dict | None) or set(marks or {}) - _FIELDS:
        raise TypeError(f"{NON_FINITE} is not an object of fields: {marks}")
    for name, mark in from_json(marks or {}).items():
        nested = isinstance(mark, dict) and isinstance(values.get(name), dict)
        values[name] = {**values[name], **mark} if nested else mark
    return SignalRecord(**values)


def read_signals(
    path: str | os.PathLike[str], iterations: tuple[int, int] | None = None
) -> list[SignalRecord]:
    """Every record of every attempt, in file order (``iterations=(first, last)``: of that
    range). Torn lines and lines that are not signals records are skipped with a warning
    naming their line."""
    content = read_jsonl(path)
    records, foreign = [], []
    for number, raw in zip(content.line_numbers, content.records):
        if is_gap(raw):
            continue  # read_gaps
        try:
            records.append(record_of(raw))
        except TypeError as exc:
            foreign.append(f"line {number} ({exc})")
    if iterations is not None:
        first, last = iterations
        records = [
            r for r in records if not isinstance(r.iteration, int) or first <= r.iteration <= last
        ]
    if foreign:
        warnings.warn(
            f"{path}: skipped {len(foreign)} line(s) that are not signals records: "
            f"{'; '.join(foreign[:5])}",
            stacklevel=2,
        )
    return records


def latest_per_iteration(records: list[SignalRecord]) -> list[SignalRecord]:
    """One record per iteration: the one from the latest attempt (a rollback's replay wins)."""
    best: dict[int, SignalRecord] = {}
    for record in records:
        current = best.get(record.iteration)
        if current is None or record.attempt >= current.attempt:
            best[record.iteration] = record
    return [best[i] for i in sorted(best)]


# -- columns: a block of lines read by pyarrow -------------------------------------------------

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
LAYERS = ("layer_grad_norms", "layer_param_norms", "layer_update_norms")  # name -> norm
STRAGGLERS = (
    "slowest_rank",
    "slowest_step_time",
    "median_step_time",
    "straggler_rank",
    "straggler_node",
)
BOOLEANS = {"skipped_iter", "update_skipped"}
APPENDED = ("log_z", "update_skipped", *LAYERS, *STRAGGLERS)  # older lines lack them
_REQUIRED = ("iteration", "attempt", "job_id", "wall_time", "consumed_samples", "skipped_samples")
_ORDER = [f.name for f in fields(SignalRecord) if f.name in COLUMNS]
_SOURCES = ("lm_loss_by_dataset", "tokens_by_dataset")
_SMALL = 32  # lines: a piece pyarrow refuses is read line by line from this size down


@dataclass
class MemberColumns:
    """An object field's members as (rows, names) arrays, one per later field; :attr:`FILLS`:
    each array's value where a row does not name the member."""

    names: list[str]  # in order of first appearance
    FILLS: ClassVar[tuple] = ()

    def arrays(self) -> list[np.ndarray]:
        return [getattr(self, f.name) for f in fields(self)[1:]]

    def take(self, rows: np.ndarray) -> Self:
        return type(self)(self.names, *(a[rows] for a in self.arrays()))

    @classmethod
    def concat(cls, parts: list[tuple[Self | None, int]]) -> Self:
        """Blocks' columns one after the other (each with its row count; None: no member),
        over the union of their names."""
        names = list(dict.fromkeys(n for c, _ in parts if c is not None for n in c.names))
        out = [np.full((sum(n for _, n in parts), len(names)), fill) for fill in cls.FILLS]
        row = 0
        for columns, count in parts:
            if columns is not None:
                index = [names.index(n) for n in columns.names]
                for array, values in zip(out, columns.arrays()):
                    array[row : row + count, index] = values
            row += count
        return cls(names, *out)


@dataclass
class SourceColumns(MemberColumns):
    """Each member's loss and tokens, a row per record (``has_*``: False where a record does
    not name the member, or names it with null)."""

    losses: np.ndarray  # (rows, members) float64
    has_loss: np.ndarray  # (rows, members) bool
    tokens: np.ndarray  # (rows, members) int64
    has_tokens: np.ndarray  # (rows, members) bool
    FILLS: ClassVar[tuple] = (math.nan, False, 0, False)

    def dicts(self, row: int) -> tuple[dict[str, float], dict[str, int]]:
        """Row ``row`` as a record holds it: (lm_loss_by_dataset, tokens_by_dataset)."""
        losses, has_loss = self.losses[row].tolist(), self.has_loss[row].tolist()
        tokens, has_tokens = self.tokens[row].tolist(), self.has_tokens[row].tolist()
        return (
            {n: v for n, v, h in zip(self.names, losses, has_loss) if h},
            {n: v for n, v, h in zip(self.names, tokens, has_tokens) if h},
        )


@dataclass
class DictColumns(MemberColumns):
    """A float-valued object field (per-layer norms): each name's value per row (``present``:
    False where a record does not name it, or names it with null)."""

    values: np.ndarray  # (rows, names) float64
    present: np.ndarray  # (rows, names) bool
    FILLS: ClassVar[tuple] = (math.nan, False)


@dataclass
class Block:
    """One block's records as columns (``present``: False where a field was null), the gap
    lines (with the row they precede) and the lines that were not records."""

    values: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    gaps: list[tuple[int, dict]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    slow_lines: int = 0  # lines not in the writer's format (read by json.loads)
    sources: SourceColumns | None = None  # parse_block(sources=True); None: no row has any
    dicts: dict[str, DictColumns] = field(default_factory=dict)  # the LAYERS fields asked for

    def __len__(self) -> int:
        return len(self.values["iteration"])

    def take(self, rows: np.ndarray) -> Block:
        return Block(
            {k: v[rows] for k, v in self.values.items()},
            {k: v[rows] for k, v in self.present.items()},
            sources=self.sources.take(rows) if self.sources is not None else None,
            dicts={k: v.take(rows) for k, v in self.dicts.items()},
        )

    @staticmethod
    def concat(blocks: list[Block]) -> Block:
        """Blocks one after the other (their gaps' rows moved with them)."""
        if len(blocks) == 1:
            return blocks[0]
        out = Block(
            {k: np.concatenate([b.values[k] for b in blocks]) for k in blocks[0].values},
            {k: np.concatenate([b.present[k] for b in blocks]) for k in blocks[0].present},
        )
        if any(b.sources is not None for b in blocks):
            out.sources = SourceColumns.concat([(b.sources, len(b)) for b in blocks])
        for name in {n for b in blocks for n in b.dicts}:
            out.dicts[name] = DictColumns.concat([(b.dicts.get(name), len(b)) for b in blocks])
        rows = 0
        for block in blocks:
            out.gaps += [(row + rows, gap) for row, gap in block.gaps]
            out.problems += block.problems
            out.slow_lines += block.slow_lines
            rows += len(block)
        return out


@functools.cache
def _arrow_types() -> tuple[Any, Any]:
    import pyarrow as pa  # not at module level: training writes the log without it
    import pyarrow.json as pa_json

    kinds = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    schema = pa.schema(
        [
            (f.name, kinds[str(f.type).split(" ")[0]])
            for f in fields(SignalRecord)
            if not str(f.type).startswith("dict")
        ]
    )
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")
    return pa_json, options


class _NotArrow(Exception):
    """An internal control-flow signal: pyarrow cannot read this piece as the writer's lines,
    so it is read line by line."""


def _arrow_block(data: bytes, names: Collection[str], sources: bool) -> Block:
    """A piece of the writer's lines, read by pyarrow; :class:`_NotArrow` otherwise."""
    import pyarrow as pa

    pa_json, options = _arrow_types()
    try:
        table = pa_json.read_json(
            io.BytesIO(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=options,
        ).combine_chunks()
    except (pa.ArrowException, ValueError) as exc:
        raise _NotArrow from exc
    unknown = set(table.column_names) - _FIELDS - {NON_FINITE}
    rows = table.num_rows
    if unknown or any(table[n].null_count for n in _REQUIRED):
        raise _NotArrow(f"unknown fields {sorted(unknown)}, or a required one missing or null")
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    if rows != lines and rows != sum(1 for line in data.splitlines() if line.strip()):
        raise _NotArrow  # two objects on one line, or one over several
    block = Block({}, {})
    for name in _ORDER:
        if name not in names:
            continue
        column = table[name]
        block.present[name] = column.is_valid().to_numpy(zero_copy_only=False)
        if name in INTEGERS:
            block.values[name] = column.to_numpy()
        elif name in BOOLEANS:
            block.values[name] = column.fill_null(False).to_numpy(zero_copy_only=False)
            block.present[name] = np.ones(rows, dtype=bool)
        else:
            filled = column.cast(pa.float64(), safe=False).fill_null(math.nan)
            block.values[name] = filled.to_numpy(zero_copy_only=False)
    if sources:
        kinds = {_SOURCES[0]: pa.float64(), _SOURCES[1]: pa.int64()}
        columns = _arrow_columns(table, SourceColumns, rows, kinds)
        block.sources = columns if columns.names else None
    block.dicts = {
        n: _arrow_columns(table, DictColumns, rows, {n: pa.float64()}) for n in LAYERS if n in names
    }
    if NON_FINITE in table.column_names:
        _mark_non_finite(block, table[NON_FINITE])
    return block


def _struct_columns(table: Any, name: str, kind: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A flat object field's members as (values, present) arrays of type ``kind``."""
    import pyarrow as pa

    if name not in table.column_names or pa.types.is_null(table[name].type):
        return {}
    column = table[name]
    if not pa.types.is_struct(column.type):
        raise _NotArrow
    out = {}
    for member, child in zip([f.name for f in column.type], column.flatten()):
        try:
            child = child.cast(kind)
        except (pa.ArrowException, ValueError) as exc:
            raise _NotArrow from exc
        values = child.fill_null(math.nan if kind == pa.float64() else 0)
        present = child.is_valid().to_numpy(zero_copy_only=False)
        out[member] = (values.to_numpy(zero_copy_only=False), present)
    return out


def _arrow_columns[C: MemberColumns](
    table: Any, cls: type[C], rows: int, kinds: dict[str, Any]
) -> C:
    """Object fields (name -> pyarrow type of its members) as ``cls``'s columns, a (values,
    present) pair per field, over the union of their members."""
    fields_members = [_struct_columns(table, name, kind) for name, kind in kinds.items()]
    names = list(dict.fromkeys(m for members in fields_members for m in members))
    out = [np.full((rows, len(names)), fill) for fill in cls.FILLS]
    for values, present, members in zip(out[::2], out[1::2], fields_members):
        for k, name in enumerate(names):
            if name in members:
                values[:, k], present[:, k] = members[name]
    return cls(names, *out)


def _mark_non_finite(block: Block, marks: Any) -> None:
    """Put the values the writer named in ``non_finite`` back where it wrote null; anything
    the line-by-line path would read otherwise raises :class:`_NotArrow`."""
    rows = np.flatnonzero(marks.is_valid().to_numpy(zero_copy_only=False))
    for arrays in (block.values, block.present):  # pyarrow's buffers are read-only
        arrays.update({k: v.copy() for k, v in arrays.items() if not v.flags.writeable})
    for row, mark in zip(rows.tolist(), marks.take(rows).to_pylist()):
        for name, value in from_json(mark).items():
            if name not in _FIELDS or name == _SOURCES[1]:
                raise _NotArrow
            if value is None:
                continue
            if name in block.values:
                if not isinstance(value, float):
                    raise _NotArrow
                block.values[name][row], block.present[name][row] = value, True
            elif name == _SOURCES[0] and block.sources is not None:
                sources = block.sources
                _mark(sources.names, sources.losses, sources.has_loss, row, value)
            elif name in block.dicts:
                columns = block.dicts[name]
                _mark(columns.names, columns.values, columns.present, row, value)


def _mark(names: list[str], values: np.ndarray, present: np.ndarray, row: int, marks: Any) -> None:
    """An object field's non-finite members into its columns' row ``row``."""
    if not isinstance(marks, dict):
        raise _NotArrow
    for member, value in marks.items():
        if value is not None:
            if not isinstance(value, float) or member not in names:
                raise _NotArrow
            k = names.index(member)
            values[row, k], present[row, k] = value, True


def _json_block(data: bytes, offset: int, names: Collection[str], sources: bool) -> Block:
    """A piece read line by line with ``json.loads``, as a full read reads it: torn and
    foreign lines reported by byte offset, gap lines kept with the row they precede."""
    records: list[SignalRecord] = []
    gaps, problems, slow = [], [], 0
    start = 0
    for line in data.split(b"\n"):
        where, start = offset + start, start + len(line) + 1
        if not line.strip():
            continue
        raw, record = _record_at(line, where, problems)
        if record is None:
            if raw is not None:
                gaps.append((len(records), raw[GAP_KEY]))
            slow += 1
            continue
        records.append(record)
        rest = {k: v for k, v in raw.items() if k != NON_FINITE}
        slow += from_json(rest) != rest  # an older writer's quoted non-finite
    # The records in the writer's format: pyarrow reads them, or the values are not a
    # record's (a string or a null where a number must be).
    lines = "".join(json.dumps(r.as_json(), separators=(",", ":")) + "\n" for r in records)
    try:  # no record: an empty line, which pyarrow reads as no rows
        block = _arrow_block(lines.encode() or b"\n", names, sources)
    except (_NotArrow, TypeError, ValueError) as exc:
        raise ValueError(
            f"a signals record at bytes {offset}-{offset + len(data)} holds a value of the "
            f"wrong type for its field ({exc.__cause__ or exc})"
        ) from None
    block.gaps, block.problems, block.slow_lines = gaps, problems, slow
    return block


def _pieces(data: bytes, offset: int, names: Collection[str], sources: bool) -> Iterator[Block]:
    """pyarrow on the whole piece; where it refuses, on each half, down to :data:`_SMALL`
    lines, which are read line by line (so one torn line costs a few more reads, not a
    line-by-line block)."""
    try:
        yield _arrow_block(data, names, sources)
        return
    except _NotArrow:
        pass
    cut = data.find(b"\n", len(data) // 2) + 1
    if data.count(b"\n") <= _SMALL or cut in (0, len(data)):
        yield _json_block(data, offset, names, sources)
        return
    yield from _pieces(data[:cut], offset, names, sources)
    yield from _pieces(data[cut:], offset + cut, names, sources)


def parse_block(
    data: bytes, offset: int, names: Collection[str] = COLUMNS, sources: bool = False
) -> Block:
    """Whole lines ``data`` (read from byte ``offset``) as the columns ``names`` (some of
    :data:`COLUMNS`; the iteration and attempt always), in line order; ``sources``: also the
    per-source fields (:attr:`Block.sources`)."""
    names = {"iteration", "attempt", *names}
    return Block.concat(list(_pieces(data, offset, names, sources)))


def replay_records(block: Block, rows: np.ndarray) -> list[SignalRecord]:
    """Records of ``rows`` with the fields a detector reads (the columns and the per-source
    fields); the others (job id, wall time, bucket norms, ...) are left empty."""
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


# -- seeking: bisection by (attempt, iteration) ------------------------------------------------

KEY = re.compile(rb'\{\s*"iteration"\s*:\s*(\d+)\s*,\s*"attempt"\s*:\s*(\d+)\s*,')
BLOCK = 1 << 20  # bytes read per step of a sequential read

type Key = tuple[int, int]  # (attempt, iteration): the order of the file


class OrderError(Refusal, ValueError):
    """The log is not in the order its writer appends; a seek cannot trust its positions."""


@dataclass(frozen=True)
class Segment:
    """One attempt's stretch of the file: its lines start in ``[start, end)``."""

    attempt: int
    first_iteration: int
    last_iteration: int
    start: int
    end: int


class KeyedLines:
    """A JSONL file read by position: the lines from any offset, and bisection over the lines
    :meth:`key` recognises (torn and foreign lines have no key and are stepped over).
    ``bytes_read``: what reads cost."""

    probe = 2048  # bytes read per bisection probe: a line or two

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self.bytes_read = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self._fd)

    @staticmethod
    def key(line: bytes) -> Key | None:
        """A line's sort key (here a signals line's), or None for a torn or foreign line."""
        match = KEY.match(line)
        return (int(match[2]), int(match[1])) if match else None

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        self.bytes_read += len(data)
        return data

    def lines(self, offset: int, limit: int, block: int = 0) -> Iterator[tuple[int, bytes]]:
        """(start, line without its newline) of each line starting in ``[offset, limit)``, in
        reads of ``block`` bytes (default :attr:`probe`) that double up to :data:`BLOCK`."""
        pos, buffer, base, block = offset, b"", 0, block or self.probe
        if 0 < offset < limit:  # the line holding offset - 1 ends at the next newline
            scan = offset - 1
            while True:
                data = self.read(scan, block)
                if not data:
                    return
                newline = data.find(b"\n")
                if newline >= 0:
                    pos = base = scan + newline + 1
                    buffer = data[newline + 1 :]
                    break
                scan += len(data)
        while pos < limit:
            newline = buffer.find(b"\n", pos - base)
            if newline < 0:
                more = self.read(base + len(buffer), block)
                if not more:  # a last line without a newline: a torn tail
                    if pos < base + len(buffer):
                        yield pos, buffer[pos - base :]
                    return
                buffer, base = buffer[pos - base :] + more, pos
                block = min(block * 2, BLOCK)
                continue
            yield pos, buffer[pos - base : newline]
            pos = base + newline + 1

    def _first_keyed(self, offset: int, limit: int) -> tuple[Key, int, int] | None:
        """The first keyed line starting in ``[offset, limit)``: key, start, next start."""
        for start, line in self.lines(offset, limit):
            key = self.key(line)
            if key is not None:
                return key, start, start + len(line) + 1
        return None

    def _last_keyed(self, limit: int, floor: int = 0) -> tuple[Key, int] | None:
        """The last keyed line starting in ``[floor, limit)``: key, start."""
        low, span = limit, 4 * self.probe
        while low > floor:
            low, span = max(floor, low - span), span * 2
            found = None
            for start, line in self.lines(low, limit, limit - low + 1):
                key = self.key(line)
                if key is not None:
                    found = key, start
            if found is not None:
                return found
        return None

    def bisect(self, target: Key, low: int, high: int) -> int:
        """The start of the first keyed line in ``[low, high)`` with key >= ``target``
        (``high`` if none)."""
        best = high
        while high - low > self.probe:
            middle = (low + high) // 2
            found = self._first_keyed(middle, high)
            if found is None:
                high = middle
            elif found[0] >= target:
                best, high = found[1], middle
            else:
                low = found[2]
        for start, line in self.lines(low, high):  # a probe's worth: read on, line by line
            key = self.key(line)
            if key is not None and key >= target:
                return start
        return best


class SignalsLog(KeyedLines):
    """An open signals log, read by position. Each attempt is one contiguous segment (the
    writer's order), found from the end by bisection; torn and foreign lines have no
    ``{"iteration":N,"attempt":M,`` key and are stepped over. A log that breaks the order
    raises :class:`OrderError`. ``bytes_read``, ``lines_parsed``: what reads cost."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.lines_parsed = 0
        self._segments: list[Segment] | None = None

    def segments(self) -> list[Segment]:
        """Every attempt's segment, in file order, found from the end of the file."""
        if self._segments is not None:
            return self._segments
        found: list[Segment] = []
        limit = self.size
        while limit > 0 and (last := self._last_keyed(limit)) is not None:
            (attempt, last_iteration), last_start = last
            if found and attempt >= found[-1].attempt:
                raise OrderError(
                    f"{self.path}: attempt {attempt} at byte {last_start} comes before attempt "
                    f"{found[-1].attempt}'s lines, not after them"
                )
            start = self.bisect((attempt, -1), 0, last_start + 1)
            first = self._first_keyed(start, last_start + 1)
            assert first is not None  # the bisection stops on a keyed line
            if first[0][0] != attempt or first[0][1] > last_iteration:
                raise OrderError(
                    f"{self.path}: the lines of attempt {attempt} are not in one increasing run"
                )
            found.append(Segment(attempt, first[0][1], last_iteration, start, limit))
            limit = start
        if found:  # the first segment starts at the top: lines before its first record too
            found[-1] = replace(found[-1], start=0)
        self._segments = found[::-1]
        return self._segments

    def records(
        self, segment: Segment, first: int, last: int, problems: list[str]
    ) -> list[SignalRecord]:
        """The segment's records of iterations ``first..last`` (the later of duplicates);
        torn and foreign lines among them go to ``problems``."""
        out: list[SignalRecord] = []
        previous = (segment.attempt, first - 1)
        start = self.bisect((segment.attempt, first), segment.start, segment.end)
        for offset, line in self.lines(start, segment.end):  # blocks grow to BLOCK
            key = self.key(line)
            if key is not None:
                if key[0] != segment.attempt or key < previous:
                    raise OrderError(
                        f"{self.path}: byte {offset}: attempt {key[0]} iteration {key[1]} after "
                        f"attempt {previous[0]} iteration {previous[1]}"
                    )
                if key[1] > last:
                    break
                previous = key
            elif not line.strip():
                continue
            self.lines_parsed += 1
            record = _record_at(line, offset, problems)[1]
            if record is None:
                continue
            if out and out[-1].iteration == record.iteration:
                out.pop()
            out.append(record)
        return out

    def window(self, first: int, last: int) -> list[SignalRecord]:
        """Every record of iterations ``first..last``, all attempts, in file order."""
        problems: list[str] = []
        out = []
        for segment in self.segments():
            if segment.first_iteration <= last and segment.last_iteration >= first:
                out += self.records(segment, first, last, problems)
        report(self.path, problems)
        return out

    def timeline(
        self, attempt: int = sys.maxsize, before: int = sys.maxsize
    ) -> list[tuple[Segment, int]]:
        """What an attempt starting at iteration ``before`` continued from (default: what the run
        finally trained): each earlier attempt's segment and its last iteration before a later
        attempt restarted, in file order."""
        pieces = []
        bound = before  # the first iteration a later attempt restarted at
        for segment in reversed([s for s in self.segments() if s.attempt < attempt]):
            top = min(bound - 1, segment.last_iteration)
            if top >= segment.first_iteration:
                pieces.append((segment, top))
            bound = min(bound, segment.first_iteration)
        return pieces[::-1]

    def history(self, attempt: int, before: int, count: int) -> list[SignalRecord]:
        """The last ``count`` iterations (oldest first) of :meth:`timeline`: for each iteration,
        the latest earlier attempt that logged it."""
        out: list[SignalRecord] = []
        problems: list[str] = []
        for segment, top in reversed(self.timeline(attempt, before)):
            span = count - len(out)
            while span > 0:
                low = max(segment.first_iteration, top - span + 1)
                got = self.records(segment, low, top, problems)
                if len(got) >= count - len(out) or low == segment.first_iteration:
                    out = got[-(count - len(out)) :] + out
                    break
                span *= 2  # holes in the stretch: look further back
            if len(out) >= count:
                break
        report(self.path, problems)
        return out


def _record_at(line: bytes, offset: int, problems: list[str]) -> tuple[Any, SignalRecord | None]:
    """One line's object and record: (the gap line, None) for a gap line; (None, None) and a
    problem named by byte for a torn or foreign line."""
    try:
        raw = json.loads(line)
    except ValueError:
        problems.append(f"byte {offset} (torn)")
        return None, None
    if isinstance(raw, dict) and is_gap(raw):
        return raw, None  # a gap line names records that are not there
    try:
        return raw, record_of(raw)
    except TypeError as exc:
        problems.append(f"byte {offset} ({exc})")
        return None, None


def report(path: Path, problems: list[str]) -> None:
    """One warning for the torn and foreign lines a read stepped over."""
    if problems:
        torn = sum(p.endswith("(torn)") for p in problems)
        warnings.warn(
            f"{path}: skipped {len(problems)} line(s) ({torn} torn, left by a killed writer; "
            f"{len(problems) - torn} not signals records): {'; '.join(problems[:5])}",
            stacklevel=3,
        )


def read_window(path: str | os.PathLike[str], first: int, last: int) -> list[SignalRecord]:
    """:meth:`SignalsLog.window`, or a full scan (warned) when the log is out of order."""
    try:
        with SignalsLog(path) as log:
            return log.window(first, last)
    except OrderError as exc:
        warnings.warn(f"{exc}; reading the whole log instead", stacklevel=2)
        return read_signals(path, iterations=(first, last))


def history_before(path: str | os.PathLike[str], before: int, count: int) -> list[SignalRecord]:
    """The last ``count`` iterations (oldest first) that a run whose first iteration is
    ``before`` continues from, or a full scan (warned) when the log is out of order."""
    if not Path(path).exists():
        return []
    try:
        with SignalsLog(path) as log:
            return log.history(sys.maxsize, before, count)
    except OrderError as exc:
        warnings.warn(f"{exc}; reading the whole log instead", stacklevel=2)
        earlier = [r for r in latest_per_iteration(read_signals(path)) if r.iteration < before]
        return earlier[-count:] if count else []


# -- the writer --------------------------------------------------------------------------------


def next_attempt(path: Path) -> int:
    """One more than every attempt in the log at ``path`` (1 for no log), found by seeking
    (a real log is hundreds of MiB). A log out of the writer's order is read whole, with a
    warning; torn or foreign lines after the last record are warned about by byte offset."""
    if not path.exists():
        return 1
    try:
        with SignalsLog(path) as log:
            if not log.segments():
                return 1
            last = log.segments()[-1]  # the latest attempt: attempts increase down the file
            problems: list[str] = []  # a line appended after the last record is named
            log.records(last, last.last_iteration, last.last_iteration, problems)
            report(path, problems)
            return last.attempt + 1
    except OrderError as exc:
        warnings.warn(f"{exc}; reading the whole log for its attempts", stacklevel=2)
        return max((record.attempt for record in read_signals(path)), default=0) + 1


class SignalsWriter:
    """Appends :class:`SignalRecord` lines to ``DIR/signals.jsonl`` under a fresh attempt."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory) / SIGNALS_FILE
        self.attempt = next_attempt(path)
        self._out = GapLog(path, "signals log")
        self.path = path

    def write(self, record: SignalRecord) -> bool:
        """Append one record; False when the write failed (warned, kept as a gap)."""
        record.attempt = self.attempt
        return self._out.append(record.as_json(), record.iteration)
