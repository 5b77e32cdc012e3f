"""The run's layout history: which DP size, micro and global batch and skips each iteration
was trained with, across resumes that changed them.

Users resize on resume (nodes lost: DP=2 to iteration 10, then DP=1 with the same global
batch; or a smaller micro-batch for memory). The sample stream is the same, but which DP
rank and micro-batch read a sample is not, so one checkpoint's args answer only for the
iterations its own attempt trained. Two records give the history:

- **the layout log** (``SAMPLE_LOG_DIR/layout.jsonl``, one line per attempt, written at
  start-up: first iteration, consumed samples, DP, micro/global batch, skips). It survives
  the deletion of old checkpoints, and its order is the order the attempts ran in;
- **every checkpoint's saved args**: the attempt that saved ``iter_N`` resumed from
  ``args.iteration`` (Megatron sets it at load and saves it unchanged), so it trained
  ``args.iteration+1 .. N`` with the layout in those args.

Iteration ``k`` was last trained by the latest attempt that started at or before ``k``: the
last such line of the layout log, else the checkpoint segment that starts latest. An
iteration no record covers is a gap: refused, never answered with another layout.
No Megatron import here (checkpoints are read through :mod:`megatron_ext.common.checkpoint_state`).
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.files import CHECKPOINT_DIR, LAYOUT_FILE
from megatron_ext.common.io import read_jsonl
from megatron_ext.common.records.sample_log import DATA_FIELDS, LAYOUT_FIELDS
from megatron_ext.lookup.errors import ConfigError, PositionError


@dataclass(frozen=True)
class Segment:
    """Iterations ``first ..`` as one attempt trained them."""

    first: int  # first iteration the attempt trained (resume + 1)
    consumed: int | None  # consumed_train_samples before ``first`` (None: not known yet)
    layout: dict[str, Any]  # LAYOUT_FIELDS values
    skips: frozenset[int]
    data: dict[str, Any]  # DATA_FIELDS values
    source: str  # for humans: where this segment comes from
    started: float | None = None  # the layout line's wall time (places sample-log attempts)
    job_id: str = ""
    drill: str | None = None  # the attempt's --drill-corrupt-batch (layout log)

    def describe(self) -> str:
        layout = self.layout
        return (
            f"iterations {self.first}.. trained with DP={layout['data_parallel_size']}, "
            f"micro-batch {layout['micro_batch_size']}, global batch "
            f"{layout['global_batch_size']} ({self.source})"
        )


def _pick(values: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    get = values.get if isinstance(values, dict) else lambda k: getattr(values, k, None)
    return {name: get(name) for name in fields}


def log_segments(path: Path) -> list[Segment]:
    """The layout log's lines, in the order the attempts started."""
    content = read_jsonl(path)
    segments = []
    for number, record in zip(content.line_numbers, content.records):
        try:
            segments.append(
                Segment(
                    first=int(record["first_iteration"]),
                    consumed=int(record["consumed_samples"]),
                    layout=_pick(record, LAYOUT_FIELDS),
                    skips=frozenset(int(i) for i in record.get("iterations_to_skip") or ()),
                    data=_pick(record, DATA_FIELDS),
                    source=f"{path} line {number}",
                    started=record.get("wall_time"),
                    job_id=str(record.get("job_id") or ""),
                    drill=record.get("drill_corrupt_batch"),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path} line {number} is not a layout record: {exc}") from None
    return segments


def checkpoint_segments(checkpoints: list[tuple[int, argparse.Namespace]]) -> list[Segment]:
    """One segment per attempt that left checkpoints (iteration, saved args), oldest first;
    the consumed samples at its start come from the checkpoint it resumed from, or back from
    its own when the batch size was constant."""
    consumed_at = {n: int(getattr(a, "consumed_train_samples", 0) or 0) for n, a in checkpoints}
    by_start: dict[int, Segment] = {}
    for iteration, args in sorted(checkpoints, key=lambda item: item[0]):
        resumed = int(getattr(args, "iteration", 0) or 0)
        if resumed >= iteration:  # saved by an attempt that trained nothing: no evidence
            continue
        layout = _pick(args, LAYOUT_FIELDS)
        consumed = 0 if resumed == 0 else consumed_at.get(resumed)
        # 0.17's args have no step_batch_size_schedule, and 0.17 ramps the batch up.
        ramped = layout["rampup_batch_size"] and "step_batch_size_schedule" not in vars(args)
        if consumed is None and not layout["step_batch_size_schedule"] and not ramped:
            unit = layout["micro_batch_size"] * layout["data_parallel_size"]
            size = layout["global_batch_size"]
            if layout["decrease_batch_size_if_needed"]:
                size = size // unit * unit
            consumed = consumed_at[iteration] - (iteration - resumed) * size
        by_start[resumed + 1] = Segment(
            first=resumed + 1,
            consumed=consumed,
            layout=layout,
            skips=frozenset(int(i) for i in (args.iterations_to_skip or ())),
            data=_pick(args, DATA_FIELDS),
            source=f"checkpoint iter_{iteration:07d}, resumed from iteration {resumed}",
        )
    return [by_start[first] for first in sorted(by_start)]


@dataclass(frozen=True)
class History:
    """Every known segment; answers which one trained an iteration last."""

    from_log: tuple[Segment, ...]
    from_checkpoints: tuple[Segment, ...]
    log_path: Path | None
    # iteration -> saved args of every checkpoint in the --save directory: the data
    # configuration of each stage (a resume that changed the blend) is read from them.
    checkpoint_args: dict[int, argparse.Namespace] = field(default_factory=dict)

    def attempts(self) -> tuple[Segment, ...]:
        """One segment per attempt, in the order they ran: the layout log's lines, else (no
        log) the checkpoint segments, oldest start first."""
        return self.from_log or self.from_checkpoints

    def newest_checkpoint(self) -> int | None:
        return max(self.checkpoint_args, default=None)

    def segment_for(self, iteration: int) -> Segment:
        logged = [s for s in self.from_log if s.first <= iteration]
        if logged:
            return logged[-1]  # the log's order is the attempts' order
        saved = [s for s in self.from_checkpoints if s.first <= iteration]
        if saved:
            return saved[-1]
        known = sorted({s.first for s in (*self.from_log, *self.from_checkpoints)})
        where = (
            f"the layout log {self.log_path} starts at iteration {known[0]}"
            if self.from_log
            else "no layout log (the run had no --sample-log-dir, or it was deleted)"
        )
        raise PositionError(
            f"iteration {iteration} lies in a gap of the run's layout history: the oldest "
            f"record starts at iteration {known[0] if known else '?'} ({where}; the checkpoints "
            f"that remain start at {[s.first for s in self.from_checkpoints]}), so the DP size "
            "and batch sizes it was trained with are unknown. Restore an older checkpoint, or "
            "pass --data-parallel-size, --micro-batch-size and --global-batch-size to answer "
            "under that assumption"
        )

    def distinct_layouts(self) -> int:
        segments = (*self.from_log, *self.from_checkpoints)
        return len({json.dumps(s.layout, sort_keys=True) for s in segments})  # lists inside


def read_history(save_dir: Path, sample_log_dirs: list[str], load: Any) -> History:
    """Gather both records. ``load(directory) -> state`` reads a checkpoint's common state
    (injected so this module needs no Megatron import)."""
    checkpoints = []
    for child in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        match = CHECKPOINT_DIR.match(child.name)
        if match and (child / "metadata.json").is_file():
            checkpoints.append((int(match[1]), load(child)["args"]))
    log_path = next(
        (Path(d) / LAYOUT_FILE for d in sample_log_dirs if d and (Path(d) / LAYOUT_FILE).is_file()),
        None,
    )
    return History(
        tuple(log_segments(log_path)) if log_path else (),
        tuple(checkpoint_segments(checkpoints)),
        log_path,
        dict(checkpoints),
    )


def stage_args(
    history: History, base: argparse.Namespace, segment: Segment
) -> tuple[argparse.Namespace, str | None]:
    """The args of the data stage ``segment`` was trained under, and a note saying where they
    come from when that is not ``base`` (the checkpoint read).

    A resume may change the blend or the data (a new stage of the mixture). The stage's own
    configuration is, in order: the saved args of a checkpoint whose data fields are the
    segment's (one the segment's own attempt saved first: every flag of that stage, not only
    the recorded fields), else the layout log's recorded data fields on top of ``base``. The
    caches (found by the md5 of their description) and ``--sample-log`` then prove it. Refused
    only when neither survives.
    """
    changed = {k: v for k, v in segment.data.items() if v != getattr(base, k, None)}
    if not changed:
        return base, None
    what = ", ".join(
        f"{k}: {v!r} then, {getattr(base, k, None)!r} in the checkpoint read"
        for k, v in changed.items()
    )
    saved = [
        (n, a)
        for n, a in sorted(history.checkpoint_args.items())
        if _pick(a, DATA_FIELDS) == segment.data
    ]
    own = [(n, a) for n, a in saved if int(getattr(a, "iteration", 0) or 0) == segment.first - 1]
    if own or saved:
        n, args = (own or saved)[0]
        return args, (
            f"the data changed at a resume ({what}); iteration {segment.first}'s stretch is "
            f"answered with its own data configuration, from checkpoint iter_{n:07d}"
        )
    if all(v is None for v in segment.data.values()):
        raise ConfigError(
            f"the data changed at a resume, and no record of the data configuration of "
            f"{segment.describe()} survives: no checkpoint of that stage remains and its "
            "layout-log line has no data fields (written by an older version). Pass that "
            "stage's data flags (--data-path ..., --split, --seed, --seq-length) to answer for it"
        )
    args = copy.copy(base)
    for name, value in segment.data.items():
        setattr(args, name, value)
    return args, (
        f"the data changed at a resume ({what}); iteration {segment.first}'s stretch is "
        f"answered with its own data configuration, from {segment.source} (no checkpoint of "
        "that stage remains; other data flags as in the checkpoint read)"
    )


def segment_args(base: argparse.Namespace, segment: Segment) -> argparse.Namespace:
    """The run's args as they were during ``segment``: its layout and skips, and
    ``iteration``/``consumed_train_samples`` at its start (the anchor the schedule walks
    from). ``base`` carries the segment's data configuration (:func:`stage_args`)."""
    if segment.consumed is None:
        raise PositionError(
            f"{segment.describe()}, but the consumed samples at its start are unknown (the "
            f"checkpoint it resumed from, iteration {segment.first - 1}, is gone and the batch "
            "size varied); restore that checkpoint or keep the layout log"
        )
    args = copy.copy(base)
    for name, value in segment.layout.items():
        setattr(args, name, value)
    args.iterations_to_skip = sorted(segment.skips)
    args.iteration = segment.first - 1
    args.consumed_train_samples = segment.consumed
    args.skipped_train_samples = None  # per attempt; the checkpoint's count is for another
    return args
