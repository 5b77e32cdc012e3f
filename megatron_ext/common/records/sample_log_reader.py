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
from megatron_ext.common.records.signals import KeyedLines

READ = 8192  # bytes of the first read of a run's lines: one iteration's records
# Every record starts with these keys, in this order (asdict of SampleRecord, compact JSON).
_KEY = re.compile(rb'\{"iteration":(\d+),"dp_rank":-?\d+,"microbatch":(\d+),')


@dataclass(frozen=True)
class Attempt:
    """One writer's run of records in one rank's file."""

    ordinal: int  # 1-based, in file order (a scanned stretch's runs share its number)
    start: int  # byte offsets [start, end) of its records
    end: int
    indexed: bool  # False: no attempt line names it (older log, broken index): scanned
    info: dict[str, Any] = field(default_factory=dict)  # the attempt line: job, host, pid, time


@dataclass(frozen=True)
class AttemptRecords:
    """The records of one iteration that one attempt wrote."""

    attempt: Attempt
    records: list[SampleRecord]


class RankLog(KeyedLines):
    """One DP rank's ``samples-dp{rank}.jsonl``, read by iteration."""

    probe = 1024  # a record or two

    def __init__(self, path: str | os.PathLike[str], dp_rank: int | None = None) -> None:
        super().__init__(path)
        self.records_parsed = 0
        self.torn_lines = 0
        if dp_rank is None:
            dp_rank = int(self.path.stem.removeprefix("samples-dp"))
        self.attempts = self._attempts(sample_log_attempts_file(self.path.parent, dp_rank))

    @staticmethod
    def key(line: bytes) -> tuple[int, int] | None:
        """(iteration, micro-batch) from a record's first keys; None for a line that is not one."""
        match = _KEY.match(line)
        return (int(match[1]), int(match[2])) if match else None

    def _parse(self, start: int, text: bytes) -> SampleRecord | None:
        """The record of a line; None (counted as torn) when it is not whole JSON."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            self.torn_lines += 1
            return None
        if is_gap(value):
            return None  # a full disk's gap line (megatron_ext.common.gap_log): no record here
        self.records_parsed += 1
        try:
            return SampleRecord(**from_json(value))
        except TypeError as exc:
            raise ValueError(f"{self.path}: byte {start} is not a sample record: {exc}") from exc

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
                or (0 < offset < self.size and self.read(offset - 1, 1) != b"\n")
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
        """The highest iteration the file's attempts end with (a few tail reads)."""
        ends = [self._last_keyed(attempt.end, attempt.start) for attempt in self.attempts]
        return max(end[0][0] for end in ends if end) if any(ends) else None

    # -- one iteration ---------------------------------------------------------------------

    def _scan(
        self, attempt: Attempt, iteration: int, start: int
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """Lines of ``iteration`` from ``start``; False when the run is not sorted there, or
        when its last record is not its highest (another writer appended behind it)."""
        found: list[tuple[int, bytes]] = []
        end = self._last_keyed(attempt.end, attempt.start)
        if end is None:
            return found, True  # nothing whole in it
        last, previous, past = end[0], None, False
        for offset, text in self.lines(start, attempt.end, READ):
            key = self.key(text)
            if key is None:
                self.torn_lines += bool(text.strip())
                continue
            if previous is not None and key <= previous:
                return found, False
            if past:  # one line past the iteration, still rising: sorted here
                break
            previous = key
            past = key[0] > iteration
            if key[0] == iteration:
                found.append((offset, text))
        return found, previous is None or previous <= last

    def _unsorted(self, stretch: Attempt, iteration: int) -> list[AttemptRecords]:
        """A stretch no attempt line vouches for, split into runs where the keys stop rising."""
        runs: list[tuple[int, list[SampleRecord]]] = [(stretch.start, [])]
        previous = None
        lines = self.lines(stretch.start, stretch.end, READ)
        for start, text in _progress(lines, stretch, self.path):
            key = self.key(text)
            if key is None:
                self.torn_lines += bool(text.strip())
                continue
            if previous is not None and key <= previous:
                runs.append((start, []))
            previous = key
            if key[0] == iteration and (record := self._parse(start, text)) is not None:
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
            start = self.bisect((iteration, 0), attempt.start, attempt.end)
            lines, ordered = self._scan(attempt, iteration, start)
            if not ordered:
                warnings.warn(
                    f"{self.path}: the records of attempt {attempt.ordinal} (bytes "
                    f"{attempt.start}..{attempt.end}) are not in iteration order (two writers "
                    "on one file?); reading that stretch line by line",
                    stacklevel=2,
                )
                out += self._unsorted(attempt, iteration)
                continue
            records = [r for line in lines if (r := self._parse(*line)) is not None]
            if records:
                out.append(AttemptRecords(attempt, records))
        if self.torn_lines > torn_before:
            warnings.warn(
                f"{self.path}: skipped {self.torn_lines - torn_before} torn line(s) (left by a "
                "killed writer)",
                stacklevel=2,
            )
        return out


def _progress(
    lines: Iterator[tuple[int, bytes]], attempt: Attempt, path: Path
) -> Iterator[tuple[int, bytes]]:
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
        for start, text in lines:
            yield start, text
            if start - done > 1 << 24:
                bar.update(start - done)
                done = start


def latest(groups: list[AttemptRecords]) -> dict[int, SampleRecord]:
    """Micro-batch -> the record the run finally trained on (the last attempt's)."""
    return {record.microbatch: record for group in groups for record in group.records}


def read_iteration(
    directory: str | os.PathLike[str], iteration: int, dp_ranks: list[int]
) -> dict[int, list[AttemptRecords]]:
    """``iteration``'s records in each rank's file (ranks without one left out); a progress bar
    on stderr after two seconds."""
    from tqdm import tqdm

    out = {}
    for rank in tqdm(dp_ranks, desc=f"sample log, iteration {iteration}", unit="rank", delay=2):
        path = sample_log_file(directory, rank)
        if path.is_file():
            with RankLog(path, rank) as log:
                out[rank] = log.iteration(iteration)
    return out
