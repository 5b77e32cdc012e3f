"""The per-step signals log: one JSON line per iteration, append-only, attempt-aware.

Why: a loss spike is diagnosed from signals recorded *before* it: loss, the rank with the
worst local loss, grad and per-bucket grad norms, params norm, update ratio, lr,
loss scale, zeros in the grads, max attention logit. The log is written every step by one
rank. A restart (requeue, rollback) appends under a new ``attempt`` number instead of
rewriting history; readers take the latest attempt per iteration. A write failure (a full
disk) never stops training: the records that could not be written are named by one gap line,
``{"gap": {"first_iteration": A, "last_iteration": B, "records_lost": N, "reason": ...,
"wall_time": T}}`` (:class:`~megatron_ext.common.gap_log.Gap`, :func:`read_gaps`), once writing
works again. No Megatron
imports here.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_ext.common.gap_log import Gap, is_gap, read_gaps
from megatron_ext.common.io import from_json, json_safe, read_jsonl


@dataclass
class SignalRecord:
    """What one training iteration looked like (``None``: not measured in this run)."""

    iteration: int  # 1-indexed, as Megatron logs it
    attempt: int  # 1 for the first launch writing this log, +1 per restart
    job_id: str
    wall_time: float  # seconds since the epoch when the iteration was logged
    consumed_samples: int
    skipped_samples: int
    lm_loss: float | None
    z_loss: float | None = None
    max_local_loss: float | None = None  # the worst DP rank's token-averaged loss
    max_loss_dp_rank: int | None = None
    grad_norm: float | None = None  # pre-clip, as Megatron computes it
    bucket_grad_norms: dict[str, float] = field(default_factory=dict)
    # Per blend member (named by its --data-path prefix, the basename when unambiguous): the
    # token-weighted pure-CE loss of its samples in this global batch (members with tokens
    # only; the token-weighted mean is lm_loss) and its loss-mask tokens.
    lm_loss_by_dataset: dict[str, float] = field(default_factory=dict)
    tokens_by_dataset: dict[str, int] = field(default_factory=dict)
    params_norm: float | None = None
    update_ratio: float | None = None  # ||Δθ|| / ||θ||
    lr: float | None = None
    loss_scale: float | None = None
    num_zeros: float | None = None
    max_attention_logit: float | None = None
    skipped_iter: bool = False  # the optimizer skipped the update (inf/NaN grads)
    nan_iter: bool = False
    # Appended fields (older logs lack them): the mean log Z of the output softmax over the
    # loss tokens (--log-output-z), and whether --spike-skip-update withheld this step's
    # optimizer update (skipped_iter is then True too).
    log_z: float | None = None
    update_skipped: bool = False

    def as_json(self) -> dict[str, Any]:
        return json_safe(self)


_FIELDS = {f.name for f in fields(SignalRecord)}
# Gap records are part of this log's format (module docstring); readers find them here too.
__all__ = [
    "Gap",
    "SignalRecord",
    "latest_per_iteration",
    "read_gaps",
    "read_signals",
]


def read_signals(
    path: str | os.PathLike[str], iterations: tuple[int, int] | None = None
) -> list[SignalRecord]:
    """Every record of every attempt, in file order (torn lines skipped and reported).

    ``iterations=(first, last)`` keeps only that range; lines outside it are recognised by
    their leading ``{"iteration":N`` key without being parsed, so a planner can look at the
    stretch before an incident in a million-line log quickly.

    A JSON line that is not a signals record (another tool appended to the file, or a field
    this version does not know) is skipped with a warning naming its line, as a torn line
    is: one foreign line must not stop a training start-up or hide the other records.
    """
    content = read_jsonl(path, iterations=iterations)
    records, foreign = [], []
    for number, raw in zip(content.line_numbers, content.records):
        if is_gap(raw):
            continue  # read_gaps
        try:
            if set(raw) - _FIELDS:
                raise TypeError(f"unknown fields {sorted(set(raw) - _FIELDS)}")
            records.append(SignalRecord(**from_json(raw)))
        except TypeError as exc:
            foreign.append(f"line {number} ({exc})")
    if foreign:
        warnings.warn(
            f"{path}: skipped {len(foreign)} line(s) that are not signals records: "
            f"{'; '.join(foreign[:5])}",
            stacklevel=2,
        )
    return records


def latest_per_iteration(records: list[SignalRecord]) -> list[SignalRecord]:
    """One record per iteration: the one from the latest attempt (a rollback's replay wins)."""
    best: dict[int, SignalRecord] = {}
    for record in records:
        current = best.get(record.iteration)
        if current is None or record.attempt >= current.attempt:
            best[record.iteration] = record
    return [best[i] for i in sorted(best)]
