"""The recovery feature in Megatron: at start-up, whether this attempt resumed from an applied
rollback (decided on the writing rank, broadcast); then, over the first ``--recovery-iters``
updates, the lr ramp (set in the optimizer's param groups before the step; the scheduler sets
its own again after it), Adam's moments zeroed at the resume and the update-norm clip.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.common.features import (
    Feature,
    FeatureError,
    StepRecord,
    collective_device,
    from_writing_rank,
)
from megatron_ext.common.files import SIGNALS_FILE, applied_incidents_file
from megatron_ext.common.io import read_jsonl
from megatron_ext.common.records.signals import history_before
from megatron_ext.recovery.core import (
    RecoveryConfig,
    UpdateNorms,
    chosen_options,
    clip_scale,
    lr_multiplier,
    rollback_resumed,
    update_norms_from,
)

# Adam's moments and step count: the first update after the reset is Adam's first step.
RESET = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def config_of(args: Any) -> RecoveryConfig:
    return RecoveryConfig(
        iters=args.recovery_iters,
        lr_mult=args.recovery_lr_mult,
        reset_moments=args.recovery_reset_moments,
        clip_update=args.recovery_clip_update,
        window=args.spike_window,
    )


def _check_clip(args: Any) -> None:
    if not (args.signals_dir and args.signals_update_ratio):
        raise FeatureError(
            "--recovery-clip-update needs --signals-dir and --signals-update-ratio: its "
            "statistics start from the update norms logged before the rollback"
        )
    main_copies = [f for f in ("use_distributed_optimizer", "fp16", "bf16") if getattr(args, f)]
    if main_copies or getattr(args, "use_torch_fsdp2", False):
        raise FeatureError(
            f"--recovery-clip-update is verified only where the optimizer updates the model's "
            f"own fp32 parameters (DDP, no --use-distributed-optimizer/--fp16/--bf16/FSDP); "
            f"drop it or {'/'.join('--' + f.replace('_', '-') for f in main_copies) or 'FSDP'}"
        )


def _counted(part: Any) -> list[tuple[torch.Tensor, bool]]:
    """A part's parameters and whether Megatron's grad norm counts them on this rank."""
    return [
        (p, param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, part.tp_group))
        for p in part.get_parameters()
    ]


class RecoveryFeature(Feature):
    """The recovery window after a rollback's resume and the options applied in it."""

    name = "recovery"

    def __init__(self) -> None:
        self.args: Any = None
        self.config = RecoveryConfig()
        self.optimizer: Any = None
        self.active = False  # this attempt resumed from an applied rollback
        self.updates = 0  # updates taken since the resume
        self.stepped = False  # before_grad_norm ran for the step being logged
        self.mult = 1.0
        self.norms: UpdateNorms | None = None
        self.snapshot: list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor, bool]]]] = []

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--recovery-iters",
            type=int,
            default=0,
            help="After a resume from an applied rollback (megatron-ext skiplist --apply), apply "
            "the --recovery-* options to this many updates (default 0: off). docs/incidents.md.",
        )
        group.add_argument(
            "--recovery-lr-mult",
            type=float,
            default=1.0,
            help="Scale the lr of the first update after the rollback by this factor, ramping "
            "linearly back to the schedule's lr over --recovery-iters updates (default 1: off).",
        )
        group.add_argument(
            "--recovery-reset-moments",
            action="store_true",
            help="Zero Adam's moments and step count at the rollback's resume: the first update "
            "after it is Adam's first step (lr x sign of the gradient per element).",
        )
        group.add_argument(
            "--recovery-clip-update",
            type=float,
            default=None,
            metavar="K",
            help="During the recovery window, scale down an update whose norm is above mean + K "
            "sigma of the last --spike-window update norms (needs --signals-update-ratio).",
        )

    def enabled(self, args: Any) -> bool:
        # Any option set is validated, even without --recovery-iters.
        options = (args.recovery_lr_mult, args.recovery_reset_moments, args.recovery_clip_update)
        return bool(args.recovery_iters or chosen_options(*options))

    def validate(self, args: Any) -> None:
        try:
            config = config_of(args)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
        if not args.load:
            raise FeatureError("--recovery-iters needs --load: a rollback resumes from it")
        if config.reset_moments and args.optimizer != "adam":
            raise FeatureError(
                f"--recovery-reset-moments needs --optimizer adam, not {args.optimizer}"
            )
        if config.clip_update is not None:
            _check_clip(args)

    def install(self, args: Any) -> None:
        self.args, self.config = args, config_of(args)

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        """Decide (writing rank, broadcast) whether this start resumed from a rollback."""
        self.optimizer = optimizer
        loaded = int(getattr(self.args, "iteration", 0) or 0)
        window = self.config.window
        values = from_writing_rank(window + 1, lambda: self._resumed_rollback(loaded))
        self.active = values[0] == 1.0
        if not self.active:
            return
        self.norms = UpdateNorms(window)
        self.norms.prime(values[1:])  # NaN: no norm
        if self.config.reset_moments:
            self._reset_moments()
        if dist.get_rank() == 0:
            chosen = ", ".join(self.config.options()) or "no option"
            print(
                f"megatron-ext: resumed from the rollback to iteration {loaded}: recovery for "
                f"{self.config.iters} updates ({chosen})",
                flush=True,
            )

    def _resumed_rollback(self, loaded: int) -> list[float]:
        """[1, the update norms before it (with --recovery-clip-update)] when this start resumed
        from a rollback, else []."""
        path = applied_incidents_file(self.args.load)
        applied = read_jsonl(path).records if path.exists() else []
        if rollback_resumed(loaded, applied) is None:
            return []
        if self.config.clip_update is None:
            return [1.0]
        signals = Path(self.args.signals_dir) / SIGNALS_FILE  # its statistics start from these
        window = self.config.window
        return [1.0, *update_norms_from(history_before(signals, loaded + 1, window))[-window:]]

    def _reset_moments(self) -> None:
        """Zero Adam's moments and step in every part's torch optimizer (distributed optimizer:
        this rank's shard); registry ``optimizer-inner-torch-optimizer``."""
        with torch.no_grad():
            for part in self.optimizer.chained_optimizers:
                for state in part.optimizer.state.values():
                    for key in RESET:
                        if torch.is_tensor(state.get(key)):
                            state[key].zero_()
                        elif key in state:
                            state[key] = 0

    def before_grad_norm(self, optimizer: Any) -> None:
        """Inside the window: scale this step's lr and snapshot the parameters for the clip."""
        if optimizer is not self.optimizer or not self.active or self.updates >= self.config.iters:
            return
        self.updates += 1
        self.stepped = True
        self.mult = lr_multiplier(self.config, self.updates)
        for group in optimizer.param_groups:
            group["lr"] *= self.mult  # in place when a tensor
        if self.config.clip_update is not None:
            with torch.no_grad():
                self.snapshot = [
                    (part, [(p, p.detach().clone(), c) for p, c in _counted(part)])
                    for part in optimizer.chained_optimizers
                ]

    def after_step(self, record: StepRecord) -> None:
        """Clip the update just applied (every rank alike) and mark the step's record."""
        if not self.stepped:
            return
        self.stepped = False
        record.recovery = {"update": self.updates, "lr_mult": self.mult}
        if self.snapshot and not record.skipped_iter:
            record.recovery.update(self._clip(record.iteration))
        self.snapshot = []
        if self.updates == self.config.iters and dist.get_rank() == 0:
            print(
                f"megatron-ext: recovery window ended at iteration {record.iteration}", flush=True
            )

    def _clip(self, iteration: int) -> dict[str, float]:
        """The update's global norm against mean + K sigma; scaled down in place above it."""
        assert self.norms is not None and self.config.clip_update is not None
        total = 0.0
        with torch.no_grad():
            for part, params in self.snapshot:
                squares = torch.zeros(1, dtype=torch.float64, device=collective_device())
                for p, old, counted in params:
                    if counted:
                        squares += (p.detach().float() - old.float()).double().square().sum()
                dist.all_reduce(squares, group=part.get_grad_stats_parallel_group())
                total += squares.item()
            norm = math.sqrt(total)
            threshold = self.norms.threshold(self.config.clip_update)
            scale = clip_scale(norm, threshold)
            if scale < 1.0:
                for _, params in self.snapshot:
                    for p, old, _ in params:
                        p.sub_(old).mul_(scale).add_(old)
        self.norms.push(norm * scale)
        if scale < 1.0 and dist.get_rank() == 0:
            print(
                f"megatron-ext: recovery clipped the update of iteration {iteration}: norm "
                f"{norm:.4g} > {threshold:.4g} (x{scale:.3g})",
                flush=True,
            )
        return {"update_norm": norm, "clip_threshold": threshold, "clip_scale": scale}
