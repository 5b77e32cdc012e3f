"""Streaming loss-spike detector over the per-step signals (no Megatron imports).

Rules (a sliding median and a robust spread, not a single high step):

- **Baseline**: rolling median and MAD of the loss and the median grad norm over the last
  ``window`` *healthy* iterations; the detector arms after ``warmup`` iterations.
- **Spike**: loss above ``threshold = max(median·(1+loss_rel), median + mad_k·1.4826·MAD)``
  AND grad norm ≥ ``grad_factor`` × its median (a loss jump the gradients corroborate).
- **Divergence**: a non-finite loss or grad norm, or the loss above the threshold for
  ``patience`` consecutive iterations without the gradient corroboration (slow blow-up).
- Iterations between the relative and the full threshold stay out of the baseline (so a
  spike's first steps cannot raise its own threshold) unless they last ``patience`` iterations.
- **Recovery**: after a spike, the loss back under the (frozen) threshold within ``patience``
  iterations: transient, logged, nothing else. Otherwise: **rollback**.

Per iteration the work is a bisect into a fixed-size sorted window (O(log window)); the MAD is
only computed when the loss already exceeds the relative threshold. Cost does not grow with the
length of the run.
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ext.io import json_safe
from megatron_ext.telemetry.signals import SignalRecord

EventKind = Literal["spike", "recovered", "divergence", "rollback"]

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class SpikeConfig:
    """Detector thresholds; the defaults and their reasons are in README ("Spike tracker")."""

    window: int = 100
    warmup: int = 100
    loss_rel: float = 0.10
    mad_k: float = 6.0
    grad_factor: float = 3.0
    patience: int = 50
    context: int = 20  # signal records kept in each ledger event

    def __post_init__(self) -> None:
        if self.window < 3 or self.warmup < self.window // 2 or self.patience < 0:
            raise ValueError(
                f"spike detector: need window >= 3, warmup >= window/2 and patience >= 0 "
                f"(got window={self.window}, warmup={self.warmup}, patience={self.patience})"
            )
        if self.loss_rel <= 0 or self.mad_k <= 0 or self.grad_factor <= 1:
            raise ValueError("spike detector: loss_rel and mad_k must be > 0, grad_factor > 1")


def add_detector_args(group: argparse._ArgumentGroup) -> None:
    """The ``--spike-*`` threshold flags, shared by training and ``megatron-ext plot``."""
    d = SpikeConfig()
    group.add_argument(
        "--spike-window",
        type=int,
        default=d.window,
        help="healthy iterations in the rolling median/MAD (default %(default)s)",
    )
    group.add_argument(
        "--spike-warmup",
        type=int,
        default=d.warmup,
        help="iterations before the detector arms (default %(default)s)",
    )
    group.add_argument(
        "--spike-loss-rel",
        type=float,
        default=d.loss_rel,
        help="relative loss jump over the median (default %(default)s)",
    )
    group.add_argument(
        "--spike-mad-k",
        type=float,
        default=d.mad_k,
        help="robust sigmas (1.4826 x MAD) over the median (default %(default)s)",
    )
    group.add_argument(
        "--spike-grad-factor",
        type=float,
        default=d.grad_factor,
        help="grad norm / its median that corroborates a spike (default %(default)s)",
    )
    group.add_argument(
        "--spike-patience",
        type=int,
        default=d.patience,
        help="iterations a spike may take to recover, and an uncorroborated "
        "elevated loss may last, before a rollback (default %(default)s)",
    )


def config_from_args(options: Any) -> SpikeConfig:
    """The thresholds the ``--spike-*`` flags describe (raises ValueError if invalid)."""
    return SpikeConfig(
        window=options.spike_window,
        warmup=options.spike_warmup,
        loss_rel=options.spike_loss_rel,
        mad_k=options.spike_mad_k,
        grad_factor=options.spike_grad_factor,
        patience=options.spike_patience,
    )


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
    loss_threshold: float | None
    grad_norm: float | None
    grad_baseline: float | None
    classification: str
    attempt: int = 0
    window: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return json_safe(self)


class RollingWindow:
    """Fixed-size window with O(log n) median (sorted mirror of a deque)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def push(self, value: float) -> None:
        self._order.append(value)
        bisect.insort(self._sorted, value)
        if len(self._order) > self.size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def median(self) -> float:
        s, n = self._sorted, len(self._sorted)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def mad(self) -> float:
        med = self.median()
        deviations = sorted(abs(v - med) for v in self._sorted)
        n = len(deviations)
        return deviations[n // 2] if n % 2 else 0.5 * (deviations[n // 2 - 1] + deviations[n // 2])


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class SpikeDetector:
    """Feed :meth:`observe` one :class:`SignalRecord` per iteration; it returns ledger events.

    ``state`` is ``"healthy"`` or ``"watching"`` (a spike is in progress: checkpoints must not
    be written, so the last healthy one stays the rollback target) or ``"rollback"``.
    """

    def __init__(self, config: SpikeConfig) -> None:
        self.config = config
        self.loss = RollingWindow(config.window)
        self.grad = RollingWindow(config.window)
        self.seen = 0
        self.state: Literal["healthy", "watching", "rollback"] = "healthy"
        self.elevated = 0  # consecutive iterations above the threshold, uncorroborated
        self.suspicious = 0  # consecutive iterations between the relative and full threshold
        self.incident: SpikeEvent | None = None
        self.recent: deque[SignalRecord] = deque(maxlen=config.context)

    def armed(self) -> bool:
        return self.seen >= self.config.warmup and len(self.loss) >= self.config.window // 2

    def threshold(self) -> float:
        """The current loss threshold (only meaningful once armed)."""
        median = self.loss.median()
        relative = median * (1.0 + self.config.loss_rel)
        if relative <= median:  # non-positive losses: the relative rule is meaningless
            relative = median
        return max(relative, median + self.config.mad_k * MAD_TO_SIGMA * self.loss.mad())

    def observe(self, record: SignalRecord) -> list[SpikeEvent]:
        """Update with one iteration and return the events it caused (usually none)."""
        self.recent.append(record)
        self.seen += 1
        loss, grad = record.lm_loss, record.grad_norm
        if self.state == "rollback":
            return []
        if not (_finite(loss) and (grad is None or _finite(grad))):
            return self._escalate(self._event("divergence", record, "non-finite loss or grad"))
        if not self.armed():
            self._learn(loss, grad)
            return []
        if self.state == "watching":
            return self._watch(record)
        relative = self.loss.median() * (1.0 + self.config.loss_rel)
        if loss <= relative:  # cheap path: most iterations stop here
            self.elevated = self.suspicious = 0
            self._learn(loss, grad)
            return []
        if loss <= self.threshold():
            # Suspicious but not a spike: keep it out of the baseline so a spike's first steps
            # cannot raise the threshold, unless it lasts (a level shift, e.g. a new mixture).
            self.elevated = 0
            self.suspicious += 1
            if self.suspicious > self.config.patience:
                self._learn(loss, grad)
            return []
        grad_baseline = self.grad.median() if len(self.grad) else None
        corroborated = (
            grad is not None
            and grad_baseline is not None
            and grad >= self.config.grad_factor * grad_baseline
        )
        if corroborated:
            self.incident = self._event("spike", record, "loss jump corroborated by grad norm")
            self.state = "watching"
            return [self.incident]
        self.elevated += 1
        if self.elevated >= max(self.config.patience, 1):
            event = self._event("divergence", record, "loss above threshold without recovery")
            event.onset = record.iteration - self.elevated + 1
            return self._escalate(event)
        return []

    def _learn(self, loss: float, grad: float | None) -> None:
        self.loss.push(loss)
        if _finite(grad):
            self.grad.push(grad)  # type: ignore[arg-type]

    def _watch(self, record: SignalRecord) -> list[SpikeEvent]:
        assert self.incident is not None
        if record.lm_loss <= self.incident.loss_threshold:  # type: ignore[operator]
            recovered = self._event("recovered", record, "loss back under the threshold")
            recovered.onset = self.incident.onset
            self.state, self.incident = "healthy", None
            return [recovered]
        if record.iteration - self.incident.iteration >= self.config.patience:
            event = self._event("rollback", record, "spike did not recover within patience")
            event.onset = self.incident.onset
            event.culprit_dp_rank = self.incident.culprit_dp_rank
            self.state = "rollback"
            return [event]
        return []

    def _escalate(self, divergence: SpikeEvent) -> list[SpikeEvent]:
        rollback = SpikeEvent(
            **{**asdict(divergence), "kind": "rollback", "window": list(divergence.window)}
        )
        self.state = "rollback"
        return [divergence, rollback]

    def _event(self, kind: EventKind, record: SignalRecord, why: str) -> SpikeEvent:
        armed = self.armed() and len(self.loss) > 0
        return SpikeEvent(
            kind=kind,
            iteration=record.iteration,
            onset=record.iteration,
            consumed_samples=record.consumed_samples,
            culprit_dp_rank=record.max_loss_dp_rank,
            loss=record.lm_loss,
            loss_baseline=self.loss.median() if armed else None,
            loss_threshold=self.threshold() if armed else None,
            grad_norm=record.grad_norm,
            grad_baseline=self.grad.median() if len(self.grad) else None,
            classification=why,
            attempt=record.attempt,
            window=[_summary(r) for r in self.recent],
        )


def _summary(record: SignalRecord) -> dict[str, Any]:
    """The few signals an on-call engineer reads first, per iteration."""
    return {
        "iteration": record.iteration,
        "lm_loss": record.lm_loss,
        "grad_norm": record.grad_norm,
        "max_local_loss": record.max_local_loss,
        "max_loss_dp_rank": record.max_loss_dp_rank,
        "update_ratio": record.update_ratio,
        "lr": record.lr,
    }


def spike_candidates(records: list[SignalRecord], config: SpikeConfig) -> list[SpikeEvent]:
    """Offline: run the detector over one attempt's records; all spike/divergence events.

    Unlike training, the replay keeps going after a rollback decision, so a plot shows every
    candidate in the log.
    """
    detector, events = SpikeDetector(config), []
    for record in records:
        found = detector.observe(record)
        events += [e for e in found if e.kind in ("spike", "divergence")]
        if detector.state == "rollback":
            detector.state, detector.incident = "healthy", None
    return events
