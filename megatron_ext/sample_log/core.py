"""Per-rank record of which global sample ids each micro-batch trained on, and their losses.

Why: "what exactly was in that batch, on which rank?" must be answerable from facts written
during training, and resume/skip correctness is proven by comparing these records between an
interrupted and an uninterrupted run. Each sample's token-averaged loss lets an incident name
the documents that drove a spike, not just the batch. The format is JSON Lines, append-only
and flushed per record, so a kill -9 leaves at most one torn last line, which
:func:`read_records` drops. No Megatron imports here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from megatron_ext.files import sample_log_file
from megatron_ext.io import JsonlAppender, from_json, read_jsonl


@dataclass(frozen=True)
class SampleRecord:
    """One micro-batch as one data-parallel rank saw it."""

    iteration: int  # 1-indexed, as Megatron logs it
    dp_rank: int
    microbatch: int
    sample_ids: list[int]
    token_sha1: list[str]  # SHA-1 of each sample's input token ids (int64, little-endian)
    loss_sum: float  # token-summed local training loss (before any averaging)
    num_tokens: int
    sample_losses: list[float] = field(default_factory=list)  # token-averaged, per sample
    # Token-summed local loss as Megatron's ``lm loss`` measures it: equal to ``loss_sum``
    # unless the training loss adds a term (z-loss). None in logs that predate the field.
    lm_loss_sum: float | None = None


class SampleLog:
    """Append-only JSONL writer, one file per DP rank (``samples-dp{rank}.jsonl``)."""

    def __init__(self, directory: str | os.PathLike[str], dp_rank: int) -> None:
        self._out = JsonlAppender(sample_log_file(directory, dp_rank))
        self.path = self._out.path

    def write(self, record: SampleRecord) -> None:
        """Append one record and flush, so it survives the process being killed."""
        self._out.append(asdict(record))


def read_records(path: str | os.PathLike[str]) -> Iterator[SampleRecord]:
    """Yield records in file order; torn lines (kill -9) are skipped and reported.

    A line that is valid JSON but not a sample record means the file is not what it claims
    to be, and that is an error, never silently skipped.
    """
    content = read_jsonl(path)
    for raw, number in zip(content.records, content.line_numbers):
        try:
            yield SampleRecord(**from_json(raw))
        except TypeError as exc:
            raise ValueError(f"{path}: line {number} is not a sample record: {exc}") from exc
