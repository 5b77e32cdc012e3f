"""``--spike-skip-update``: withhold the update of a step whose grad norm is far above its
robust baseline, by setting megatron-core 0.18+'s ``grad_norm_skip_threshold`` from earlier
steps only (every rank decides alike, no sync). docs/instabilities.md "Adaptive update skip".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.common.features import (
    Feature,
    FeatureError,
    StepRecord,
    from_writing_rank,
    print_rank_0,
)
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals import history_before
from megatron_ext.spikes.detector import RollingWindow


@dataclass(frozen=True)
class GateConfig:
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
    """Feed :meth:`learn` each step's grad norm; :meth:`threshold` is the next step's limit
    (withheld or overflowed steps never enter the window)."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self.norms = RollingWindow(config.window)
        self.seen = 0  # steps observed (healthy or not), for the warm-up

    def threshold(self) -> float:
        """The grad norm above which the next update is withheld; inf until armed (as the
        detector: after ``warmup`` steps, with at least half a window of norms)."""
        c = self.config
        if self.seen < c.warmup or len(self.norms) < c.window // 2:
            return math.inf
        return self.norms.threshold(c.factor - 1.0, c.mad_k)

    def learn(self, grad_norm: float | None, skipped: bool) -> None:
        """One step: its norm enters the baseline only if applied and finite."""
        self.seen += 1
        if not skipped and grad_norm is not None and math.isfinite(grad_norm):
            self.norms.push(grad_norm)

    def prime(self, seen: int, norms: Iterable[float]) -> None:
        """After a restart: the healthy norms of the history the run continues from."""
        self.seen = seen
        for norm in norms:
            self.norms.push(norm)


class UpdateSkipFeature(Feature):
    """The gate, the thresholds it sets on Megatron's optimizer parts, and the skip count."""

    name = "update_skip"

    def __init__(self) -> None:
        self.args: Any = None
        self.gate: UpdateGate | None = None
        self.parts: list[Any] = []  # the chained optimizers whose config carries the threshold
        self.static: list[float] = []  # each part's own threshold (a user's static one)
        self.optimizer: Any = None
        self.limit = math.inf  # the threshold the current step is judged against
        self.withheld = 0  # updates withheld in this attempt

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        defaults = GateConfig()
        group.add_argument(
            "--spike-skip-update",
            action="store_true",
            help="Withhold the update of a step whose grad norm is far above its median over "
            "the last --spike-window healthy steps. Needs --spike-detect, megatron-core >= 0.18.",
        )
        group.add_argument(
            "--spike-skip-update-factor",
            type=float,
            default=defaults.factor,
            help=f"Withhold above this x the median grad norm (default {defaults.factor}).",
        )
        group.add_argument(
            "--spike-skip-update-mad-k",
            type=float,
            default=defaults.mad_k,
            help=f"... and above median + this many robust sigmas (default {defaults.mad_k}).",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.spike_skip_update)

    def _config(self, a: Any) -> GateConfig:
        return GateConfig(
            a.spike_skip_update_factor, a.spike_skip_update_mad_k, a.spike_window, a.spike_warmup
        )

    def validate(self, args: Any) -> None:
        try:
            self._config(args)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
        if not args.spike_detect:
            raise FeatureError(
                "--spike-skip-update needs --spike-detect: a streak of withheld updates must "
                "become an incident (and a rollback), which the detector decides"
            )
        from megatron.core.optimizer import OptimizerConfig

        if "grad_norm_skip_threshold" not in getattr(OptimizerConfig, "__dataclass_fields__", {}):
            raise FeatureError(
                "--spike-skip-update needs megatron-core >= 0.18: it sets the optimizer's "
                "grad_norm_skip_threshold, which 0.17 does not have. Upgrade megatron-core or "
                "drop the flag."
            )

    def install(self, args: Any) -> None:
        self.args = args
        self.gate = UpdateGate(self._config(args))

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        """Keep the parts whose threshold Megatron reads, and prime the gate on every rank with
        the healthy norms of the history this run continues from (read by the writing rank,
        broadcast)."""
        self.optimizer = optimizer
        self.parts = list(optimizer.chained_optimizers)
        self.static = [part.config.grad_norm_skip_threshold for part in self.parts]
        first_iteration = int(getattr(self.args, "iteration", 0) or 0) + 1
        assert self.gate is not None
        config = self.gate.config

        def healthy_history() -> list[float]:  # [records read, their healthy grad norms]
            path = Path(self.args.signals_dir) / SIGNALS_FILE
            history = history_before(path, first_iteration, config.warmup + config.window)
            norms = [
                r.grad_norm
                for r in history
                if not r.skipped_iter and r.grad_norm is not None and math.isfinite(r.grad_norm)
            ][-config.window :]
            return [len(history), *norms]

        seen, *norms = from_writing_rank(config.window + 1, healthy_history)
        self.gate.prime(int(seen), [n for n in norms if math.isfinite(n)])

    def before_grad_norm(self, optimizer: Any) -> None:
        """The step's threshold, from earlier steps only, where Megatron will compare."""
        if optimizer is not self.optimizer:
            return
        assert self.gate is not None
        self.limit = self.gate.threshold()
        for part, static in zip(self.parts, self.static):
            part.config.grad_norm_skip_threshold = min(static, self.limit)

    def after_step(self, record: StepRecord) -> None:
        """Mark a withheld step on the record (the signals log reads it) and learn the step."""
        assert self.gate is not None
        norm = record.grad_norm
        record.update_skipped = bool(
            record.skipped_iter and norm is not None and math.isfinite(norm) and norm > self.limit
        )
        self.gate.learn(norm, record.skipped_iter)
        if record.update_skipped:
            self.withheld += 1
            median = self.gate.norms.median()
            print_rank_0(
                f"megatron-ext: update withheld at iteration {record.iteration}: grad norm "
                f"{norm:.4g} > {self.limit:.4g} ({norm / median:.1f}x the median "
                f"{median:.4g}); {self.withheld} withheld in this attempt"
            )
