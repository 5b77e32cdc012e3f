"""Crash-safe files: append-only JSON Lines (one flushed ``write`` a record: a kill -9 leaves at
most one torn line, ended by the next writer, skipped by readers), atomic whole-file writes
keeping the mode, and JSON-safe records (non-finite floats as ``"nan"``, ``"inf"``, ``"-inf"``).
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

DEFAULT_FILE_MODE = 0o666  # masked by the process umask, as open() does

# Tests only: SIGKILL this process right after its k-th kill point (a multi-step write's step).
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


_NON_FINITE = {s: float(s) for s in ("nan", "inf", "-inf", "NaN", "Infinity", "-Infinity")}


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
    """SHA-1 of one sample's token ids as little-endian int64 (the sample log and the lookup
    must agree byte for byte)."""
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
    """Replace ``path`` with ``data`` (text, bytes, or a function writing to a binary file);
    readers never see a partial file, and an error leaves the target and no temporary."""
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
    """``os.rename`` made durable: both parent directories are fsynced."""
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


def check_writable(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` and a file in it now, before any work (``OSError`` where either
    fails), so that a refusal comes before anything is written."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    tempfile.NamedTemporaryFile(dir=directory, prefix=".megatron-ext-write-test.").close()


def atomic_write_json(path: str | os.PathLike[str], value: Any) -> Path:
    """:func:`atomic_write` of an indented, JSON-safe document."""
    return atomic_write(path, json.dumps(json_safe(value), indent=2) + "\n")


# -- append-only JSON Lines ----------------------------------------------------------------


def torn_tail(path: str | os.PathLike[str]) -> bool:
    """Whether the file ends inside a line (a kill -9 or a short write mid-record)."""
    try:
        with open(path, "rb") as raw:
            size = raw.seek(0, os.SEEK_END)
            return size > 0 and (raw.seek(size - 1), raw.read(1))[1] != b"\n"
    except FileNotFoundError:
        return False


class JsonlAppender:
    """Append-only JSONL file; one flushed ``write`` per record."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115
        if torn_tail(self.path):
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
    """The parsed records, and each one's line number (1-based)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)


def read_jsonl(path: str | os.PathLike[str], warn: bool = True) -> JsonlContent:
    """Every JSON object line; torn lines are skipped and reported, never guessed at."""
    content, torn = JsonlContent(), []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if not isinstance(value, dict):
                torn.append(number)
                continue
            content.records.append(value)
            content.line_numbers.append(number)
    if warn and torn:
        warnings.warn(
            f"{path}: skipped {len(torn)} torn line(s) at {torn[:10]} (left by a killed writer)",
            stacklevel=2,
        )
    return content
