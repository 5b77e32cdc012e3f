"""Early warning: divergence precursors in the signals before the loss moves (no Megatron
imports): a ledger ``warning`` and a console line, never a rollback. One warning per episode,
re-armed once back within half the rise. Rule and reasons: docs/instabilities.md "Early warning".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from megatron_ext.common.io import json_safe
from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.spike_config import ATTENTION_LOGIT_LIMIT, SpikeConfig


@dataclass(frozen=True)
class Precursor:
    """One watched signal: its field, how a value is read and the rise that warns."""

    field: str
    rise: float  # in the transformed unit: log-ratio, or nats for log Z
    log: bool  # compare logarithms (a ratio) rather than values
    two_sided: bool = False
    floor: float | None = None  # the signal's own level it must also be past (raw units)

    def value(self, record: SignalRecord) -> float | None:
        raw = getattr(record, self.field)
        if raw is None or not math.isfinite(raw) or (self.log and raw <= 0):
            return None
        return math.log(raw) if self.log else raw


# Grad norm x2; the attention logit x1.5 and past where bf16 softmax saturates; log Z 5 nats.
PRECURSORS = (
    Precursor("grad_norm", math.log(2.0), log=True),
    Precursor("max_attention_logit", math.log(1.5), log=True, floor=ATTENTION_LOGIT_LIMIT),
    Precursor("log_z", 5.0, log=False, two_sided=True),
)


@dataclass(frozen=True)
class WarnConfig:
    """Windows of the rule (module docstring); the defaults follow the detector's defaults."""

    recent: int = 20
    persist: int = 10
    horizon: int = 500
    trend: float = 0.5
    warmup: int = 100  # steps before any warning (the loss and every norm still settle)
    improving: float = 0.02  # a loss median this much below the reference's: learning

    @classmethod
    def following(cls, detector: SpikeConfig) -> WarnConfig:
        """Windows scaled with the detector's (``--spike-window``, ``--spike-warmup``)."""
        window = detector.window
        return cls(max(3, window // 5), max(2, window // 10), 5 * window, warmup=detector.warmup)


@dataclass
class PrecursorWarning:
    """A ledger line of kind ``warning``."""

    iteration: int
    attempt: int
    signal: str
    value: float
    reference: float
    classification: str
    kind: str = "warning"

    def as_json(self) -> dict[str, Any]:
        return json_safe(self)


@dataclass
class _Track:
    values: deque[float]
    medians: deque[tuple[int, float, float]]  # (iteration, m, loss median then), the horizon
    above: int = 0
    warned: bool = False


def rank_trend(values: list[float]) -> float:
    """Spearman rank correlation with time (0 for a constant)."""
    if len(set(values)) < 2:
        return 0.0
    return statistics.correlation(range(len(values)), values, method="ranked")


class PrecursorMonitor:
    """Feed :meth:`observe` one record per iteration; it returns the warnings it raises."""

    def __init__(self, config: WarnConfig | None = None) -> None:
        self.config = c = config or WarnConfig()
        self.seen = 0
        self.losses: deque[float] = deque(maxlen=c.recent)
        self.tracks = {p.field: _Track(deque(maxlen=c.recent), deque()) for p in PRECURSORS}

    def observe(self, record: SignalRecord) -> list[PrecursorWarning]:
        self.seen += 1
        if record.skipped_iter:
            return []  # not a measurement of the model's trajectory
        if record.lm_loss is not None and math.isfinite(record.lm_loss):
            self.losses.append(record.lm_loss)
        if len(self.losses) < self.config.recent:
            return []
        steps = (self._step(p, self.tracks[p.field], record) for p in PRECURSORS)
        return [warning for warning in steps if warning is not None]

    def _step(self, p: Precursor, track: _Track, record: SignalRecord) -> PrecursorWarning | None:
        value = p.value(record)
        if value is None:
            return None
        c = self.config
        track.values.append(value)
        if len(track.values) < c.recent:
            return None
        m, loss = statistics.median(track.values), statistics.median(self.losses)
        if self.seen < c.warmup:
            return None  # the reference starts after the warm-up's settling
        horizon = track.medians
        while horizon and horizon[0][0] <= record.iteration - c.horizon:
            horizon.popleft()
        past = [(v, lo) for i, v, lo in horizon if i <= record.iteration - c.recent]
        horizon.append((record.iteration, m, loss))
        if not past:
            return None
        # Learning moves these signals too, so a reference is a point the loss has not
        # improved on since: a move that bought the loss nothing is the precursor.
        flat = [v for v, lo in past if loss >= lo * (1.0 - c.improving)]
        reference = min(flat or [v for v, _ in past])
        if p.two_sided and flat and max(flat) - m > m - reference:
            reference = max(flat)
        drift = m - reference
        trend = rank_trend(list(track.values))
        value = math.exp(m) if p.log else m
        rising = (
            bool(flat)
            and abs(drift) >= p.rise
            and trend * math.copysign(1.0, drift) >= c.trend
            and (p.floor is None or value >= p.floor)
        )
        if abs(drift) < p.rise / 2:
            track.warned = False
        track.above = track.above + 1 if rising else 0
        if track.warned or track.above < c.persist:
            return None
        track.warned = True
        ref = math.exp(reference) if p.log else reference
        change = f"{math.exp(drift):.2f}x" if p.log else f"{drift:+.2f} nats"
        why = (
            f"early warning: {p.field} {'rising' if drift > 0 else 'falling'} for "
            f"{c.persist}+ steps: median of the last {c.recent} {value:.4g} vs "
            f"{ref:.4g} within the last {c.horizon} ({change}, trend "
            f"{trend:.2f}); a divergence precursor, no rollback"
        )
        return PrecursorWarning(record.iteration, record.attempt, p.field, value, ref, why)


def replay(records: list[SignalRecord], config: WarnConfig | None = None) -> list[PrecursorWarning]:
    """Offline: every warning over ``records`` (benchmarks, tests)."""
    monitor = PrecursorMonitor(config)
    return [w for r in records for w in monitor.observe(r)]
