"""Per-rank record of which global sample ids each micro-batch trained on (and its loss).

Why: "what exactly was in that batch, on which rank?" must be answerable from facts written
during training, and resume/skip correctness is proven by comparing these records between an
interrupted and an uninterrupted run. The format is JSON Lines, append-only and flushed per
record, so a kill -9 leaves at most one torn last line, which :func:`read_records` drops.
No Megatron imports here; the adapter that calls :meth:`SampleLog.write` is ``gpt_step``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from megatron_ext.jsonl import JsonlAppender, read_jsonl


@dataclass(frozen=True)
class SampleRecord:
    """One micro-batch as one data-parallel rank saw it."""

    iteration: int  # 1-indexed, as Megatron logs it
    dp_rank: int
    microbatch: int
    sample_ids: list[int]
    token_sha1: list[str]  # SHA-1 of each sample's input token ids (int64, little-endian)
    loss_sum: float  # token-summed local loss (before any averaging)
    num_tokens: int


class SampleLog:
    """Append-only JSONL writer, one file per DP rank (``samples-dp{rank}.jsonl``)."""

    def __init__(self, directory: str | os.PathLike[str], dp_rank: int) -> None:
        self._out = JsonlAppender(Path(directory) / f"samples-dp{dp_rank}.jsonl")
        self.path = self._out.path

    def write(self, record: SampleRecord) -> None:
        """Append one record and flush, so it survives the process being killed."""
        self._out.append(asdict(record))


def read_records(path: str | os.PathLike[str]) -> Iterator[SampleRecord]:
    """Yield records in file order; torn lines (kill -9) are skipped and reported.

    A line that is valid JSON but not a sample record means the file is not what it claims
    to be, and that is an error, never silently skipped.
    """
    for number, raw in enumerate(read_jsonl(path).records, start=1):
        try:
            yield SampleRecord(**raw)
        except TypeError as exc:
            raise ValueError(f"{path}: record {number} is not a sample record: {exc}") from exc
