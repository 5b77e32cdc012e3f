"""An append-only JSONL log whose write failures never stop training: a failed write warns (at
most once per :data:`WARN_EVERY_S`), later records retry, and the first that succeeds follows a
gap record (:func:`gap_record`) so readers say "not logged", not "not trained". No torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from megatron_ext.common.io import DEFAULT_FILE_MODE, json_safe, read_jsonl, torn_tail

GAP_KEY = "gap"
WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class Gap:
    """Iterations whose records a write failure (a full disk) kept out of a log: trained, not
    logged."""

    first_iteration: int
    last_iteration: int
    records_lost: int
    reason: str
    wall_time: float

    def covers(self, iteration: int) -> bool:
        return self.first_iteration <= iteration <= self.last_iteration

    def describe(self) -> str:
        return (
            f"iterations {self.first_iteration}-{self.last_iteration} trained but not logged "
            f"({self.records_lost} records lost to {self.reason})"
        )


def gap_record(first: int, last: int, lost: int, reason: str, wall_time: float) -> dict:
    """The line standing for ``lost`` records of iterations ``first..last`` not written."""
    return {GAP_KEY: asdict(Gap(first, last, lost, reason, wall_time))}


def read_gaps(path: str | os.PathLike[str]) -> list[Gap]:
    """Every gap record of a log (signals, sample log, spike ledger), in file order."""
    if not Path(path).is_file():
        return []
    names = {f.name for f in fields(Gap)}
    return [
        Gap(**raw[GAP_KEY])
        for raw in read_jsonl(path, warn=False).records
        if is_gap(raw) and set(raw[GAP_KEY]) == names
    ]


def is_gap(raw: dict[str, Any]) -> bool:
    """Whether a parsed line is a gap record (and not a record of the log's own kind)."""
    return isinstance(raw.get(GAP_KEY), dict) and set(raw) == {GAP_KEY}


class GapLog:
    """Append-only JSONL file ``path`` (``what`` names it in warnings) that survives write
    failures; ``clock`` is injectable so rate limits are testable."""

    def __init__(
        self, path: str | os.PathLike[str], what: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.path, self.what, self.clock = Path(path), what, clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._missing: list[int] = []  # [first, last] iteration without a record on disk
        self._lost = 0
        self._reason = ""
        self._warned_at: float | None = None
        self._suppressed = 0

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, DEFAULT_FILE_MODE)
            if torn_tail(self.path):  # a kill -9, a short write on a full disk: end it first
                self._write_all(b"\n")
        return self._fd

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        while data:
            data = data[os.write(self._fd, data) :]

    def _line(self, record: Any) -> bytes:
        return (json.dumps(json_safe(record), separators=(",", ":")) + "\n").encode()

    def append(self, record: Any, iteration: int) -> bool:
        """Write one record of ``iteration``; False (and a rate-limited warning) when it
        could not be written, in which case it counts towards the next gap record."""
        try:
            self._open()
            if self._lost:
                first, last = self._missing
                gap = gap_record(first, last, self._lost, self._reason, self.clock())
                self._write_all(self._line(gap))
                self._recovered(first, last)
            self._write_all(self._line(record))
            return True
        except OSError as exc:
            self._failed(exc, iteration)
            return False

    def _failed(self, exc: OSError, iteration: int) -> None:
        if self._fd is not None:  # reopen on the next try: the descriptor may be stale
            os.close(self._fd)
            self._fd = None
        first = self._missing[0] if self._lost else iteration
        self._missing = [first, iteration]
        self._lost += 1
        self._reason = f"{type(exc).__name__}: {exc}"
        now = self.clock()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more failures since the last warning)" * bool(
            self._suppressed
        )
        self._warned_at, self._suppressed = now, 0
        print(
            f"megatron-ext: WARNING: cannot write the {self.what} {self.path}: {self._reason}"
            f"{more}. Training continues; iterations {first}-{iteration} are missing from the "
            f"log so far; retrying at every record, a gap record will name them.",
            file=sys.stderr,
            flush=True,
        )

    def _recovered(self, first: int, last: int) -> None:
        print(
            f"megatron-ext: the {self.what} {self.path} is writable again; iterations "
            f"{first}-{last} ({self._lost} records) are missing from it, recorded as a gap",
            file=sys.stderr,
            flush=True,
        )
        self._missing, self._lost, self._warned_at, self._suppressed = [], 0, None, 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
