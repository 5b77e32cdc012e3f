"""The signals log read by position instead of by scanning: bisection by (attempt, iteration).

Why: a real run's log holds millions of ~500-byte lines (1 M iterations: ~500 MiB), and the
planner needs a few thousand of them, a detector's prime a few hundred, the plot the attempts'
boundaries. The writer's discipline sorts the file by the key (attempt, iteration): one writer
per run appends; a restart appends under the log's last attempt + 1; an attempt logs increasing
iterations (a rollback's replay repeats lower iterations, but under a higher attempt). So each
attempt is one contiguous **segment**, found from the end by bisection over byte offsets, and
any iteration range of a segment by one more bisection; nothing outside is read.

A probe reads one small block at an offset and takes the first line after it that starts with
``{"iteration":N,"attempt":M,`` (the writer puts those two keys first). Torn lines (a killed
writer) and foreign lines have no such key and are stepped over; inside an asked range they are
parsed and reported as a full read reports them, by byte offset (a seek knows no line numbers).
What is read is checked against the order (keys never decrease); a log that breaks it (two runs
writing one directory, files concatenated by hand) raises :class:`OrderError`, and callers say
so or fall back to a full scan. No Megatron imports here.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from megatron_ext.common.errors import Refusal
from megatron_ext.common.gap_log import GAP_KEY
from megatron_ext.common.io import from_json
from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals

KEY = re.compile(rb'\{\s*"iteration"\s*:\s*(\d+)\s*,\s*"attempt"\s*:\s*(\d+)\s*,')
PROBE = 2048  # bytes read per bisection probe: a line or two
BLOCK = 1 << 20  # bytes read per step of a sequential read
_FIELDS = {f.name for f in fields(SignalRecord)}

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


def line_key(line: bytes) -> Key | None:
    """A line's (attempt, iteration), or None for a torn or foreign line."""
    match = KEY.match(line)
    return (int(match[2]), int(match[1])) if match else None


def record_of(raw: Any) -> SignalRecord:
    """A parsed JSON line as a record; TypeError names what makes it foreign."""
    if not isinstance(raw, dict):
        raise TypeError("not a JSON object")
    if set(raw) - _FIELDS:
        raise TypeError(f"unknown fields {sorted(set(raw) - _FIELDS)}")
    return SignalRecord(**from_json(raw))


class SignalsLog:
    """An open signals log; ``bytes_read`` and ``lines_parsed`` count what reads cost."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close()/with)
        self.size = os.fstat(self._file.fileno()).st_size
        self.bytes_read = 0
        self.lines_parsed = 0
        self._segments: list[Segment] | None = None

    def __enter__(self) -> SignalsLog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def read(self, offset: int, size: int) -> bytes:
        self._file.seek(offset)
        data = self._file.read(size)
        self.bytes_read += len(data)
        return data

    def lines(self, offset: int, limit: int, block: int = PROBE) -> Iterator[tuple[int, bytes]]:
        """(start, line without its newline) of each line starting in ``[offset, limit)``."""
        pos = offset
        if offset > 0:  # the line holding offset - 1 ends at the first newline from there
            scan = offset - 1
            while True:
                data = self.read(scan, block)
                if not data:
                    return
                newline = data.find(b"\n")
                if newline >= 0:
                    pos, buffer, base = scan + newline + 1, data[newline + 1 :], scan + newline + 1
                    break
                scan += len(data)
        else:
            buffer, base = b"", 0
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
            key = line_key(line)
            if key is not None:
                return key, start, start + len(line) + 1
        return None

    def _last_keyed(self, limit: int) -> tuple[Key, int] | None:
        """The last keyed line starting before ``limit``: key, start."""
        low, span = limit, 4 * PROBE
        while low > 0:
            low, span = max(0, low - span), span * 2
            found = None
            for start, line in self.lines(low, limit):
                key = line_key(line)
                if key is not None:
                    found = key, start
            if found is not None:
                return found
        return None

    def bisect(self, target: Key, low: int, high: int) -> int:
        """The start of the first keyed line in ``[low, high)`` with key >= ``target``
        (``high`` if none)."""
        best = high
        while low < high:
            middle = (low + high) // 2
            found = self._first_keyed(middle, high)
            if found is None:
                high = middle
            elif found[0] >= target:
                best, high = found[1], middle
            else:
                low = found[2]
        return best

    def segments(self) -> list[Segment]:
        """Every attempt's segment, in file order, found from the end of the file."""
        if self._segments is not None:
            return self._segments
        found: list[Segment] = []
        limit = self.size
        while limit > 0:
            last = self._last_keyed(limit)
            if last is None:
                break
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
            key = line_key(line)
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
            try:
                raw = json.loads(line)
            except ValueError:
                problems.append(f"byte {offset} (torn)")
                continue
            if isinstance(raw, dict) and set(raw) == {GAP_KEY}:
                continue  # a gap line names records that are not there
            try:
                record = record_of(raw)
            except TypeError as exc:
                problems.append(f"byte {offset} ({exc})")
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

    def history(self, attempt: int, before: int, count: int) -> list[SignalRecord]:
        """The last ``count`` iterations (oldest first) that an attempt starting at
        iteration ``before`` continued from: for each iteration, the latest earlier attempt
        that logged it, never one past a later attempt's restart."""
        out: list[SignalRecord] = []
        problems: list[str] = []
        bound = before
        for segment in reversed([s for s in self.segments() if s.attempt < attempt]):
            top = min(bound - 1, segment.last_iteration)
            span = count - len(out)
            while span > 0 and top >= segment.first_iteration:
                low = max(segment.first_iteration, top - span + 1)
                got = self.records(segment, low, top, problems)
                if len(got) >= count - len(out) or low == segment.first_iteration:
                    out = got[-(count - len(out)) :] + out
                    break
                span *= 2  # holes in the stretch: look further back
            if len(out) >= count:
                break
            bound = min(bound, segment.first_iteration)
        report(self.path, problems)
        return out

    def last_attempt(self) -> int | None:
        """The attempt of the log's last record (the highest, by the writer's order)."""
        last = self._last_keyed(self.size)
        return last[0][0] if last else None


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
    ``before`` continues from (:meth:`SignalsLog.history` over every attempt that started
    earlier), or a full scan (warned) when the log is out of order. No log: nothing."""
    if not Path(path).exists():
        return []
    try:
        with SignalsLog(path) as log:
            return log.history(sys.maxsize, before, count)
    except OrderError as exc:
        warnings.warn(f"{exc}; reading the whole log instead", stacklevel=2)
        earlier = [r for r in latest_per_iteration(read_signals(path)) if r.iteration < before]
        return earlier[-count:] if count else []
