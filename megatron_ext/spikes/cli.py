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
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        help="load a checkpoint at least this many iterations before the onset",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument(
        "--skip-batches",
        type=int,
        default=300,
        help="global batches to skip after the rollback target (PaLM: 200-500)",
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
        help="confirm: replay the same data first, skip only a reproduced spike",
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
        "--no-lookup",
        action="store_true",
        help="do not list the culprit batch's documents in the report",
    )
    return p


def _culprit_batch(plan: Plan, ckpt_dir: Path) -> str:
    """What the culprit DP rank read at the onset (``megatron-ext lookup``), for the report.

    Best effort: a failed lookup is reported in its place, it never blocks the rollback.
    """
    rank = plan.incident.get("culprit_dp_rank")
    command = [
        sys.executable,
        "-m",
        "megatron_ext.cli",
        "lookup",
        "--from-checkpoint",
        str(ckpt_dir),
        "--ckpt-step",
        str(plan.rollback_to),
        "--iteration",
        str(plan.onset),
        "--text",
        *(["--dp-rank", str(rank)] if rank is not None else []),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "lookup timed out"
    if result.returncode != 0:
        return f"lookup failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:]}"
    return result.stdout


def _train_iters(ckpt_dir: Path, iteration: int) -> int | None:
    """``train_iters`` from a checkpoint's saved Megatron args (None if unreadable)."""
    try:
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        return int(
            load_common_state_dict(str(checkpoint_dir(ckpt_dir, iteration)))["args"].train_iters
        )
    except Exception:  # a legacy or partial checkpoint: the window check is then skipped
        return None


def _earlier_skips(ckpt_dir: Path) -> list[int]:
    """Iterations already skipped: the applied list training keeps with the checkpoints.

    Not ``LAST_PLAN_SKIP_FILE``: that holds the last plan, which may never have been applied.
    """
    persisted = ckpt_dir / SKIPPED_ITERATIONS_FILE
    return read_file(persisted) if persisted.exists() else []


def _report(plan: Plan, number: int, culprit: str) -> str:
    incident = plan.incident
    rows = "\n".join(
        f"| {w['iteration']} | {w['lm_loss']} | {w['grad_norm']} | {w['max_local_loss']} | "
        f"{w['max_loss_dp_rank']} | {w['update_ratio']} |"
        for w in incident.get("window", [])
    )
    return (
        f"# Incident {number:03d}: {incident['kind']} at iteration {incident['iteration']}\n\n"
        f"{plan.summary}\n\n"
        f"- action: **{plan.action}**\n- onset: {plan.onset}\n"
        f"- culprit DP rank (max local loss): {incident.get('culprit_dp_rank')}\n"
        f"- classification: {incident.get('classification')}\n"
        f"- rollback to checkpoint: {plan.rollback_to} (moved aside: {plan.moved_checkpoints})\n"
        f"- skip window: {plan.skip_window}\n- all skipped: {plan.skip_ranges}\n"
        f"- restart with: `{' '.join(plan.restart_args)}`\n\n"
        "## Signals before the incident\n\n"
        "| iteration | lm loss | grad norm | max local loss | worst DP rank | update ratio |\n"
        "|---|---|---|---|---|---|\n" + rows + "\n\n"
        f"## What DP rank {incident.get('culprit_dp_rank')} read at iteration {plan.onset}\n\n"
        f"```\n{culprit.rstrip()}\n```\n"
    )


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
    culprit = (
        "not looked up (--no-lookup)" if args.no_lookup else _culprit_batch(plan, args.ckpt_dir)
    )
    report = {**plan.as_json(), "culprit_batch": culprit}
    atomic_write_json(stem.with_suffix(".json"), report)
    atomic_write(stem.with_suffix(".md"), _report(plan, number, culprit))
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
