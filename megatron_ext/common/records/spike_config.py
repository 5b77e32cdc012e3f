"""The spike detector's thresholds and their ``--spike-*`` flags (no Megatron imports).

One definition shared by training (``--spike-detect``), ``megatron-ext plot`` (which defaults
to the thresholds the run recorded in its ledger) and the benchmark. The defaults were chosen
on real curves (``benchmarks/detector.py``; README "Spike detector" says why).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# The max attention logit past which bf16 softmax saturates (seed 000 ch. 2 §4; Megatron's
# --qk-clip-threshold default): the cause tree and the early warning both read it.
ATTENTION_LOGIT_LIMIT = 100.0


@dataclass(frozen=True)
class SpikeConfig:
    """Detector thresholds; the defaults and their reasons are in README ("Spike detector")."""

    window: int = 100  # healthy iterations in the rolling median / MAD
    warmup: int = 100  # iterations before the detector arms
    loss_rel: float = 0.10  # moderate jump: needs corroboration (grad, skip, worst rank)
    mad_k: float = 6.0  # robust sigmas of a moderate jump
    large_rel: float = 0.30  # large jump: escalates on the loss alone
    large_mad_k: float = 12.0  # robust sigmas of a large jump
    grad_factor: float = 2.0  # grad norm / its median that corroborates a moderate jump
    skip_streak: int = 5  # consecutive skipped iterations that start an incident
    patience: int = 50  # iterations a flagged spike may take to recover
    context: int = 20  # signal records kept in each ledger event
    # Per-source baselines (lm_loss_by_dataset): the average judged under the baseline's
    # mixture, a member's own jump corroborates or flags (spikes/sources.py).
    per_source: bool = True

    def __post_init__(self) -> None:
        for name in ("loss_rel", "mad_k", "large_rel", "large_mad_k", "grad_factor"):
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN compares False with every loss: no flag ever
                raise ValueError(
                    f"spike detector: --spike-{name.replace('_', '-')} must be a finite "
                    f"number, got {value}"
                )
        if self.window < 3 or self.warmup < self.window // 2 or self.patience < 1:
            raise ValueError(
                f"spike detector: need window >= 3, warmup >= window/2 and patience >= 1 "
                f"(got window={self.window}, warmup={self.warmup}, patience={self.patience})"
            )
        if self.loss_rel <= 0 or self.mad_k <= 0 or self.grad_factor <= 1:
            raise ValueError("spike detector: loss_rel and mad_k must be > 0, grad_factor > 1")
        if self.large_rel < self.loss_rel or self.large_mad_k < self.mad_k:
            raise ValueError(
                "spike detector: a large jump must be at least a moderate one: need "
                f"large_rel >= loss_rel ({self.large_rel} < {self.loss_rel}?) and "
                f"large_mad_k >= mad_k ({self.large_mad_k} < {self.mad_k}?)"
            )
        if self.skip_streak < 1 or self.context < 1:
            raise ValueError("spike detector: skip_streak and context must be >= 1")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> SpikeConfig:
        """The config a ledger recorded; keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


# (flag suffix, field, type, help). One table: training and plot get the same flags.
_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("window", "window", int, "healthy iterations in the rolling median/MAD"),
    ("warmup", "warmup", int, "iterations before the detector arms"),
    (
        "loss-rel",
        "loss_rel",
        float,
        "moderate jump: relative loss rise over the median; flagged only when corroborated "
        "(grad norm, skipped step, worst DP rank)",
    ),
    ("mad-k", "mad_k", float, "moderate jump: robust sigmas (1.4826 x MAD) over the median"),
    ("large-rel", "large_rel", float, "large jump, flagged on the loss alone: relative rise"),
    ("large-mad-k", "large_mad_k", float, "large jump: robust sigmas over the median"),
    ("grad-factor", "grad_factor", float, "grad norm / its median that corroborates a jump"),
    (
        "skip-streak",
        "skip_streak",
        int,
        "consecutive skipped iterations (overflow, loss-scale drop) that start an incident",
    ),
    (
        "patience",
        "patience",
        int,
        "iterations a flagged spike may take to recover, and an uncorroborated "
        "elevated loss may last, before a rollback",
    ),
)


def add_detector_args(group: argparse._ArgumentGroup, defaults: bool = True) -> None:
    """The ``--spike-*`` threshold flags. ``defaults=False`` (plot): unset flags stay None so
    the caller can fill them from the run's recorded config."""
    d = SpikeConfig()
    for suffix, name, kind, text in _FLAGS:
        group.add_argument(
            f"--spike-{suffix}",
            dest=f"spike_{name}",
            type=kind,
            default=getattr(d, name) if defaults else None,
            help=f"{text} (default {getattr(d, name)}"
            + (")" if defaults else "; plot: the run's recorded value)"),
        )


def config_from_args(options: Any, base: SpikeConfig | None = None) -> SpikeConfig:
    """The thresholds the ``--spike-*`` flags describe; unset (None) flags keep ``base``'s
    value (raises ValueError if invalid)."""
    base = base or SpikeConfig()
    values = {}
    for _, name, _, _ in _FLAGS:
        given = getattr(options, f"spike_{name}", None)
        values[name] = getattr(base, name) if given is None else given
    return SpikeConfig(**{**base.as_json(), **values})


def flags_given(options: Any) -> bool:
    """Whether any ``--spike-*`` threshold flag was set (``add_detector_args(defaults=False)``)."""
    return any(getattr(options, f"spike_{name}", None) is not None for _, name, _, _ in _FLAGS)
