"""Reading one iteration out of a sample log of millions of lines, without reading the rest.

``attempts-dp{rank}.jsonl`` says where each attempt starts; :meth:`RankLog.iteration` bisects
each sorted run that can hold the iteration and parses only its lines (torn lines skipped and
reported; unsorted or unindexed stretches scanned). docs/lookup.md.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import sample_log_attempts_file, sample_log_file
from megatron_ext.common.gap_log import is_gap
from megatron_ext.common.io import from_json, read_jsonl
from megatron_ext.common.records.sample_log import SampleRecord

PROBE = 1024  # bytes read per bisection probe: a record or two; a longer line is read on
BLOCK = 4096  # bisect down to this many bytes, then read on line by line
# Every record starts with these keys, in this order (asdict of SampleRecord, compact JSON).
_KEY = re.compile(rb'\{"iteration":(\d+),"dp_rank":-?\d+,"microbatch":(\d+),')


@dataclass(frozen=True)
class Attempt:
    """One writer's run of records in one rank's file."""

    ordinal: int  # 1-based, in file order (a scanned stretch's runs share its number)
    start: int  # byte offsets [start, end) of its records
    end: int
    # False: no attempt line names it (older log, or a broken index), so it was scanned. The
    # runs an indexed attempt splits into when it is not sorted (two writers) stay True.
    indexed: bool
    info: dict[str, Any] = field(default_factory=dict)  # the attempt line: job, host, pid, time


@dataclass(frozen=True)
class AttemptRecords:
    """The records of one iteration that one attempt wrote."""

    attempt: Attempt
    records: list[SampleRecord]


@dataclass(frozen=True)
class _Line:
    start: int
    end: int  # past the newline
    key: tuple[int, int] | None  # (iteration, micro-batch); None for a line that is not one
    text: bytes


class RankLog:
    """One DP rank's ``samples-dp{rank}.jsonl``, read by iteration."""

    def __init__(self, path: str | os.PathLike[str], dp_rank: int | None = None) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.bytes_read = 0
        self.records_parsed = 0
        self.torn_lines = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        if dp_rank is None:
            dp_rank = int(self.path.stem.removeprefix("samples-dp"))
        self.attempts = self._attempts(sample_log_attempts_file(self.path.parent, dp_rank))

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> RankLog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------

    def _read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, max(0, min(length, self.size - offset)), offset)
        self.bytes_read += len(data)
        return data

    def _line_at(self, offset: int, limit: int) -> _Line | None:
        """The first whole line that starts at or after ``offset`` and before ``limit``."""
        base = max(0, offset - 1)
        buffer = self._read(base, PROBE)

        def newline_from(position: int) -> int:
            nonlocal buffer
            found = buffer.find(b"\n", position)
            while found < 0:  # a line longer than what was read: read on
                more = self._read(base + len(buffer), max(PROBE, len(buffer)))
                if not more:
                    return -1
                buffer += more
                found = buffer.find(b"\n", position)
            return found

        first = 0
        if offset > 0:  # step past the rest of the line ``offset`` falls in
            first = newline_from(0) + 1
            if first == 0:
                return None
        if base + first >= limit:
            return None
        last = newline_from(first)
        text = buffer[first:] if last < 0 else buffer[first : last + 1]
        return _Line(base + first, base + first + len(text), _key(text), text)

    def _lines(self, start: int, end: int) -> Iterator[_Line]:
        """Every line of [start, end) (``start`` a line start), in reads that grow from 8 KiB
        (one iteration's records) to 1 MiB (a stretch scanned line by line)."""
        offset, rest, size = start, b"", 2 * BLOCK
        while offset + len(rest) < end:
            chunk = self._read(offset + len(rest), min(size, end - offset - len(rest)))
            if not chunk:
                break
            size = min(2 * size, 1 << 20)
            rest += chunk
            *lines, rest = rest.split(b"\n")
            for text in lines:
                yield _Line(offset, offset + len(text) + 1, _key(text), text)
                offset += len(text) + 1
        if rest:
            yield _Line(offset, offset + len(rest), _key(rest), rest)

    def _parse(self, line: _Line) -> SampleRecord | None:
        """The record of a line; None (counted as torn) when it is not whole JSON."""
        try:
            value = json.loads(line.text)
        except json.JSONDecodeError:
            self.torn_lines += 1
            return None
        if is_gap(value):
            return None  # a full disk's gap line (megatron_ext.common.gap_log): no record here
        self.records_parsed += 1
        try:
            return SampleRecord(**from_json(value))
        except TypeError as exc:
            raise ValueError(
                f"{self.path}: byte {line.start} is not a sample record: {exc}"
            ) from exc

    # -- the attempt index ---------------------------------------------------------------

    def _attempts(self, index: Path) -> list[Attempt]:
        """The runs of the file: one per attempt line, and unindexed stretches scanned."""
        lines = read_jsonl(index, warn=False).records if index.is_file() else []
        starts: list[tuple[int, dict[str, Any]]] = []
        for info in lines:
            offset = info.get("offset")
            if (
                not isinstance(offset, int)
                or not 0 <= offset <= self.size
                or (starts and offset < starts[-1][0])
                or (0 < offset < self.size and self._read(offset - 1, 1) != b"\n")
            ):
                return [Attempt(1, 0, self.size, False)]  # the index does not fit: scan
            starts.append((offset, info))
        attempts = []
        if not starts or starts[0][0] > 0:
            attempts.append(Attempt(1, 0, starts[0][0] if starts else self.size, False))
        for k, (offset, info) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else self.size
            attempts.append(Attempt(len(attempts) + 1, offset, end, True, info))
        return attempts

    def last_iteration(self) -> int | None:
        """The highest iteration the file's attempts end with (a few tail reads): how far the
        run got, as this rank recorded it."""
        keys = [key for attempt in self.attempts if (key := self._last_key(attempt))]
        return max(key[0] for key in keys) if keys else None

    # -- one iteration ---------------------------------------------------------------------

    def _first_at_least(self, attempt: Attempt, target: tuple[int, int]) -> int:
        """Offset of the first line of the sorted run whose key is >= ``target`` (bisection)."""
        low, high = attempt.start, attempt.end
        while high - low > BLOCK:
            line = self._line_at((low + high) // 2, high)
            if line is None:
                high = (low + high) // 2
            elif line.key is not None and line.key < target:
                low = line.end
            else:  # at or past the target (or a torn line, which ends a run): look before
                high = line.start
        return low

    def _last_key(self, attempt: Attempt) -> tuple[int, int] | None:
        """The key of the run's last record (a torn last line skipped)."""
        start = max(attempt.start, attempt.end - 4 * PROBE)
        tail = self._read(start, attempt.end - start).split(b"\n")
        keys = [k for text in (tail[1:] if start > attempt.start else tail) if (k := _key(text))]
        return keys[-1] if keys else None

    def _scan(self, attempt: Attempt, iteration: int, start: int) -> tuple[list[_Line], bool]:
        """Lines of ``iteration`` from ``start``; False when the run is not sorted there, or
        when its last record is not its highest (another writer appended behind it)."""
        found: list[_Line] = []
        previous = self._last_key(attempt)
        if previous is None:
            return found, True  # nothing whole in it
        last, previous, past = previous, None, False
        for line in self._lines(start, attempt.end):
            if line.key is None:
                self.torn_lines += bool(line.text.strip())
                continue
            if previous is not None and line.key <= previous:
                return found, False
            if past:  # one line past the iteration, still rising: sorted here
                break
            previous = line.key
            past = line.key[0] > iteration
            if line.key[0] == iteration:
                found.append(line)
        return found, previous is None or previous <= last

    def _unsorted(self, stretch: Attempt, iteration: int) -> list[AttemptRecords]:
        """Every line of a stretch no attempt line vouches for, split into runs where the keys
        stop rising (each run one attempt, as far as the file can tell)."""
        runs: list[tuple[int, list[SampleRecord]]] = [(stretch.start, [])]
        previous = None
        for line in _progress(self._lines(stretch.start, stretch.end), stretch, self.path):
            if line.key is None:
                self.torn_lines += bool(line.text.strip())
                continue
            if previous is not None and line.key <= previous:
                runs.append((line.start, []))
            previous = line.key
            if line.key[0] == iteration and (record := self._parse(line)) is not None:
                runs[-1][1].append(record)
        ends = [start for start, _ in runs[1:]] + [stretch.end]
        return [
            AttemptRecords(
                Attempt(stretch.ordinal, start, end, stretch.indexed, stretch.info), records
            )
            for (start, records), end in zip(runs, ends)
            if records
        ]

    def iteration(self, iteration: int) -> list[AttemptRecords]:
        """The records of ``iteration``, grouped by the attempt that wrote them, in file order
        (the last group holding a micro-batch is what the run finally trained on)."""
        out = []
        torn_before = self.torn_lines
        for attempt in self.attempts:
            if not attempt.indexed:
                out += self._unsorted(attempt, iteration)
                continue
            first = attempt.info.get("first_iteration")
            if isinstance(first, int) and first > iteration:
                continue  # the run starts after it (it may be empty, too)
            lines, ordered = self._scan(
                attempt, iteration, self._first_at_least(attempt, (iteration, 0))
            )
            if not ordered:
                warnings.warn(
                    f"{self.path}: the records of attempt {attempt.ordinal} (bytes "
                    f"{attempt.start}..{attempt.end}) are not in iteration order (two writers "
                    "on one file?); reading that stretch line by line",
                    stacklevel=2,
                )
                out += self._unsorted(attempt, iteration)
                continue
            records = [r for line in lines if (r := self._parse(line)) is not None]
            if records:
                out.append(AttemptRecords(attempt, records))
        if self.torn_lines > torn_before:
            warnings.warn(
                f"{self.path}: skipped {self.torn_lines - torn_before} torn line(s) (left by a "
                "killed writer)",
                stacklevel=2,
            )
        return out


def _key(text: bytes) -> tuple[int, int] | None:
    """(iteration, micro-batch) from a record's first keys; None for a line that is not one."""
    match = _KEY.match(text)
    return (int(match[1]), int(match[2])) if match else None


def _progress(lines: Iterator[_Line], attempt: Attempt, path: Path) -> Iterator[_Line]:
    """A progress bar (stderr, after two seconds) over a stretch read line by line."""
    from tqdm import tqdm

    with tqdm(
        total=attempt.end - attempt.start,
        desc=f"reading {path.name} (no attempt index)",
        unit="B",
        unit_scale=True,
        delay=2,
    ) as bar:
        done = attempt.start
        for line in lines:
            yield line
            if line.end - done > 1 << 24:
                bar.update(line.end - done)
                done = line.end


def latest(groups: list[AttemptRecords]) -> dict[int, SampleRecord]:
    """Micro-batch -> the record the run finally trained on (the last attempt's)."""
    out: dict[int, SampleRecord] = {}
    for group in groups:
        for record in group.records:
            out[record.microbatch] = record
    return out


def read_iteration(
    directory: str | os.PathLike[str], iteration: int, dp_ranks: list[int]
) -> dict[int, list[AttemptRecords]]:
    """``iteration``'s records in each rank's file (ranks without a file are left out), with a
    progress bar on stderr when the ranks take more than two seconds (64 ranks of a cold
    filesystem)."""
    from tqdm import tqdm

    out = {}
    for rank in tqdm(dp_ranks, desc=f"sample log, iteration {iteration}", unit="rank", delay=2):
        path = sample_log_file(directory, rank)
        if path.is_file():
            with RankLog(path, rank) as log:
                out[rank] = log.iteration(iteration)
    return out
