"""The run's layout history (layout log + checkpoints' saved args) and its attempts: which
layout, skips and data stage trained each iteration, and which attempt trained it (the latest
that did; rolled back after is said). docs/lookup.md, "Attempts".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.common.checkpoint_state import CheckpointUnreadable, load_common_state
from megatron_ext.common.files import (
    CHECKPOINT_DIR,
    CHECKPOINT_METADATA_FILE,
    LAYOUT_FILE,
    sample_log_file,
)
from megatron_ext.common.io import read_jsonl
from megatron_ext.common.records.sample_log import DATA_FIELDS, LAYOUT_FIELDS
from megatron_ext.common.records.sample_log_reader import Attempt, RankLog
from megatron_ext.lookup.config import honours_rampup
from megatron_ext.lookup.errors import ConfigError, NotTrained, PositionError


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
            for name in LAYOUT_FIELDS[:6]:  # the sizes: null or not a number is no layout
                int(record[name])
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
        ramped = layout["rampup_batch_size"] and honours_rampup(args, from_checkpoint=True)
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
        for segments in (self.from_log, self.from_checkpoints):  # each in the attempts' order
            covering = [s for s in segments if s.first <= iteration]
            if covering:
                return covering[-1]
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


def read_history(checkpoint: Path, sample_log_dir: str | None) -> History:
    """Gather both records of the run whose checkpoint (--save or iter_* directory) is read."""
    save_dir = checkpoint.parent if CHECKPOINT_DIR.match(checkpoint.name) else checkpoint
    checkpoints = []
    for child in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        match = CHECKPOINT_DIR.match(child.name)
        if match and (child / CHECKPOINT_METADATA_FILE).is_file():
            try:
                checkpoints.append((int(match[1]), load_common_state(child)["args"]))
            except CheckpointUnreadable as exc:
                raise ConfigError(
                    f"{exc}. The lookup reads every checkpoint of the run for its layout "
                    "history; pass --data-parallel-size/--micro-batch-size to answer without it"
                ) from None
    log_path = Path(sample_log_dir, LAYOUT_FILE) if sample_log_dir else None
    log_path = log_path if log_path and log_path.is_file() else None
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
    come from when that is not ``base`` (the checkpoint read)."""
    changed = {k: v for k, v in segment.data.items() if v != getattr(base, k, None)}
    if not changed:
        return base, None
    what = ", ".join(
        f"{k}: {v!r} then, {getattr(base, k, None)!r} in the checkpoint read"
        for k, v in changed.items()
    )
    said = (
        f"the data changed at a resume ({what}); iteration {segment.first}'s stretch is "
        "answered with its own data configuration, from "
    )
    saved = [
        (n, a)
        for n, a in sorted(history.checkpoint_args.items())
        if _pick(a, DATA_FIELDS) == segment.data
    ]
    own = [(n, a) for n, a in saved if int(getattr(a, "iteration", 0) or 0) == segment.first - 1]
    if own or saved:
        n, args = (own or saved)[0]
        return args, f"{said}checkpoint iter_{n:07d}"
    if all(v is None for v in segment.data.values()):
        raise ConfigError(
            f"the data changed at a resume, and no record of the data configuration of "
            f"{segment.describe()} survives: no checkpoint of that stage remains and its "
            "layout-log line has no data fields (written by an older version). Pass that "
            "stage's data flags (--data-path ..., --split, --seed, --seq-length) to answer for it"
        )
    return argparse.Namespace(**{**vars(base), **segment.data}), (
        f"{said}{segment.source} (no checkpoint of that stage remains; other data flags as in "
        "the checkpoint read)"
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
    args = argparse.Namespace(**{**vars(base), **segment.layout})
    args.iterations_to_skip = sorted(segment.skips)
    args.iteration = segment.first - 1
    args.consumed_train_samples = segment.consumed
    args.skipped_train_samples = None  # per attempt; the checkpoint's count is for another
    return args


@dataclass(frozen=True)
class AttemptAt:
    """One attempt that started at or before the iteration, and what it did with it."""

    number: int  # 1-based, in the order the attempts ran
    segment: Segment
    trained: bool  # it trained the iteration (False: skipped it, or never got that far)
    fate: str  # what it did, and what became of it

    def describe(self) -> str:
        job = f", job {self.segment.job_id}" if self.segment.job_id else ""
        return f"attempt {self.number} (from iteration {self.segment.first}{job}): {self.fate}"


def attempt_number(segments: tuple[Segment, ...], attempt: Attempt) -> int | None:
    """The layout-log attempt that wrote a sample-log attempt; None when it cannot be placed
    (a stretch the attempt index does not vouch for, or no wall times)."""
    wall = attempt.info.get("wall_time") if attempt.indexed else None
    if not isinstance(wall, int | float):
        return None
    # No slack for node clocks: a rank writes its attempt line after its first step, seconds
    # after rank 0's layout line, and NTP keeps nodes milliseconds apart.
    started = [
        n for n, s in enumerate(segments, start=1) if s.started is not None and s.started <= wall
    ]
    return started[-1] if started else None


@dataclass(frozen=True)
class Attempts:
    """The attempts at one iteration, and the evidence they were judged on."""

    iteration: int
    at: list[AttemptAt]
    log_read: bool  # a sample log was read for the evidence
    caveat: str | None = None  # said when no record tells whether the run got this far

    def answer(self, asked: int | None) -> AttemptAt:
        """``--attempt N``, else the latest attempt that trained the iteration, else the
        latest that reached it (it skipped it)."""
        if asked is not None:
            chosen = [a for a in self.at if a.number == asked]
            if not chosen:
                raise ConfigError(
                    f"--attempt {asked}: the attempts that started at or before iteration "
                    f"{self.iteration} are {[a.number for a in self.at]}"
                )
            return chosen[0]
        trained = [a for a in self.at if a.trained]
        return (trained or self.at)[-1]

    def lines(self, answered: AttemptAt) -> list[str]:
        out = [f"note: {self.caveat}"] if self.caveat else []
        if len(self.at) == 1 and self.at[0].trained and self.at[0].number == 1:
            return out  # one attempt, nothing rolled back: the usual answer needs no more
        out.append(f"answer: what attempt {answered.number} read at iteration {self.iteration}")
        out.append(f"attempts at iteration {self.iteration}:")
        out += [f"  {a.describe()}" for a in self.at]
        if not self.log_read:
            out.append(
                "  (no sample log read: whether a rolled-back attempt got this far is not known)"
            )
        return out


def attempts_at(history: History, iteration: int, sample_log: str | None, rank: int) -> Attempts:
    """Judge every attempt at ``iteration`` from the history and one rank's sample log."""
    segments = history.attempts()
    logged: set[int | None] = set()  # the attempts the rank's log holds the iteration of
    last_logged = None
    path = sample_log_file(sample_log, rank) if sample_log else None
    log_read = path is not None and path.is_file()
    if log_read:
        assert path is not None
        with RankLog(path, rank) as log:
            logged = {attempt_number(segments, g.attempt) for g in log.iteration(iteration)}
            last_logged = log.last_iteration()
    covering = [(n, s) for n, s in enumerate(segments, start=1) if s.first <= iteration]
    if not logged:
        _check_reached(history, iteration, last_logged, log_read, Path(str(sample_log)))
    if not covering:
        history.segment_for(iteration)  # raises: a gap of the layout history
    at = [
        judged
        for k in range(len(covering))
        if (judged := _judge(history, iteration, covering, k, logged, log_read)) is not None
    ]
    caveat = None
    newest = history.newest_checkpoint()
    if not log_read and iteration > max([newest or 0] + [s.first - 1 for s in segments]):
        caveat = (
            f"iteration {iteration} is past the newest checkpoint ({newest}) and no sample log "
            "is at hand: nothing says whether the run trained it yet (this is the batch it "
            "reads there)"
        )
    return Attempts(iteration, at, log_read, caveat)


def _judge(
    history: History,
    iteration: int,
    covering: list[tuple[int, Segment]],
    k: int,
    logged: set[int | None],
    log_read: bool,
) -> AttemptAt | None:
    """What attempt ``covering[k]`` did with ``iteration`` (None: it never got that far)."""
    number, segment = covering[k]
    final_number, final = covering[-1]
    later = covering[k + 1] if k + 1 < len(covering) else None
    if iteration in segment.skips:
        return AttemptAt(number, segment, False, "skipped it (--iterations-to-skip)")
    if later is None:
        newest = history.newest_checkpoint()
        kept = (
            f"kept (checkpoint {newest} holds it)"
            if newest is not None and newest >= iteration
            else f"no checkpoint holds it yet (newest: {newest})"
        )
        return AttemptAt(number, segment, True, f"trained it; {kept}")
    if log_read and number not in logged and None not in logged:
        return None  # it stopped, or was rolled back, before this iteration: not an answer
    if not log_read:
        fate = (
            f"may have trained it before attempt {later[0]} resumed from iteration "
            f"{later[1].first - 1} (no sample log to tell; --attempt {number} shows what "
            "it read if it did)"
        )
        return AttemptAt(number, segment, False, fate)
    then = "skipped afterwards" if iteration in final.skips else "trained again"
    fate = (
        f"trained it; rolled back (attempt {later[0]} resumed from iteration "
        f"{later[1].first - 1}), {then} by attempt {final_number}"
    )
    return AttemptAt(number, segment, True, fate)


def _check_reached(
    history: History, iteration: int, last_logged: int | None, log_read: bool, log: Path
) -> None:
    """Refuse an iteration past everything the run recorded (when a sample log says so)."""
    resumes = [s.first - 1 for s in history.attempts()]
    reached = max(
        [i for i in (last_logged, history.newest_checkpoint(), *resumes) if i is not None],
        default=0,
    )
    if log_read and iteration > reached:
        newest = history.newest_checkpoint()
        raise NotTrained(
            f"iteration {iteration} is not yet trained: the run's sample log ({log}) ends at "
            f"iteration {last_logged}, its newest checkpoint is "
            f"{'none' if newest is None else newest}. Ask again once the run got there"
        )
