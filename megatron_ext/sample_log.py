"""Per-rank record of which global sample ids each micro-batch trained on (and its loss).

Why: "what exactly was in that batch, on which rank?" must be answerable from facts written
during training, and resume/skip correctness is proven by comparing these records between an
interrupted and an uninterrupted run. The format is JSON Lines, append-only and flushed per
record, so a kill -9 leaves at most one torn last line, which :func:`read_records` drops.
No Megatron imports here; the adapter that calls :meth:`SampleLog.write` is ``gpt_step``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator


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
        self.path = Path(directory) / f"samples-dp{dp_rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: SampleRecord) -> None:
        """Append one record and flush, so it survives the process being killed."""
        self._file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
        self._file.flush()


def read_records(path: str | os.PathLike[str]) -> Iterator[SampleRecord]:
    """Yield records, dropping a torn final line (the only damage kill -9 can cause).

    Every record is written with its newline in one flushed write, so only text after the
    last newline can be incomplete. A malformed *complete* line means the file was edited or
    corrupted, and that is an error, never silently skipped.
    """
    text = Path(path).read_text(encoding="utf-8")
    complete, _, _torn = text.rpartition("\n")
    for number, line in enumerate(complete.split("\n") if complete else [], start=1):
        try:
            yield SampleRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: malformed sample record: {exc}") from exc
