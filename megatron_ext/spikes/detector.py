"""Streaming loss-spike detector over the per-step signals (no Megatron imports): rolling
median/MAD baselines learned on healthy iterations; a large jump flags alone, a moderate one
when corroborated (rules: docs/incidents.md "Spike detector"). Per step: a bisect into sorted
windows; a MAD only where a value is already above its relative threshold.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from megatron_ext.common.io import json_safe
from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.spike_config import SpikeConfig

EventKind = Literal["spike", "recovered", "divergence", "rollback"]
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


def _middle(s: list[float]) -> float:
    """The median of sorted ``s``."""
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class RollingWindow:
    """Fixed-size window with O(log n) median (sorted mirror of a deque)."""

    __slots__ = ("_order", "size", "values")

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: deque[float] = deque()
        self.values: list[float] = []  # sorted; read directly on the per-step path

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        order, ordered = self._order, self.values
        order.append(value)
        bisect.insort(ordered, value)
        if len(ordered) > self.size:
            del ordered[bisect.bisect_left(ordered, order.popleft())]

    def median(self) -> float:
        return _middle(self.values)

    def mad(self) -> float:
        med = self.median()
        return _middle(sorted(abs(v - med) for v in self.values))

    def above(self, value: float, rel: float, k: float, scale: float | None = None) -> bool:
        """``value`` above both ``median + rel·scale`` (scale: the median itself unless given)
        and ``median + k·σ``; the cheap test first."""
        median = self.median()
        if value <= median + abs(median if scale is None else scale) * rel:
            return False
        return value > median + k * MAD_TO_SIGMA * self.mad()

    def threshold(self, rel: float, k: float, scale: float | None = None) -> float:
        median = self.median()
        relative = median + abs(median if scale is None else scale) * rel
        return max(relative, median + k * MAD_TO_SIGMA * self.mad())


class SourceBaselines:
    """One :class:`RollingWindow` per blend member's own loss, by name (members come and go
    with stages). The average is judged mixture-adjusted: aggregate median + Σ share·(member
    loss − member median), so a changed mixture alone moves nothing."""

    def __init__(self, window: int) -> None:
        self.size = window
        self.windows: dict[str, RollingWindow] = {}

    def armed(self, name: str) -> RollingWindow | None:
        window = self.windows.get(name)
        return window if window is not None and len(window) >= self.size // 2 else None

    def adjusted(self, record: SignalRecord, aggregate_median: float) -> float | None:
        """The mixture-adjusted average, or None when the record has no per-source losses or
        no member of it has a baseline yet (a member without one counts as on it)."""
        losses, tokens = record.lm_loss_by_dataset, record.tokens_by_dataset
        total = sum(tokens.get(n, 0) for n in losses)
        if not losses or total <= 0:
            return None
        moved, judged = 0.0, False
        for name, loss in losses.items():
            window = self.armed(name)
            if window is not None:
                moved += tokens.get(name, 0) / total * (loss - window.median())
                judged = True
        return aggregate_median + moved if judged else None

    def rising(self, record: SignalRecord, rel: float) -> bool:
        """Any member above ``median·(1+rel)`` (the cheap test, every step)."""
        return any(
            (window := self.armed(name)) is not None and loss > window.median() * (1 + rel)
            for name, loss in record.lm_loss_by_dataset.items()
        )

    def jump(self, record: SignalRecord, rel: float, k: float) -> str | None:
        """The member above both its relative and its MAD threshold, the one furthest above
        its median when several are; None when none is."""
        rises = {
            name: loss / window.median() - 1 if window.median() else math.inf
            for name, loss in record.lm_loss_by_dataset.items()
            if (window := self.armed(name)) is not None and window.above(loss, rel, k)
        }
        return max(rises, key=rises.__getitem__, default=None)

    def median(self, name: str) -> float | None:
        window = self.armed(name)
        return window.median() if window is not None else None

    def learn(self, record: SignalRecord) -> None:
        for name, loss in record.lm_loss_by_dataset.items():
            if math.isfinite(loss):
                self.windows.setdefault(name, RollingWindow(self.size)).push(loss)


@dataclass
class SpikeEvent:
    """One ledger line: what happened, where, the culprit rank and the signals before it."""

    kind: EventKind
    iteration: int
    onset: int  # the iteration the incident started at
    consumed_samples: int
    culprit_dp_rank: int | None
    loss: float | None
    loss_baseline: float | None
    loss_threshold: float | None  # the moderate threshold (recovery is judged against it)
    grad_norm: float | None
    grad_baseline: float | None
    classification: str
    attempt: int = 0
    max_local_loss: float | None = None
    max_local_baseline: float | None = None
    # The blend member whose own loss jumped, its loss and median, and the mixture-adjusted
    # average the thresholds were applied to.
    culprit_source: str | None = None
    source_loss: float | None = None
    source_baseline: float | None = None
    adjusted_loss: float | None = None
    window: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return json_safe(self)


@dataclass(slots=True)
class _Step:
    """One iteration's readings, with the skip evidence applied to the grad norm."""

    record: SignalRecord
    loss: float
    grad: float | None  # None when not measured, or not a measurement (skipped step)
    excess: float | None  # worst DP rank's loss - the DP average: one rank's own trouble
    skipped: bool
    source: str | None = None  # the member whose own jump flagged or corroborated it


def primed(config: SpikeConfig, history: list[SignalRecord]) -> SpikeDetector:
    """A detector armed as the training-time tracker arms itself after a restart: fed the
    last ``warmup + window`` iterations the run continues from; a clean start if that history
    ends mid-incident (the incident was the previous attempt's to decide)."""
    detector = SpikeDetector(config)
    for record in history[-(config.warmup + config.window) :]:
        detector.observe(record)
    detector.seen = max(detector.seen, len(history))
    return detector if detector.state == "healthy" else SpikeDetector(config)


class SpikeDetector:
    """Feed :meth:`observe` one :class:`SignalRecord` per iteration; it returns ledger events.

    ``state`` is ``"healthy"``, ``"watching"`` (a spike is in progress: no checkpoint may be
    written, so the last healthy one stays the rollback target) or ``"rollback"``.
    """

    def __init__(self, config: SpikeConfig) -> None:
        self.config = config
        self.loss = RollingWindow(config.window)
        self.grad = RollingWindow(config.window)
        self.excess = RollingWindow(config.window)
        self.seen = 0
        self._armed = False  # cached: the windows never shrink, so once armed, always armed
        self.state: Literal["healthy", "watching", "rollback"] = "healthy"
        self.elevated = 0  # consecutive iterations above the moderate threshold, uncorroborated
        self.suspicious = 0  # consecutive iterations above the relative threshold only
        self.raised_since: int | None = None  # first iteration of the current rise
        self.skips = 0  # consecutive skipped iterations
        self.last_scale: float | None = None
        self.incident: SpikeEvent | None = None
        self.frozen: tuple[float | None, float | None] = (None, None)  # loss, excess thresholds
        self.sources = SourceBaselines(config.window)
        self.frozen_source: tuple[str, float] | None = None  # culprit member, its threshold
        self.recent: deque[SignalRecord] = deque(maxlen=config.context)

    def resume(self) -> None:
        """Offline replays only: go on after a rollback decision as if the run had not
        stopped (same baseline, no incident in progress)."""
        self.state, self.incident, self.raised_since = "healthy", None, None
        self.elevated = self.suspicious = 0

    def armed(self) -> bool:
        return self.seen >= self.config.warmup and len(self.loss) >= self.config.window // 2

    def _read(self, record: SignalRecord) -> tuple[float, float | None, float | None, bool]:
        """The iteration's loss, grad norm (None when skipped), excess and skip flag."""
        scale, skipped = record.loss_scale, bool(record.skipped_iter)
        if scale is not None and math.isfinite(scale):
            if self.last_scale is not None and scale < self.last_scale:
                skipped = True  # the scaler backed off: an overflow, counted or not
            self.last_scale = scale
        self.skips = self.skips + 1 if skipped else 0
        loss = math.nan if record.lm_loss is None else record.lm_loss
        worst = record.max_local_loss
        excess = None if worst is None else worst - loss  # inf - inf is nan
        if excess is not None and not math.isfinite(excess):
            excess = None
        return loss, None if skipped else record.grad_norm, excess, skipped

    def observe(self, record: SignalRecord) -> list[SpikeEvent]:
        """Update with one iteration and return the events it caused (usually none). The
        common case (healthy, nothing rising) is kept flat: no objects made."""
        self.recent.append(record)
        self.seen += 1
        loss, grad, excess, skipped = self._read(record)
        if self.state == "rollback":
            return []
        if not (math.isfinite(loss) and (grad is None or math.isfinite(grad))):
            return self._diverged(_Step(record, loss, grad, excess, skipped))
        if not self._armed and not self._arm(_Step(record, loss, grad, excess, skipped)):
            return []
        median = self.loss.median()
        by_source = self._blend(record)
        if by_source:  # judge the average the batch would have had under the baseline's mix
            adjusted = self.sources.adjusted(record, median)
            loss = loss if adjusted is None else adjusted
        if self.state == "watching":
            return self._watch(_Step(record, loss, grad, excess, skipped))
        margin = abs(median) * self.config.loss_rel
        one_rank = excess is not None and bool(self.excess.values)
        rising = (
            loss > median + margin
            or (one_rank and excess > self.excess.median() + margin)  # type: ignore[operator]
            or (by_source and self.sources.rising(record, self.config.loss_rel))
        )
        if not rising and self.skips < self.config.skip_streak:  # most iterations stop here
            if self.raised_since is not None:
                self.elevated = self.suspicious = 0
                self.raised_since = None
            if not skipped:  # a skipped step (overflow, withheld update) is no baseline
                self._learn(record, loss, grad, excess)
            return []
        return self._rising(_Step(record, loss, grad, excess, skipped), rising, one_rank)

    def _arm(self, step: _Step) -> bool:
        """Whether the detector is armed now; until it is, every healthy step is learned."""
        self._armed = self.armed()
        if not self._armed and not step.skipped:
            self._learn(step.record, step.loss, step.grad, step.excess)
        return self._armed

    def _diverged(self, step: _Step) -> list[SpikeEvent]:
        event = self._event("divergence", step, "non-finite loss or grad norm")
        if self.incident is not None:
            event.onset = self.incident.onset
        return self._escalate(event)

    def _rising(self, step: _Step, rising: bool, one_rank: bool) -> list[SpikeEvent]:
        """A healthy run's loss (or one rank's excess) over its relative threshold, or a skip
        streak: flag it, count it as elevated or as suspicious."""
        c = self.config
        if self.raised_since is None:
            self.raised_since = step.record.iteration - (0 if rising else self.skips - 1)
        why = self._flag_reason(step, one_rank)
        if why is not None:
            self.incident = self._event("spike", step, why)
            self.incident.onset = self.raised_since
            median = self.loss.median()
            excess = (
                self.excess.threshold(c.loss_rel, c.mad_k, median) if self.excess.values else None
            )
            self.frozen = (self.incident.loss_threshold, excess)
            name = self.incident.culprit_source
            window = None if name is None else self.sources.armed(name)
            limit = None if window is None else window.threshold(c.loss_rel, c.mad_k)
            self.frozen_source = None if limit is None else (name, limit)  # type: ignore[assignment]
            self.state, self.elevated, self.suspicious = "watching", 0, 0
            return [self.incident]
        if self.loss.above(step.loss, c.loss_rel, c.mad_k):
            self.elevated += 1
            if self.elevated >= max(c.patience, 1):
                event = self._event("divergence", step, "loss above threshold without recovery")
                event.onset = self.raised_since
                return self._escalate(event)
            return []
        # Suspicious but not a spike: kept out of the baseline so a spike's first steps cannot
        # raise the threshold, unless it lasts (a level shift, e.g. a new data mixture).
        self.elevated = 0
        self.suspicious += 1
        if self.suspicious > c.patience and not step.skipped:
            self._learn(step.record, step.loss, step.grad, step.excess)
        return []

    def _flag_reason(self, step: _Step, one_rank: bool) -> str | None:
        """Why this iteration starts an incident, or None."""
        why = self._large_jump(step, one_rank)
        if why is None and self.skips >= self.config.skip_streak:
            why = f"{self.skips} consecutive skipped iterations"
        return why or self._corroborated(step, one_rank)

    def _large_jump(self, step: _Step, one_rank: bool) -> str | None:
        """A jump that flags alone: of the loss, of one source or of one rank's excess."""
        c = self.config
        if self.loss.above(step.loss, c.large_rel, c.large_mad_k):
            return "large loss jump"
        step.source = self._source_jump(step, c.large_rel, c.large_mad_k)
        if step.source is not None:  # a bad source with a small share: the average hides it
            return f"large loss jump of source {step.source}"
        scale = self.loss.median()
        if one_rank and self.excess.above(step.excess, c.large_rel, c.large_mad_k, scale):  # type: ignore[arg-type]
            return "large jump of one DP rank's loss over the average"
        return None

    def _corroborated(self, step: _Step, one_rank: bool) -> str | None:
        """A moderate loss jump with something that corroborates it, or None."""
        c = self.config
        if not self.loss.above(step.loss, c.loss_rel, c.mad_k):
            return None
        step.source = self._source_jump(step, c.loss_rel, c.mad_k)
        if step.source is not None:
            return f"loss jump corroborated by source {step.source}"
        if self._grad_high(step.grad):
            return "loss jump corroborated by grad norm"
        if step.skipped:
            return "loss jump on a skipped iteration (overflow / loss-scale drop)"
        scale = self.loss.median()
        if one_rank and self.excess.above(step.excess, c.loss_rel, c.mad_k, scale):  # type: ignore[arg-type]
            return "loss jump corroborated by one DP rank's loss over the average"
        return None

    def _source_jump(self, step: _Step, rel: float, k: float) -> str | None:
        if not self._blend(step.record):
            return None
        return self.sources.jump(step.record, rel, k)

    def _blend(self, record: SignalRecord) -> bool:
        """Judge by source only a blend: one member's loss is the average itself, so its
        "own jump" would corroborate every jump of a single-dataset run."""
        return self.config.per_source and len(record.lm_loss_by_dataset) > 1

    def _grad_high(self, grad: float | None) -> bool:
        return (
            grad is not None
            and bool(self.grad.values)
            and grad >= self.config.grad_factor * self.grad.median()
        )

    def _learn(
        self, record: SignalRecord, loss: float, grad: float | None, excess: float | None
    ) -> None:
        if self.config.per_source:
            self.sources.learn(record)
        self.loss.push(loss)
        if grad is not None:  # finite: observe() diverges on a non-finite one
            self.grad.push(grad)
        if excess is not None:
            self.excess.push(excess)

    def _watch(self, step: _Step) -> list[SpikeEvent]:
        assert self.incident is not None
        loss_limit, excess_limit = self.frozen
        back = (
            step.loss <= loss_limit  # type: ignore[operator]
            and (excess_limit is None or step.excess is None or step.excess <= excess_limit)
            and not self._grad_high(step.grad)
            and not step.skipped
            and (
                self.frozen_source is None
                or step.record.lm_loss_by_dataset.get(self.frozen_source[0], -math.inf)
                <= self.frozen_source[1]
            )
        )
        if back:
            recovered = self._event(
                "recovered", step, "loss, worst rank, culprit source and grad norm back"
            )
            recovered.onset = self.incident.onset
            self.state, self.incident, self.raised_since = "healthy", None, None
            return [recovered]
        if step.record.iteration - self.incident.iteration >= self.config.patience:
            event = self._event("rollback", step, "spike did not recover within patience")
            event.onset = self.incident.onset
            event.culprit_dp_rank = self.incident.culprit_dp_rank
            event.culprit_source = self.incident.culprit_source
            event.classification = f"{self.incident.classification}; not recovered"
            self.state = "rollback"
            return [event]
        return []

    def _escalate(self, divergence: SpikeEvent) -> list[SpikeEvent]:
        rollback = replace(divergence, kind="rollback", window=list(divergence.window))
        self.state = "rollback"
        return [divergence, rollback]

    def _event(self, kind: EventKind, step: _Step, why: str) -> SpikeEvent:
        armed = self.armed() and len(self.loss) > 0
        record = step.record
        c = self.config
        source = step.source
        if source is None and kind != "recovered":
            source = self._source_jump(step, c.loss_rel, c.mad_k)
        return SpikeEvent(
            kind=kind,
            iteration=record.iteration,
            onset=record.iteration,
            consumed_samples=record.consumed_samples,
            culprit_dp_rank=record.max_loss_dp_rank,
            loss=record.lm_loss,
            loss_baseline=self.loss.median() if armed else None,
            loss_threshold=self.loss.threshold(c.loss_rel, c.mad_k) if armed else None,
            grad_norm=record.grad_norm,
            grad_baseline=self.grad.median() if len(self.grad) else None,
            classification=why,
            attempt=record.attempt,
            max_local_loss=record.max_local_loss,
            max_local_baseline=(
                self.loss.median() + self.excess.median() if armed and len(self.excess) else None
            ),
            culprit_source=source,
            source_loss=record.lm_loss_by_dataset.get(source) if source else None,
            source_baseline=self.sources.median(source) if source else None,
            adjusted_loss=step.loss if self._blend(record) and armed else None,
            window=[{name: getattr(r, name) for name in _SUMMARY} for r in self.recent],
        )


# An event's window: the few signals an on-call engineer reads first, per iteration.
_SUMMARY = (
    "iteration", "lm_loss", "grad_norm", "max_local_loss", "max_loss_dp_rank",
    "lm_loss_by_dataset", "update_ratio", "lr", "skipped_iter",
)  # fmt: skip


def replay(records: list[SignalRecord], config: SpikeConfig) -> list[SpikeEvent]:
    """Offline: every event over ``records``, going on after a rollback decision
    (:meth:`~SpikeDetector.resume`) so that a plot or a benchmark sees every incident."""
    detector, events = SpikeDetector(config), []
    for record in records:
        events += detector.observe(record)
        if detector.state == "rollback":
            detector.resume()
    return events
