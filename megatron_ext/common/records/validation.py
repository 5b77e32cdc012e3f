"""The validation log ``DIR/validation.jsonl``: one line per evaluated set per evaluation,
Megatron's ``lm loss`` beside each blend member's, written by the last rank (one ``os.write``
per line, as the signals log) and read back by tests and tools. No torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from megatron_ext.common.files import SIGNALS_FILE, VALIDATION_FILE
from megatron_ext.common.gap_log import GapLog
from megatron_ext.common.io import from_json, read_jsonl
from megatron_ext.common.records.signals import next_attempt


@dataclass
class ValidationRecord:
    """One evaluated set at one evaluation (``None``: not measured)."""

    iteration: int  # the training iteration evaluated after, as Megatron prints it
    attempt: int  # the signals log's attempt of the same launch
    job_id: str
    wall_time: float
    consumed_samples: int  # training samples consumed so far
    split: str  # "valid" or "test"
    set_name: str | None  # --multiple-validation-sets: Megatron's suffix; else None
    lm_loss: float | None  # Megatron's own validation lm loss of the set
    # Per member of the set's blend: token-weighted loss of its samples, and its loss tokens;
    # Σ loss·tokens / Σ tokens is lm_loss.
    lm_loss_by_dataset: dict[str, float] = field(default_factory=dict)
    tokens_by_dataset: dict[str, int] = field(default_factory=dict)


_FIELDS = {f.name for f in fields(ValidationRecord)}


def read_validation(path: str | os.PathLike[str]) -> list[ValidationRecord]:
    """Every record in file order; gap lines and foreign lines are left out."""
    return [ValidationRecord(**from_json(r)) for r in read_jsonl(path).records if set(r) == _FIELDS]


class ValidationWriter:
    """Appends :class:`ValidationRecord` lines to ``DIR/validation.jsonl``; the attempt is the
    signals log's next one, so records of one launch share it (opened before training logs)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.attempt = next_attempt(Path(directory) / SIGNALS_FILE)
        self.path = Path(directory) / VALIDATION_FILE
        self._out = GapLog(self.path, "validation log")

    def write(self, record: ValidationRecord) -> bool:
        """Append one record; False when the write failed (warned, kept as a gap)."""
        record.attempt = self.attempt
        return self._out.append(asdict(record), record.iteration)
