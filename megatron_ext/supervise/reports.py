"""What the supervisor reports of a failed attempt: a hang (exit 43: the report in the log and
in ``CKPT_DIR/megatron_ext_incidents/hang-TAG.{json,md}``, and whether it repeats the previous
attempt's hang) and a failed result validation (exit 17)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from megatron_ext.common.files import INCIDENTS_DIR
from megatron_ext.common.io import atomic_write, atomic_write_json
from megatron_ext.common.records import hangs

STACK_LINES = 12  # of the hung rank's main thread, in the supervisor's log


def hang(
    hang_dir: Path,
    ckpt_dir: Path,
    tag: str,
    attempt: int,
    codes: tuple[int, ...],
    say: Callable[[str], None],
) -> tuple[str, bool]:
    """Write the report of the attempt ``tag`` and ``say`` it; return the hang's one-line
    description and whether it repeats the previous one."""
    report = hangs.report(hangs.read_dumps(hang_dir), len(codes) or None)
    if report is None:
        return "a rank's hang watchdog fired but no rank left its stacks", False
    repeats = hangs.repeats_previous(hang_dir, report.iteration, report.where)
    folder = ckpt_dir / INCIDENTS_DIR
    atomic_write_json(folder / f"hang-{tag}.json", report.as_json(attempt))
    markdown = atomic_write(folder / f"hang-{tag}.md", report.markdown(attempt, repeats))
    if not (hang_dir / hangs.REPORT_FILE).is_file():  # the firing rank died before writing it
        atomic_write_json(hang_dir / hangs.REPORT_FILE, report.as_json(attempt))
    first = report.dumps[0]
    ranks = ", ".join(f"rank {r}" for r in report.hung) or "no rank"
    description = (
        f"hang at iteration {report.iteration}: {ranks} made no progress (stuck at {report.where})"
    )
    say(f"attempt {attempt}: {description}; report: {markdown}")
    if report.silent:
        say(f"ranks that left no stacks (stopped or in the kernel): {list(report.silent)}")
    say(f"rank {first.rank} on {first.host}, main thread (innermost last):")
    lines = "".join(first.main_stack).rstrip().splitlines()[-STACK_LINES:]
    print("\n".join(lines), flush=True, file=sys.stderr)
    return description, repeats


def validation_failure(
    tracker: Path, ckpt_dir: Path, slurm: dict[str, str], say: Callable[[str], None]
) -> None:
    """Exit 17: what Megatron's result-rejected tracker file says, and where to go on."""
    say(
        "ERROR: training exited 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION): a "
        "result validation failed in Megatron's rerun state machine and the failure was "
        "reproducible or hardware-suspect. Not retrying on the same nodes."
    )
    say(f"result-rejected tracker file: {tracker}")
    if tracker.is_file() and tracker.stat().st_size:
        lines = tracker.read_text(errors="replace").splitlines()
        say("last tracker entries:")
        print("\n".join(lines[-10:]), file=sys.stderr, flush=True)
        nodes = sorted({w[5:] for line in lines for w in line.split() if w.startswith("node=")})
        if nodes:
            say(f"nodes named in the tracker file: {','.join(nodes)}")
    else:
        say("(the tracker file is missing or empty; see the training log above)")
    if slurm.get("SLURM_JOB_NODELIST"):
        say(f"this job ran on: {slurm['SLURM_JOB_NODELIST']}")
    say(
        f"inspect the log and tracker file; to continue from {ckpt_dir}, "
        "resubmit excluding the suspect node (sbatch --exclude=NODE ...)"
    )
