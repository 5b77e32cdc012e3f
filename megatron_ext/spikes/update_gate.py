"""The adaptive update skip's decision: a grad-norm threshold from its own healthy history (no
Megatron imports).

Why a robust baseline: OLMo-core's ``SkipStepOptimizer`` skips an update whose loss or grad
norm exceeds mean + 6σ over 128 steps; a mean and a standard deviation are pulled up by the
very outliers they are meant to catch, so here the detector's statistics are used instead
(:class:`~megatron_ext.spikes.windows.RollingWindow`: median and MAD over the last ``window``
healthy steps). The threshold is known *before* the step (it depends only on past steps), so
Megatron's own comparison of the step's grad norm with it decides, after the one host sync
Megatron already does for the norm: no sync is added.

A withheld step never enters the window (nor does a step the optimizer skipped for its own
reasons, an fp16 overflow), so a run of bad steps cannot raise the threshold and let itself
through; a streak of withheld steps is the detector's ``skip_streak`` incident, which ends in a
rollback when it does not recover.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from megatron_ext.spikes.windows import RollingWindow


@dataclass(frozen=True)
class GateConfig:
    """``--spike-skip-update-factor`` / ``--spike-skip-update-mad-k`` and the detector's
    window and warm-up."""

    factor: float = 2.0  # withhold above factor × median ...
    mad_k: float = 6.0  # ... and above median + mad_k robust sigmas
    window: int = 100
    warmup: int = 100

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(f"--spike-skip-update-factor must be > 1, got {self.factor}")
        if not (math.isfinite(self.mad_k) and self.mad_k > 0):
            raise ValueError(f"--spike-skip-update-mad-k must be > 0, got {self.mad_k}")


class UpdateGate:
    """Feed :meth:`learn` each step's grad norm; :meth:`threshold` is the next step's limit."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self.norms = RollingWindow(config.window)
        self.seen = 0  # steps observed (healthy or not), for the warm-up

    def armed(self) -> bool:
        """As the detector: after ``warmup`` steps, with at least half a window of norms."""
        return self.seen >= self.config.warmup and len(self.norms) >= self.config.window // 2

    def threshold(self) -> float:
        """The grad norm above which the next update is withheld (inf while not armed)."""
        if not self.armed():
            return math.inf
        c = self.config
        return self.norms.threshold(c.factor - 1.0, c.mad_k)

    def learn(self, grad_norm: float | None, skipped: bool) -> None:
        """One step: its grad norm enters the baseline only if the update was applied and the
        norm is a finite measurement."""
        self.seen += 1
        if not skipped and grad_norm is not None and math.isfinite(grad_norm):
            self.norms.push(grad_norm)

    def prime(self, seen: int, norms: Iterable[float]) -> None:
        """After a restart: the healthy norms of the history the run continues from."""
        self.seen = seen
        for norm in norms:
            self.norms.push(norm)
