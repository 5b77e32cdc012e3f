"""One lookup invocation: the run's config, tokenizer and opened caches, and a batch walked
down to records (plain dicts shared by ``--json``, ``--out`` and ``--emit-blocklist``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.io import atomic_write, token_sha1
from megatron_ext.common.records.provenance import place
from megatron_ext.lookup.config import (
    TOKENIZER_PATH_ARGS,
    Checkpoint,
    RunConfig,
    honours_rampup,
    load_checkpoint,
    megatron_namespace,
    pad_token_id,
    rebuild_caches,
    run_config,
    tokenizer_from_args,
)
from megatron_ext.lookup.data import TrainIndex, open_train_index, remap
from megatron_ext.lookup.errors import CacheMissing, ConfigError, PositionError, Refused
from megatron_ext.lookup.history import (
    AttemptAt,
    Attempts,
    History,
    Segment,
    attempts_at,
    read_history,
    segment_args,
    stage_args,
)
from megatron_ext.lookup.mock import MOCK_PATH, open_mock_index
from megatron_ext.lookup.schedule import Batch, CyclicOrder


def spans_text(spans: Iterable[dict[str, int]]) -> str:
    """``document@offset+count`` of each span, as the tables show them."""
    return " ".join(f"{s['document']}@{s['offset']}+{s['count']}" for s in spans)


def _tokens(tokens: list[int], limit: int) -> str:
    shown = " ".join(map(str, tokens[:limit]))
    return shown + (f" ... ({len(tokens)})" if len(tokens) > limit else "")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in [header, *rows]
    ]


def samples_table(lines: list[str], records: list[dict[str, Any]], max_tokens: int) -> str:
    """Readable table: context lines, then one row per sample (and its text, if decoded)."""
    spans = "documents (id@offset+count)"
    header = ["sample", "dp", "mb", "ranks", "dataset#sample", spans, "tokens"]
    rows = [
        [
            str(r["sample_index"]),
            str(r["dp_rank"]),
            str(r["microbatch"]),
            ",".join(map(str, r["readers"])),
            f"{Path(r['dataset_path']).name}#{r['dataset_sample']}",
            spans_text(r["documents"]),
            _tokens(r["tokens"], max_tokens),
        ]
        for r in records
    ]
    shown = table(header, rows)
    out = [*lines, shown[0]]
    for line, record in zip(shown[1:], records):
        out.append(line)
        if where := source_line(record["documents"]) or record.get("mock"):
            out.append(f"    {where}")
        if "text" in record:
            out.append(f"    text: {json.dumps(record['text'][:300], ensure_ascii=False)}")
    return "\n".join(out)


def hits_table(lines: list[str], hits: list[dict[str, Any]]) -> str:
    """Readable table of the inverse lookup's hits."""
    keys = ("iteration", "dp_rank", "microbatch", "sample_index", "dataset_sample")
    rows = [
        [
            *(str(h[k]) for k in keys),
            f"{h['offset']}+{h['count']}",
            "skipped" if h["skipped"] else "",
        ]
        for h in hits
    ]
    header = ["iteration", "dp", "mb", "sample", "dataset_sample", "tokens", ""]
    return "\n".join([*lines, *(table(header, rows) if rows else [])])


def describe_source(source: dict[str, Any]) -> str:
    """``FILE:LINE (id X)`` (Parquet: ``FILE row R ...``): a raw record as people read it."""
    where = place(source)
    return where if source.get("id") is None else f"{where} (id {source['id']})"


def source_line(documents: list[dict[str, Any]]) -> str | None:
    """``from: FILE:LINE (id X), ...`` for a sample's documents with a known raw record."""
    known = [d["source"] for d in documents if d.get("source")]
    return "from: " + ", ".join(map(describe_source, known)) if known else None


def spans_of(records: list[dict[str, Any]]) -> set[tuple[int, str, int]]:
    """(blend member, dataset path, document) of every document the records read."""
    return {
        (r["dataset"], r["dataset_path"], d["document"]) for r in records for d in r["documents"]
    }


def write_jsonl(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> None:
    """Write ``records`` as compact JSON Lines, atomically (all or nothing)."""
    lines = (json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in records)
    try:
        atomic_write(path, "".join(lines))
    except OSError as exc:
        raise Refused(
            f"cannot write {path}: {exc.strerror or exc}; nothing was written. Pass a file path "
            "in a writable directory"
        ) from None


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
        self.tokenizer: Any = tokenizer_from_args(args, self.remaps) if options.text else None
        # An explicit --sample-log names the run's sample log; else the run's --sample-log-dir.
        self.sample_log = options.sample_log or getattr(args, "sample_log_dir", None)
        # Explicit layout flags assert the layout: the history is then not consulted.
        self.history: History | None = None
        if checkpoint is not None and not (
            options.data_parallel_size or _given(megatron_flags, LAYOUT_FLAGS)
        ):
            self.history = read_history(checkpoint.directory, self.sample_log)

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
        return attempts_at(self.history, iteration, self.sample_log, self.options.dp_rank or 0)

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

    def batch_at_consumed(self, consumed: int) -> Batch:
        """The batch that starts at ``consumed`` samples, under the layout in force there."""
        if self.history is None:
            return self.config.schedule.batch_at_consumed(consumed)
        history = self.history
        known = [
            s for s in (*history.from_checkpoints, *history.from_log) if s.consumed is not None
        ]
        for segment in reversed(sorted(known, key=lambda s: s.consumed)):
            if segment.consumed <= consumed:
                self.use_layout_of(segment.first)
                batch = self.config.schedule.batch_at_consumed(consumed)
                if history.segment_for(batch.iteration) == segment:
                    return batch
        raise PositionError(
            f"consumed samples {consumed}: no segment of the run's layout history reaches it"
        )

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
        """Open (and with --rebuild-caches, first build) the run's train caches; with mock
        data, megatron-core's MockGPTDataset built again (:mod:`megatron_ext.lookup.mock`)."""
        if getattr(self.config.args, "mock_data", False):
            target = self.config.train_target(phase)
            return open_mock_index(self.config.args, target, self.config.add_extra_token)
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
        open_index = functools.partial(
            open_train_index,
            self.config.data_spec(phase),
            cache_dir=self.options.cache_dir,
            data_root=self.remaps,
            tokenizer=tokenizer,
        )
        try:
            return open_index()
        except CacheMissing:
            if not self.options.rebuild_caches:
                raise
        rebuild_caches(self.config, phase, self.options.cache_dir)
        return open_index()

    def cyclic_order(self, index: TrainIndex) -> CyclicOrder | None:
        """The cyclic sampler's order over ``index`` (None: the single dataloader's stream
        position is the global sample index)."""
        if self.config.dataloader_type == "single":
            return None
        schedule = self.config.schedule
        return CyclicOrder(
            len(index),
            schedule.micro_batch_size,
            schedule.data_parallel_size,
            self.config.data_sharding,
        )


def batch_records(
    session: Session, batch: Batch, microbatch: int | None = None, dp_rank: int | None = None
) -> tuple[TrainIndex, list[dict[str, Any]]]:
    """The samples of one iteration (optionally one micro-batch / DP rank), as records."""
    schedule, topology = session.config.schedule, session.config.topology
    index = session.index(session.phase(batch.phase))
    microbatches = [microbatch] if microbatch is not None else range(batch.num_microbatches)
    ranks = [dp_rank] if dp_rank is not None else range(schedule.data_parallel_size)
    slots = [(m, r) for m in microbatches for r in ranks]
    per_slot = [schedule.positions(batch, m, r) for m, r in slots]
    positions, order = np.concatenate(per_slot), session.cyclic_order(index)
    indices = (positions if order is None else order.dataset_indices(positions)).tolist()
    pad_id, tokenizer = None, session.tokenizer  # GPTDataset maps its pad id to 0
    if tokenizer is not None:
        pad_id = pad_token_id(tokenizer, bool(session.config.args.allow_ambiguous_pad_tokens))
    samples = index.resolve(indices, pad_id)
    records = []
    for sample, (m, r) in zip(samples, (slot for slot, p in zip(slots, per_slot) for _ in p)):
        # One sample as the tool reports it (--json, --out); each document's raw record (file,
        # line, byte, id) from the provenance sidecar, None without one.
        record: dict[str, Any] = {
            "iteration": batch.iteration,
            "dp_rank": r,
            "microbatch": m,
            "skipped": batch.skipped,
            "sample_index": sample.index,
            "dataset": sample.dataset,
            "dataset_path": sample.dataset_path,
            "dataset_sample": sample.dataset_sample,
            "stream_sample": sample.stream_sample,
            "documents": [
                {"document": s.document, "offset": s.offset, "count": s.count}
                | {"source": index.mids[sample.dataset].source(s.document)}
                for s in sample.spans
            ],
            "tokens": sample.tokens.tolist(),
            "token_sha1": token_sha1(sample.tokens),
            "readers": topology.readers(r),
        }
        if not sample.spans and sample.dataset_path == MOCK_PATH:
            record["mock"] = (
                f"mock sample {sample.index}, no document/raw record (megatron-core's "
                "MockGPTDataset)"
            )
        if tokenizer is not None:
            record["text"] = tokenizer.detokenize(sample.tokens.tolist())
        records.append(record)
    return index, records


def _stage_key(segment: Segment) -> str:
    """What decides which slot read which sample: the layout and the data stage."""
    return repr((sorted(segment.layout.items()), sorted(segment.data.items())))


def emit_blocklist(
    session: Session, index: TrainIndex, documents: set[tuple[int, str, int]]
) -> None:
    """Write ``documents`` ((blend member, dataset path, document)) to ``--emit-blocklist``."""
    tokenizer, target = session.tokenizer, session.options.emit_blocklist
    records = []
    for member, path, document in sorted(documents):
        # Where the document is, a content hash that survives reordering, and its raw record
        # (None without a provenance sidecar), which `megatron-ext blocklist apply` removes.
        mid = index.mids[member]
        tokens = np.asarray(mid.data.get(document), dtype=np.int64)  # the whole document
        records.append(
            {"dataset_path": path, "document": document, "num_tokens": len(tokens)}
            | {"token_sha1": token_sha1(tokens), "source": mid.source(document)}
            | ({} if tokenizer is None else {"text": tokenizer.detokenize(tokens.tolist())})
        )
    write_jsonl(target, records)
    note = "each names its raw record (`megatron-ext blocklist apply` removes them)"
    missing = [r for r in records if r["source"] is None]
    if missing:
        datasets = ", ".join(sorted({r["dataset_path"] for r in missing}))
        note = (
            f"{len(missing)} name no raw record: no provenance sidecar beside {datasets} "
            "(`megatron-ext provenance rebuild` writes one)"
        )
    print(f"wrote {len(records)} document(s) to {target}; {note}", file=sys.stderr)
