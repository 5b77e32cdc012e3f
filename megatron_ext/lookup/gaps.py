"""Logging gaps in the sample log: iterations trained while the log could not be written.

A full disk under ``--sample-log-dir`` no longer stops training; the records it kept out are
named by one gap record per outage (:mod:`megatron_ext.common.gap_log`). ``lookup --sample-log``
must then say "trained, not logged" for those iterations, not "not in the log".
"""

from __future__ import annotations

from pathlib import Path

from megatron_ext.common.files import sample_log_file
from megatron_ext.common.gap_log import Gap, read_gaps


def sample_log_gaps(directory: str | Path, dp_ranks: set[int]) -> dict[int, list[Gap]]:
    """The gap records of each DP rank's sample log."""
    return {rank: read_gaps(sample_log_file(directory, rank)) for rank in sorted(dp_ranks)}


def gap_of(gaps: dict[int, list[Gap]], iteration: int, dp_rank: int) -> Gap | None:
    """The logging gap that covers ``iteration`` on ``dp_rank``, if any."""
    return next((g for g in gaps.get(dp_rank, []) if g.covers(iteration)), None)
