"""Stragglers: each rank's busy time per step, and the rank that stays slower than its peers.

Every rank's step lasts as long as the slowest one's, so a rank's *busy* time (its step's
first training forward to the end of its last, before the gradient all-reduce) is compared
with its data-parallel peers' median; one over ``factor`` times it for ``steps`` consecutive
steps is named. No Megatron imports.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

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
        start, end = self.events or (None, None)
        if start is not None and end is not None and end.query():  # never waits
            busy = max(busy, start.elapsed_time(end) / 1000)
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


def slowest(times: list[float], groups: list[int]) -> Slowest | None:
    """The rank whose busy time is the largest multiple of its peers' median (peers: the other
    ranks of its ``groups`` entry, or every other rank where it has none); None without two
    measured ranks. Only each group's slowest can be it: O(ranks log ranks)."""
    measured = {r: t for r, t in enumerate(times) if math.isfinite(t)}
    members: dict[int, list[int]] = {}
    for rank in measured:
        members.setdefault(groups[rank], []).append(rank)
    everyone = sorted(measured.values())
    best: Slowest | None = None
    for ranks in members.values():
        rank = max(ranks, key=lambda r: (measured[r], -r))  # the first of equals
        pool = sorted(measured[r] for r in ranks) if len(ranks) > 1 else everyone
        if len(pool) < 2:
            continue
        at = bisect.bisect_left(pool, measured[rank])
        candidate = Slowest(rank, measured[rank], statistics.median(pool[:at] + pool[at + 1 :]))
        if best is None or candidate.ratio > best.ratio:
            best = candidate
    return best


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


FACTOR, STEPS, MARGIN = 1.5, 5, 0.0  # the defaults of --straggler-factor, -steps, -min-seconds


def add_straggler_args(group: Any) -> None:
    """The straggler rule's flags (recorded with --signals-dir)."""
    group.add_argument(
        "--straggler-factor",
        type=float,
        default=FACTOR,
        help="With --signals-dir: name a rank a straggler when its busy time per step (start "
        "to last forward) is over this many times its data-parallel peers' median "
        "(default %(default)s) ...",
    )
    group.add_argument(
        "--straggler-steps",
        type=int,
        default=STEPS,
        help="... for this many consecutive steps (default %(default)s): console, signals "
        "straggler_rank/straggler_node, incident report.",
    )
    group.add_argument(
        "--straggler-min-seconds",
        type=float,
        default=MARGIN,
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


def watch_from_args(args: Any) -> StragglerWatch:
    return StragglerWatch(args.straggler_factor, args.straggler_steps, args.straggler_min_seconds)


class Stragglers:
    """The writer's view of the slowest ranks: the rule, each rank's node, what a step adds to
    the signals (fields), TensorBoard (scalars) and the console (an announcement on change)."""

    def __init__(self, watch: StragglerWatch, nodes: list[str]) -> None:
        self.watch = watch
        self.nodes = nodes

    def node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else "?"

    def observe(self, iteration: int, step: Slowest | None) -> StragglerStep:
        """What one step adds to the signals, TensorBoard and the console."""
        before = self.watch.named
        named, change = self.watch.observe(step)
        out = StragglerStep({"straggler_rank": named})
        out.fields["straggler_node"] = None if named is None else self.node(named)
        if change == "cleared" and before is not None:
            out.news = (
                f"iteration {iteration}: rank {before} on {self.node(before)} is no longer slow"
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
                f"iteration {iteration}: rank {step.rank} on {self.node(step.rank)} is a "
                f"straggler: busy {step.seconds:.3f} s per step, {step.ratio:.1f}x its peers' "
                f"median {step.median:.3f} s, for {self.watch.streak} consecutive steps"
            )
        out.line = (
            f"slowest rank {step.rank} ({self.node(step.rank)}): busy {step.seconds:.3f} s, "
            f"peers' median {step.median:.3f} s"
        )
        return out
