"""Lookup results as records (JSON / JSON Lines), a readable table, and atomic files.

Records are plain dicts so ``--json``, ``--out`` and the blocklist share one schema; files are
written to a temporary name in the target directory and renamed, so a reader (a data filter,
a dashboard) never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.io import atomic_write, token_sha1
from megatron_ext.lookup.dataset import Sample


def sample_record(
    sample: Sample,
    *,
    iteration: int,
    dp_rank: int,
    microbatch: int,
    skipped: bool,
    readers: list[int],
    text: str | None,
    sources: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """One sample as the tool reports it (``--json`` / ``--out``); ``sources``: each span's
    raw record (file, line, byte, id) from the provenance sidecar, None without one."""
    record: dict[str, Any] = {
        "iteration": iteration,
        "dp_rank": dp_rank,
        "microbatch": microbatch,
        "skipped": skipped,
        "sample_index": sample.index,
        "dataset": sample.dataset,
        "dataset_path": sample.dataset_path,
        "dataset_sample": sample.dataset_sample,
        "stream_sample": sample.stream_sample,
        "documents": [
            {"document": s.document, "offset": s.offset, "count": s.count, "source": source}
            for s, source in zip(sample.spans, sources)
        ],
        "tokens": sample.tokens.tolist(),
        "token_sha1": token_sha1(sample.tokens),
        "readers": readers,
    }
    if text is not None:
        record["text"] = text
    return record


def _spans(spans: Iterable[dict[str, int]]) -> str:
    return " ".join(f"{s['document']}@{s['offset']}+{s['count']}" for s in spans)


def _tokens(tokens: list[int], limit: int) -> str:
    shown = " ".join(map(str, tokens[:limit]))
    return shown + (f" ... ({len(tokens)})" if len(tokens) > limit else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in [header, *rows]
    ]


def samples_table(lines: list[str], records: list[dict[str, Any]], max_tokens: int) -> str:
    """Readable table: context lines, then one row per sample (and its text, if decoded)."""
    header = [
        "sample",
        "dp",
        "mb",
        "ranks",
        "dataset#sample",
        "documents (id@offset+count)",
        "tokens",
    ]
    rows = [
        [
            str(r["sample_index"]),
            str(r["dp_rank"]),
            str(r["microbatch"]),
            ",".join(map(str, r["readers"])),
            f"{Path(r['dataset_path']).name}#{r['dataset_sample']}",
            _spans(r["documents"]),
            _tokens(r["tokens"], max_tokens),
        ]
        for r in records
    ]
    table = _table(header, rows)
    out = [*lines, table[0]]
    for line, record in zip(table[1:], records):
        out.append(line)
        if where := source_line(record["documents"]):
            out.append(f"    {where}")
        if "text" in record:
            out.append(f"    text: {json.dumps(record['text'][:300], ensure_ascii=False)}")
    return "\n".join(out)


def hits_table(lines: list[str], hits: list[dict[str, Any]]) -> str:
    """Readable table of the inverse lookup's hits."""
    rows = [
        [
            str(h["iteration"]),
            str(h["dp_rank"]),
            str(h["microbatch"]),
            str(h["sample_index"]),
            str(h["dataset_sample"]),
            f"{h['offset']}+{h['count']}",
            "skipped" if h["skipped"] else "",
        ]
        for h in hits
    ]
    header = ["iteration", "dp", "mb", "sample", "dataset_sample", "tokens", ""]
    return "\n".join([*lines, *(_table(header, rows) if rows else [])])


def document_record(
    path: str,
    document: int,
    tokens: np.ndarray,
    decode: Callable[[list[int]], str] | None,
    source: dict[str, Any] | None,
) -> dict[str, Any]:
    """A blocklist entry: where the document is, a content hash that survives reordering, and
    its raw record (``source``: file, line, byte, id; None without a provenance sidecar), which
    ``megatron-ext blocklist apply`` removes from the shards."""
    record: dict[str, Any] = {
        "dataset_path": path,
        "document": document,
        "num_tokens": len(tokens),
        "token_sha1": token_sha1(tokens),
        "source": source,
    }
    if decode is not None:
        record["text"] = decode(tokens.tolist())
    return record


def describe_source(source: dict[str, Any]) -> str:
    """``FILE:LINE (id X)``: a raw record as people read it."""
    where = f"{source['file']}:{source['line']}"
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


def write_atomic(path: str | os.PathLike[str], lines: Iterable[str]) -> None:
    """Write text lines to ``path`` atomically (all or nothing, see
    :mod:`megatron_ext.common.io`)."""
    atomic_write(path, "".join(line + "\n" for line in lines))


def jsonl(records: Iterable[dict[str, Any]]) -> Iterable[str]:
    """JSON Lines, compact."""
    return (json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in records)
