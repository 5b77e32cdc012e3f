"""Raw shards as records, each at ``(number, locator)`` (the sidecar's ``line`` and ``byte``):
a JSONL line's 1-based number and byte offset, or a Parquet row's 1-based number and row group.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ext.common.records.provenance import shard_entry
from megatron_ext.data.encode import EncodeError, lines

PARQUET = (".parquet", ".pq")
BATCH_ROWS = 1024  # rows decoded at a time

Payload = bytes | dict[str, Any]


def is_parquet(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in PARQUET


def _open(path: Path, columns: list[str]) -> pq.ParquetFile:
    """The Parquet file, refusing one that is not Parquet or lacks a column."""
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise EncodeError(f"{path}: not a readable Parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise EncodeError(
            f"{path}: no column {', '.join(map(repr, missing))} (columns: {names}); choose the "
            "column with --json-keys (--json-key, --provenance-key)"
        )
    return parquet


def records(path: Path, columns: list[str]) -> Iterator[tuple[int, int, Payload]]:
    """(number, locator, record) of every record: a JSONL shard's non-blank lines (raw
    bytes), a Parquet shard's rows (``columns`` only, as a dict)."""
    if not is_parquet(path):
        yield from lines(path)
        return
    parquet, number = _open(path, columns), 0
    for group in range(parquet.num_row_groups):
        batches = parquet.iter_batches(BATCH_ROWS, row_groups=[group], columns=columns)
        try:
            for batch in batches:
                for row in batch.to_pylist():
                    number += 1
                    yield number, group, row
        except (OSError, pa.ArrowException) as exc:  # a damaged page: not the output's fault
            raise EncodeError(
                f"{path}: row group {group} cannot be read ({exc}); the Parquet file is damaged, "
                "restore it from a good copy"
            ) from None


def group_rows(parquet: pq.ParquetFile) -> list[int]:
    """Rows per row group of an opened Parquet file (its footer, read when it was opened)."""
    metadata = parquet.metadata
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def record_at(path: Path, number: int, locator: int, columns: list[str]) -> Payload:
    """The record at (``number``, ``locator``), as :func:`records` yields it."""
    if not is_parquet(path):
        with path.open("rb") as handle:
            handle.seek(locator)
            return handle.readline()
    parquet = _open(path, columns)
    first = sum(group_rows(parquet)[:locator])
    table = parquet.read_row_group(locator, columns=columns)
    return table.slice(number - 1 - first, 1).to_pylist()[0]


def entry(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A shard as the sidecar records it; a Parquet shard with its format and row groups."""
    described = shard_entry(path)
    if is_parquet(path):
        described |= {"format": "parquet", "row_groups": group_rows(pq.ParquetFile(path))}
    return described


def located(path: Path, numbers: list[int], column: str | None) -> dict[int, tuple[int, Any]]:
    """Each Parquet row number's (from 1) row group and, with ``column``, its value there."""
    parquet = _open(path, [column] if column else [])
    found, first = {}, 0
    for group, rows in enumerate(group_rows(parquet)):
        inside = [n for n in numbers if first < n <= first + rows]
        if inside and column:
            values = parquet.read_row_group(group, columns=[column]).column(column)
            found |= {n: (group, values[n - 1 - first].as_py()) for n in inside}
        elif inside:
            found |= {n: (group, None) for n in inside}
        first += rows
    return found


def write_without(path: Path, numbers: set[int], out: BinaryIO | None) -> tuple[int, int]:
    """Copy a Parquet shard's rows except rows ``numbers`` (from 1) to ``out`` (None: count
    only), row group by row group, schema and metadata kept; (kept rows, removed rows)."""
    parquet = pq.ParquetFile(path)
    writer = None if out is None else pq.ParquetWriter(out, parquet.schema_arrow)
    kept = removed = first = 0
    for group, rows in enumerate(group_rows(parquet)):
        keep = [first + k + 1 not in numbers for k in range(rows)]
        removed += rows - sum(keep)
        kept += sum(keep)
        if writer is not None:
            writer.write_table(parquet.read_row_group(group).filter(pa.array(keep)))
        first += rows
    if writer is not None:
        writer.close()
    return kept, removed
