"""The spike detector's thresholds and their ``--spike-*`` flags (no Megatron imports), shared
by training, ``megatron-ext plot`` and the benchmarks; defaults: docs/incidents.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# The max attention logit past which bf16 softmax saturates (seed 000 ch. 2 §4; Megatron's
# --qk-clip-threshold default): the cause tree and the early warning both read it.
ATTENTION_LOGIT_LIMIT = 100.0


def _flag(default: float, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class SpikeConfig:
    """Detector thresholds; the defaults and their reasons: docs/incidents.md "Spike detector"."""

    window: int = _flag(100, "healthy iterations in the rolling median/MAD")
    warmup: int = _flag(100, "iterations before the detector arms")
    loss_rel: float = _flag(
        0.10,
        "moderate jump: relative loss rise over the median; flagged only when corroborated "
        "(grad norm, skipped step, worst DP rank)",
    )
    mad_k: float = _flag(6.0, "moderate jump: robust sigmas (1.4826 x MAD) over the median")
    large_rel: float = _flag(0.30, "large jump, flagged on the loss alone: relative rise")
    large_mad_k: float = _flag(12.0, "large jump: robust sigmas over the median")
    grad_factor: float = _flag(2.0, "grad norm / its median that corroborates a jump")
    skip_streak: int = _flag(
        5, "consecutive skipped iterations (overflow, loss-scale drop) that start an incident"
    )
    patience: int = _flag(
        50,
        "iterations a flagged spike may take to recover, and an uncorroborated "
        "elevated loss may last, before a rollback",
    )
    context: int = 20  # signal records kept in each ledger event
    # Per-source baselines (lm_loss_by_dataset): a member's own jump corroborates or flags.
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


def _flags() -> list[Any]:
    return [f for f in fields(SpikeConfig) if "help" in f.metadata]


def add_detector_args(group: argparse._ArgumentGroup, defaults: bool = True) -> None:
    """The ``--spike-*`` threshold flags. ``defaults=False`` (plot): unset flags stay None so
    the caller can fill them from the run's recorded config."""
    for f in _flags():
        group.add_argument(
            f"--spike-{f.name.replace('_', '-')}",
            dest=f"spike_{f.name}",
            type=type(f.default),
            default=f.default if defaults else None,
            help=f"{f.metadata['help']} (default {f.default}"
            + (")" if defaults else "; plot: the run's recorded value)"),
        )


def config_from_args(options: Any, base: SpikeConfig | None = None) -> SpikeConfig:
    """The thresholds the ``--spike-*`` flags describe; unset (None) flags keep ``base``'s
    value (raises ValueError if invalid)."""
    given = {f.name: getattr(options, f"spike_{f.name}", None) for f in _flags()}
    return replace(base or SpikeConfig(), **{k: v for k, v in given.items() if v is not None})


def flags_given(options: Any) -> bool:
    """Whether any ``--spike-*`` threshold flag was set (``add_detector_args(defaults=False)``)."""
    return any(getattr(options, f"spike_{f.name}", None) is not None for f in _flags())
