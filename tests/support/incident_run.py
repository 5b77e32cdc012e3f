"""A spiking run as the skip-list tests need it: signals, a ledger with the same spike in two
attempts, checkpoints every 5 iterations up to 45, and ``megatron-ext skiplist`` run on it."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from megatron_ext.common.io import JsonlAppender
from megatron_ext.incidents.cli import main as skiplist_main
from tests.support.checkpoints import write_loadable_checkpoint
from tests.support.spike_curves import events, records

CHECKPOINTS = list(range(5, 50, 5))
SPIKE = {i: (5.0, 6.0 if i == 40 else 1.0) for i in range(40, 60)}
FOREIGN_REJECTED_LINE = "ts=x node=n1 device=0 jobID=7 rank=3 iteration=9 status=other result=1\n"
EARLIER_SKIPS = "3\n"
PLAN = ["--rollback-iters", "5", "--skip-batches", "20", "--train-iters", "100", "--no-lookup"]
# journal, skip list, tracker, rejected lines, 2 moves, applied record
APPLY_STEPS = 7


def make_run(root: Path, attempts: int = 2) -> Path:
    """A spiking run's signals, ledger and checkpoint directory under ``root``."""
    signals, ledger = (
        JsonlAppender(root / "signals" / "signals.jsonl"),
        JsonlAppender(root / "signals" / "spikes.jsonl"),
    )
    for attempt in range(1, attempts + 1):
        curve = records(60, SPIKE, attempt=attempt)
        for record in curve:
            signals.append(record.as_json())
        for event in events(curve):
            ledger.append({**event.as_json(), "attempt": attempt})
    signals.close()
    ledger.close()
    ckpt = root / "ckpt"
    for iteration in CHECKPOINTS:
        write_loadable_checkpoint(ckpt / f"iter_{iteration:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("45")
    (ckpt / "megatron_ext_skipped_iterations.txt").write_text(EARLIER_SKIPS)
    (root / "rejected.txt").write_text(FOREIGN_REJECTED_LINE)
    return root


def skiplist_argv(root: Path, *extra: str) -> list[str]:
    return [
        "--ckpt-dir",
        str(root / "ckpt"),
        "--signals-dir",
        str(root / "signals"),
        "--policy",
        "confirm",
        "--tracker-file",
        str(root / "rejected.txt"),
        *PLAN,
        *extra,
    ]


def rerun(root: Path, *extra: str) -> tuple[int, str]:
    """The CLI's ``main`` in this process (exit status, stdout + stderr): the finishing
    command after a kill, where the process boundary is not what is tested."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = skiplist_main(skiplist_argv(root, *extra))
    return status, out.getvalue() + err.getvalue()
