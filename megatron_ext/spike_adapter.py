"""Megatron adapter for the online spike tracker, the skip-list flags and the drill.

Flags: ``--spike-detect`` (needs ``--signals-dir``), the detector thresholds, ``--spike-ledger``,
``--spike-exit-code``, ``--iterations-to-skip-file`` and ranges in ``--iterations-to-skip``
(expanded by ``pretrain_gpt_ext.py`` before Megatron parses them), ``--drill-corrupt-batch``.

Per iteration, after the signals record is built on the last rank, the detector runs there and
its decision (healthy / spike in progress / rollback) is broadcast to all ranks (one int).
While a spike is in progress no checkpoint is written (registered patch on
``save_checkpoint_and_time``), so the last healthy checkpoint stays the rollback target. On a
rollback decision every rank exits with ``--spike-exit-code`` (default 42), which the launch
scripts turn into: plan (``megatron-ext skiplist``) → apply → restart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import mpu

from megatron_ext import patches, signals_adapter
from megatron_ext.drill import CorruptionSpec, garbage_batch, parse_spec
from megatron_ext.jsonl import JsonlAppender
from megatron_ext.signals import SIGNALS_FILE, latest_per_iteration, read_signals
from megatron_ext.skip_ranges import PERSISTED_NAME, format_ranges, write_atomically
from megatron_ext.spikes import (
    LEDGER_NAME,
    SpikeDetector,
    add_detector_args,
    config_from_args,
)

EXIT_CODE_SPIKE = 42
_DECISIONS = {"healthy": 0, "watching": 1, "rollback": 2}


def add_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spike-detect", action="store_true",
                       help="Run the streaming spike detector on the signals log; on an "
                       "unrecovered spike or divergence, stop saving checkpoints and exit with "
                       "--spike-exit-code. Needs --signals-dir.")
    add_detector_args(group)
    group.add_argument("--spike-ledger", type=str, default=None,
                       help=f"Spike ledger JSONL (default: SIGNALS_DIR/{LEDGER_NAME}).")
    group.add_argument("--spike-exit-code", type=int, default=EXIT_CODE_SPIKE,
                       help="Exit code that asks the launcher for a rollback (default 42).")
    group.add_argument("--iterations-to-skip-file", type=str, default=None,
                       help="File of iterations/ranges (A-B) to skip, one per line; merged "
                       "into --iterations-to-skip (which also takes A-B ranges here). The "
                       f"applied list is kept in SAVE/{PERSISTED_NAME} for later restarts.")
    group.add_argument("--drill-corrupt-batch", type=str, default=None,
                       help="Drill only: feed deterministic garbage tokens to one DP rank at "
                       "START[-END] (1-indexed), reproducibly across replays.")


class _Tracker:
    """Detector (last rank), ledger, and the decision every rank acts on."""

    def __init__(self) -> None:
        self.args: Any = None
        self.detector: SpikeDetector | None = None
        self.ledger: JsonlAppender | None = None
        self.decision = "healthy"
        self.drill: CorruptionSpec | None = None
        self.primed = False

    def _prime(self, first_iteration: int) -> None:
        """After a restart, rebuild the baseline from the history this run continues from
        (latest attempt per iteration, before the first iteration of this run), so a replayed
        spike right after a rollback is caught without a new warm-up."""
        self.primed = True
        path = Path(self.args.signals_dir) / SIGNALS_FILE
        history = [r for r in latest_per_iteration(read_signals(path))
                   if r.iteration < first_iteration]
        config = self.detector.config  # type: ignore[union-attr]
        for record in history[-(config.warmup + config.window):]:
            self.detector.observe(record)  # type: ignore[union-attr]
        self.detector.seen = max(self.detector.seen, len(history))  # type: ignore[union-attr]
        if self.detector.state != "healthy":  # type: ignore[union-attr]
            self.detector = SpikeDetector(config)  # history ended mid-incident: start clean

    def after_step(self, iteration: int) -> None:
        """Runs on every rank after each training_log."""
        if self.detector is not None:
            record = signals_adapter.TELEMETRY.last_record
            if not self.primed:
                self._prime(iteration)
            if record is not None and record.iteration == iteration:
                for event in self.detector.observe(record):
                    self.ledger.append(event.as_json())  # type: ignore[union-attr]
                    print(f"megatron-ext spike tracker: {event.kind} at iteration "
                          f"{event.iteration} (onset {event.onset}, culprit DP rank "
                          f"{event.culprit_dp_rank}): {event.classification}", flush=True)
            code = _DECISIONS[self.detector.state]
        else:
            code = 0
        decision = torch.tensor([code], dtype=torch.int64,
                                device="cuda" if torch.cuda.is_available() else "cpu")
        dist.broadcast(decision, src=dist.get_world_size() - 1)
        self.decision = {v: k for k, v in _DECISIONS.items()}[int(decision.item())]
        if self.decision == "rollback":
            if dist.get_rank() == dist.get_world_size() - 1:
                print(f"megatron-ext: rollback requested at iteration {iteration}; exiting "
                      f"with code {self.args.spike_exit_code} without saving a checkpoint",
                      flush=True)
            sys.exit(self.args.spike_exit_code)

    def corrupt(self, batch: dict[str, Any]) -> None:
        """Drill: replace this rank's tokens/labels if the spec hits this iteration."""
        if self.drill is None:
            return
        iteration, rank = self.args.curr_iteration + 1, mpu.get_data_parallel_rank()
        if self.drill.hits(iteration, rank):
            batch["tokens"], batch["labels"] = garbage_batch(
                batch["tokens"], iteration, rank, self.args.padded_vocab_size)


TRACKER = _Tracker()


def _wrap_save(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        if TRACKER.decision != "healthy":
            if dist.get_rank() == 0:
                print(f"megatron-ext: spike in progress, not saving iteration {iteration}: the "
                      "last healthy checkpoint stays the rollback target", flush=True)
            return None
        return original(iteration, *args, **kwargs)

    return save_checkpoint_and_time


SAVE = patches.register(patches.Patch(
    name="spike-checkpoint-guard",
    target="megatron.training.training:save_checkpoint_and_time",
    reason="While a spike is being watched (or a rollback is requested) no checkpoint may be "
    "written, so the latest checkpoint on disk stays a healthy rollback target.",
    signature=("(iteration, model, optimizer, opt_param_scheduler, "
               "num_floating_point_operations_so_far, checkpointing_context, "
               "non_persistent_ckpt=False, train_data_iterator=None)"),
    wrap=_wrap_save,
))


def persist_skips(args: Any) -> None:
    """Rank 0 keeps the applied skip list next to the checkpoints (absolute iterations)."""
    if args.save and args.iterations_to_skip and args.rank == 0:
        write_atomically(Path(args.save) / PERSISTED_NAME,
                         format_ranges(list(args.iterations_to_skip)))


def install(args: Any) -> None:
    """Validate the flags; set up the detector, ledger, checkpoint guard and drill."""
    TRACKER.args = args
    persist_skips(args)
    if args.drill_corrupt_batch:
        TRACKER.drill = parse_spec(args.drill_corrupt_batch)
    if not args.spike_detect:
        return
    if not args.signals_dir:
        raise SystemExit("--spike-detect needs --signals-dir (the detector reads the signals)")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.rank == args.world_size - 1:
        TRACKER.detector = SpikeDetector(config)
        TRACKER.ledger = JsonlAppender(args.spike_ledger or Path(args.signals_dir) / LEDGER_NAME)
    signals_adapter.STEP_HOOKS.append(TRACKER.after_step)
    patches.apply(SAVE.name)
