"""Per-rank record of which global sample ids each micro-batch trained on, and their losses
(append-only JSONL, no Megatron imports). Beside each rank's file, ``attempts-dp{rank}.jsonl``
says where each attempt's records start, ``layout.jsonl`` the layout each attempt ran with.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import LAYOUT_FILE, sample_log_attempts_file, sample_log_file
from megatron_ext.common.gap_log import GapLog, is_gap
from megatron_ext.common.io import JsonlAppender, from_json, read_jsonl, torn_tail


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

    def __init__(self, directory: str | os.PathLike[str], dp_rank: int, job_id: str = "") -> None:
        self._out = GapLog(sample_log_file(directory, dp_rank), "sample log")
        self.path = self._out.path
        self.attempts_path = sample_log_attempts_file(directory, dp_rank)
        self.job_id = job_id
        self._indexed = False

    def write(self, record: SampleRecord) -> bool:
        """Append one record (after this writer's attempt line, before its first record);
        False when the write failed (warned, named by a gap line once writing works)."""
        if not self._indexed:
            self._indexed = True
            try:
                index = JsonlAppender(self.attempts_path)
                # Where the next record starts: past the newline the writer adds first when a
                # torn tail (kill -9) left the last line open.
                size = self.path.stat().st_size + torn_tail(self.path) if self.path.exists() else 0
                index.append(
                    {
                        "offset": size,
                        "first_iteration": record.iteration,
                        "job_id": self.job_id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "wall_time": time.time(),
                    }
                )
                index.close()
            except OSError as exc:
                warnings.warn(
                    f"megatron-ext: the sample log's attempt index {self.attempts_path} could "
                    f"not be written ({exc}); lookup reads this attempt's records line by line",
                    stacklevel=2,
                )
        return self._out.append(asdict(record), record.iteration)


def read_records(path: str | os.PathLike[str]) -> Iterator[SampleRecord]:
    """Yield records in file order; torn lines are skipped and reported, a JSON line that is
    not a sample record is an error."""
    content = read_jsonl(path)
    for raw, number in zip(content.records, content.line_numbers):
        if is_gap(raw):
            continue  # records a full disk kept out (megatron_ext.common.gap_log); see read_gaps
        try:
            yield SampleRecord(**from_json(raw))
        except TypeError as exc:
            raise ValueError(f"{path}: line {number} is not a sample record: {exc}") from exc


# -- the layout log: one line per attempt --------------------------------------------------

# What places a sample in (iteration, DP rank, micro-batch): a change at a resume is what the
# lookup's layout history (megatron_ext.lookup.history) exists for. Names as in Megatron's args.
LAYOUT_FIELDS = (
    "data_parallel_size",
    "micro_batch_size",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "step_batch_size_schedule",
    "rampup_batch_size",  # honoured by megatron-core 0.17, ignored from 0.18 on
    "decrease_batch_size_if_needed",
    "train_iters",
    "train_samples",
)
# What identifies the data: a change at a resume means another dataset, not another layout.
DATA_FIELDS = ("data_path", "split", "seed", "seq_length", "dataloader_type")


def layout_record(args: Any, job_id: str, wall_time: float) -> dict[str, Any]:
    """An attempt's data layout, from Megatron's args after the checkpoint load (the lookup
    places every later iteration from it, without the checkpoints)."""
    return {
        "first_iteration": int(args.iteration) + 1,
        "consumed_samples": int(args.consumed_train_samples),
        **{name: getattr(args, name, None) for name in LAYOUT_FIELDS + DATA_FIELDS},
        "iterations_to_skip": sorted(int(i) for i in (args.iterations_to_skip or ())),
        # Mock data (MockGPTDataset): samples without documents; the lookup builds them again.
        "mock_data": bool(getattr(args, "mock_data", False)),
        # A drill corrupts batches in flight: the lookup names it where trained tokens differ.
        "drill_corrupt_batch": getattr(args, "drill_corrupt_batch", None),
        "job_id": job_id,
        "wall_time": wall_time,
    }


def append_layout(directory: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one attempt's layout to ``DIR/layout.jsonl``; a write failure only warns (the
    lookup then places this attempt's iterations from its checkpoints)."""
    out = GapLog(Path(directory) / LAYOUT_FILE, "layout log")
    out.append(record, int(record["first_iteration"]))
    out.close()
