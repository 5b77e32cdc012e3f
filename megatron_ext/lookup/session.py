"""One lookup: the run's configuration, its tokenizer when asked for, the opened caches, and
the samples of a batch resolved to documents and tokens.

A batch walk (:func:`batch_records`) goes down, one module per level, each called only from
the levels above it (tests/unit/lookup/test_lookup_layers.py pins the order):

1. ``session``: the iteration's batch (``position``: which stream positions each micro-batch
   and DP rank read; ``cyclic``: the sampler's order) and, per sample, its record (``render``);
2. ``indices``: opens the train index once (:func:`~.indices.open_train_index`), which asks
   ``caches`` to find the caches by their descriptions, then maps and checks them; then, as the
   blend level (``BlendedDataset``), routes each global sample to a dataset and a sample in it;
3. ``dataset``: that GPTDataset's shuffle, sample and document indices give the sample's
   documents and token spans, checked against today's ``.idx``;
4. ``formats``: the documents' tokens, read from the ``.bin``/``.idx`` pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron_ext.common.checkpoint_state import CheckpointUnreadable, load_common_state
from megatron_ext.common.files import CHECKPOINT_DIR
from megatron_ext.lookup.attempts import AttemptAt, Attempts, attempts_at
from megatron_ext.lookup.config import (
    Checkpoint,
    RunConfig,
    honours_rampup,
    load_checkpoint,
    megatron_namespace,
    run_config,
)
from megatron_ext.lookup.cyclic import CyclicOrder
from megatron_ext.lookup.errors import CacheMissing, ConfigError, PositionError
from megatron_ext.lookup.formats import remap
from megatron_ext.lookup.history import History, Segment, read_history, segment_args, stage_args
from megatron_ext.lookup.indices import TrainIndex, open_train_index
from megatron_ext.lookup.position import Batch
from megatron_ext.lookup.render import sample_record
from megatron_ext.lookup.tokenizer import TOKENIZER_PATH_ARGS, pad_token_id, text_tokenizer

LAYOUT_FLAGS = ("--micro-batch-size", "--global-batch-size", "--data-parallel-size")
DATA_FLAGS = ("--data-path", "--train-data-path", "--data-args-path", "--per-split-data-args-path")


def _given(flags: list[str], names: tuple[str, ...]) -> bool:
    return any(f in names or f.split("=", 1)[0] in names for f in flags)


class Session:
    """One invocation: the run's config, its tokenizer when needed, and the opened caches."""

    def __init__(self, options: argparse.Namespace, megatron_flags: list[str]) -> None:
        self.options = options
        checkpoint = None
        if options.from_checkpoint:
            checkpoint = load_checkpoint(options.from_checkpoint, options.ckpt_step)
        elif options.ckpt_step is not None:
            raise ConfigError("--ckpt-step needs --from-checkpoint")
        self.source = f"checkpoint {checkpoint.directory}" if checkpoint else "flags"
        # Which megatron-core trained the run decides what --rampup-batch-size did; the
        # checkpoint's own args tell (read before the flags fill in the installed defaults).
        self.rampup_honoured = honours_rampup(
            checkpoint.args if checkpoint else argparse.Namespace(),
            from_checkpoint=checkpoint is not None,
        )
        args = megatron_namespace(megatron_flags, checkpoint.args if checkpoint else None)
        self.data_from_checkpoint = not _given(megatron_flags, DATA_FLAGS)
        self.config: RunConfig = run_config(
            args,
            data_parallel_size=options.data_parallel_size,
            checkpoint=checkpoint,
            data_from_checkpoint=self.data_from_checkpoint,
            add_extra_token=not options.no_add_extra_token_to_sequence,
            rampup_honoured=self.rampup_honoured,
        )
        self.args = args
        self.checkpoint = checkpoint
        self.remaps = [tuple(item.split("=", 1)) for item in options.data_root]
        self.tokenizer: Any = text_tokenizer(args, self.remaps) if options.text else None
        # Explicit layout flags assert the layout: the history is then not consulted.
        self.history: History | None = None
        if checkpoint is not None and not (
            options.data_parallel_size or _given(megatron_flags, LAYOUT_FLAGS)
        ):
            self.history = _history(checkpoint, options, args)

    def use_layout_of(self, iteration: int) -> None:
        """Answer ``iteration`` with the layout the run had when it trained it last."""
        if self.history is not None:
            self.use_segment(self.history.segment_for(iteration))

    def use_segment(self, segment: Segment) -> None:
        """Answer with the layout, skips and data stage of one attempt's stretch."""
        assert self.history is not None and self.checkpoint is not None
        base, stage = self.args, None
        if self.data_from_checkpoint:
            base, stage = stage_args(self.history, self.args, segment)
        args = segment_args(base, segment)
        config = run_config(
            args,
            data_parallel_size=int(segment.layout["data_parallel_size"]),
            checkpoint=Checkpoint(self.checkpoint.directory, segment.first - 1, args),
            data_from_checkpoint=self.data_from_checkpoint,
            add_extra_token=not self.options.no_add_extra_token_to_sequence,
            segment=True,
            rampup_honoured=self.rampup_honoured,
        )
        notes = config.notes + ((stage,) if stage else ())
        if self.history.distinct_layouts() > 1:
            notes = (*notes, f"layout changed at resumes; {segment.describe()}")
        self.config = dataclasses.replace(config, notes=notes)

    def attempts_at(self, iteration: int) -> Attempts | None:
        """The attempts at ``iteration`` (None without a layout history), judged with the
        asked rank's (else rank 0's) sample log: ``--sample-log``, else the run's own."""
        if self.history is None:
            return None
        directory = self.options.sample_log or getattr(self.args, "sample_log_dir", None)
        return attempts_at(self.history, iteration, directory, self.options.dp_rank or 0)

    def answers_by_attempt(
        self, attempts: Attempts, chosen: AttemptAt, records: list[dict[str, Any]]
    ) -> dict[int, list[dict[str, Any]]]:
        """Each attempt that trained the iteration -> its answer, under its own layout and
        data stage (computed once per distinct one); the config is left at ``chosen``'s."""
        answers, computed = {chosen.number: records}, {_stage_key(chosen.segment): records}
        for attempt in attempts.at:
            key = _stage_key(attempt.segment)
            if attempt.trained and key not in computed:
                self.use_segment(attempt.segment)
                batch = self.config.schedule.batch(attempts.iteration)
                opts = self.options
                computed[key] = batch_records(self, batch, opts.microbatch, opts.dp_rank)[1]
            if attempt.trained:
                answers[attempt.number] = computed[key]
        self.use_segment(chosen.segment)
        return answers

    def iteration_at_consumed(self, consumed: int) -> int:
        """The iteration that starts at ``consumed`` samples, under the layout in force there."""
        if self.history is None:
            return self.config.schedule.batch_at_consumed(consumed).iteration
        segments = sorted(
            (
                s
                for s in (*self.history.from_checkpoints, *self.history.from_log)
                if s.consumed is not None
            ),
            key=lambda s: s.consumed,
        )
        for segment in reversed(segments):
            if segment.consumed <= consumed:
                self.use_layout_of(segment.first)
                iteration = self.config.schedule.batch_at_consumed(consumed).iteration
                if self.history.segment_for(iteration) == segment:
                    return iteration
        raise PositionError(
            f"consumed samples {consumed}: no segment of the run's layout history reaches it"
        )

    def decode(self) -> Callable[[list[int]], str] | None:
        """The tokenizer's detokenize, when --text asked for one."""
        return None if self.tokenizer is None else self.tokenizer.detokenize

    def pad_id(self) -> int | None:
        """GPTDataset's pad id, known only with the tokenizer (it maps pad tokens to 0)."""
        if self.tokenizer is None:
            return None
        return pad_token_id(self.tokenizer, bool(self.config.args.allow_ambiguous_pad_tokens))

    def phase(self, asked: int | None) -> int:
        """The phase whose data the config describes; refuses a mismatch with ``asked``."""
        own = self.config.data_phase
        if own is None:
            own = asked if asked is not None else self.options.phase
        if own is None:
            if self.config.schedule.phase_transitions:
                raise ConfigError("with phase transitions and no checkpoint, pass --phase")
            own = 0
        if asked is not None and asked != own:
            before, last = self.config.schedule.phase_bounds(asked)
            raise PositionError(
                f"the asked iteration is in phase {asked} (iterations {before + 1}..{last}), but "
                f"the {self.source} describes phase {own}'s data; use a checkpoint from that "
                "phase, or pass that phase's data flags"
            )
        return own

    def index(self, phase: int) -> TrainIndex:
        """Open (and with --rebuild-caches, first build) the run's train caches."""
        tokenizer = None
        if self.tokenizer is not None:
            tokenizer = json.loads(json.dumps(self.tokenizer.unique_identifiers))
            # The caches name the tokenizer by the path training used, before any move.
            originals = {
                remap(getattr(self.args, name), self.remaps): getattr(self.args, name)
                for name in TOKENIZER_PATH_ARGS
                if isinstance(getattr(self.args, name, None), str)
            }
            tokenizer = {k: originals.get(v, v) for k, v in tokenizer.items()}
        spec = self.config.data_spec(phase)

        def open_index() -> TrainIndex:
            return open_train_index(
                spec, cache_dir=self.options.cache_dir, data_root=self.remaps, tokenizer=tokenizer
            )

        try:
            return open_index()
        except CacheMissing:
            if not self.options.rebuild_caches:
                raise
        from megatron_ext.lookup.rebuild import rebuild_caches

        rebuild_caches(self.config, phase, self.options.cache_dir)
        return open_index()

    def sampler_indices(self, index: TrainIndex, positions: np.ndarray) -> np.ndarray:
        """Stream positions -> global sample indices (identity for the single dataloader)."""
        if self.config.dataloader_type == "single":
            return positions
        order = CyclicOrder(
            len(index),
            self.config.schedule.micro_batch_size,
            self.config.schedule.data_parallel_size,
            self.config.data_sharding,
        )
        return order.dataset_indices(positions)


def batch_records(
    session: Session, batch: Batch, microbatch: int | None = None, dp_rank: int | None = None
) -> tuple[TrainIndex, list[dict[str, Any]]]:
    """The samples of one iteration (optionally one micro-batch / DP rank), as records.

    The whole path from a batch to its tokens, top to bottom (the module docstring's levels):
    each step is one call into the module of its concept (named in the comment), which calls
    only further down.
    """
    schedule, topology = session.config.schedule, session.config.topology
    # Opening (indices, which asks caches): the phase's caches, found by description, mapped.
    index = session.index(session.phase(batch.phase))
    # Sample position (position): the stream positions each (micro-batch, DP rank) slot read.
    microbatches = [microbatch] if microbatch is not None else range(batch.num_microbatches)
    ranks = [dp_rank] if dp_rank is not None else range(schedule.data_parallel_size)
    slots = [(m, r) for m in microbatches for r in ranks]
    per_slot = [schedule.positions(batch, m, r) for m, r in slots]
    # The sampler (cyclic): stream positions -> global sample indices.
    indices = session.sampler_indices(index, np.concatenate(per_slot)).tolist()
    # The blend level (indices): the pages the batch reads, requested at once (cold caches)...
    index.prefetch(np.asarray(indices, dtype=np.int64))
    # ...and global sample -> (dataset, sample within that GPTDataset).
    members, within = index.route(np.asarray(indices, dtype=np.int64))
    pad_id, decode = session.pad_id(), session.decode()
    records = []
    for k, (m, r) in enumerate(slot for slot, p in zip(slots, per_slot) for _ in p):
        # The dataset level (dataset, through indices): its documents, checked against today's
        # .idx, and its tokens (formats).
        sample = index.sample(indices[k], int(members[k]), int(within[k]), pad_id)
        # Rendering (render): one record, as --json, --out and the table show it.
        records.append(
            sample_record(
                sample,
                iteration=batch.iteration,
                dp_rank=r,
                microbatch=m,
                skipped=batch.skipped,
                readers=topology.readers(r),
                text=None if decode is None else decode(sample.tokens.tolist()),
                # Provenance (dataset: the sidecar beside the pair): each document's raw record.
                sources=index.sources(sample),
            )
        )
    return index, records


def _stage_key(segment: Segment) -> str:
    """What decides which slot read which sample: the layout and the data stage."""
    return repr((sorted(segment.layout.items()), sorted(segment.data.items())))


def _history(
    checkpoint: Checkpoint, options: argparse.Namespace, args: argparse.Namespace
) -> History:
    """The layout history of the checkpoint's run (its --save directory and layout log)."""
    directory = checkpoint.directory
    save_dir = directory.parent if CHECKPOINT_DIR.match(directory.name) else directory

    def load(path: Any) -> dict[str, Any]:
        try:
            return load_common_state(path)
        except CheckpointUnreadable as exc:
            raise ConfigError(
                f"{exc}. The lookup reads every checkpoint of the run for its layout history; "
                "pass --data-parallel-size/--micro-batch-size to answer without it"
            ) from None

    # An explicit --sample-log names the run's sample log; else the run's --sample-log-dir.
    logs = [options.sample_log or getattr(args, "sample_log_dir", None)]
    return read_history(save_dir, logs, load)
