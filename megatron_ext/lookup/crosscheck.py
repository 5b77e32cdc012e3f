"""What training recorded in the sample log, against the answer (``--sample-log``), ranked by
loss (``--worst``), or as the answer itself (``--from-sample-log``). Only the asked iteration's
records are read. Other samples are refused (the data changed); other tokens are shown only
where a recorded drill corrupted that batch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.common.files import SAMPLE_LOG_GLOB, sample_log_file
from megatron_ext.common.gap_log import Gap, read_gaps
from megatron_ext.common.records.sample_log import SampleRecord
from megatron_ext.common.records.sample_log_reader import AttemptRecords, latest, read_iteration
from megatron_ext.lookup.errors import ConfigError, DataChanged, PositionError, Refused, TwoWriters
from megatron_ext.lookup.history import Segment, attempt_number
from megatron_ext.lookup.session import source_line, spans_text

_DRILL = re.compile(r"^(\d+)(?:-(\d+))?:(\d+|\*)$")  # --drill-corrupt-batch START[-END]:RANK


@dataclass(frozen=True)
class Differ:
    """A micro-batch trained on the answered samples, but on other tokens than the disk's."""

    key: tuple[int, int, int]  # iteration, DP rank, micro-batch
    attempt: int | None
    trained: list[str]  # token SHA-1s training logged
    disk: list[str]  # the data's today


def check_against_log(
    directory: str | Path,
    records: list[dict[str, Any]],
    answers: dict[int, list[dict[str, Any]]] | None = None,
    segments: tuple[Segment, ...] = (),
    answered: int | None = None,
) -> str:
    """Compare answered samples with the log; returns a one-line verdict, raises on mismatch."""
    if not Path(directory).is_dir() or not any(Path(directory).glob(SAMPLE_LOG_GLOB)):
        raise Refused(
            f"--sample-log {directory}: no sample log there ({SAMPLE_LOG_GLOB} files, written by "
            "training with --sample-log-dir); pass the run's --sample-log-dir, or drop "
            "--sample-log to answer without the check"
        )
    slots = _slots(records)
    each = {n: _slots(a) for n, a in (answers or {}).items()}
    ranks = sorted({k[1] for k in slots} | {k[1] for a in each.values() for k in a})
    logged: dict[tuple[int, int, int], SampleRecord] = {}
    matched: dict[int | None, int] = {}
    differ: list[Differ] = []
    twice: list[str] = []
    for iteration in sorted({k[0] for k in slots}):
        for rank, groups in read_iteration(directory, iteration, ranks).items():
            twice += _two_writers(directory, iteration, rank, groups)
            if answers is None and groups:
                # A resumed run's record replaces a rolled-back one: the last attempt's wins.
                groups = [AttemptRecords(groups[-1].attempt, list(latest(groups).values()))]
            for group in groups:
                number = attempt_number(segments, group.attempt) if answers else answered
                own = each.get(number, slots) if number is not None else slots
                for entry in group.records:
                    key = (iteration, rank, entry.microbatch)
                    if entry.dp_rank != rank or key not in own:
                        continue
                    found = _compare(key, entry, own[key], number)
                    if found is None:
                        matched[number] = matched.get(number, 0) + 1
                    else:
                        differ.append(found)
                    if number in (answered, None):
                        logged[key] = entry
    verdict = _verdict(directory, slots, logged, matched, twice, len(differ))
    return verdict + "".join(_differ_note(d, segments) for d in differ)


def _slots(records: list[dict[str, Any]]) -> dict[tuple[int, int, int], list[dict[str, Any]]]:
    slots: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for record in records:
        key = (record["iteration"], record["dp_rank"], record["microbatch"])
        slots.setdefault(key, []).append(record)
    return slots


def _two_writers(
    directory: str | Path, iteration: int, rank: int, groups: list[AttemptRecords]
) -> list[str]:
    """Raise on two different records of one micro-batch in one attempt; name the same record
    written twice (two writers with the same data) for the verdict."""
    seen: dict[tuple[int, int], SampleRecord] = {}
    twice = []
    for group in groups:
        if not group.attempt.indexed:  # runs of an unindexed stretch: attempts of their own
            continue
        for record in group.records:
            first = seen.setdefault((group.attempt.ordinal, record.microbatch), record)
            if first is record:
                continue
            where = (
                f"iteration {iteration} DP rank {rank} micro-batch {record.microbatch}: "
                f"attempt {group.attempt.ordinal} of {sample_log_file(directory, rank)}"
            )
            if (first.sample_ids, first.token_sha1) != (record.sample_ids, record.token_sha1):
                raise TwoWriters(
                    f"{where} holds two different records (samples {first.sample_ids} and "
                    f"{record.sample_ids}): two trainings wrote to one run directory at once. "
                    "The log cannot say which one the checkpoints hold; find the other job "
                    "(the run lock names live holders), and treat this stretch as untrusted"
                )
            twice.append(where)
    return twice


def _compare(
    key: tuple[int, int, int], entry: SampleRecord, answered: list[dict[str, Any]], number: Any
) -> Differ | None:
    """None when training logged these samples with these tokens; the two SHA-1 lists when
    only the tokens differ; raises when the samples do (the answer would be wrong)."""
    ids = [r["sample_index"] for r in answered]
    digests = [r["token_sha1"] for r in answered]
    if entry.sample_ids != ids:
        by = f" (attempt {number})" if number is not None else ""
        raise DataChanged(
            f"iteration {key[0]} DP rank {key[1]} micro-batch {key[2]}: training{by} logged "
            f"samples {entry.sample_ids} with token SHA-1s {entry.token_sha1}, the caches and "
            f"data today give {ids} with {digests}; the data changed since training"
        )
    return Differ(key, number, entry.token_sha1, digests) if entry.token_sha1 != digests else None


def _differ_note(found: Differ, segments: tuple[Segment, ...]) -> str:
    """What is known of a micro-batch trained on other tokens than the disk's: both SHA-1s,
    and the drill of the attempt that trained it when the layout log records one."""
    iteration, rank, micro = found.key
    by = f" (attempt {found.attempt})" if found.attempt is not None else ""
    note = (
        f"\n  iteration {iteration} DP rank {rank} micro-batch {micro}{by}: the same samples, "
        f"but the tokens trained differ from the data on disk (token SHA-1s trained "
        f"{found.trained}, on disk {found.disk}; the answer shows the disk's)"
    )
    chosen = [segments[found.attempt - 1]] if found.attempt and segments else list(segments)
    drills = [s.drill for s in chosen if s.drill and _covers(s.drill, iteration, rank)]
    if drills:
        return note + f": the drill --drill-corrupt-batch {drills[-1]} corrupted it in flight"
    # No drill of that attempt hit this batch: the data on disk is not what was trained.
    raise DataChanged(
        note.strip().replace("; the answer shows the disk's", "")
        + ": the data changed since training (no drill is recorded for this batch)"
    )


def _covers(drill: str, iteration: int, rank: int) -> bool:
    """Whether a ``--drill-corrupt-batch`` spec corrupts this iteration on this DP rank."""
    match = _DRILL.match(drill.strip())
    if match is None:
        return False
    first, last = int(match[1]), int(match[2] or match[1])
    return first <= iteration <= last and match[3] in ("*", str(rank))


def _uncompared(
    directory: str | Path,
    slots: dict[tuple[int, int, int], list[dict[str, Any]]],
    logged: dict[tuple[int, int, int], SampleRecord],
) -> tuple[int, int, list[Gap]]:
    """Answered micro-batches not compared: (not in the log, skipped, in a logging gap)."""
    # Gap records are read only for ranks with an answered micro-batch the log lacks.
    missing = {k[1] for k in slots if k not in logged}
    gaps = {rank: read_gaps(sample_log_file(directory, rank)) for rank in sorted(missing)}
    absent = skipped = 0
    unlogged: list[Gap] = []
    for key, answered in slots.items():
        if answered[0]["skipped"]:
            skipped += 1  # read and discarded, never trained: training logs nothing for it
        elif key in logged:
            continue
        elif gap := next((g for g in gaps.get(key[1], []) if g.covers(key[0])), None):
            unlogged.append(gap)  # trained while the log could not be written
        else:
            absent += 1
    return absent, skipped, unlogged


def _verdict(
    directory: str | Path,
    slots: dict[tuple[int, int, int], list[dict[str, Any]]],
    logged: dict[tuple[int, int, int], SampleRecord],
    matched: dict[int | None, int],
    twice: list[str],
    differ: int,
) -> str:
    """What was compared, or a refusal when nothing was (``differ``: micro-batches compared
    whose tokens differ, named after the verdict)."""
    absent, skipped, unlogged = _uncompared(directory, slots, logged)
    total = sum(matched.values())
    if unlogged and not total + differ:
        raise Refused(
            f"--sample-log {directory}: {len(unlogged)} micro-batch(es) answered fall in a "
            f"logging gap: {unlogged[0].describe()}; nothing was compared; drop --sample-log "
            "to answer without the check"
        )
    if absent and not total + differ:
        raise Refused(
            f"--sample-log {directory} has no record of the {absent} micro-batch(es) answered "
            "(the log starts later, or those DP ranks' files are missing): nothing was "
            "compared; drop --sample-log to answer without the check"
        )
    verdict = f"sample log: {total} micro-batches match the training record"
    placed = sorted(matched.items(), key=lambda item: (item[0] is None, item[0] or 0))
    if any(n is not None for n in matched):
        by = (f"attempt {n}: {c}" if n is not None else f"unplaced: {c}" for n, c in placed)
        verdict += f" ({', '.join(by)})"
    if differ:
        verdict += f", {differ} trained on the same samples with other tokens (below)"
    if absent:
        verdict += f", {absent} not in the log (not compared)"
    if unlogged:
        verdict += f", {len(unlogged)} in a logging gap NOT compared ({unlogged[0].describe()})"
    if skipped:
        verdict += (
            f"; {skipped} skipped micro-batch(es) NOT compared (a skipped batch is read and "
            "discarded, so training logs nothing for it)"
        )
    if twice:
        verdict += f"; WARNING: the same record written twice (two writers?) at {twice[0]}"
    return verdict


@dataclass(frozen=True)
class Ranked:
    """One trained sample and its token-averaged loss, as the sample log recorded it."""

    loss: float | None  # None: the log holds no per-sample losses (an older version wrote it)
    dp_rank: int
    microbatch: int
    position: int  # index within the micro-batch
    sample_id: int
    token_sha1: str


def _ranks(directory: str | Path, dp_rank: int | None) -> list[int]:
    if dp_rank is not None:
        return [dp_rank]
    stems = (p.stem.removeprefix("samples-dp") for p in Path(directory).glob(SAMPLE_LOG_GLOB))
    return sorted(int(s) for s in stems if s.isdigit())


def ranked_samples(
    directory: str | Path,
    iteration: int,
    dp_rank: int | None = None,
    attempt: int | None = None,
    segments: tuple[Segment, ...] = (),
    by_loss: bool = True,
) -> list[Ranked]:
    """Every sample the run finally trained at ``iteration`` (one DP rank, or all;
    ``attempt``: that attempt's records where they can be placed), highest loss first; with
    ``by_loss=False`` in the index answer's order, losses None where the log has none."""
    out: list[Ranked] = []
    for rank, groups in read_iteration(directory, iteration, _ranks(directory, dp_rank)).items():
        placed = [attempt_number(segments, g.attempt) for g in groups]
        if attempt is not None and any(n is not None for n in placed):
            groups = [g for g, n in zip(groups, placed) if n == attempt]
        for microbatch, record in latest(groups).items():
            if record.dp_rank != rank:
                continue
            losses: list[float | None] = list(record.sample_losses)
            if len(losses) != len(record.sample_ids):
                if by_loss:
                    raise ConfigError(
                        f"the sample log in {directory} has no per-sample losses for iteration "
                        f"{iteration} (written by an older version): --worst needs them"
                    )
                losses = [None] * len(record.sample_ids)
            out += [
                Ranked(loss, rank, microbatch, k, sample_id, digest)
                for k, (loss, sample_id, digest) in enumerate(
                    zip(losses, record.sample_ids, record.token_sha1)
                )
            ]
    if not out:
        raise PositionError(
            f"the sample log in {directory} has no record of iteration {iteration}"
            + (f" on DP rank {dp_rank}" if dp_rank is not None else "")
            + (f" by attempt {attempt}" if attempt is not None else "")
            + " (was it trained with --sample-log-dir, and not skipped?)"
        )
    if not by_loss:
        return sorted(out, key=lambda r: (r.microbatch, r.dp_rank, r.position))
    return sorted(out, key=lambda r: (-_badness(r.loss), r.dp_rank, r.microbatch, r.position))


def _badness(loss: float | None) -> float:
    """A sample's loss as a sort key: NaN (a diverged sample) is the worst, like inf (as a
    key it would scramble the whole order); no loss logged is 0."""
    return math.inf if loss is not None and math.isnan(loss) else loss or 0.0


def log_answer(
    directory: str | Path, iteration: int, dp_rank: int | None, microbatch: int | None
) -> list[dict[str, Any]]:
    """An iteration's samples as the sample log recorded them, in the index answer's order and
    with its field names (the fields the log holds, and each sample's loss when logged)."""
    records = [
        {"iteration": iteration, "dp_rank": r.dp_rank, "microbatch": r.microbatch}
        | {"sample_index": r.sample_id, "token_sha1": r.token_sha1, "loss": r.loss}
        for r in ranked_samples(directory, iteration, dp_rank, by_loss=False)
        if microbatch is None or r.microbatch == microbatch
    ]
    if not records:
        raise PositionError(
            f"the sample log in {directory} has no record of iteration {iteration} "
            f"micro-batch {microbatch}"
        )
    return records


def attach(ranked: list[Ranked], records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The lookup records of the ranked samples, with their loss and rank by loss."""
    slots = {key[1:]: slot for key, slot in _slots(records).items()}  # one iteration's
    out, changed = [], 0
    for order, sample in enumerate(ranked, start=1):
        slot = slots.get((sample.dp_rank, sample.microbatch), [])
        found = slot[sample.position]["sample_index"] if sample.position < len(slot) else None
        if found != sample.sample_id:
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
        out.append(
            f"#{r['rank_by_loss']:<3} loss {r['loss']:.4f}  dp {r['dp_rank']} mb "
            f"{r['microbatch']}  sample {r['sample_index']}  source "
            f"{Path(r['dataset_path']).name}#{r['dataset_sample']}  documents "
            f"{spans_text(r['documents'])}"
            + (f"  attempt {r['attempt']}" if r.get("attempt") is not None else "")
            + ("  [trained tokens differ]" if r["trained_tokens_differ"] else "")
        )
        if where := source_line(r["documents"]):
            out.append(f"     {where}")
        if "text" in r:
            text = " ".join(r["text"].split())
            out.append(f"     text: {text[:snippet]}{'...' if len(text) > snippet else ''}")
    return "\n".join(out)


def sample_log_dir(options: Any, run_args: Any, flag: str) -> str:
    """``--sample-log DIR``, else the run's own ``--sample-log-dir`` (from the checkpoint)."""
    directory = options.sample_log or getattr(run_args, "sample_log_dir", None)
    if not directory:
        raise ConfigError(
            f"{flag} reads the sample log training wrote: pass --sample-log DIR (the run's "
            "--sample-log-dir), or use a checkpoint of a run trained with it"
        )
    return directory
