"""``megatron-ext skiplist``: plan (and with ``--apply``, carry out) a rollback + skip.

Writes the plan, the skip file and an incident report under ``CKPT/megatron_ext_incidents/``.
``--apply`` moves the checkpoints newer than the target to ``CKPT/rolled_back/incident-NNN/``,
points the tracker at the target and updates the persisted skip list, so the same launch
command resumes with the plan; it is journaled (killed, ``--apply`` finishes it, ``--undo``
reverts it). Exit status: 0 planned or already applied, 2 refused. See docs/incidents.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext.common import exit_codes
from megatron_ext.common.checkpoint_state import (
    CheckpointUnreadable,
    UnreadableState,
    checkpoint_problem,
    load_common_state,
    read_saved_args,
)
from megatron_ext.common.files import (
    CHECKPOINT_TRACKER_FILE,
    LAST_PLAN_SKIP_FILE,
    SIGNALS_FILE,
    SKIPPED_ITERATIONS_FILE,
    SPIKE_LEDGER_FILE,
    checkpoint_dir,
    incident_stem,
    read_checkpoint_tracker,
    rolled_back_dir,
)
from megatron_ext.common.io import atomic_write, atomic_write_json, read_jsonl
from megatron_ext.common.records.signals import SignalRecord, read_window
from megatron_ext.common.records.skip_ranges import format_windows, read_file, read_windows
from megatron_ext.common.records.skip_windows import Window
from megatron_ext.common.run_lock import RunLockHeld, held
from megatron_ext.incidents import transaction
from megatron_ext.incidents.planner import (
    MAX_REPEATS,
    Plan,
    PlanConfig,
    PlanError,
    check_unhandled,
    complete_newest_first,
    incident_id,
    latest_incident,
    make_plan,
    take_down_to,
)
from megatron_ext.incidents.report import DEFAULT_WORST, build_report

ONSET_LOOKBACK = 10_000  # iterations of signals read before the incident


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-ext skiplist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ckpt-dir", type=Path, required=True, help="the run's --save/--load dir")
    p.add_argument("--signals-dir", type=Path, help="the run's --signals-dir (not for --undo)")
    p.add_argument("--ledger", type=Path, help=f"spike ledger (SIGNALS/{SPIKE_LEDGER_FILE})")
    p.add_argument(
        "--rollback-iters",
        type=int,
        default=100,
        help="load a checkpoint at least this many iterations before the onset "
        "(default: %(default)s)",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument(
        "--skip-batches",
        type=int,
        default=300,
        help="global batches to skip after the rollback target (default: %(default)s)",
    )
    n.add_argument(
        "--skip-from-beta2",
        type=float,
        dest="beta2",
        help="derive the window from Adam beta2: 10 time constants, 10/(1-beta2)",
    )
    p.add_argument(
        "--policy",
        choices=["skip", "confirm"],
        default="skip",
        help="confirm: replay the same data first, skip only a reproduced spike "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--train-iters", type=int, help="refuse windows past it (default: read from the checkpoint)"
    )
    p.add_argument(
        "--tracker-file",
        type=Path,
        help="Megatron's --result-rejected-tracker-filename, for confirmed spikes (confirm policy)",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument("--apply", action="store_true", help="carry the plan out (see above)")
    action.add_argument(
        "--undo",
        action="store_true",
        help="revert an interrupted --apply (its journal is still in CKPT)",
    )
    p.add_argument(
        "--worst",
        type=int,
        default=DEFAULT_WORST,
        metavar="K",
        help="report the onset batch's K highest-loss samples and documents (needs the run's "
        "--sample-log-dir)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="--apply/--undo although the run lock's holder looks alive (known dead only)",
    )
    p.add_argument(
        "--no-lookup",
        action="store_true",
        help="do not look up the onset batch's documents for the report",
    )
    return p


def _train_iters(ckpt_dir: Path, newest_first: list[int]) -> int:
    """``train_iters`` from the newest checkpoint whose saved args read."""
    problems = []
    for iteration in newest_first:
        try:
            state = load_common_state(checkpoint_dir(ckpt_dir, iteration))
            return int(state["args"].train_iters)
        except CheckpointUnreadable as exc:
            problems.append(str(exc))
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    raise PlanError(
        f"no checkpoint's saved args could be read ({'; '.join(problems[:3])}{more}); pass "
        "--train-iters to plan without reading them"
    )


def _batch_at(ckpt_dir: Path, iteration: int) -> tuple[int, int] | None:
    """Checkpoint ``iteration``'s consumed samples and global batch (None: unreadable)."""
    try:
        args = read_saved_args(checkpoint_dir(ckpt_dir, iteration))
    except (UnreadableState, OSError):
        return None
    consumed, batch = getattr(args, "consumed_train_samples", None), args.global_batch_size
    return (int(consumed), int(batch)) if consumed is not None and batch else None


def _skip_text(plan: Plan, ckpt_dir: Path) -> str:
    """The persisted skip list plus the plan's window."""
    persisted = ckpt_dir / SKIPPED_ITERATIONS_FILE
    windows = read_windows(persisted) if persisted.exists() else []
    if plan.skip_window:
        samples = plan.skip_samples
        windows.append(Window(*plan.skip_window, (samples[0], samples[1]) if samples else None))
    return format_windows(windows)


def _number(ckpt_dir: Path, ident: str) -> int:
    """The incident's number: the one an earlier plan of the same request got, else the next."""
    incidents = incident_stem(ckpt_dir, 1).parent
    numbers = {}
    for path in incidents.glob("incident-*.json"):
        try:
            numbers[int(path.stem.removeprefix("incident-"))] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # not one of ours (or being written): never reuse its number
    for number, plan in sorted(numbers.items()):
        if isinstance(plan, dict) and plan.get("incident_id") == ident:
            return number
    return max(numbers, default=0) + 1


def _journal(
    plan: Plan, ckpt_dir: Path, number: int, ident: str, tracker_file: Path | None
) -> transaction.Journal:
    aside = rolled_back_dir(ckpt_dir, number).relative_to(ckpt_dir)
    tracker = ckpt_dir / CHECKPOINT_TRACKER_FILE
    skips = ckpt_dir / SKIPPED_ITERATIONS_FILE
    return transaction.Journal(
        incident=number,
        incident_id=ident,
        rollback_to=plan.rollback_to,
        tracker_before=tracker.read_text() if tracker.exists() else None,
        skips_before=skips.read_text() if skips.exists() else None,
        skips_after=_skip_text(plan, ckpt_dir),
        moves=[
            [name, str(aside / name)]
            for name in (checkpoint_dir(ckpt_dir, i).name for i in plan.moved_checkpoints)
        ],
        applied={
            "incident": number,
            "incident_id": ident,
            "onset": plan.onset,
            "iteration": plan.incident["iteration"],
            "attempt": plan.incident.get("attempt"),
            "rollback_to": plan.rollback_to,
            "skip_window": plan.skip_window,
            "action": plan.action,
            "applied_at": time.time(),
        },
        rejected_tracker=str(tracker_file) if plan.tracker_lines and tracker_file else None,
        rejected_lines=list(plan.tracker_lines) if tracker_file else [],
    )


def _pending(args: argparse.Namespace) -> int | None:
    """Finish (``--apply``) or undo (``--undo``) an interrupted apply; an exit status when
    there is nothing more to do."""
    if args.undo:
        journal = transaction.undo_pending(args.ckpt_dir)
        print(
            f"undid the interrupted apply of incident {journal.incident:03d}: checkpoints moved "
            f"back, tracker and skip list restored"
            if journal
            else f"nothing to undo: no interrupted --apply in {args.ckpt_dir}"
        )
        return 0
    if transaction.pending(args.ckpt_dir) is None:
        return None
    if not args.apply:
        raise PlanError(
            f"an --apply was interrupted in {args.ckpt_dir} (journal "
            f"{transaction.journal_path(args.ckpt_dir).name}): rerun with --apply to finish it, "
            "or with --undo to revert it"
        )
    journal = transaction.finish_pending(args.ckpt_dir)
    assert journal is not None
    print(
        f"finished the interrupted apply of incident {journal.incident:03d} "
        f"(rolled back to {journal.rollback_to})"
    )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.signals_dir is None and not args.undo:
        parser.error("--signals-dir is required (except with --undo)")
    if not (args.apply or args.undo):
        return _plan(args)
    if not args.ckpt_dir.is_dir():
        parser.error(f"--ckpt-dir {args.ckpt_dir} is not a directory")
    # --apply and --undo change the checkpoint directory: only as its one writer.
    what = "skiplist " + ("--apply" if args.apply else "--undo")
    try:
        with held(args.ckpt_dir, "skiplist", what, args.force):
            return _plan(args)
    except RunLockHeld as exc:
        return _refuse(str(exc).removeprefix("megatron-ext: "))


def _refuse(message: str) -> int:
    print(f"megatron-ext skiplist: error: {message}", file=sys.stderr)
    return exit_codes.USAGE


def _plan(args: argparse.Namespace) -> int:
    try:
        status = _pending(args)
        if status is not None:
            return status
        made = _make_plan(args)
    except (PlanError, ValueError, OSError, transaction.TransactionError) as exc:
        return _refuse(str(exc))
    return 0 if made is None else _write(args, *made)


def _make_plan(
    args: argparse.Namespace,
) -> tuple[Plan, list[dict[str, Any]], list[SignalRecord], str] | None:
    """The plan, the ledger, the signals read and the incident's identity (None: applied)."""
    if args.train_iters is not None and args.train_iters < 1:
        raise PlanError(
            f"--train-iters {args.train_iters}: must be >= 1 (leave it out to read it from the "
            "checkpoint)"
        )
    ledger_path = args.ledger or args.signals_dir / SPIKE_LEDGER_FILE
    signals_path = args.signals_dir / SIGNALS_FILE
    for path in (ledger_path, signals_path):
        if not path.exists():
            raise PlanError(
                f"{path} not found: was the run started with --signals-dir and --spike-detect?"
            )
    ledger: list[dict[str, Any]] = read_jsonl(ledger_path).records
    incident = latest_incident(ledger)
    ident = incident_id(incident)
    applied = transaction.applied_records(args.ckpt_dir)
    # The onset search looks back from the incident: read only that stretch of the log,
    # and check only the checkpoints a plan can use (the rollback target and those after).
    last = int(incident["iteration"])
    first = max(1, last - ONSET_LOOKBACK)
    floors = [min(int(incident["onset"]), first) - args.rollback_iters]
    floors += [int(r["rollback_to"]) for r in applied if r.get("incident_id") == ident]
    # A repeat of the last rollbacks goes to a checkpoint older than their targets.
    floors += [int(r["rollback_to"]) - 1 for r in applied[-MAX_REPEATS - 1 :]]
    newest_first = complete_newest_first(args.ckpt_dir)
    checkpoints = take_down_to(newest_first, min(floors))
    tracker = read_checkpoint_tracker(args.ckpt_dir)
    done = check_unhandled(incident, applied, checkpoints, tracker)
    if done is not None:
        print(
            f"incident {int(done['incident']):03d} ({ident}) is already applied: rolled "
            f"back to {done['rollback_to']}, nothing to do; restart with the same command"
        )
        return None
    config = PlanConfig(args.rollback_iters, args.skip_batches, args.beta2, args.policy)
    train_iters = args.train_iters or (
        _train_iters(args.ckpt_dir, checkpoints[::-1]) if checkpoints else None
    )
    history = read_window(signals_path, first, last)
    persisted = args.ckpt_dir / SKIPPED_ITERATIONS_FILE  # the skips applied so far
    plan = make_plan(
        ledger,
        history,
        checkpoints,
        read_file(persisted) if persisted.exists() else [],
        config,
        train_iters,
        str(args.ckpt_dir),
        lambda iteration: _batch_at(args.ckpt_dir, iteration),
        lambda iteration: checkpoint_problem(checkpoint_dir(args.ckpt_dir, iteration)),
        newest_first,
        applied,
    )
    return plan, ledger, history, ident


def _write(
    args: argparse.Namespace,
    plan: Plan,
    ledger: list[dict[str, Any]],
    history: list[SignalRecord],
    ident: str,
) -> int:
    """Write the plan, its report and skip file; with ``--apply`` carry it out."""
    number = _number(args.ckpt_dir, ident)
    stem = incident_stem(args.ckpt_dir, number)
    report = build_report(
        plan, ledger, history, args.ckpt_dir, number, None if args.no_lookup else args.worst
    )
    atomic_write_json(stem.with_suffix(".json"), {**report.as_json(), "incident_id": ident})
    atomic_write(stem.with_suffix(".md"), report.markdown())
    atomic_write(args.ckpt_dir / LAST_PLAN_SKIP_FILE, _skip_text(plan, args.ckpt_dir))
    if args.apply:
        journal = _journal(plan, args.ckpt_dir, number, ident, args.tracker_file)
        try:
            transaction.apply(args.ckpt_dir, journal)
        except (OSError, transaction.TransactionError) as exc:
            return _refuse(
                f"applying incident {number:03d} failed ({exc}); rerun with --apply to finish it "
                "or with --undo to revert it"
            )
    restart = f"not applied; restart with: {' '.join(plan.restart_args)}"
    print(plan.summary)
    print(f"plan: {stem.with_suffix('.json')}\nreport: {stem.with_suffix('.md')}")
    print("applied: restart with the same command" if args.apply else restart)
    return 0
