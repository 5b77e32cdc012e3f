"""The signals log's one writer, which numbers its attempt from the end of the log.

Why its own module: a restart appends under the log's last attempt + 1, and a real run's log
is hundreds of MiB (1 M iterations: ~550 MiB). Reading it whole for that number (what the
writer did before) cost a training start-up seconds and GiBs of record objects; the seek
(:mod:`megatron_ext.common.records.signals_seek`) finds every attempt's segment from the end in a
few KiB. No Megatron imports here.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.gap_log import GapLog
from megatron_ext.common.records.signals import SignalRecord, read_signals
from megatron_ext.common.records.signals_seek import OrderError, SignalsLog, report


def next_attempt(path: Path) -> int:
    """One more than every attempt in the log at ``path`` (1 for no log).

    A log out of its writer's order (two runs on one directory, files joined by hand) is
    read whole, with a warning, so the new attempt is still above every old one. Torn or
    foreign lines after the last record (a kill -9, a line appended by another tool) are
    warned about by byte offset; the rest of the log is not read."""
    if not path.exists():
        return 1
    try:
        with SignalsLog(path) as log:
            segments = log.segments()
            if segments:  # a line appended after the last record is named, as a full read did
                problems: list[str] = []
                last = segments[-1]
                log.records(last, last.last_iteration, last.last_iteration, problems)
                report(path, problems)
            attempts = [segment.attempt for segment in segments]
    except OrderError as exc:
        warnings.warn(f"{exc}; reading the whole log for its attempts", stacklevel=2)
        attempts = [record.attempt for record in read_signals(path)]
    return max(attempts, default=0) + 1


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
