"""``skiplist --apply`` as a journaled transaction: a kill at any point leaves a resumable run.

The intent is journaled first; then the skip list, the tracker (and Bridge's train state), the
rejected lines, the moves to ``CKPT/rolled_back/incident-NNN/`` and the applied record, each
step idempotent; a journal found later is finished by ``--apply`` or start-up, or undone by
``--undo``. docs/incidents.md.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.errors import UsageError
from megatron_ext.common.files import (
    APPLY_JOURNAL_FILE,
    BRIDGE_TRACKER_FILE,
    BRIDGE_TRAIN_STATE_FILE,
    CHECKPOINT_TRACKER_FILE,
    SKIPPED_ITERATIONS_FILE,
    applied_incidents_file,
    checkpoint_dir,
)
from megatron_ext.common.io import (
    JsonlAppender,
    atomic_write,
    atomic_write_json,
    kill_point,
    read_jsonl,
    remove_durably,
    rename_durably,
)


class TransactionError(UsageError, RuntimeError):
    """A pending apply cannot be finished as recorded; the message says what to do."""


@dataclass
class Journal:
    """Everything needed to finish or undo one apply, written before anything changes."""

    incident: int  # incident-NNN
    incident_id: str
    rollback_to: int
    tracker_before: str | None  # the tracker's text before the apply (None: there was none)
    skips_before: str | None
    skips_after: str
    moves: list[list[str]]  # [source, destination], relative to the checkpoint directory
    applied: dict[str, Any]  # the line recorded in applied.jsonl
    rejected_tracker: str | None = None  # Megatron's --result-rejected-tracker-filename
    rejected_lines: list[str] = field(default_factory=list)
    # Megatron-Bridge's tracker before the apply, base64 (None: there was none).
    bridge_tracker_before: str | None = None


def journal_path(ckpt_dir: str | Path) -> Path:
    return Path(ckpt_dir) / APPLY_JOURNAL_FILE


def pending(ckpt_dir: str | Path) -> Journal | None:
    """The journal of an apply that did not finish, if any."""
    path = journal_path(ckpt_dir)
    if not path.exists():
        return None
    try:
        return Journal(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:  # written atomically: only a foreign file gets here
        raise TransactionError(
            f"{path} is not a megatron-ext apply journal ({exc}); if no `skiplist --apply` "
            "ran here, move it away"
        ) from None


def _restore(path: Path, text: str | None) -> None:
    if text is None:
        remove_durably(path)
    else:
        atomic_write(path, text)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def applied_records(ckpt_dir: str | Path) -> list[dict[str, Any]]:
    """The applied incidents; a line whose iteration fields are not whole numbers is refused
    (the planner and the undo compute with them)."""
    path = applied_incidents_file(ckpt_dir)
    if not path.exists():
        return []
    content = read_jsonl(path)
    for number, record in zip(content.line_numbers, content.records, strict=True):
        bad = [
            f"{key}={record.get(key)!r}"
            for key in ("incident", "onset", "rollback_to")
            if not _whole(record.get(key))
        ]
        window = record.get("skip_window")
        if window is not None and not (
            isinstance(window, list) and len(window) == 2 and all(map(_whole, window))
        ):
            bad.append(f"skip_window={window!r}")
        if bad:
            raise TransactionError(
                f"{path}:{number}: an applied incident with {', '.join(bad)}, not iteration "
                "numbers: the line is damaged or was not written by `skiplist --apply`; restore "
                "it from that incident's plan (incident-NNN.json next to it)"
            )
    return content.records


def _move(ckpt_dir: Path, source: str, destination: str, journal: Journal) -> None:
    src, dst = ckpt_dir / source, ckpt_dir / destination
    if src.exists() and dst.exists():
        raise TransactionError(
            f"both {src} and {dst} exist: the apply of incident {journal.incident:03d} cannot "
            "tell which one to keep; move one away by hand and rerun"
        )
    if src.exists():
        rename_durably(src, dst)


def _set_rejected_lines(journal: Journal, present: bool) -> None:
    if not journal.rejected_tracker or not journal.rejected_lines:
        return
    path = Path(journal.rejected_tracker)
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    if present:
        missing = [line for line in journal.rejected_lines if line not in lines]
        if missing:  # Megatron's own append-only format
            with open(path, "a") as handle:
                handle.write(("" if not text or text.endswith("\n") else "\n") + "".join(missing))
                handle.flush()
                os.fsync(handle.fileno())
    elif any(line in lines for line in journal.rejected_lines):
        atomic_write(path, "".join(line for line in lines if line not in journal.rejected_lines))


def _carry_out(ckpt_dir: Path, journal: Journal) -> None:
    """Steps 2-6; each one is a no-op when already done."""
    target = checkpoint_dir(ckpt_dir, journal.rollback_to)
    if not target.is_dir():
        raise TransactionError(
            f"the pending apply of incident {journal.incident:03d} rolls back to {target}, which "
            f"is missing: restore it, or undo the apply with `megatron-ext skiplist --ckpt-dir "
            f"{ckpt_dir} --undo`"
        )
    atomic_write(ckpt_dir / SKIPPED_ITERATIONS_FILE, journal.skips_after)
    kill_point()
    atomic_write(ckpt_dir / CHECKPOINT_TRACKER_FILE, f"{journal.rollback_to}\n")
    bridge_state = target / BRIDGE_TRAIN_STATE_FILE
    if bridge_state.is_file():  # a Megatron-Bridge checkpoint
        atomic_write(ckpt_dir / BRIDGE_TRACKER_FILE, bridge_state.read_bytes())
    kill_point()
    _set_rejected_lines(journal, present=True)
    kill_point()
    for source, destination in journal.moves:
        _move(ckpt_dir, source, destination, journal)
        kill_point()
    if not any(r.get("incident_id") == journal.incident_id for r in applied_records(ckpt_dir)):
        appender = JsonlAppender(applied_incidents_file(ckpt_dir))
        appender.append(journal.applied)
        appender.close()
    kill_point()
    remove_durably(journal_path(ckpt_dir))


def apply(ckpt_dir: str | Path, journal: Journal) -> None:
    ckpt_dir = Path(ckpt_dir)
    if pending(ckpt_dir) is not None:
        raise TransactionError(f"{journal_path(ckpt_dir)} exists: finish or undo it first")
    bridge_tracker = ckpt_dir / BRIDGE_TRACKER_FILE
    if bridge_tracker.is_file() and journal.bridge_tracker_before is None:
        journal.bridge_tracker_before = base64.b64encode(bridge_tracker.read_bytes()).decode()
    atomic_write_json(journal_path(ckpt_dir), asdict(journal))
    kill_point()
    _carry_out(ckpt_dir, journal)


def finish_pending(ckpt_dir: str | Path) -> Journal | None:
    """Roll a pending apply forward (the intent was recorded, so it is carried out)."""
    journal = pending(ckpt_dir)
    if journal is not None:
        _carry_out(Path(ckpt_dir), journal)
    return journal


def undo_pending(ckpt_dir: str | Path) -> Journal | None:
    """Put everything back as the journal found it, checkpoints before the tracker (so it
    never names a moved checkpoint)."""
    ckpt_dir = Path(ckpt_dir)
    journal = pending(ckpt_dir)
    if journal is None:
        return None
    for source, destination in reversed(journal.moves):
        _move(ckpt_dir, destination, source, journal)
        kill_point()
    _restore(ckpt_dir / CHECKPOINT_TRACKER_FILE, journal.tracker_before)
    if journal.bridge_tracker_before is not None:
        atomic_write(
            ckpt_dir / BRIDGE_TRACKER_FILE, base64.b64decode(journal.bridge_tracker_before)
        )
    kill_point()
    _restore(ckpt_dir / SKIPPED_ITERATIONS_FILE, journal.skips_before)
    kill_point()
    _set_rejected_lines(journal, present=False)
    records = applied_records(ckpt_dir)
    if any(r.get("incident_id") == journal.incident_id for r in records):
        kept = [r for r in records if r.get("incident_id") != journal.incident_id]
        atomic_write(
            applied_incidents_file(ckpt_dir),
            "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept),
        )
    kill_point()
    remove_durably(journal_path(ckpt_dir))
    return journal


def settle_at_startup(load: str | None, rank: int) -> Journal | None:
    """Training start-up: rank 0 finishes an interrupted apply in ``--load``; the others wait
    for the journal to go (the shared filesystem is the only channel yet)."""
    if not load or not journal_path(load).exists():
        return None
    if rank == 0:
        try:
            return finish_pending(load)
        except TransactionError as exc:
            raise SystemExit(f"megatron-ext: {exc}") from None
    wait_for_rank_0(
        lambda: not journal_path(load).exists(),
        f"rank {rank}: rank 0 did not finish the interrupted `skiplist --apply` in {load}",
    )
    return None


def wait_for_rank_0(done: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
    """Poll the shared filesystem until ``done()``; past ``timeout``, exit saying ``what``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"megatron-ext: {what} within {timeout:.0f} s; see rank 0's output")
        time.sleep(0.5)
