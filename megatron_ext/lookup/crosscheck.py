"""``--sample-log DIR``: check the answer against what training itself recorded.

The index arithmetic proves the caches and the .idx agree; only a record written during
training proves the *tokens* are the ones trained on. When the run had ``--sample-log-dir``,
each trained micro-batch's sample ids and token SHA-1s are on disk (:mod:`megatron_ext.sample_log`).
Other samples mean the data changed since, and the answer is refused rather than shown. The
same samples with other tokens mean the tokens trained differ from the data on disk: changed
since, or corrupted in flight, as a drill does: when the layout log records a drill that hit
that batch the answer is shown, with both SHA-1s and the drill named; otherwise it is refused
as changed data, with both SHA-1s.
Only the answered iteration's records are read (:mod:`megatron_ext.common.records.sample_log_reader`
seeks to them), so the check costs the same at iteration 100 as at 100 k, on 1 rank or 64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.common.files import SAMPLE_LOG_GLOB, sample_log_file
from megatron_ext.common.gap_log import Gap
from megatron_ext.common.records.sample_log import SampleRecord
from megatron_ext.common.records.sample_log_reader import AttemptRecords, latest, read_iteration
from megatron_ext.lookup.attempts import attempt_number
from megatron_ext.lookup.errors import DataChanged, Refused, TwoWriters
from megatron_ext.lookup.gaps import gap_of, sample_log_gaps
from megatron_ext.lookup.history import Segment

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
    """Compare answered samples with the log; returns a one-line verdict, raises on mismatch.

    ``records`` is the answer shown (attempt ``answered``). With ``answers`` (attempt number
    -> that attempt's answer, under its own layout and data stage), every attempt's records
    of the iteration are compared with its own answer, and ``segments`` (the layout history's
    attempts) place each sample-log attempt; without, the last record per micro-batch is
    compared with ``records``. Two different records of one micro-batch in one attempt (two
    trainings writing one log) are an error. Refuses when there is nothing to compare with
    (no directory, no sample log in it, or no record of any answered micro-batch): a check
    that compared nothing must not read as passed.
    """
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
    # Gap records are read only for ranks with an answered micro-batch the log lacks.
    missing = {k[1] for k in slots if k not in logged}
    gaps = sample_log_gaps(directory, missing) if missing else {}
    absent = skipped = 0
    unlogged: list[Gap] = []
    for key, answered in slots.items():
        if answered[0]["skipped"]:
            skipped += 1  # read and discarded, never trained: training logs nothing for it
        elif key in logged:
            continue
        elif (gap := gap_of(gaps, key[0], key[1])) is not None:
            unlogged.append(gap)  # trained while the log could not be written
        else:
            absent += 1
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
    if any(n is not None for n in matched):
        verdict += (
            " ("
            + ", ".join(
                f"attempt {n}: {c}" if n is not None else f"unplaced: {c}"
                for n, c in sorted(
                    matched.items(), key=lambda item: (item[0] is None, item[0] or 0)
                )
            )
            + ")"
        )
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
