"""Recovery after a rollback, without Megatron: whether a start resumed from an applied
rollback, and what the options do over the first ``--recovery-iters`` updates after it (the
lr ramp, the update-norm clip at the rolling mean + K sigma). docs/incidents.md "Recovery".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MIN_NORMS = 10  # update norms the clip needs before it clips (fewer: no threshold)


@dataclass(frozen=True)
class RecoveryConfig:
    iters: int = 0
    lr_mult: float = 1.0
    reset_moments: bool = False
    clip_update: float | None = None  # K: clip at mean + K sigma of recent update norms
    window: int = 100  # update norms the clip's statistics keep

    def __post_init__(self) -> None:
        if self.iters < 0:
            raise ValueError(f"--recovery-iters must be >= 0, got {self.iters}")
        if not (math.isfinite(self.lr_mult) and 0 < self.lr_mult <= 1):
            raise ValueError(f"--recovery-lr-mult must be in (0, 1], got {self.lr_mult}")
        if self.clip_update is not None and not (
            math.isfinite(self.clip_update) and self.clip_update > 0
        ):
            raise ValueError(f"--recovery-clip-update must be > 0, got {self.clip_update}")
        if self.clip_update is not None and self.window < MIN_NORMS:
            raise ValueError(
                f"--recovery-clip-update keeps --spike-window update norms: it must be >= "
                f"{MIN_NORMS}, got {self.window}"
            )
        if self.options() and self.iters == 0:
            raise ValueError(
                f"{', '.join(self.options())} need(s) --recovery-iters N > 0: the number of "
                "updates after a rollback's resume that the options apply to"
            )

    def options(self) -> list[str]:
        """The options chosen, as flags."""
        return chosen_options(self.lr_mult, self.reset_moments, self.clip_update)


def chosen_options(lr_mult: float, reset_moments: bool, clip_update: float | None) -> list[str]:
    """The recovery options set to other than their off values, as flags."""
    chosen = ["--recovery-lr-mult"] if lr_mult != 1.0 else []
    chosen += ["--recovery-reset-moments"] if reset_moments else []
    return chosen + (["--recovery-clip-update"] if clip_update is not None else [])


def rollback_resumed(loaded_iteration: int, applied: list[dict[str, Any]]) -> dict | None:
    """The applied rollback this start resumes from: the newest applied plan whose target is
    the loaded iteration (None: a fresh start or an ordinary resume)."""
    newest = applied[-1] if applied else {}
    target = newest.get("rollback_to")
    return newest if isinstance(target, int) and target == loaded_iteration > 0 else None


def lr_multiplier(config: RecoveryConfig, update: int) -> float:
    """The lr factor of the ``update``-th update after the resume (1-based): F at the first,
    rising linearly, 1 from update N + 1 on."""
    n = config.iters
    if update < 1 or update > n:
        return 1.0
    return config.lr_mult + (1.0 - config.lr_mult) * (update - 1) / n


class UpdateNorms:
    """The last ``window`` update norms; :meth:`threshold` is mean + K sigma over them."""

    def __init__(self, window: int) -> None:
        self.norms: deque[float] = deque(maxlen=window)

    def push(self, norm: float) -> None:
        if math.isfinite(norm):
            self.norms.append(norm)

    def prime(self, norms: Iterable[float]) -> None:
        for norm in norms:
            self.push(norm)

    def threshold(self, k: float) -> float:
        """mean + k·sigma (population), inf with fewer than :data:`MIN_NORMS` norms."""
        if len(self.norms) < MIN_NORMS:
            return math.inf
        return statistics.fmean(self.norms) + k * statistics.pstdev(self.norms)


def clip_scale(norm: float, threshold: float) -> float:
    """The factor that brings an update of ``norm`` down to ``threshold`` (1: no clip)."""
    if not math.isfinite(norm) or norm <= threshold or norm == 0:
        return 1.0
    return threshold / norm


def update_norms_from(records: Iterable[Any]) -> list[float]:
    """Past update norms from signals records: update ratio x params norm (the ratio's
    denominator is the counted parameters' norm after the step), where both were logged."""
    return [
        float(r.update_ratio) * float(r.params_norm)
        for r in records
        if r.update_ratio is not None and r.params_norm is not None and not r.skipped_iter
    ]
