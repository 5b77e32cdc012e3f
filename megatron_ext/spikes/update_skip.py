"""``--spike-skip-update``: withhold the optimizer update of a step whose grad norm is far above
its robust baseline (:mod:`megatron_ext.spikes.update_gate`), inside Megatron's step.

How it meets Megatron: megatron-core 0.18+ ``ChainedOptimizer.step`` computes the grad norm
(its one host sync), then skips the update when the norm exceeds each part's
``OptimizerConfig.grad_norm_skip_threshold`` (a static number, infinite by default; registry
assumption ``optimizer-grad-norm-skip-threshold``). Before every norm (``before_grad_norm``)
this feature sets that threshold to the gate's, which depends only on earlier steps, so every
rank (they all see the same global norm) decides alike and Megatron's own comparison does the
rest: no patch, no collective, no sync. A withheld step goes down Megatron's overflow path
(``update_successful`` False): no parameter, optimizer-state or learning-rate-schedule change,
``skipped_iter`` 1 and Megatron's "number of skipped iterations" counts it; the signals log
marks it ``update_skipped`` and the spike detector takes it as a skipped iteration (a streak of
``--spike-skip-streak`` is an incident that ends in a rollback if it does not recover).
megatron-core 0.17 has no threshold to set: the flag is refused there.

The loss is not part of the decision: Megatron reduces the loss over data-parallel ranks after
the optimizer step, so no rank knows the step's loss before the update without a collective.
After a restart the gate is primed, like the detector, from the signals history the run
continues from: the writing rank reads it and broadcasts the healthy norms once, at set-up.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.common.features import (
    Feature,
    FeatureError,
    StepRecord,
    collective_device,
    is_writing_rank,
    writing_rank,
)
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.records.signals_seek import history_before
from megatron_ext.spikes.update_gate import GateConfig, UpdateGate


def _has_threshold() -> bool:
    """Whether this megatron-core's optimizer config has the threshold the skip sets."""
    from megatron.core.optimizer import OptimizerConfig

    return "grad_norm_skip_threshold" in getattr(OptimizerConfig, "__dataclass_fields__", {})


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
            help="Withhold the optimizer update of a step whose grad norm is above both "
            "--spike-skip-update-factor x its median and median + --spike-skip-update-mad-k "
            "robust sigmas over the last --spike-window healthy steps (after --spike-warmup). "
            "No extra sync. Needs --spike-detect (a streak of withheld steps is an incident) "
            "and megatron-core >= 0.18.",
        )
        group.add_argument(
            "--spike-skip-update-factor",
            type=float,
            default=defaults.factor,
            help=f"Grad norm / its median above which an update may be withheld "
            f"(default {defaults.factor}).",
        )
        group.add_argument(
            "--spike-skip-update-mad-k",
            type=float,
            default=defaults.mad_k,
            help=f"Robust sigmas (1.4826 x MAD) above the median grad norm above which an "
            f"update may be withheld (default {defaults.mad_k}).",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.spike_skip_update)

    def _config(self, args: Any) -> GateConfig:
        return GateConfig(
            factor=args.spike_skip_update_factor,
            mad_k=args.spike_skip_update_mad_k,
            window=args.spike_window,
            warmup=args.spike_warmup,
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
        if not _has_threshold():
            raise FeatureError(
                "--spike-skip-update needs megatron-core >= 0.18: it sets the optimizer's "
                "grad_norm_skip_threshold, which 0.17 does not have. Upgrade megatron-core or "
                "drop the flag."
            )

    def install(self, args: Any) -> None:
        self.args = args
        self.gate = UpdateGate(self._config(args))

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        """Keep the parts whose threshold Megatron reads, and prime the gate (every rank)."""
        self.optimizer = optimizer
        self.parts = list(optimizer.chained_optimizers)
        self.static = [part.config.grad_norm_skip_threshold for part in self.parts]
        self._prime(int(getattr(self.args, "iteration", 0) or 0) + 1)

    def _prime(self, first_iteration: int) -> None:
        """The writing rank reads the history this run continues from; one broadcast gives
        every rank the same healthy norms (a fresh run: nothing to read, a warm-up)."""
        assert self.gate is not None
        config = self.gate.config
        world = dist.get_world_size()
        values = torch.full((config.window + 1,), math.nan, dtype=torch.float64)
        if is_writing_rank(dist.get_rank(), world):
            path = Path(self.args.signals_dir) / SIGNALS_FILE
            history = history_before(path, first_iteration, config.warmup + config.window)
            norms = [
                r.grad_norm
                for r in history
                if not r.skipped_iter and r.grad_norm is not None and math.isfinite(r.grad_norm)
            ][-config.window :]
            values[0] = len(history)
            values[1 : 1 + len(norms)] = torch.tensor(norms, dtype=torch.float64)
        values = values.to(collective_device())
        dist.broadcast(values, src=writing_rank(world))
        seen, norms = values[0].item(), values[1:].tolist()
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
            if dist.get_rank() == 0:
                median = self.gate.norms.median()
                print(
                    f"megatron-ext: update withheld at iteration {record.iteration}: grad norm "
                    f"{norm:.4g} > {self.limit:.4g} ({norm / median:.1f}x the median "
                    f"{median:.4g}); {self.withheld} withheld in this attempt",
                    flush=True,
                )
