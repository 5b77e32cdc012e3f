"""Crash-safe JSON Lines: append-only writers and readers that survive kill -9.

Every record is one ``write`` of ``json + "\\n"`` followed by a flush, so a killed process can
leave at most one incomplete (torn) line at the end of the file. A writer that reopens the file
first terminates such a torn tail with a newline, so the next record starts on its own line.
Readers therefore skip lines that are not valid JSON and report them (file and line number),
instead of failing or silently mixing fragments into data.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


class JsonlAppender:
    """Append-only JSONL file; flushes every record."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self.path, "a+", encoding="utf-8")
        self._seal_torn_tail()

    def _seal_torn_tail(self) -> None:
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return
        with open(self.path, "rb") as raw:
            raw.seek(size - 1)
            if raw.read(1) != b"\n":
                self._file.write("\n")
                self._file.flush()

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line and flush it to the OS."""
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class JsonlContent:
    """Parsed records plus the line numbers of torn (unparseable) lines that were skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    torn_lines: list[int] = field(default_factory=list)


_ITERATION_KEY = '{"iteration":'


def _outside(line: str, iterations: tuple[int, int]) -> bool:
    """True when a ``{"iteration":N,...`` line is certainly outside ``iterations``."""
    if not line.startswith(_ITERATION_KEY):
        return False
    end = line.find(",", len(_ITERATION_KEY))
    try:
        value = int(line[len(_ITERATION_KEY):end])
    except ValueError:
        return False  # let the JSON parser decide (torn or foreign line)
    return not iterations[0] <= value <= iterations[1]


def read_jsonl(path: str | os.PathLike[str], warn: bool = True,
               iterations: tuple[int, int] | None = None) -> JsonlContent:
    """Read every JSON object line; torn lines are skipped and reported, never guessed at.

    With ``iterations``, lines that start with an ``iteration`` key outside the range are
    skipped unparsed (the writers here always put that key first).
    """
    content = JsonlContent()
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip() or (iterations is not None and _outside(line, iterations)):
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                content.torn_lines.append(number)
                continue
            if not isinstance(value, dict):
                content.torn_lines.append(number)
                continue
            content.records.append(value)
    if warn and content.torn_lines:
        warnings.warn(
            f"{path}: skipped {len(content.torn_lines)} torn line(s) at "
            f"{content.torn_lines[:10]} (left by a killed writer)",
            stacklevel=2,
        )
    return content
