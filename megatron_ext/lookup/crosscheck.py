"""``--sample-log DIR``: check the answer against what training itself recorded.

The index arithmetic proves the caches and the .idx agree; only a record written during
training proves the *tokens* are the ones trained on. When the run had ``--sample-log-dir``,
each trained micro-batch's sample ids and token SHA-1s are on disk (:mod:`megatron_ext.sample_log`);
any difference means the data changed since, and the answer is refused rather than shown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.files import sample_log_file
from megatron_ext.lookup.errors import DataChanged
from megatron_ext.sample_log import read_records


def check_against_log(directory: str | Path, records: list[dict[str, Any]]) -> str:
    """Compare answered samples with the log; returns a one-line verdict, raises on mismatch."""
    slots: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for record in records:
        key = (record["iteration"], record["dp_rank"], record["microbatch"])
        slots.setdefault(key, []).append(record)
    logged = {}
    for rank in sorted({k[1] for k in slots}):
        path = sample_log_file(directory, rank)
        if path.is_file():
            for entry in read_records(path):
                key = (entry.iteration, entry.dp_rank, entry.microbatch)
                if key in slots:
                    logged[key] = entry  # a resumed run's record replaces a rolled-back one
    matched = absent = 0
    for key, answered in slots.items():
        entry = logged.get(key)
        if answered[0]["skipped"]:
            continue  # a record can only be from an attempt rolled back before the skip
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
    return f"sample log: {matched} micro-batches match the training record" + (
        f", {absent} not in the log" if absent else ""
    )
