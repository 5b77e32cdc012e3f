"""The spike features in Megatron: the online detector (no checkpoint while a spike is in
progress, exit ``--spike-exit-code`` on a rollback decision), the skip list kept with the
checkpoints, and the drill that corrupts one DP rank's batch reproducibly (docs/incidents.md).
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import signal
import sys
import time
from collections.abc import Callable
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
    print_rank_0,
    writing_rank,
)
from megatron_ext.common.files import SIGNALS_FILE, SKIPPED_ITERATIONS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.gap_log import GapLog
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.ledger import config_record
from megatron_ext.common.records.signals import SignalRecord, history_before
from megatron_ext.common.records.skip_ranges import WINDOWS_BATCH_FLAG, WINDOWS_FLAG, persisted_text
from megatron_ext.common.records.sources import train_members
from megatron_ext.common.records.spike_config import add_detector_args, config_from_args
from megatron_ext.common.validation import check_directory, check_exit_code
from megatron_ext.spikes.detector import SpikeDetector, SpikeEvent, primed
from megatron_ext.spikes.precursors import PrecursorMonitor, PrecursorWarning, WarnConfig

_DECISIONS = ("healthy", "watching", "rollback")  # broadcast as the index


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
            help="Detect loss spikes from the signals log (needs --signals-dir); an unrecovered "
            "one stops checkpoints and exits with --spike-exit-code.",
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
            help="Do not log divergence precursor warnings (rising grad norm, max attention "
            "logit or |log Z|), on by default with --spike-detect.",
        )
        group.add_argument(
            "--spike-exit-code",
            type=int,
            default=exit_codes.SPIKE_ROLLBACK,
            help=f"Exit code that asks for a rollback (default {exit_codes.SPIKE_ROLLBACK}).",
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
            # A full disk must not stop training (GapLog); an unlogged request is unconfirmed.
            self.ledger = GapLog(
                args.spike_ledger or Path(args.signals_dir) / SPIKE_LEDGER_FILE, "spike ledger"
            )

    def _prime(self, first_iteration: int) -> None:
        """After a restart, rebuild the baselines from the history this run continues from."""
        self.primed = True
        assert self.detector is not None
        config = self.detector.config
        path = Path(self.args.signals_dir) / SIGNALS_FILE
        count = config.warmup + config.window
        if self.precursors is not None:
            count = max(count, self.precursors.config.horizon + self.precursors.config.recent)
        history = history_before(path, first_iteration, count)
        self.detector = primed(config, history)
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
                self._observe(self.detector, signals)
            code = _DECISIONS.index(self.detector.state)
        decision = torch.tensor([code], dtype=torch.int64, device=collective_device())
        dist.broadcast(decision, src=writing_rank(dist.get_world_size()))
        self.decision = _DECISIONS[int(decision.item())]
        if self.decision == "rollback":
            sys.exit(self._rolling_back(record.iteration))

    def _observe(self, detector: SpikeDetector, signals: SignalRecord) -> None:
        """The writer: this attempt's config line first, then the step's events and warnings."""
        assert self.ledger is not None
        if not self.recorded:
            self.recorded = True
            a = self.args
            line = config_record(
                signals.iteration, signals.attempt, detector.config, a.save, a.sample_log_dir
            )
            self.ledger.append(line, signals.iteration)
        self.last_signals = signals
        events = detector.observe(signals)
        warnings = [] if self.precursors is None else self.precursors.observe(signals)
        if not events and detector.state == "healthy":  # a precursor precedes; no veto
            for warning in warnings:
                self._say(warning, f"iteration {warning.iteration}: {warning.classification}")
        self._record(events)

    def _record(self, events: list[SpikeEvent]) -> None:
        """Append the detector's events to the ledger and say each on the console."""
        for event in events:
            source = f", culprit source {event.culprit_source}" if event.culprit_source else ""
            self._say(
                event,
                f"{event.kind} at iteration {event.iteration} (onset {event.onset}, culprit DP "
                f"rank {event.culprit_dp_rank}{source}): {event.classification}",
            )

    def _say(self, entry: SpikeEvent | PrecursorWarning, text: str) -> None:
        assert self.ledger is not None
        self.ledger.append(entry.as_json(), entry.iteration)
        print(f"megatron-ext spike detector: {text}", flush=True)

    def _rolling_back(self, iteration: int) -> int:
        """Every rank: stop for a rollback; returns the exit code to end with."""
        self.decision = "rollback"
        if is_writing_rank(dist.get_rank(), dist.get_world_size()):
            print(
                f"megatron-ext: rollback requested at iteration {iteration}; exiting with code "
                f"{self.args.spike_exit_code} without saving a checkpoint",
                flush=True,
            )
        # torchrun SIGTERMs a node's other workers when the first exits; one still tearing down
        # would report 143, not the spike code. Its SIGKILL still bounds a hung teardown.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return self.args.spike_exit_code

    def rerun_reproduced(self, iteration: int, culprits: list[int]) -> int:
        """Megatron's in-place rerun reproduced a NaN/Inf on DP ranks ``culprits``: record a
        divergence; returns the exit code to end with."""
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
        """``--rerun-mode disabled`` would raise here; say once that the detector takes it."""
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
        print_rank_0(
            f"megatron-ext: spike in progress, not saving iteration {iteration}: the "
            "last healthy checkpoint stays the rollback target"
        )
        return False


def reproducible_result_rolls_back(
    original: Callable[[Any], tuple[bool, bool, int]], feature: SpikeFeature
) -> Callable[[Any], tuple[bool, bool, int]]:
    """Under ``--rerun-mode validate_results`` a reproduced NaN/Inf is a rollback request, not
    Megatron's checkpoint and exit 16 (which loops on the same GPU: Megatron-LM #5281)."""

    def should_checkpoint_and_exit(self: Any) -> tuple[bool, bool, int]:
        from megatron.core.rerun_state_machine import RerunState

        will_rerun = self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
        verdict = original(self)
        if not will_rerun:
            return verdict
        return False, True, feature.rerun_reproduced(self.current_iteration, _culprits(self))

    return should_checkpoint_and_exit


def _culprits(machine: Any) -> list[int]:
    """The DP ranks whose own validation rejected the result (one all-reduce, at the incident)."""
    from megatron.core import parallel_state

    mine = parallel_state.get_data_parallel_rank() if machine.failed_validation_call else -1
    ranks = torch.full((dist.get_world_size(),), -1, dtype=torch.int64, device=collective_device())
    ranks[dist.get_rank()] = mine
    dist.all_reduce(ranks, op=dist.ReduceOp.MAX)
    return sorted({int(r) for r in ranks.tolist() if r >= 0})


def nonfinite_goes_to_the_detector(
    original: Callable[..., None], feature: SpikeFeature
) -> Callable[..., None]:
    def validate_result(
        self: Any,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Under ``--rerun-mode disabled``, a NaN/Inf is left to the detector, not raised."""
        from megatron.core.rerun_state_machine import RerunMode

        if self.mode == RerunMode.DISABLED and rejection_func in (torch.isnan, torch.isinf):
            if rejection_func(result):
                feature.nonfinite_seen(self.current_iteration, message)
            return None
        return original(self, result, rejection_func, message, *args, **kwargs)

    return validate_result


class SkipListFeature(Feature):
    """Skip lists from files and ranges; the applied list is kept with the checkpoints."""

    name = "skip_list"

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--iterations-to-skip-file",
            type=str,
            default=None,
            help="File of iterations or A-B ranges to skip, one per line (repeatable); merged "
            f"with --iterations-to-skip and LOAD/{SKIPPED_ITERATIONS_FILE}, kept in SAVE.",
        )
        # Set by pretrain_gpt_ext.py (records.skip_ranges.resolve_argv), not by people.
        group.add_argument(WINDOWS_FLAG, nargs="*", default=[], help=argparse.SUPPRESS)
        group.add_argument(WINDOWS_BATCH_FLAG, type=int, default=None, help=argparse.SUPPRESS)

    def __init__(self) -> None:
        self.args: Any = None

    def enabled(self, args: Any) -> bool:
        return bool(args.save and args.iterations_to_skip)

    def validate(self, args: Any) -> None:
        """Sample windows placed at the checkpoint's global batch must match Megatron's."""
        placed_at = args.skip_windows_global_batch
        if placed_at is not None and placed_at != args.global_batch_size:
            raise FeatureError(
                f"the skip windows were placed at global batch {placed_at} (the checkpoint's; "
                f"--global-batch-size was not given), but Megatron uses {args.global_batch_size}: "
                f"give --global-batch-size {args.global_batch_size} so they are placed at it"
            )

    def install(self, args: Any) -> None:
        """Rank 0 keeps the applied skip list next to the checkpoints."""
        self.args = args
        if args.rank == 0:
            atomic_write(
                Path(args.save) / SKIPPED_ITERATIONS_FILE,
                persisted_text(list(args.iterations_to_skip), args.skip_sample_windows),
            )


def save_after_a_skipped_end(
    original: Callable[..., Any], feature: SkipListFeature
) -> Callable[..., Any]:
    """Wrap Megatron's ``train`` (registry ``skip-list-final-checkpoint``): Megatron saves
    nothing at a last iteration that is skipped and a multiple of the save interval."""

    def train(*args: Any, **kwargs: Any) -> Any:
        iteration, flops = original(*args, **kwargs)
        interval = feature.args.save_interval
        if interval and iteration % interval == 0 and iteration in feature.args.iterations_to_skip:
            from megatron.training import training

            a = inspect.signature(original).bind(*args, **kwargs).arguments
            print_rank_0(
                f"megatron-ext: iteration {iteration}, the last, was skipped; saving the "
                "final checkpoint Megatron's loop leaves out after a skip"
            )
            training.save_checkpoint_and_time(
                iteration,
                a["model"],
                a["optimizer"],
                a["opt_param_scheduler"],
                flops,
                a["checkpointing_context"],
                train_data_iterator=a["train_data_iterator"],
            )
        return iteration, flops

    return train


_SPEC = re.compile(r"^(\d+)(?:-(\d+))?:(\d+|\*)$")


def parse_spec(text: str) -> tuple[int, int, int | None]:
    """``"40:1"`` or ``"40-45:1"`` (1-indexed iterations, inclusive) on DP rank 1; ``"40:*"``
    on every DP rank (None)."""
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            f"--drill-corrupt-batch {text!r}: expected START[-END]:DP_RANK (or :* for every "
            "rank), e.g. 40-45:1"
        )
    first, last = int(match[1]), int(match[2] or match[1])
    rank = None if match[3] == "*" else int(match[3])
    if first < 1 or last < first:
        raise ValueError(f"--drill-corrupt-batch {text!r}: need 1 <= START <= END")
    return first, last, rank


def garbage_batch(
    tokens: torch.Tensor, iteration: int, dp_rank: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random tokens and their next-token labels, seeded by (iteration, rank)."""
    generator = torch.Generator().manual_seed(1_000_003 * iteration + dp_rank)
    batch, length = tokens.shape
    sequence = torch.randint(0, vocab_size, (batch, length + 1), generator=generator)
    return sequence[:, :-1].to(tokens.dtype), sequence[:, 1:].to(tokens.dtype)


class DrillFeature(Feature):
    """``--drill-corrupt-batch``: a bad batch on one DP rank, reproducibly across replays."""

    name = "drill"

    def __init__(self) -> None:
        self.args: Any = None
        self.spec: tuple[int, int, int | None] | None = None
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
            help="Drill only: corrupt only this train blend member's samples (its name in "
            "lm_loss_by_dataset).",
        )
        group.add_argument(
            "--drill-corruption",
            choices=("garbage", "mis-encoded"),
            default="garbage",
            help="Drill only: garbage (random tokens) or mis-encoded (real tokens t read as "
            "V-1-t). Default %(default)s.",
        )

    def enabled(self, args: Any) -> bool:
        # The other drill flags are validated too: without a batch they would do nothing.
        return bool(
            args.drill_corrupt_batch
            or args.drill_corrupt_source
            or args.drill_corruption != "garbage"
        )

    def validate(self, args: Any) -> None:
        if not args.drill_corrupt_batch:
            given = "--drill-corrupt-source" if args.drill_corrupt_source else "--drill-corruption"
            raise FeatureError(
                f"{given} needs --drill-corrupt-batch START[-END]:DP_RANK (the batches it "
                "corrupts); without it nothing is corrupted"
            )
        try:
            first, _, rank = parse_spec(args.drill_corrupt_batch)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
        dp_size = getattr(args, "data_parallel_size", None)
        if rank is not None and dp_size is not None and rank >= dp_size:
            raise FeatureError(
                f"--drill-corrupt-batch {args.drill_corrupt_batch!r}: DP rank {rank} does not "
                f"exist (data-parallel size {dp_size}: ranks 0-{dp_size - 1}, or * for every "
                "rank); nothing would be corrupted"
            )
        if args.train_iters is not None and first > args.train_iters:
            raise FeatureError(
                f"--drill-corrupt-batch {args.drill_corrupt_batch!r}: --train-iters "
                f"{args.train_iters} never reaches {first}; nothing would be corrupted"
            )
        names = train_members(args) if args.drill_corrupt_source else []
        if args.drill_corrupt_source and args.drill_corrupt_source not in names:
            raise FeatureError(
                f"--drill-corrupt-source {args.drill_corrupt_source!r} is not a member of the "
                f"train blend; members: {', '.join(names) or 'none (mock data)'}"
            )

    def install(self, args: Any) -> None:
        self.args = args
        self.spec = parse_spec(args.drill_corrupt_batch)
        if args.drill_corrupt_source:
            self.source = train_members(args).index(args.drill_corrupt_source)

    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None:
        assert self.spec is not None
        mb, (first, last, rank) = micro_batch, self.spec
        if not (mb.training and first <= mb.iteration <= last and rank in (None, mb.dp_rank)):
            return
        vocab = self.args.padded_vocab_size  # set by Megatron's initialisation, after install
        if self.args.drill_corruption == "mis-encoded":  # a wrong code page: t -> V-1-t
            tokens, labels = vocab - 1 - batch["tokens"], vocab - 1 - batch["labels"]
        else:
            tokens, labels = garbage_batch(batch["tokens"], mb.iteration, mb.dp_rank, vocab)
        if self.source is not None:  # only that member's rows (a 1-member run has no ids)
            ids = micro_batch.dataset_ids
            rows = torch.ones(len(tokens), dtype=torch.bool) if ids is None else ids == self.source
            tokens = torch.where(rows[:, None], tokens, batch["tokens"])
            labels = torch.where(rows[:, None], labels, batch["labels"])
        batch["tokens"], batch["labels"] = tokens, labels
