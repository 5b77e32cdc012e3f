"""``--sample-log DIR``: check the answer against what training itself recorded.

The index arithmetic proves the caches and the .idx agree; only a record written during
training proves the *tokens* are the ones trained on. When the run had ``--sample-log-dir``,
each trained micro-batch's sample ids and token SHA-1s are on disk (:mod:`megatron_ext.sample_log`);
any difference means the data changed since, and the answer is refused rather than shown.
Only the answered iteration's records are read (:mod:`megatron_ext.records.sample_log_reader`
seeks to them), so the check costs the same at iteration 100 as at 100 k, on 1 rank or 64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.files import SAMPLE_LOG_GLOB, sample_log_file
from megatron_ext.gap_log import Gap
from megatron_ext.lookup.attempts import attempt_number
from megatron_ext.lookup.errors import DataChanged, Refused, TwoWriters
from megatron_ext.lookup.gaps import gap_of, sample_log_gaps
from megatron_ext.lookup.history import Segment
from megatron_ext.records.sample_log import SampleRecord
from megatron_ext.records.sample_log_reader import AttemptRecords, latest, read_iteration


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
                    _compare(key, entry, own[key], number)
                    matched[number] = matched.get(number, 0) + 1
                    if number in (answered, None):
                        logged[key] = entry
    return _verdict(directory, slots, logged, matched, twice)


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
) -> None:
    ids = [r["sample_index"] for r in answered]
    digests = [r["token_sha1"] for r in answered]
    if entry.sample_ids != ids or entry.token_sha1 != digests:
        by = f" (attempt {number})" if number is not None else ""
        raise DataChanged(
            f"iteration {key[0]} DP rank {key[1]} micro-batch {key[2]}: training{by} logged "
            f"samples {entry.sample_ids} with token SHA-1s {entry.token_sha1}, the caches and "
            f"data today give {ids} with {digests}; the data changed since training"
        )


def _verdict(
    directory: str | Path,
    slots: dict[tuple[int, int, int], list[dict[str, Any]]],
    logged: dict[tuple[int, int, int], SampleRecord],
    matched: dict[int | None, int],
    twice: list[str],
) -> str:
    """What was compared, or a refusal when nothing was."""
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
    if unlogged and not total:
        raise Refused(
            f"--sample-log {directory}: {len(unlogged)} micro-batch(es) answered fall in a "
            f"logging gap: {unlogged[0].describe()}; nothing was compared; drop --sample-log "
            "to answer without the check"
        )
    if absent and not total:
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
