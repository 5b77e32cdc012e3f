"""The hang watchdog in Megatron's loop (:mod:`megatron_ext.hang.watchdog`): on by default under
the launchers (unless ``--enable-ft-package``), started at install so that a rank stuck before
its first step is caught too (docs/hangs.md)."""

from __future__ import annotations

import argparse
import atexit
import os
from pathlib import Path
from typing import Any

from megatron_ext.common.features import Feature, FeatureError, LossInputs, MicroBatch, StepRecord
from megatron_ext.common.records.hangs import HANG_DIR_ENV
from megatron_ext.common.validation import check_directory, check_finite
from megatron_ext.hang.watchdog import Bounds, Watchdog

FLAGS = ("hang_detect", "hang_timeout_factor", "hang_min_timeout", "hang_first_timeout", "hang_dir")


class HangFeature(Feature):
    name = "hang"
    watchdog: Watchdog  # from install on, as every hook
    history: Path  # the phases' durations, kept across attempts

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--hang-detect",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Hang watchdog: a rank with no progress within its bound dumps every rank's "
            "stacks and exits 43, which the launchers turn into a restart from the last "
            "checkpoint (default: on under the launchers, off otherwise).",
        )
        group.add_argument(
            "--hang-timeout-factor",
            type=float,
            default=5.0,
            help="The bound is this many times the slowest recent step (or save, evaluation).",
        )
        group.add_argument(
            "--hang-min-timeout",
            type=float,
            default=120.0,
            help="Seconds: the bound is never shorter than this.",
        )
        group.add_argument(
            "--hang-first-timeout",
            type=float,
            default=1800.0,
            help="Seconds: the bound of a phase with no history yet (start-up and checkpoint "
            "load, the first steps, the first save and evaluation).",
        )
        group.add_argument(
            "--hang-dir",
            default=None,
            help="Where the watchdogs of one attempt meet and write their stacks (default: "
            f"${HANG_DIR_ENV}, set per attempt by the launchers; else SIGNALS_DIR/hangs).",
        )

    def enabled(self, args: Any) -> bool:
        """Explicit flags win; by default on under the launchers, except with Megatron's
        ``--enable-ft-package``: nvidia-resiliency-ext's rank monitor times the sections then."""
        if args.hang_detect is None:
            nvrx = getattr(args, "enable_ft_package", False)
            return bool(os.environ.get(HANG_DIR_ENV)) and not nvrx
        return bool(args.hang_detect)

    def _directory(self, args: Any) -> Path | None:
        """The launchers' per-attempt folder; else one per attempt under ``--hang-dir`` (or
        SIGNALS_DIR/hangs), named by the launcher's run and restart count (torchrun and
        ft_launcher set them; a manual rerun reuses ``run-0``: stale files are ignored)."""
        if os.environ.get(HANG_DIR_ENV) and not args.hang_dir:
            return Path(os.environ[HANG_DIR_ENV])
        base = args.hang_dir or (
            Path(args.signals_dir) / "hangs" if getattr(args, "signals_dir", None) else None
        )
        if base is None:
            return None
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        return Path(base) / f"{run}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def validate(self, args: Any) -> None:
        try:
            check_finite("--hang-timeout-factor", args.hang_timeout_factor, minimum=1.0)
            check_finite("--hang-min-timeout", args.hang_min_timeout, minimum=0.1)
            check_finite("--hang-first-timeout", args.hang_first_timeout, minimum=0.1)
            directory = self._directory(args)
            if directory is None:
                raise ValueError(
                    "--hang-detect needs a folder for the ranks' stacks: pass --hang-dir DIR "
                    "or --signals-dir DIR, or launch with launch/run_single_node.sh or the "
                    "sbatch script, which set one per attempt"
                )
            check_directory("--hang-dir", directory)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None

    def install(self, args: Any) -> None:
        directory = self._directory(args)
        assert directory is not None
        bounds = Bounds(args.hang_timeout_factor, args.hang_min_timeout, args.hang_first_timeout)
        self.watchdog = Watchdog(args.rank, args.world_size, directory, bounds)
        self.history = directory.parent / "durations.json"
        self.watchdog.recall(self.history)
        self.watchdog.start()
        atexit.register(self.watchdog.stop)

    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None:
        self._beat("batch read", micro_batch.training)

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        self._beat("loss", inputs.micro_batch.training)
        return {}

    def after_step(self, record: StepRecord) -> None:
        self.watchdog.step_end(record.iteration)

    def on_checkpoint(self, iteration: int) -> bool:
        if self.watchdog.iteration and self.watchdog.rank == 0:
            self.watchdog.remember(self.history)
        self.watchdog.beat("save", "save")
        return True

    def _beat(self, what: str, training: bool) -> None:
        self.watchdog.beat(what if training else f"eval {what}", "train" if training else "eval")
