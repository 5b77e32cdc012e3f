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

from megatron_ext.files import SAMPLE_LOG_GLOB
from megatron_ext.gap_log import Gap
from megatron_ext.lookup.errors import DataChanged, Refused
from megatron_ext.lookup.gaps import gap_of, sample_log_gaps
from megatron_ext.records.sample_log_reader import latest, read_iteration


def check_against_log(directory: str | Path, records: list[dict[str, Any]]) -> str:
    """Compare answered samples with the log; returns a one-line verdict, raises on mismatch.

    Refuses when there is nothing to compare with (no directory, no sample log in it, or no
    record of any answered micro-batch): a check that compared nothing must not read as passed.
    """
    if not Path(directory).is_dir() or not any(Path(directory).glob(SAMPLE_LOG_GLOB)):
        raise Refused(
            f"--sample-log {directory}: no sample log there ({SAMPLE_LOG_GLOB} files, written by "
            "training with --sample-log-dir); pass the run's --sample-log-dir, or drop "
            "--sample-log to answer without the check"
        )
    slots: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for record in records:
        key = (record["iteration"], record["dp_rank"], record["microbatch"])
        slots.setdefault(key, []).append(record)
    logged = {}
    for iteration in sorted({k[0] for k in slots}):
        ranks = sorted({k[1] for k in slots if k[0] == iteration})
        for rank, groups in read_iteration(directory, iteration, ranks).items():
            # A resumed run's record replaces a rolled-back one: the last attempt's wins.
            for microbatch, entry in latest(groups).items():
                if entry.dp_rank == rank:
                    logged[(iteration, rank, microbatch)] = entry
    # Gap records are read only for ranks with an answered micro-batch the log lacks.
    missing = {k[1] for k in slots if k not in logged}
    gaps = sample_log_gaps(directory, missing) if missing else {}
    matched = absent = skipped = 0
    unlogged: list[Gap] = []
    for key, answered in slots.items():
        entry = logged.get(key)
        if answered[0]["skipped"]:
            skipped += 1  # read and discarded, never trained: training logs nothing for it
            continue
        if entry is None and (gap := gap_of(gaps, key[0], key[1])) is not None:
            unlogged.append(gap)  # trained while the log could not be written
            continue
        if entry is None:
            absent += 1
            continue
        ids = [r["sample_index"] for r in answered]
        digests = [r["token_sha1"] for r in answered]
        if entry.sample_ids != ids or entry.token_sha1 != digests:
            raise DataChanged(
                f"iteration {key[0]} DP rank {key[1]} micro-batch {key[2]}: training logged "
                f"samples {entry.sample_ids} with token SHA-1s {entry.token_sha1}, the caches and "
                f"data today give {ids} with {digests}; the data changed since training"
            )
        matched += 1
    if unlogged and not matched:
        raise Refused(
            f"--sample-log {directory}: {len(unlogged)} micro-batch(es) answered fall in a "
            f"logging gap: {unlogged[0].describe()}; nothing was compared; drop --sample-log "
            "to answer without the check"
        )
    if absent and not matched:
        raise Refused(
            f"--sample-log {directory} has no record of the {absent} micro-batch(es) answered "
            "(the log starts later, or those DP ranks' files are missing): nothing was "
            "compared; drop --sample-log to answer without the check"
        )
    verdict = f"sample log: {matched} micro-batches match the training record"
    if absent:
        verdict += f", {absent} not in the log (not compared)"
    if unlogged:
        verdict += f", {len(unlogged)} in a logging gap NOT compared ({unlogged[0].describe()})"
    if skipped:
        verdict += (
            f"; {skipped} skipped micro-batch(es) NOT compared (a skipped batch is read and "
            "discarded, so training logs nothing for it)"
        )
    return verdict
