"""What the supervisor reads of a run's progress between attempts.

- the checkpoint tracker before and after an attempt: an early exit (exit duration, exit
  interval, a stop signal) that saved a newer checkpoint made progress, so relaunching it is
  not a failure to budget for;
- the requeues made after such progress: Slurm counts every requeue in
  ``SLURM_RESTART_COUNT``, and a month-long run that stops at each allocation's time limit
  would exhaust ``MAX_RESTARTS`` with no failure at all, so these are kept in
  ``LAUNCH_STATE_DIR`` and not charged.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ext.common.files import UNCHARGED_REQUEUES_FILE, TrackerError, read_checkpoint_tracker
from megatron_ext.common.io import atomic_write


def tracker(ckpt_dir: Path) -> int | None:
    """The iteration of the newest checkpoint (None: none, or a damaged tracker, which the
    next attempt's start-up reports)."""
    try:
        return read_checkpoint_tracker(ckpt_dir)
    except TrackerError:
        return None


def uncharged_requeues(launch_state: Path) -> int:
    """Requeues after an early exit that saved progress, so far in this job."""
    try:
        text = (launch_state / UNCHARGED_REQUEUES_FILE).read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text) if text.isdigit() else 0


def count_uncharged_requeue(launch_state: Path) -> None:
    """Record one more (written atomically: a requeue may kill the supervisor right after)."""
    atomic_write(
        launch_state / UNCHARGED_REQUEUES_FILE, f"{uncharged_requeues(launch_state) + 1}\n"
    )
