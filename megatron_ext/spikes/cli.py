"""``megatron-ext skiplist``: plan (and with ``--apply``, carry out) a rollback + skip.

Reads the spike ledger and signals log (all attempts), the checkpoint directory and earlier
skip lists; writes the plan (JSON), the skip file and an incident report (Markdown + JSON)
under ``CKPT/megatron_ext_incidents/``. ``--apply`` then moves checkpoints newer than the
rollback target aside (``CKPT/rolled_back/incident-NNN/``, nothing is deleted), points
Megatron's ``latest_checkpointed_iteration.txt`` at the target and updates the persisted skip
list that ``pretrain_gpt_ext.py`` reads from ``--load``, so the same launch command resumes
with the plan. Every file is written atomically. Exit status: 0 planned, 2 impossible plan.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from megatron_ext.checkpoint_state import UnreadableState, read_saved_args
from megatron_ext.files import (
    CHECKPOINT_TRACKER_FILE,
    LAST_PLAN_SKIP_FILE,
    SIGNALS_FILE,
    SKIPPED_ITERATIONS_FILE,
    SPIKE_LEDGER_FILE,
    checkpoint_dir,
    incident_stem,
    rolled_back_dir,
)
from megatron_ext.io import atomic_write, atomic_write_json, read_jsonl
from megatron_ext.spikes.planner import (
    Plan,
    PlanConfig,
    PlanError,
    complete_checkpoints,
    make_plan,
)
from megatron_ext.spikes.report import DEFAULT_WORST, build_report
from megatron_ext.spikes.skip_ranges import format_ranges, read_file
from megatron_ext.telemetry.signals import read_signals

ONSET_LOOKBACK = 10_000  # iterations of signals read before the incident


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-ext skiplist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ckpt-dir", type=Path, required=True, help="the run's --save/--load dir")
    p.add_argument("--signals-dir", type=Path, required=True, help="the run's --signals-dir")
    p.add_argument(
        "--ledger", type=Path, help=f"spike ledger (default SIGNALS/{SPIKE_LEDGER_FILE})"
    )
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
        help="global batches to skip after the rollback target (PaLM: 200-500) "
        "(default: %(default)s)",
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
        help="Megatron --result-rejected-tracker-filename to append confirmed "
        "spikes to (confirm policy)",
    )
    p.add_argument("--apply", action="store_true", help="carry the plan out (see above)")
    p.add_argument(
        "--worst",
        type=int,
        default=DEFAULT_WORST,
        metavar="K",
        help="list the onset batch's K samples with the highest loss, and their documents, in "
        "the report (megatron-ext lookup --worst; needs the run's --sample-log-dir)",
    )
    p.add_argument(
        "--no-lookup",
        action="store_true",
        help="do not look up the onset batch's documents for the report",
    )
    return p


def _train_iters(ckpt_dir: Path, iteration: int) -> int | None:
    """``train_iters`` from a checkpoint's saved Megatron args (None if unreadable)."""
    try:
        return int(read_saved_args(checkpoint_dir(ckpt_dir, iteration)).train_iters)
    except (UnreadableState, OSError, TypeError, ValueError):
        return None  # a partial or unknown checkpoint: the window check is then skipped


def _earlier_skips(ckpt_dir: Path) -> list[int]:
    """Iterations already skipped: the applied list training keeps with the checkpoints.

    Not ``LAST_PLAN_SKIP_FILE``: that holds the last plan, which may never have been applied.
    """
    persisted = ckpt_dir / SKIPPED_ITERATIONS_FILE
    return read_file(persisted) if persisted.exists() else []


def _apply(plan: Plan, ckpt_dir: Path, number: int, tracker_file: Path | None) -> None:
    aside = rolled_back_dir(ckpt_dir, number)
    for iteration in plan.moved_checkpoints:
        aside.mkdir(parents=True, exist_ok=True)
        source = checkpoint_dir(ckpt_dir, iteration)
        shutil.move(str(source), str(aside / source.name))
    skipped = [i for a, b in plan.skip_ranges for i in range(a, b + 1)]
    atomic_write(ckpt_dir / SKIPPED_ITERATIONS_FILE, format_ranges(skipped))
    atomic_write(ckpt_dir / CHECKPOINT_TRACKER_FILE, f"{plan.rollback_to}\n")
    if plan.tracker_lines and tracker_file is not None:
        with open(tracker_file, "a") as handle:  # Megatron's own append-only format
            handle.write("".join(plan.tracker_lines))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ledger_path = args.ledger or args.signals_dir / SPIKE_LEDGER_FILE
    signals_path = args.signals_dir / SIGNALS_FILE
    try:
        for path in (ledger_path, signals_path):
            if not path.exists():
                raise PlanError(
                    f"{path} not found: was the run started with --signals-dir and --spike-detect?"
                )
        ledger: list[dict[str, Any]] = read_jsonl(ledger_path).records
        checkpoints = complete_checkpoints(args.ckpt_dir)
        config = PlanConfig(
            rollback_iters=args.rollback_iters,
            skip_batches=args.skip_batches,
            beta2=args.beta2,
            policy=args.policy,
        )
        train_iters = args.train_iters or (
            _train_iters(args.ckpt_dir, checkpoints[-1]) if checkpoints else None
        )
        # The onset search looks back from the incident; read only that stretch of the log.
        last = max((int(e["iteration"]) for e in ledger if e.get("kind") == "rollback"), default=0)
        history = read_signals(signals_path, iterations=(max(1, last - ONSET_LOOKBACK), last))
        plan = make_plan(
            ledger,
            history,
            checkpoints,
            _earlier_skips(args.ckpt_dir),
            config,
            train_iters,
            str(args.ckpt_dir),
        )
    except (PlanError, ValueError) as exc:
        print(f"megatron-ext skiplist: error: {exc}", file=sys.stderr)
        return 2
    incidents = incident_stem(args.ckpt_dir, 1).parent
    number = len(list(incidents.glob("incident-*.json"))) + 1 if incidents.exists() else 1
    stem = incident_stem(args.ckpt_dir, number)
    report = build_report(
        plan, ledger, history, args.ckpt_dir, number, None if args.no_lookup else args.worst
    )
    atomic_write_json(stem.with_suffix(".json"), report.as_json())
    atomic_write(stem.with_suffix(".md"), report.markdown())
    skipped = [i for a, b in plan.skip_ranges for i in range(a, b + 1)]
    atomic_write(args.ckpt_dir / LAST_PLAN_SKIP_FILE, format_ranges(skipped))
    if args.apply:
        _apply(plan, args.ckpt_dir, number, args.tracker_file)
    print(plan.summary)
    print(
        f"plan: {stem.with_suffix('.json')}\nreport: {stem.with_suffix('.md')}"
        + (
            "\napplied: restart with the same command"
            if args.apply
            else f"\nnot applied; restart with: {' '.join(plan.restart_args)}"
        )
    )
    return 0
