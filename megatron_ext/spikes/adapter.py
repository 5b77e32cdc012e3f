"""The spike features in Megatron: the online detector, the skip lists and the drill.

- :class:`SpikeFeature` (``--spike-detect``, thresholds, ``--spike-ledger``,
  ``--spike-exit-code``): after each step the detector runs on the last rank over the signals
  record; its decision (healthy / spike in progress / rollback) is broadcast to every rank
  (one int). While a spike is in progress no checkpoint is written (``on_checkpoint``
  vetoes the save), so the last healthy checkpoint stays the rollback target. On a rollback
  decision every rank exits with ``--spike-exit-code`` (default 42), which the launchers'
  supervisor turns into: plan (``megatron-ext skiplist``) -> apply -> restart.
- the skip lists: :mod:`megatron_ext.spikes.skip_list`.
- :class:`DrillFeature` (``--drill-corrupt-batch``, ``--drill-corruption``): a reproducible bad
  batch on one DP rank (garbage tokens, or real documents mis-encoded).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.common import exit_codes
from megatron_ext.common.features import (
    Feature,
    FeatureError,
    MicroBatch,
    StepRecord,
    collective_device,
    is_writing_rank,
    writing_rank,
)
from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.gap_log import GapLog
from megatron_ext.common.records.ledger import config_record
from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.signals_seek import history_before
from megatron_ext.common.records.sources import member_names, train_blend
from megatron_ext.common.records.spike_config import add_detector_args, config_from_args
from megatron_ext.common.validation import check_directory, check_exit_code
from megatron_ext.spikes.detector import SpikeDetector, SpikeEvent, primed
from megatron_ext.spikes.drill import (
    CORRUPTIONS,
    CorruptionSpec,
    garbage_batch,
    misencode,
    parse_spec,
)
from megatron_ext.spikes.precursors import PrecursorMonitor, PrecursorWarning, WarnConfig

_DECISIONS = ("healthy", "watching", "rollback")  # broadcast as the index


def _is_writer() -> bool:
    return is_writing_rank(dist.get_rank(), dist.get_world_size())


class SpikeFeature(Feature):
    """Detector (last rank), ledger, checkpoint veto and the decision every rank acts on."""

    name = "spikes"

    def __init__(self) -> None:
        self.args: Any = None
        self.detector: SpikeDetector | None = None
        self.ledger: GapLog | None = None
        self.decision = "healthy"
        self.primed = False
        self.recorded = False  # this attempt's config line is in the ledger
        self.last_signals: SignalRecord | None = None  # the writer's last observed step
        self.nonfinite_reported: set[int] = set()
        self.precursors: PrecursorMonitor | None = None  # --spike-warn, on the writer

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--spike-detect",
            action="store_true",
            help="Run the streaming spike detector on the signals log; on an "
            "unrecovered spike or divergence, stop saving checkpoints and exit "
            "with --spike-exit-code. Needs --signals-dir.",
        )
        add_detector_args(group)
        group.add_argument(
            "--spike-ledger",
            type=str,
            default=None,
            help=f"Spike ledger JSONL (default: SIGNALS_DIR/{SPIKE_LEDGER_FILE}).",
        )
        group.add_argument(
            "--no-spike-warn",
            dest="spike_warn",
            action="store_false",
            help="Do not warn of divergence precursors (a sustained rise of the grad norm, "
            "the max attention logit or |log Z|; ledger kind 'warning', no rollback), which "
            "--spike-detect does by default.",
        )
        group.add_argument(
            "--spike-exit-code",
            type=int,
            default=exit_codes.SPIKE_ROLLBACK,
            help="Exit code that asks the launcher for a rollback "
            f"(default {exit_codes.SPIKE_ROLLBACK}).",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.spike_detect)

    def validate(self, args: Any) -> None:
        if not args.signals_dir:
            raise FeatureError(
                "--spike-detect needs --signals-dir (the detector reads the signals)"
            )
        try:
            config_from_args(args)
            check_exit_code("--spike-exit-code", args.spike_exit_code)
            if args.spike_ledger:
                check_directory("--spike-ledger's folder", Path(args.spike_ledger).parent)
                if Path(args.spike_ledger).is_dir():
                    raise ValueError(f"--spike-ledger {args.spike_ledger} is a directory")
        except ValueError as exc:
            raise FeatureError(str(exc)) from None

    def install(self, args: Any) -> None:
        self.args = args
        if is_writing_rank(args.rank, args.world_size):
            self.detector = SpikeDetector(config_from_args(args))
            config = WarnConfig.following(self.detector.config)
            self.precursors = PrecursorMonitor(config) if args.spike_warn else None
            # A full disk must not stop training: the detector runs on in memory, and a
            # rollback request that could not be logged is not confirmed, so the supervisor
            # stops instead of rolling back blind.
            self.ledger = GapLog(
                args.spike_ledger or Path(args.signals_dir) / SPIKE_LEDGER_FILE, "spike ledger"
            )

    def _prime(self, first_iteration: int) -> None:
        """After a restart, rebuild the baseline from the history this run continues from
        (latest attempt per iteration, before the first iteration of this run), so a replayed
        spike right after a rollback is caught without a new warm-up. Read by seeking: the
        ``warmup + window`` records it needs, not a 1 M-iteration log."""
        self.primed = True
        assert self.detector is not None
        config = self.detector.config
        path = Path(self.args.signals_dir) / SIGNALS_FILE
        count = config.warmup + config.window
        if self.precursors is not None:
            count = max(count, self.precursors.config.horizon + self.precursors.config.recent)
        history = history_before(path, first_iteration, count)
        self.detector = primed(config, history[-(config.warmup + config.window) :])
        if self.precursors is not None:  # the history's warnings were said by its attempts
            for record in history:
                self.precursors.observe(record)

    def after_step(self, record: StepRecord) -> None:
        """Runs on every rank after each logged iteration."""
        code = 0
        if self.detector is not None:
            if not self.primed:
                self._prime(record.iteration)
            signals = record.signals
            if signals is not None and signals.iteration == record.iteration:
                assert self.ledger is not None
                if not self.recorded:
                    self.recorded = True
                    self.ledger.append(
                        config_record(
                            record.iteration,
                            signals.attempt,
                            self.detector.config,
                            self.args.save,
                            self.args.sample_log_dir,
                        ),
                        record.iteration,
                    )
                self.last_signals = signals
                events = self.detector.observe(signals)
                warnings = [] if self.precursors is None else self.precursors.observe(signals)
                if not events and self.detector.state == "healthy":  # a precursor precedes
                    self._warn(warnings)
                self._record(events)
            code = _DECISIONS.index(self.detector.state)
        decision = torch.tensor([code], dtype=torch.int64, device=collective_device())
        dist.broadcast(decision, src=writing_rank(dist.get_world_size()))
        self.decision = _DECISIONS[int(decision.item())]
        if self.decision == "rollback":
            sys.exit(self._rolling_back(record.iteration))

    def _record(self, events: list[SpikeEvent]) -> None:
        """Append the detector's events to the ledger and say each on the console."""
        assert self.ledger is not None
        for event in events:
            self.ledger.append(event.as_json(), event.iteration)
            source = f", culprit source {event.culprit_source}" if event.culprit_source else ""
            print(
                f"megatron-ext spike detector: {event.kind} at iteration {event.iteration} "
                f"(onset {event.onset}, culprit DP rank {event.culprit_dp_rank}{source}): "
                f"{event.classification}",
                flush=True,
            )

    def _warn(self, warnings: list[PrecursorWarning]) -> None:
        """Ledger and console; nothing else changes (no veto, no rollback)."""
        assert self.ledger is not None
        for warning in warnings:
            self.ledger.append(warning.as_json(), warning.iteration)
            print(
                f"megatron-ext spike detector: iteration {warning.iteration}: "
                f"{warning.classification}",
                flush=True,
            )

    def _rolling_back(self, iteration: int) -> int:
        """Every rank: stop for a rollback; returns the exit code to end with."""
        self.decision = "rollback"
        if _is_writer():
            print(
                f"megatron-ext: rollback requested at iteration {iteration}; exiting with code "
                f"{self.args.spike_exit_code} without saving a checkpoint",
                flush=True,
            )
        # Every rank exits with the spike code, but the first to go ends its node's torchrun,
        # whose peers then SIGTERM their workers: one still tearing down would report 143 and
        # its node would not say "rollback". From here a TERM changes nothing (no checkpoint
        # is saved), so it is ignored; torchrun's SIGKILL still bounds a teardown that hangs.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return self.args.spike_exit_code

    def rerun_reproduced(self, iteration: int, culprits: list[int]) -> int:
        """Megatron's in-place rerun reproduced a rejected result (NaN/Inf) at ``iteration``
        on the DP ranks ``culprits`` (:mod:`megatron_ext.spikes.rerun`): a divergence,
        recorded as the detector records one; every rank returns the exit code to end with."""
        last = self.last_signals
        if self.detector is not None and last is not None:
            nan_step = SignalRecord(
                iteration=iteration,
                attempt=last.attempt,
                job_id=last.job_id,
                wall_time=time.time(),
                consumed_samples=last.consumed_samples + self.args.global_batch_size,
                skipped_samples=last.skipped_samples,
                lm_loss=math.nan,
                max_loss_dp_rank=culprits[0] if culprits else None,
                nan_iter=True,
            )
            events = self.detector.observe(nan_step)
            for event in events:
                event.classification += (
                    f" on DP rank(s) {', '.join(map(str, culprits)) or '?'}, reproduced by "
                    "Megatron's in-place rerun (--rerun-mode validate_results): not a "
                    "transient fault"
                )
            self._record(events)
        return self._rolling_back(iteration)

    def nonfinite_seen(self, iteration: int, message: str) -> None:
        """``--rerun-mode disabled`` would raise on this rank; say once per iteration that the
        detector takes it (:mod:`megatron_ext.spikes.rerun`)."""
        if iteration not in self.nonfinite_reported:
            self.nonfinite_reported.add(iteration)
            print(
                f"megatron-ext: {message} at iteration {iteration} on rank {dist.get_rank()}; "
                "--rerun-mode disabled: left to the spike detector, which rolls back",
                flush=True,
            )

    def on_checkpoint(self, iteration: int) -> bool:
        if self.decision == "healthy":
            return True
        if dist.get_rank() == 0:
            print(
                f"megatron-ext: spike in progress, not saving iteration {iteration}: the "
                "last healthy checkpoint stays the rollback target",
                flush=True,
            )
        return False


def _train_members(args: Any) -> list[str]:
    from megatron.training.utils import get_blend_and_blend_per_split

    return member_names(train_blend(*get_blend_and_blend_per_split(args)))


class DrillFeature(Feature):
    """``--drill-corrupt-batch``: a bad batch on one DP rank, reproducibly across replays."""

    name = "drill"

    def __init__(self) -> None:
        self.args: Any = None
        self.spec: CorruptionSpec | None = None
        self.source: int | None = None  # blend member whose samples alone are corrupted

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--drill-corrupt-batch",
            type=str,
            default=None,
            help="Drill only: corrupt one DP rank's batch at START[-END] (1-indexed), "
            "reproducibly across replays (see --drill-corruption).",
        )
        group.add_argument(
            "--drill-corrupt-source",
            type=str,
            default=None,
            metavar="NAME",
            help="Drill only: corrupt only the samples of this train blend member (its name "
            "in lm_loss_by_dataset: the --data-path prefix's basename when unambiguous).",
        )
        group.add_argument(
            "--drill-corruption",
            choices=CORRUPTIONS,
            default="garbage",
            help="Drill only: garbage = uniform random tokens; mis-encoded = the rank's real "
            "documents with every token id t read as V-1-t (a wrong code page). "
            "Default %(default)s.",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.drill_corrupt_batch)

    def validate(self, args: Any) -> None:
        try:
            parse_spec(args.drill_corrupt_batch)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
        names = _train_members(args) if args.drill_corrupt_source else []
        if args.drill_corrupt_source and args.drill_corrupt_source not in names:
            raise FeatureError(
                f"--drill-corrupt-source {args.drill_corrupt_source!r} is not a member of the "
                f"train blend; members: {', '.join(names) or 'none (mock data)'}"
            )

    def install(self, args: Any) -> None:
        self.args = args
        self.spec = parse_spec(args.drill_corrupt_batch)
        if args.drill_corrupt_source:
            self.source = _train_members(args).index(args.drill_corrupt_source)

    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None:
        assert self.spec is not None
        if not (
            micro_batch.training and self.spec.hits(micro_batch.iteration, micro_batch.dp_rank)
        ):
            return
        # padded_vocab_size is set by Megatron's initialisation, after install.
        if self.args.drill_corruption == "mis-encoded":
            tokens, labels = misencode(
                batch["tokens"], batch["labels"], self.args.padded_vocab_size
            )
        else:
            tokens, labels = garbage_batch(
                batch["tokens"],
                micro_batch.iteration,
                micro_batch.dp_rank,
                self.args.padded_vocab_size,
            )
        if self.source is not None:  # only that member's rows (a 1-member run has no ids)
            ids = micro_batch.dataset_ids
            rows = torch.ones(len(tokens), dtype=torch.bool) if ids is None else ids == self.source
            tokens = torch.where(rows[:, None], tokens, batch["tokens"])
            labels = torch.where(rows[:, None], labels, batch["labels"])
        batch["tokens"], batch["labels"] = tokens, labels
