"""One pass over the signals log into the lines ``megatron-ext plot`` draws, in bounded memory.

The log is read once, in column blocks; each line (an attempt, or what the run finally
trained) keeps per panel an :class:`Envelope`, M4 aggregation per pixel column (the same
pixels as every point), with non-finite values as breaks and its spike marks from the ledger
or a detector replay.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megatron_ext.common.io import from_json
from megatron_ext.common.records.ledger import Ledger
from megatron_ext.common.records.signals import (
    BLOCK,
    LAYERS,
    Block,
    OrderError,
    Segment,
    SignalsLog,
    SourceColumns,
    parse_block,
    report,
)
from megatron_ext.common.records.signals import COLUMNS as FIELDS
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.detector import SpikeDetector, SpikeEvent, primed
from megatron_ext.spikes.fast_replay import FastReplay

COLUMNS = 2400  # per x range: twice the figure's width in pixels


class Envelope:
    """One line's columns; feed :meth:`add` points in increasing iteration order."""

    def __init__(self, start: int, width: int) -> None:
        self.start, self.width = start, width
        self.recorded = 0  # points with a value (finite or not)
        self._xs: list[np.ndarray] = []  # (columns, 4): first, min, max, last
        self._ys: list[np.ndarray] = []
        self._bad: list[np.ndarray] = []  # first non-finite iteration per column

    def add(self, x: np.ndarray, y: np.ndarray, present: np.ndarray) -> None:
        """Points ``x`` (iterations, increasing), ``y``; ``present``: False where not recorded."""
        x, y = x[present], y[present]
        self.recorded += len(x)
        finite = np.isfinite(y)
        if not finite.all():
            self._bad.append(self.firsts(x[~finite]))
        if finite.any():
            xs, ys = self._m4(x[finite], y[finite])
            self._xs.append(xs)
            self._ys.append(ys)

    def _m4(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per column of points ``x`` (increasing): its first, lowest, highest and last point."""
        bins = (x - self.start) // self.width
        starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
        ends = np.r_[starts[1:], len(x)] - 1
        order = np.lexsort((y, bins))  # bins are sorted: each column keeps its index range
        index = np.stack([starts, order[starts], order[ends], ends], axis=1)
        return x[index], y[index]

    def finite_min(self) -> float | None:
        """The lowest finite value (kept exactly: it is some column's minimum)."""
        return float(min(y[:, 1].min() for y in self._ys)) if self._ys else None

    def finite_max(self) -> float | None:
        """The highest finite value (some column's maximum)."""
        return float(max(y[:, 2].max() for y in self._ys)) if self._ys else None

    def bad(self) -> np.ndarray:
        """Iterations of the non-finite values kept (one per column)."""
        if not self._bad:
            return np.array([], dtype=np.int64)
        return self.firsts(np.concatenate(self._bad))

    def firsts(self, x: np.ndarray) -> np.ndarray:
        """The first of iterations ``x`` (increasing) in each column."""
        bins = (x - self.start) // self.width
        return x[np.r_[True, bins[1:] != bins[:-1]]]

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The line to draw: x and y in order, NaN where a non-finite value breaks it (a
        column split over two blocks: the M4 of both parts' points)."""
        x, y = np.array([], dtype=np.int64), np.array([], dtype=np.float64)
        if self._xs:
            x, y = np.concatenate(self._xs).ravel(), np.concatenate(self._ys).ravel()
            order = np.argsort(x, kind="stable")
            x, y = (a.ravel() for a in self._m4(x[order], y[order]))
        bad = self.bad()
        x, first = np.unique(np.r_[x, bad], return_index=True)
        return x, np.r_[y, np.full(len(bad), np.nan)][first]


STAGE_SHIFT = 0.1  # half the L1 distance of two mixtures' token shares that is a new stage


def _members(
    envelopes: dict[str, Envelope],
    like: Envelope,
    x: np.ndarray,
    names: list[str],
    values: np.ndarray,
    present: np.ndarray,
) -> None:
    """Each member's points (columns of ``values``) into its envelope, one like ``like``."""
    for index, name in enumerate(names):
        if present[:, index].any():
            envelope = envelopes.setdefault(name, Envelope(like.start, like.width))
            envelope.add(x, values[:, index], present[:, index])


@dataclass
class SourceLines:
    """A line's per-member envelopes and, per piece (attempt), the tokens of each member."""

    envelopes: dict[str, Envelope] = field(default_factory=dict)
    mixtures: dict[int, dict[str, int]] = field(default_factory=dict)  # attempt -> tokens

    def add(
        self, sources: SourceColumns, attempts: np.ndarray, x: np.ndarray, like: Envelope
    ) -> None:
        """The rows' members (``sources``, ``attempts``: of the rows) at iterations ``x``."""
        for attempt in np.unique(attempts).tolist():
            mine = attempts == attempt
            has_tokens = sources.has_tokens[mine]
            totals = np.where(has_tokens, sources.tokens[mine], 0).sum(axis=0).tolist()
            mixture = self.mixtures.setdefault(attempt, {})
            for name, total, seen in zip(sources.names, totals, has_tokens.any(axis=0).tolist()):
                if seen:
                    mixture[name] = mixture.get(name, 0) + total
        _members(self.envelopes, like, x, sources.names, sources.losses, sources.has_loss)


def stage_changes(
    pieces: list[tuple[int, int, int]], mixtures: dict[int, dict[str, int]]
) -> list[tuple[int, str]]:
    """(first iteration, "stage: name share, ...") where a piece's mixture differs from the
    previous piece's; the first piece is the first stage (not marked)."""
    changes, previous = [], None
    for attempt, first, _ in pieces:
        tokens = mixtures.get(attempt, {})
        total = sum(tokens.values())
        mixture = {n: t / total for n, t in tokens.items()} if total else {}
        if not mixture:
            continue
        if previous is not None:
            names = set(mixture) | set(previous)
            shift = sum(abs(mixture.get(n, 0.0) - previous.get(n, 0.0)) for n in names) / 2
            if shift > STAGE_SHIFT or {n for n, s in mixture.items() if s} != {
                n for n, s in previous.items() if s
            }:
                label = ", ".join(f"{n} {s:.0%}" for n, s in sorted(mixture.items()))
                changes.append((first, f"stage: {label}"))
        previous = mixture
    return changes


PANEL_FIELDS = ("lm_loss", "grad_norm", "params_norm", "max_attention_logit", "log_z")
MARKED_FIELDS = {"lm_loss": "loss", "grad_norm": "grad_norm"}  # marked panel -> event field
MARKERS = {"spike": "^", "divergence": "X", "recovered": "v", "rollback": "s"}
READ_BLOCK = 8 * BLOCK  # bytes parsed at a time: ~16 k lines
PARSERS = min(4, os.cpu_count() or 1)  # threads parsing blocks


@dataclass
class Series:
    """One line per panel: an attempt (or the final timeline) and its marks."""

    label: str
    pieces: list[tuple[int, int, int]]  # (attempt, first, last iteration) it shows, in order
    envelopes: dict[str, Envelope]
    sources: SourceLines  # the per-source panel's lines
    candidates: list[SpikeEvent] = field(default_factory=list)
    source: str = "replay"  # "ledger": what the tracker did; "replay": what it would flag
    marks: dict[str, dict[int, float]] = field(default_factory=dict)  # panel -> at events
    records: int = 0
    detector: FastReplay | None = None  # replays: fed in the pass
    hit: set[tuple[int, int]] = field(default_factory=set)  # (iteration, attempt) of marks
    layers: dict[str, dict[str, Envelope]] = field(default_factory=dict)  # field -> layer
    update_skips: int = 0  # records whose update --spike-skip-update withheld
    skipped_at: list[np.ndarray] = field(default_factory=list)  # their first per column


@dataclass
class Stats:
    """What the title says: every record read, all attempts."""

    records: int = 0
    attempts: set[int] = field(default_factory=set)
    first: int | None = None
    last: int | None = None
    slow_lines: int = 0  # lines parsed by json.loads (not the writer's shape)
    problems: list[str] = field(default_factory=list)  # torn and foreign lines
    gaps: list[tuple[int, dict]] = field(default_factory=list)  # (attempt, gap line)

    def count(self, attempt: int, first: int, last: int, records: int) -> None:
        self.records += records
        self.attempts.add(attempt)
        self.first = first if self.first is None else min(self.first, first)
        self.last = last if self.last is None else max(self.last, last)


def _ledger_events(ledger: Ledger, attempt: int) -> list[SpikeEvent]:
    names = set(SpikeEvent.__dataclass_fields__)
    return [
        SpikeEvent(**{k: v for k, v in from_json(e).items() if k in names})
        for e in ledger.events
        if e.get("attempt") == attempt and e.get("kind") in MARKERS
    ]


def choose(attempts: str, present: list[int]) -> list[int] | None:
    """The attempts ``--attempts`` asks for (None: ``latest``); ValueError on a bad spec."""
    if attempts == "latest":
        return None
    if attempts == "all":
        return present
    try:
        chosen = sorted({int(a) for a in attempts.split(",")})
    except ValueError:
        raise ValueError(f"--attempts takes all, latest or N[,M], got {attempts!r}") from None
    missing = [a for a in chosen if a not in present]
    if missing:
        raise ValueError(f"no attempt {missing} in the log (attempts present: {present})")
    return chosen


def plan_series(
    log: SignalsLog,
    attempts: str,
    config: SpikeConfig,
    ledger: Ledger,
    replay: bool,
    columns: int = COLUMNS,
) -> list[Series]:
    """The lines to draw, empty, with their marks' sources decided (a pass fills them)."""
    segments = log.segments()
    if not segments:
        return []
    start = min(s.first_iteration for s in segments)
    last = max(s.last_iteration for s in segments)
    width = max(1, math.ceil((last - start + 1) / columns))  # iterations per column (1: all kept)

    def new(label: str, pieces: list[tuple[int, int, int]], tracked: bool) -> Series:
        envelopes = {name: Envelope(start, width) for name in PANEL_FIELDS}
        source = "ledger" if tracked and not replay else "replay"
        return Series(label, pieces, envelopes, SourceLines(), source=source)

    chosen = choose(attempts, sorted({s.attempt for s in segments}))
    if chosen is None:
        pieces = [(s.attempt, s.first_iteration, top) for s, top in log.timeline()]
        line = new("latest per iteration", pieces, pieces[-1][0] in ledger.configs)
        if line.source == "ledger":
            line.candidates = [e for a in sorted(ledger.configs) for e in _ledger_events(ledger, a)]
        else:
            line.detector = FastReplay(SpikeDetector(config))
        return [line]
    lines = []
    for segment in [s for s in segments if s.attempt in chosen]:
        piece = (segment.attempt, segment.first_iteration, segment.last_iteration)
        line = new(f"attempt {segment.attempt}", [piece], segment.attempt in ledger.configs)
        if line.source == "ledger":
            line.candidates = _ledger_events(ledger, segment.attempt)
        else:
            count = config.warmup + config.window
            history = log.history(segment.attempt, segment.first_iteration, count)
            line.detector = FastReplay(primed(config, history))
        lines.append(line)
    return lines


def _feed(line: Series, block: Block, rows: np.ndarray, wanted: np.ndarray) -> None:
    it = block.values["iteration"][rows]
    line.records += len(rows)
    lm_loss = line.envelopes["lm_loss"]
    if block.sources is not None:
        line.sources.add(block.sources.take(rows), block.values["attempt"][rows], it, lm_loss)
    for name, columns in block.dicts.items():
        layers = line.layers.setdefault(name, {})
        _members(layers, lm_loss, it, columns.names, columns.values[rows], columns.present[rows])
    for name, envelope in line.envelopes.items():
        envelope.add(it, block.values[name][rows], block.present[name][rows])
    skipped = it[block.values["update_skipped"][rows]]
    if len(skipped):
        line.update_skips += len(skipped)
        line.skipped_at.append(lm_loss.firsts(skipped))
    if line.detector is not None:
        _replayed(line, line.detector.feed(block, rows))
    else:
        _tracked(line, block, rows, wanted)


def _replayed(line: Series, events: list[SpikeEvent]) -> None:
    """A replay's spike and divergence events, as candidates and marks."""
    for event in events:
        if event.kind in ("spike", "divergence"):
            line.candidates.append(event)
            for name, key in MARKED_FIELDS.items():
                value = getattr(event, key)
                if value is not None:
                    line.marks.setdefault(name, {})[event.iteration] = value


def _tracked(line: Series, block: Block, rows: np.ndarray, wanted: np.ndarray) -> None:
    """The values at the ledger's events' iterations (``wanted``), as marks."""
    it = block.values["iteration"][rows]
    attempts = block.values["attempt"][rows]
    for index in np.flatnonzero(np.isin(it, wanted)).tolist():
        line.hit.add((int(it[index]), int(attempts[index])))
        for name in MARKED_FIELDS:
            if block.present[name][rows[index]]:
                value = float(block.values[name][rows[index]])
                line.marks.setdefault(name, {})[int(it[index])] = value


def _whole_lines(log: SignalsLog, offset: int, end: int) -> bytes:
    """The whole lines of ``[offset, end)`` that fit in a block (at least one line)."""
    size = READ_BLOCK
    while True:
        data = log.read(offset, min(size, end - offset))
        if offset + len(data) >= end:
            return data
        cut = data.rfind(b"\n") + 1
        if cut:
            return data[:cut]
        size *= 2  # one line longer than a block


def _parsed(
    log: SignalsLog, segment: Segment, names: set[str]
) -> Iterator[tuple[int, bytes, Block]]:
    """(offset, lines, parsed block) of the segment, in order. Parsing (numpy, which releases
    the GIL in its loops) runs on ``PARSERS`` threads while the next blocks are read: a 5 M-
    iteration log is ~350 blocks, and parsing is most of a plot's time."""
    with ThreadPoolExecutor(PARSERS) as pool:
        pending: deque[tuple[int, bytes, Future[Block]]] = deque()
        offset = segment.start
        while offset < segment.end or pending:
            while offset < segment.end and len(pending) < 2 * PARSERS:
                data = _whole_lines(log, offset, segment.end)
                pending.append((offset, data, pool.submit(parse_block, data, offset, names, True)))
                offset += len(data)
            at, data, future = pending.popleft()
            yield at, data, future.result()


def _blocks(log: SignalsLog, segment: Segment, stats: Stats, names: set[str]) -> Iterator[Block]:
    """The segment's blocks, in order, duplicates of an iteration resolved to the later line
    (across blocks too: a block's last row is held back), the writer's order checked."""
    carry: Block | None = None
    previous = None
    for offset, data, block in _parsed(log, segment, names):
        stats.slow_lines += block.slow_lines
        stats.problems += block.problems
        stats.gaps += [(segment.attempt, gap) for _, gap in block.gaps]
        offset += len(data)  # the end of the block's lines: where an order error is reported
        it = block.values["iteration"]
        if len(it) and segment.first_iteration > segment.last_iteration:  # no keyed line
            raise OrderError(
                f"{log.path}: before byte {offset}: signals records whose lines do not start "
                '{"iteration":N,"attempt":M, as the writer\'s do (rewritten by another tool?); '
                "write them back in the writer's key order"
            )
        if len(it) and segment.first_iteration <= segment.last_iteration:
            before = np.r_[it[0] if previous is None else previous, it[:-1]]
            if ((block.values["attempt"] != segment.attempt) | (it < before)).any():
                raise OrderError(
                    f"{log.path}: before byte {offset}: a record out of the writer's order "
                    f"(attempt {segment.attempt}'s iterations must increase; were two runs "
                    "writing one --signals-dir, or logs concatenated?)"
                )
            previous = int(it[-1])
            stats.count(segment.attempt, int(it[0]), int(it[-1]), len(it))
        merged = Block.concat([carry, block]) if carry is not None else block
        if not len(merged):
            continue
        keep = np.r_[merged.values["iteration"][1:] != merged.values["iteration"][:-1], True]
        keep[-1] = False  # held back: the next block may repeat its iteration
        yield merged.take(np.flatnonzero(keep))
        carry = merged.take(np.array([len(merged) - 1]))
    if carry is not None:
        yield carry


def stream(log: SignalsLog, lines: list[Series]) -> Stats:
    """Read every segment once, in file order, into ``lines``; return what the title says
    (torn and foreign lines are reported once, as a full read reports them)."""
    stats = Stats()
    wanted = {
        id(line): np.array(sorted({e.iteration for e in line.candidates}), dtype=np.int64)
        for line in lines
    }
    segments = log.segments() or [Segment(0, 0, -1, 0, log.size)]  # no record: still report
    replays = any(line.detector is not None for line in lines)
    # A replay reads more fields.
    names = set(FIELDS) if replays else {*PANEL_FIELDS, "update_skipped"}
    names |= set(LAYERS)  # the per-layer panels
    for segment in segments:
        takers = [(line, p) for line in lines for p in line.pieces if p[0] == segment.attempt]
        for block in _blocks(log, segment, stats, names):
            for line, (_, first, last) in takers:
                rows = np.flatnonzero(
                    (block.values["iteration"] >= first) & (block.values["iteration"] <= last)
                )
                if len(rows):
                    _feed(line, block, rows, wanted[id(line)])
    for line in lines:
        if line.source == "ledger" and len(line.pieces) > 1:  # the final timeline: its own
            line.candidates = [e for e in line.candidates if (e.iteration, e.attempt) in line.hit]
    report(log.path, stats.problems)
    return stats
