"""The skip-list feature in Megatron (``--iterations-to-skip-file``, ranges in
``--iterations-to-skip``): ``pretrain_gpt_ext.py`` parses them with argparse before Megatron
does and hands Megatron the union of every source (flags, files, the list persisted in
``--load``, sample windows placed at the global batch in force); the applied union is persisted
next to the checkpoints, and a skipped last iteration still gets its final checkpoint.

The spike folder's second adapter (the first is :mod:`megatron_ext.spikes.adapter`): Megatron
is imported only inside the wrapper, when it runs.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_ext.common.features import Feature, FeatureError
from megatron_ext.common.files import SKIPPED_ITERATIONS_FILE
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.skip_ranges import WINDOWS_BATCH_FLAG, WINDOWS_FLAG, persisted_text


class SkipListFeature(Feature):
    """Skip lists from files and ranges; the applied list is kept with the checkpoints."""

    name = "skip_list"

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--iterations-to-skip-file",
            type=str,
            default=None,
            help="File of iterations/ranges (A-B) to skip, one per line (repeatable). "
            "Training skips the union of these files, --iterations-to-skip (which also "
            f"takes A-B ranges here) and LOAD/{SKIPPED_ITERATIONS_FILE}, printed at "
            f"start-up and kept in SAVE/{SKIPPED_ITERATIONS_FILE} for later restarts.",
        )
        # Set by pretrain_gpt_ext.py (records.skip_ranges.resolve_argv), not by people.
        group.add_argument(WINDOWS_FLAG, nargs="*", default=[], help=argparse.SUPPRESS)
        group.add_argument(WINDOWS_BATCH_FLAG, type=int, default=None, help=argparse.SUPPRESS)

    def __init__(self) -> None:
        self.args: Any = None

    def enabled(self, args: Any) -> bool:
        return bool(args.save and args.iterations_to_skip)

    def validate(self, args: Any) -> None:
        """The sample windows were placed before Megatron parsed, at the checkpoint's global
        batch when none was given: a different one (Megatron's default follows DP) would skip
        other samples."""
        placed_at = args.skip_windows_global_batch
        if placed_at is not None and placed_at != args.global_batch_size:
            raise FeatureError(
                f"the skip windows were placed at global batch {placed_at} (the checkpoint's; "
                f"--global-batch-size was not given), but Megatron uses {args.global_batch_size}: "
                f"give --global-batch-size {args.global_batch_size} so they are placed at it"
            )

    def install(self, args: Any) -> None:
        """Rank 0 keeps the applied skip list next to the checkpoints (absolute iterations,
        with the sample windows as placed); a skipped last iteration still gets its final
        checkpoint (the loop applies the ``skip-list-final-checkpoint`` patch, bound to this
        feature)."""
        self.args = args
        if args.rank == 0:
            atomic_write(
                Path(args.save) / SKIPPED_ITERATIONS_FILE,
                persisted_text(list(args.iterations_to_skip), args.skip_sample_windows),
            )

    def missed_final_save(self, iteration: int) -> bool:
        """Megatron saved nothing at ``iteration``, the end of training: it was skipped (no
        interval save) and is an interval multiple (no final save either)."""
        interval = self.args.save_interval
        return (
            bool(interval)
            and iteration % interval == 0
            and (iteration in set(self.args.iterations_to_skip))
        )


def save_after_a_skipped_end(
    original: Callable[..., Any], feature: SkipListFeature
) -> Callable[..., Any]:
    """Wrap Megatron's ``train`` (registry ``skip-list-final-checkpoint``), bound to the
    installed skip-list feature."""

    def train(*args: Any, **kwargs: Any) -> Any:
        iteration, flops = original(*args, **kwargs)
        if feature.missed_final_save(iteration):
            from megatron.training import training

            a = inspect.signature(original).bind(*args, **kwargs).arguments
            if dist.get_rank() == 0:
                print(
                    f"megatron-ext: iteration {iteration}, the last, was skipped; saving the "
                    "final checkpoint Megatron's loop leaves out after a skip",
                    flush=True,
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
