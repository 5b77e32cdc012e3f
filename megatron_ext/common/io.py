"""Crash-safe files: append-only JSON Lines, atomic whole-file writes, JSON-safe records.

Why one module: every file megatron-ext writes is read by someone else (a restarted run, the
planner, the launcher, an on-call engineer), often after a kill -9. Two disciplines cover all
of them:

- **Append-only JSONL** (signals, ledger, sample logs): every record is one ``write`` of
  ``json + "\\n"`` followed by a flush, so a killed process leaves at most one torn line at
  the end. A writer that reopens the file terminates such a tail with a newline first;
  readers skip lines that are not JSON objects and report them (file and line number).
- **Atomic replacement** (plans, skip lists, the checkpoint tracker, reports, plots): write a
  temporary file in the same directory, fsync it, rename it over the target, fsync the
  directory. Readers see the old or the new file, never a part. The new file keeps the mode
  of the file it replaces (0644 under the umask for a new one), not ``mkstemp``'s 0600.

Non-finite floats are stored as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so that any
JSON reader can load the logs (``json.dumps`` would write bare ``NaN``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

DEFAULT_FILE_MODE = 0o666  # masked by the process umask, as open() does

# Tests only: SIGKILL this process right after its k-th kill point (the step boundaries of
# multi-step writes: the skiplist transaction, publishing a .bin/.idx pair), so fault tests
# kill a real process exactly there.
KILL_AT_STEP_ENV = "MEGATRON_EXT_TEST_KILL_AT_STEP"
_kill_points_passed = 0


def kill_point() -> None:
    """A step boundary of a multi-step write (see ``KILL_AT_STEP_ENV``); a no-op otherwise."""
    global _kill_points_passed
    _kill_points_passed += 1
    if os.environ.get(KILL_AT_STEP_ENV) == str(_kill_points_passed):
        os.kill(os.getpid(), signal.SIGKILL)


def json_safe(value: Any) -> Any:
    """A dataclass, dict, list or float with non-finite floats turned into strings."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_NON_FINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "NaN": math.nan,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
}


def from_json(value: Any) -> Any:
    """Inverse of :func:`json_safe` for floats: ``"nan"``/``"inf"`` (and the JavaScript
    spellings ``"NaN"``/``"Infinity"``) become floats again."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def token_sha1(tokens: Any) -> str:
    """SHA-1 of one sample's token ids as little-endian int64.

    The one definition shared by the sample log (written during training) and the lookup
    (recomputed from the .bin files): they must agree byte for byte.
    """
    import numpy as np  # not at module level: the supervisor reads JSONL without numpy

    if hasattr(tokens, "detach"):  # a torch tensor, possibly on a GPU
        tokens = tokens.detach().to("cpu").numpy()
    return hashlib.sha1(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


# -- atomic whole-file writes --------------------------------------------------------------


def _mode_for(target: Path) -> int:
    """The mode a replacement should get: the replaced file's, else 0666 & ~umask."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return DEFAULT_FILE_MODE & ~umask


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(
    path: str | os.PathLike[str], data: str | bytes | Callable[[BinaryIO], None]
) -> Path:
    """Replace ``path`` with ``data`` (text, bytes, or a function writing to a binary file)
    so that readers never see a partial file; on any error the target is left untouched and
    the temporary file is removed (a full disk leaves nothing behind)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(target)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)
    return target


def rename_durably(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """``os.rename`` (atomic on one filesystem, never a copy) made durable: both parent
    directories are fsynced, so after a crash the entry is in exactly one of the two places."""
    source, destination = Path(source), Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    os.rename(source, destination)
    _fsync_directory(destination.parent)
    if source.parent != destination.parent:
        _fsync_directory(source.parent)


def remove_durably(path: str | os.PathLike[str]) -> None:
    """Unlink a file (if present) and fsync its directory."""
    target = Path(path)
    target.unlink(missing_ok=True)
    _fsync_directory(target.parent)


def atomic_write_json(path: str | os.PathLike[str], value: Any) -> Path:
    """:func:`atomic_write` of an indented, JSON-safe document."""
    return atomic_write(path, json.dumps(json_safe(value), indent=2) + "\n")


# -- append-only JSON Lines ----------------------------------------------------------------


class JsonlAppender:
    """Append-only JSONL file; one flushed ``write`` per record."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Held open for the run's lifetime: one flushed write per record.
        self._file: TextIO = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115
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

    def append(self, record: Any) -> None:
        """Write one record (a dict or dataclass) as one line and flush it to the OS."""
        self._file.write(json.dumps(json_safe(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class JsonlContent:
    """Parsed records plus the line numbers of torn (unparseable) lines that were skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    torn_lines: list[int] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)  # of each record, 1-based


_ITERATION_KEY = '{"iteration":'


def _outside(line: str, iterations: tuple[int, int]) -> bool:
    """True when a ``{"iteration":N,...`` line is certainly outside ``iterations``."""
    if not line.startswith(_ITERATION_KEY):
        return False
    end = line.find(",", len(_ITERATION_KEY))
    try:
        value = int(line[len(_ITERATION_KEY) : end])
    except ValueError:
        return False  # let the JSON parser decide (torn or foreign line)
    return not iterations[0] <= value <= iterations[1]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as handle:
        yield from enumerate(handle, start=1)


def read_jsonl(
    path: str | os.PathLike[str], warn: bool = True, iterations: tuple[int, int] | None = None
) -> JsonlContent:
    """Every JSON object line; torn lines are skipped and reported, never guessed at.

    With ``iterations``, lines that start with an ``iteration`` key outside the range are
    skipped unparsed (the writers here always put that key first), so a planner can read the
    stretch before an incident in a million-line log quickly.
    """
    content = JsonlContent()
    for number, line in _lines(Path(path)):
        if not line.strip() or (iterations is not None and _outside(line, iterations)):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            content.torn_lines.append(number)
            continue
        content.records.append(value)
        content.line_numbers.append(number)
    if warn and content.torn_lines:
        warnings.warn(
            f"{path}: skipped {len(content.torn_lines)} torn line(s) at "
            f"{content.torn_lines[:10]} (left by a killed writer)",
            stacklevel=2,
        )
    return content
