"""Stragglers: each rank's busy time per step (first training forward to the end of the last)
against its data-parallel peers' median; one over ``factor`` times it for ``steps``
consecutive steps is named. No Megatron imports.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class StepClock:
    """This rank's busy time per step: wall clock, and on a GPU the stream's time too (the
    larger of the two, as Megatron's StragglerDetector takes), read only after the step synced."""

    def __init__(self, cuda: bool) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.events = None
        if cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(True))

    def attach(self, chunks: list[Any]) -> None:
        """Forward hooks on each model chunk mark the step's first and last training forward."""
        for chunk in chunks:
            chunk.register_forward_pre_hook(self._forward_starts)
            chunk.register_forward_hook(self._forward_done)

    def _forward_starts(self, module: Any, inputs: Any) -> None:
        if module.training and self.start is None:
            self.start = time.perf_counter()
            if self.events is not None:
                self.events[0].record()

    def _forward_done(self, module: Any, inputs: Any, output: Any) -> None:
        if module.training:
            self.end = time.perf_counter()
            if self.events is not None:
                self.events[1].record()

    def read(self) -> float:
        """Seconds from the step's first training forward to the end of its last (NaN: none
        ran); the next step starts afresh."""
        if self.start is None or self.end is None:
            return math.nan
        busy = self.end - self.start
        if self.events is not None and self.events[1].query():  # never waits
            busy = max(busy, self.events[0].elapsed_time(self.events[1]) / 1000)
        self.start = self.end = None
        return busy


@dataclass(frozen=True)
class Slowest:
    """One step's slowest rank against its peers."""

    rank: int
    seconds: float  # its busy time
    median: float  # its peers' median busy time

    @property
    def ratio(self) -> float:
        return self.seconds / self.median if self.median > 0 else math.inf


def slowest(times: Sequence[float], groups: Sequence[int]) -> Slowest | None:
    """The rank whose busy time is the largest multiple of its peers' median (peers: the other
    ranks of its ``groups`` entry, or every other rank where it has none); None without two
    measured ranks. Only each group's slowest (the first of equals) can be it; of equal
    ratios, the group of the lowest rank. Sorted once: O(ranks log ranks)."""
    all_times = np.asarray(times, dtype=np.float64)
    ranks = np.flatnonzero(np.isfinite(all_times))
    if ranks.size < 2:
        return None
    measured, group_of = all_times[ranks], np.asarray(groups, dtype=np.int64)[ranks]
    order = np.lexsort((-ranks, measured, group_of))  # by group, time; equal times: low rank last
    values, grouped, sorted_ranks = measured[order], group_of[order], ranks[order]
    ends = np.flatnonzero(np.append(grouped[1:] != grouped[:-1], True))  # each group's slowest
    starts = np.append(0, ends[:-1] + 1)
    medians = _medians_without_last(values, starts, ends - starts)
    alone = ends == starts  # no peers: every other measured rank
    if alone.any():
        medians[alone] = _medians_without(np.sort(measured), values[ends[alone]])
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero median: inf
        ratios = np.where(medians > 0, values[ends] / medians, np.inf)
    by_first = np.argsort(np.minimum.reduceat(sorted_ranks, starts))  # groups by lowest rank
    best = by_first[np.argmax(ratios[by_first])]  # the first of equal ratios
    slow = ends[best]
    return Slowest(int(sorted_ranks[slow]), float(values[slow]), float(medians[best]))


def _medians_without_last(values: np.ndarray, starts: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per sorted run ``values[start : start + count + 1]``, the median of its first ``count``
    (as :func:`statistics.median` computes it; NaN where ``count`` is 0)."""
    half = count // 2
    low, high = values[starts + np.maximum(half - 1, 0)], values[starts + half]
    return np.where(count == 0, np.nan, np.where(count % 2 == 1, high, (low + high) / 2))


def _medians_without(pool: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """The median of sorted ``pool`` without one copy of each value of ``removed``."""
    at, size = np.searchsorted(pool, removed), pool.size - 1

    def kth(k: int) -> np.ndarray:  # the k-th smallest left
        return np.where(k < at, pool[k], pool[k + 1])

    if size % 2:
        return kth(size // 2)
    return (kth(size // 2 - 1) + kth(size // 2)) / 2


class StragglerWatch:
    """Names a rank once it was the slowest, over ``factor`` times its peers' median and
    ``margin`` seconds over it, for ``steps`` consecutive steps; clears it at the first step
    it is not."""

    def __init__(self, factor: float, steps: int, margin: float = 0.0) -> None:
        self.factor, self.steps, self.margin = factor, steps, margin
        self.rank: int | None = None  # the current candidate
        self.streak = 0
        self.named: int | None = None

    def observe(self, step: Slowest | None) -> tuple[int | None, str | None]:
        """(the named rank or None, "named"/"cleared" when that changed this step)."""
        slow = (
            step is not None
            and step.ratio >= self.factor
            and step.seconds - step.median >= self.margin
        )
        rank = step.rank if slow and step is not None else None
        self.streak = self.streak + 1 if rank is not None and rank == self.rank else int(slow)
        self.rank = rank
        before = self.named
        self.named = rank if rank is not None and self.streak >= self.steps else None
        if self.named is not None and self.named != before:
            return self.named, "named"
        if before is not None and self.named != before:
            return self.named, "cleared"
        return self.named, None


def add_straggler_args(group: Any) -> None:
    """The straggler rule's flags (recorded with --signals-dir)."""
    group.add_argument(
        "--straggler-factor",
        type=float,
        default=1.5,
        help="With --signals-dir: name a rank a straggler when its busy time per step (start "
        "to last forward) is over this many times its data-parallel peers' median "
        "(default %(default)s) ...",
    )
    group.add_argument(
        "--straggler-steps",
        type=int,
        default=5,
        help="... for this many consecutive steps (default %(default)s): console, signals "
        "straggler_rank/straggler_node, incident report.",
    )
    group.add_argument(
        "--straggler-min-seconds",
        type=float,
        default=0.0,
        help="... and at least this many seconds over that median (default %(default)s: the "
        "factor alone), for hosts whose timing noise is absolute (shared CPUs).",
    )


def check_straggler_args(args: Any) -> None:
    """ValueError for a rule that cannot work."""
    if not (math.isfinite(args.straggler_factor) and args.straggler_factor > 1):
        raise ValueError(
            f"--straggler-factor {args.straggler_factor}: must be a number > 1 (a rank "
            "as fast as its peers has factor 1)"
        )
    if args.straggler_steps < 1:
        raise ValueError(f"--straggler-steps {args.straggler_steps}: must be >= 1")
    if not (math.isfinite(args.straggler_min_seconds) and args.straggler_min_seconds >= 0):
        raise ValueError(f"--straggler-min-seconds {args.straggler_min_seconds}: must be >= 0")


@dataclass
class StragglerStep:
    """One step's straggler output: signals fields, TensorBoard scalars, the console's line
    (at --log-interval) and an announcement (a rank named or cleared)."""

    fields: dict[str, Any]
    scalars: dict[str, float] = field(default_factory=dict)
    line: str = ""
    news: str | None = None


class Stragglers:
    """The writer's view of the slowest ranks: the rule, each rank's node, what a step adds to
    the signals (fields), TensorBoard (scalars) and the console (an announcement on change)."""

    def __init__(self, watch: StragglerWatch, nodes: list[str]) -> None:
        self.watch = watch
        self.nodes = nodes

    def observe(self, iteration: int, step: Slowest | None) -> StragglerStep:
        """What one step adds to the signals, TensorBoard and the console."""
        before = self.watch.named
        named, change = self.watch.observe(step)
        out = StragglerStep({"straggler_rank": named})
        out.fields["straggler_node"] = None if named is None else self.nodes[named]
        if change == "cleared" and before is not None:
            out.news = (
                f"iteration {iteration}: rank {before} on {self.nodes[before]} is no longer slow"
            )
        if step is None:
            return out
        out.fields |= {
            "slowest_rank": step.rank,
            "slowest_step_time": step.seconds,
            "median_step_time": step.median,
        }
        out.scalars = {
            "rank-step-time/slowest": step.seconds,
            "rank-step-time/median": step.median,
            "rank-step-time/slowest-rank": float(step.rank),
        }
        if change == "named":
            out.news = (
                f"iteration {iteration}: rank {step.rank} on {self.nodes[step.rank]} is a "
                f"straggler: busy {step.seconds:.3f} s per step, {step.ratio:.1f}x its peers' "
                f"median {step.median:.3f} s, for {self.watch.streak} consecutive steps"
            )
        out.line = (
            f"slowest rank {step.rank} ({self.nodes[step.rank]}): busy {step.seconds:.3f} s, "
            f"peers' median {step.median:.3f} s"
        )
        return out
