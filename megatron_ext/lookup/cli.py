"""``megatron-ext lookup``: what a DP rank trained on at an iteration; who trained on a document.

    megatron-ext lookup --from-checkpoint ckpt/ --iteration 137000 --dp-rank 17 --text
    megatron-ext lookup --from-checkpoint ckpt/ --iteration 137000 --out batch.jsonl  # all ranks
    megatron-ext lookup --from-checkpoint ckpt/ --document 83 --dataset /data/web_text_document

The run's configuration comes from a checkpoint's saved Megatron args (``--from-checkpoint``,
``--ckpt-step``) and/or Megatron flags (``--data-path ... --seq-length ... --micro-batch-size
... --global-batch-size ... --train-iters ... --data-cache-path ...``, parsed by Megatron's own
parser; explicit flags override the checkpoint). The answer is read from the run's index caches
(memory-mapped, never rebuilt unless ``--rebuild-caches``) after checking that the data on disk
is the data they were built from. An iteration is answered per attempt (what the latest
attempt that trained it read; rolled back or skipped afterwards is said), with the data stage
in force then (megatron_ext/lookup/history.py). Exit status: 0 answered,
1 refused (the message says why), 2 usage error, 3 not yet trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

import numpy as np

from megatron_ext.common.errors import report
from megatron_ext.lookup.config import load_checkpoint
from megatron_ext.lookup.crosscheck import (
    attach,
    check_against_log,
    log_answer,
    ranked_samples,
    sample_log_dir,
    worst_lines,
    worst_table,
)
from megatron_ext.lookup.data import TrainIndex, find_document, member_of
from megatron_ext.lookup.errors import ConfigError, Refused
from megatron_ext.lookup.history import Attempts
from megatron_ext.lookup.mock import MockIndex
from megatron_ext.lookup.schedule import Batch
from megatron_ext.lookup.session import (
    Session,
    batch_records,
    describe_source,
    emit_blocklist,
    hits_table,
    samples_table,
    spans_of,
    table,
    write_jsonl,
)
from megatron_ext.registry import copies
from megatron_ext.registry.copies import COPIES

_INT, _FLAG, _MANY = {"type": int}, {"action": "store_true"}, {"action": "append", "default": []}
# The lookup's own flags: group title -> (flag, options, help) of each.
_FLAGS: dict[str, tuple[tuple[str, dict[str, Any], str], ...]] = {
    "what to look up (one of)": (
        ("--iteration", _INT, "1-indexed iteration, as Megatron logs it"),
        (
            "--consumed-samples",
            _INT,
            "the batch Megatron reads next at this consumed_train_samples",
        ),
        ("--document", _INT, "inverse: a document (sequence) id of --dataset"),
        (
            "--dataset",
            {},
            "inverse: data prefix as in --data-path, its file name, or its position in the blend",
        ),
        ("--dp-rank", _INT, "only this data-parallel rank"),
        (
            "--worst",
            {**_INT, "metavar": "K"},
            "with --iteration: the K samples with the highest loss training recorded (sample log), "
            "with their documents",
        ),
        ("--microbatch", _INT, "only this micro-batch of the iteration"),
        (
            "--attempt",
            _INT,
            "with --iteration: what this attempt (1-based, in launch order) trained there (default:"
            " the latest attempt that trained it, e.g. an incident's onset batch)",
        ),
    ),
    "the run": (
        (
            "--from-checkpoint",
            {"metavar": "DIR"},
            "a torch_dist --save directory or one iter_NNNNNNN directory",
        ),
        ("--ckpt-step", _INT, "which iteration's checkpoint to read"),
        (
            "--data-parallel-size",
            _INT,
            "DP size (default: the checkpoint's); world / (TP x PP x CP)",
        ),
        (
            "--phase",
            _INT,
            "inverse with --phase-transition-iterations and no checkpoint: which phase's data the "
            "flags describe (0-based)",
        ),
        (
            "--no-add-extra-token-to-sequence",
            _FLAG,
            "the datasets were built with add_extra_token_to_sequence=False (Megatron-LM training "
            "always uses True)",
        ),
    ),
    "data and caches": (
        (
            "--cache-dir",
            {},
            "index cache directory (default: the run's --data-cache-path, else "
            "<prefix>/cache/GPTDataset_indices)",
        ),
        (
            "--data-root",
            {**_MANY, "metavar": "OLD=NEW"},
            "the data moved: read prefixes under OLD from NEW (repeatable)",
        ),
        (
            "--rebuild-caches",
            _FLAG,
            "build missing caches with megatron-core's builder (same config)",
        ),
        (
            "--from-sample-log",
            _FLAG,
            "answer --iteration from the run's sample log alone (--sample-log DIR, else the "
            "checkpoint's --sample-log-dir): sample ids, token SHA-1s and losses as trained, in "
            "milliseconds, without Megatron or the index caches (documents and tokens need those)",
        ),
    ),
    "output": (
        ("--json", _FLAG, "one JSON document on stdout"),
        ("--out", {"metavar": "FILE.jsonl"}, "write one JSON line per sample/hit"),
        (
            "--emit-blocklist",
            {"metavar": "FILE.jsonl"},
            "write the documents found, for a data filter (one JSON line each)",
        ),
        ("--text", _FLAG, "decode tokens with the run's tokenizer (checkpoint or flags)"),
        (
            "--sample-log",
            {"metavar": "DIR"},
            "refuse unless the answer matches the run's --sample-log-dir records",
        ),
        ("--max-tokens", {**_INT, "default": 12}, "tokens per table row"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The lookup's own flags; any other flag is handed to Megatron's parser."""
    parser = argparse.ArgumentParser(
        prog="megatron-ext lookup",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag is a Megatron training flag and means what it meant to the run.",
    )
    for title, flags in _FLAGS.items():
        group = parser.add_argument_group(title)
        for flag, options, text in flags:
            group.add_argument(flag, help=text, **options)
    return parser


def _usage(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    asked = (options.iteration, options.consumed_samples, options.document)
    if sum(x is not None for x in asked) != 1:
        parser.error("give exactly one of --iteration, --consumed-samples, --document")
    if options.document is not None and options.dataset is None:
        parser.error("--document needs --dataset")
    if options.document is not None and (
        options.dp_rank is not None or options.microbatch is not None
    ):
        parser.error("--dp-rank/--microbatch select a forward lookup, not --document")
    if options.worst is not None and (
        options.document is not None or options.microbatch is not None or options.worst < 1
    ):
        parser.error("--worst K (K >= 1) ranks one iteration's samples; not with --microbatch")
    if options.attempt is not None and (options.iteration is None or options.attempt < 1):
        parser.error("--attempt N (N >= 1) chooses whose training of an --iteration to answer")
    if options.iteration is not None and options.iteration < 1:
        parser.error(
            f"--iteration must be >= 1 (iterations are 1-indexed), got {options.iteration}"
        )
    if options.consumed_samples is not None and options.consumed_samples < 0:
        parser.error(f"--consumed-samples must be >= 0, got {options.consumed_samples}")
    needs_indices = (options.text, options.emit_blocklist, options.worst, options.attempt)
    if options.from_sample_log and (options.iteration is None or any(needs_indices)):
        parser.error(
            "--from-sample-log answers --iteration [--dp-rank] [--microbatch] from the log "
            "alone; --text, --emit-blocklist, --worst and --attempt need the index caches"
        )
    if any("=" not in item for item in options.data_root):
        parser.error("--data-root takes OLD=NEW")


def _batch_lines(
    session: Session, batch: Batch, index: TrainIndex, attempts: Attempts | None
) -> list[str]:
    schedule = session.config.schedule
    lines = [
        f"iteration {batch.iteration}"
        + (f" (phase {batch.phase})" if schedule.phase_transitions else "")
        + f": consumed_train_samples {batch.consumed_before} -> "
        f"{batch.consumed_before + batch.size}; {batch.size} samples = {batch.num_microbatches} "
        f"micro-batches x DP {schedule.data_parallel_size} x mbs {schedule.micro_batch_size}"
    ]
    if batch.skipped:
        lines.append(
            "SKIPPED (--iterations-to-skip): the batch was read and discarded, not trained on"
            + (" by any attempt" if attempts else "")
        )
    lines.append(
        index.describe()
        if isinstance(index, MockIndex)
        else f"data: {index.kind} {index.hash[:12]} over {len(index.mids)} dataset(s), "
        f"{session.config.dataloader_type} dataloader; caches match today's .bin/.idx"
    )
    lines.append(f"run: {session.source}; {session.config.topology.describe()}")
    return lines + [f"note: {note}" for note in session.config.notes]


def _emit(
    options: argparse.Namespace,
    lines: list[str],
    records: list[dict[str, Any]],
    kind: str,
    table: str,
    extra: dict[str, Any],
) -> None:
    if options.out:
        write_jsonl(options.out, records)
        print(f"wrote {len(records)} {kind} to {options.out}", file=sys.stderr)
    if options.json:
        print(json.dumps({**extra, "lines": lines, kind: records}, indent=1))
    else:
        print("\n".join(lines) if options.out else table)


def forward(session: Session) -> int:
    """Iteration (or consumed samples) [+ rank / micro-batch] -> samples, documents, tokens."""
    options = session.options
    attempts = chosen = None
    if options.iteration is not None:
        attempts = session.attempts_at(options.iteration)
        if attempts is not None:
            chosen = attempts.answer(options.attempt)
            session.use_segment(chosen.segment)
        elif options.attempt is not None:
            raise ConfigError("--attempt needs the run's layout history (--from-checkpoint)")
        batch = session.config.schedule.batch(options.iteration)
    else:
        batch = session.batch_at_consumed(options.consumed_samples)
    index, records = batch_records(session, batch, options.microbatch, options.dp_rank)
    lines = _batch_lines(session, batch, index, attempts)
    if attempts is not None and chosen is not None:
        lines += attempts.lines(chosen)
        for record in records:
            record["attempt"] = chosen.number
    elif session.checkpoint is None:
        lines.append(
            "note: no checkpoint: nothing here says whether the run trained this batch yet"
        )
    history = session.history.attempts() if session.history else ()
    number = None if chosen is None else chosen.number
    if options.sample_log:
        answers = None if chosen is None else session.answers_by_attempt(attempts, chosen, records)
        lines.append(check_against_log(options.sample_log, records, answers, history, number))
    if options.worst is not None:
        directory = sample_log_dir(options, session.config.args, "--worst")
        ranked = ranked_samples(directory, batch.iteration, options.dp_rank, number, history)
        records, changed = attach(ranked[: options.worst], records)
        by = "" if chosen is None else f", attempt {chosen.number}: {chosen.fate}"
        lines += worst_lines(records, changed, len(ranked), f"sample log {directory}{by}")
    if options.emit_blocklist:
        emit_blocklist(session, index, spans_of(records))
    extra = {
        "batch": {k: v for k, v in dataclasses.asdict(batch).items() if k != "stream_start"},
        "attempt": number,
        "attempts": [
            {"attempt": a.number, "first_iteration": a.segment.first, "trained": a.trained}
            | {"fate": a.fate, "job_id": a.segment.job_id}
            for a in (attempts.at if attempts else [])
        ],
        "data": {"kind": index.kind, "cache": index.hash, "datasets": [m.path for m in index.mids]},
    }
    table = (
        worst_table(lines, records)
        if options.worst is not None
        else samples_table(lines, records, options.max_tokens)
    )
    _emit(options, lines, records, "samples", table, extra | {"notes": [*session.config.notes]})
    return 0


def _hits(
    session: Session, index: TrainIndex, hits: Any, stream_end: int, phase: int, last: int
) -> tuple[list[dict[str, Any]], int]:
    """The reads of a document placed at (iteration, DP rank, micro-batch), and how many lie
    past the run's last iteration."""
    schedule = session.config.schedule
    order = session.cyclic_order(index)
    if order is None:
        positions, origin = hits.global_indices, np.arange(len(hits.global_indices))
    else:
        epochs = max(1, -(-stream_end // order.active))
        positions, origin = order.positions_of(hits.global_indices, epochs)
    iterations, microbatches, ranks = schedule.locate(positions, phase)
    reached = (positions < stream_end) & (iterations <= last)
    records = sorted(
        (
            {
                "iteration": int(iterations[k]),
                "dp_rank": int(ranks[k]),
                "microbatch": int(microbatches[k]),
                "sample_index": int(hits.global_indices[o]),
                "dataset_sample": int(hits.dataset_samples[o]),
                "offset": int(hits.offsets[o]),
                "count": int(hits.counts[o]),
                "skipped": int(iterations[k]) in schedule.iterations_to_skip,
            }
            for k, o in enumerate(origin.tolist())
            if reached[k]
        ),
        key=lambda h: (h["iteration"], h["microbatch"], h["dp_rank"], h["offset"]),
    )
    return records, int((~reached).sum())


def inverse(session: Session) -> int:
    """Document -> every (iteration, DP rank, micro-batch) that read it."""
    options, schedule = session.options, session.config.schedule
    if session.history is not None and session.history.distinct_layouts() > 1:
        raise ConfigError(
            "the run's DP size or batch sizes changed at a resume, and the inverse lookup maps "
            "positions with one layout: it would name wrong ranks for part of the run. Look "
            "up candidate iterations forward (--iteration), or pass --ckpt-step, "
            "--data-parallel-size and --micro-batch-size for one stretch"
        )
    phase = session.phase(None)
    index = session.index(phase)
    if isinstance(index, MockIndex):
        raise ConfigError("--document with mock data: a mock sample reads no document")
    member = member_of(index, options.dataset)
    hits = find_document(index, member, options.document)
    before, last = schedule.phase_bounds(phase)
    if last is None:
        raise ConfigError("the run's last iteration is unknown; pass --train-iters")
    stream_end = (
        (last - before) * schedule.global_batch_size
        if schedule.phase_transitions
        else schedule.consumed_before(last + 1)
    )
    records, unreached = _hits(session, index, hits, stream_end, phase, last)
    mid = index.mids[member]
    source = mid.source(options.document)
    trained = {h["iteration"] for h in records if not h["skipped"]}
    lines = [
        f"document {options.document} of {mid.path} ({int(mid.lengths[options.document])} tokens):"
        f" read by {len(records)} sample(s) in {len({h['iteration'] for h in records})} "
        f"iteration(s) up to iteration {last}, trained in {len(trained)}"
        + (
            f" (phase {phase}: iterations {before + 1}..{last})"
            if schedule.phase_transitions
            else ""
        ),
        f"data: {index.kind} {index.hash[:12]}; scanned {hits.scanned} cache entries; "
        f"run: {session.source}",
        f"from: {describe_source(source)}" if source else "from: (no provenance sidecar)",
        *[f"note: {note}" for note in session.config.notes],
    ]
    if unreached:
        lines.append(
            f"{unreached} more sample(s) in the caches hold it but lie past iteration {last}"
        )
    if options.emit_blocklist:
        emit_blocklist(session, index, {(member, mid.path, options.document)})
    extra = {
        "document": options.document,
        "dataset_path": mid.path,
        "source": source,
        "data": {"kind": index.kind, "cache": index.hash},
        "notes": list(session.config.notes),
    }
    _emit(options, lines, records, "hits", hits_table(lines, records), extra)
    return 0


def from_sample_log(options: argparse.Namespace) -> int:
    """``--from-sample-log``: the iteration's samples as training logged them; reads the
    checkpoint's args without torch and imports no Megatron."""
    directory = _sample_log_dir(options, "--from-sample-log")
    records = log_answer(directory, options.iteration, options.dp_rank, options.microbatch)
    ranks = sorted({r["dp_rank"] for r in records})
    lines = [
        f"iteration {options.iteration}: {len(records)} samples on DP rank(s) "
        f"{', '.join(map(str, ranks))}, as trained",
        f"source: sample log {directory} (no Megatron, no index caches: drop "
        "--from-sample-log for documents and tokens)",
    ]
    rows = [
        [*map(str, (r["sample_index"], r["dp_rank"], r["microbatch"])), loss, r["token_sha1"]]
        for r in records
        for loss in ["-" if r["loss"] is None else f"{r['loss']:.4f}"]
    ]
    shown = "\n".join(lines + table(["sample", "dp", "mb", "loss", "token_sha1"], rows))
    _emit(options, lines, records, "samples", shown, {"source": f"sample log {directory}"})
    return 0


def _sample_log_dir(options: argparse.Namespace, flag: str) -> str:
    """``--sample-log``, else the checkpoint's ``--sample-log-dir`` (read without torch)."""
    args = None
    if not options.sample_log and options.from_checkpoint:
        args = load_checkpoint(options.from_checkpoint, options.ckpt_step).args
    return sample_log_dir(options, args, flag)


def main(argv: list[str] | None = None) -> int:
    """Run one lookup; refusals print their reason and return 1."""
    parser = build_parser()
    options, megatron_flags = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    _usage(parser, options)
    if options.from_sample_log and megatron_flags:
        parser.error(f"--from-sample-log reads what was trained; not {' '.join(megatron_flags)}")
    # Megatron logs every index it opens at INFO; the answer is the output here.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        if options.from_sample_log:
            return from_sample_log(options)
        if options.worst is not None and options.from_checkpoint and not megatron_flags:
            # A run that wrote no sample log, refused before Megatron's seconds of import:
            # the planner asks on every rollback.
            _sample_log_dir(options, "--worst")
        # The Megatron logic copied here must still be the installed megatron-core's.
        copies.verify(COPIES)
        session = Session(options, megatron_flags)
        return inverse(session) if options.document is not None else forward(session)
    except (Refused, copies.CopyChanged) as exc:
        return report(exc, "megatron-ext lookup: refused")
