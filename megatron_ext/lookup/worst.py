"""``megatron-ext lookup --iteration N --worst K``: the samples of a batch ranked by their loss.

    megatron-ext lookup --from-checkpoint ckpt/ --iteration 137000 --worst 8 --text
    megatron-ext lookup --from-checkpoint ckpt/ --iteration 137000 --worst 8 \\
        --emit-blocklist bad.jsonl                     # their documents, for a data filter

Why: a spike names a batch; the batch holds thousands of documents, and the ones that drove it
are the ones the model found hardest (garbage, mis-encoded text) or easiest (thousands of
repeated tokens). Training records each sample's token-averaged loss in the sample log
(``--sample-log-dir``, :mod:`megatron_ext.sample_log`); this ranks the iteration's samples by
it and resolves the top K to documents and text with the same index arithmetic as a forward
lookup. The sample log comes from ``--sample-log DIR`` or the run's own ``--sample-log-dir``
(saved in the checkpoint). The logged sample ids must equal what the indices give for each
slot, or the answer is refused; samples whose *tokens* differ from the data on disk (data
changed since, or corrupted in flight, as the drill does) are named in a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.common.files import SAMPLE_LOG_GLOB
from megatron_ext.common.records.sample_log import SampleRecord
from megatron_ext.common.records.sample_log_reader import latest, read_iteration
from megatron_ext.lookup.attempts import attempt_number
from megatron_ext.lookup.errors import ConfigError, DataChanged, PositionError
from megatron_ext.lookup.history import Segment
from megatron_ext.lookup.render import source_line


@dataclass(frozen=True)
class Ranked:
    """One trained sample and its token-averaged loss, as the sample log recorded it."""

    loss: float
    dp_rank: int
    microbatch: int
    position: int  # index within the micro-batch
    sample_id: int
    token_sha1: str


def ranked_samples(
    directory: str | Path,
    iteration: int,
    dp_rank: int | None = None,
    attempt: int | None = None,
    segments: tuple[Segment, ...] = (),
) -> list[Ranked]:
    """Every sample trained at ``iteration`` (one DP rank, or all), highest loss first.

    A rollback replay appends records for the same iteration again. With ``attempt`` (placed
    among the layout history's ``segments``), that attempt's records are ranked; else, or in
    a log whose attempts cannot be placed, the last one per (rank, micro-batch), which is
    what the run finally trained on. Only the asked rank's file is opened, and in each file
    only the iteration's records are read.
    """
    if dp_rank is None:
        ranks = sorted(
            int(p.stem.removeprefix("samples-dp"))
            for p in Path(directory).glob(SAMPLE_LOG_GLOB)
            if p.stem.removeprefix("samples-dp").isdigit()
        )
    else:
        ranks = [dp_rank]
    trained: dict[tuple[int, int], SampleRecord] = {}
    for rank, groups in read_iteration(directory, iteration, ranks).items():
        placed = [attempt_number(segments, g.attempt) for g in groups]
        if attempt is not None and any(n is not None for n in placed):
            groups = [g for g, n in zip(groups, placed) if n == attempt]
        for microbatch, record in latest(groups).items():
            if record.dp_rank == rank:
                trained[(rank, microbatch)] = record
    if not trained:
        raise PositionError(
            f"the sample log in {directory} has no record of iteration {iteration}"
            + (f" on DP rank {dp_rank}" if dp_rank is not None else "")
            + (f" by attempt {attempt}" if attempt is not None else "")
            + " (was it trained with --sample-log-dir, and not skipped?)"
        )
    out = []
    for (rank, microbatch), record in trained.items():
        if len(record.sample_losses) != len(record.sample_ids):
            raise ConfigError(
                f"the sample log in {directory} has no per-sample losses for iteration "
                f"{iteration} (written by an older version): --worst needs them"
            )
        out += [
            Ranked(loss, rank, microbatch, k, sample_id, digest)
            for k, (loss, sample_id, digest) in enumerate(
                zip(record.sample_losses, record.sample_ids, record.token_sha1)
            )
        ]
    return sorted(out, key=lambda r: (-r.loss, r.dp_rank, r.microbatch, r.position))


def attach(ranked: list[Ranked], records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The lookup records of the ranked samples, with their loss and rank by loss.

    ``records`` are the whole iteration's lookup records (every rank and micro-batch, in slot
    order). Returns them and how many samples' tokens differ from what was trained.
    """
    slots: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for record in records:
        slots.setdefault((record["dp_rank"], record["microbatch"]), []).append(record)
    out, changed = [], 0
    for order, sample in enumerate(ranked, start=1):
        slot = slots.get((sample.dp_rank, sample.microbatch), [])
        if (
            sample.position >= len(slot)
            or slot[sample.position]["sample_index"] != sample.sample_id
        ):
            found = slot[sample.position]["sample_index"] if sample.position < len(slot) else None
            raise DataChanged(
                f"iteration {slot[0]['iteration'] if slot else '?'} DP rank {sample.dp_rank} "
                f"micro-batch {sample.microbatch} position {sample.position}: training logged "
                f"sample {sample.sample_id}, the indices give {found}; the run's data or "
                "configuration differs from what the lookup reads"
            )
        record = dict(slot[sample.position], loss=sample.loss, rank_by_loss=order)
        record["trained_tokens_differ"] = record["token_sha1"] != sample.token_sha1
        changed += record["trained_tokens_differ"]
        out.append(record)
    return out, changed


def worst_lines(records: list[dict[str, Any]], changed: int, total: int, source: str) -> list[str]:
    """The context lines above the table."""
    lines = [f"worst {len(records)} of {total} samples by token-averaged loss ({source})"]
    if changed:
        lines.append(
            f"note: {changed} of them were trained on tokens that differ from the data on "
            "disk (data changed since, or corrupted in flight as in a drill)"
        )
    return lines


def worst_table(lines: list[str], records: list[dict[str, Any]], snippet: int = 160) -> str:
    """Readable ranking: one line per sample, its documents and a text snippet."""
    out = list(lines)
    for r in records:
        documents = " ".join(f"{d['document']}@{d['offset']}+{d['count']}" for d in r["documents"])
        out.append(
            f"#{r['rank_by_loss']:<3} loss {r['loss']:.4f}  dp {r['dp_rank']} mb "
            f"{r['microbatch']}  sample {r['sample_index']}  source "
            f"{Path(r['dataset_path']).name}#{r['dataset_sample']}  documents {documents}"
            + (f"  attempt {r['attempt']}" if r.get("attempt") is not None else "")
            + ("  [trained tokens differ]" if r["trained_tokens_differ"] else "")
        )
        if where := source_line(r["documents"]):
            out.append(f"     {where}")
        if "text" in r:
            text = " ".join(r["text"].split())
            out.append(f"     text: {text[:snippet]}{'...' if len(text) > snippet else ''}")
    return "\n".join(out)


def sample_log_dir(options: Any, run_args: Any) -> str:
    """``--sample-log DIR``, else the run's own ``--sample-log-dir`` (from the checkpoint)."""
    directory = options.sample_log or getattr(run_args, "sample_log_dir", None)
    if not directory:
        raise ConfigError(
            "--worst ranks samples by the loss training recorded: pass --sample-log DIR (the "
            "run's --sample-log-dir), or use a checkpoint of a run trained with it"
        )
    return directory
