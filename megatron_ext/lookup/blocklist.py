"""``megatron-ext lookup --emit-blocklist``: the documents an answer names, as a data filter
reads them.

One JSON line per document: its dataset and index, a content hash that survives reordering
(``token_sha1``), its text with ``--text``, and its raw record (``source``: shard, line, byte
offset, id; :mod:`megatron_ext.common.records.provenance`), which ``megatron-ext blocklist apply``
removes from the raw shards, writing filtered copies. A document whose dataset has no
provenance sidecar is still listed (by index and hash) and counted, with the command that
writes one.
"""

from __future__ import annotations

import sys

from megatron_ext.lookup.indices import TrainIndex
from megatron_ext.lookup.render import document_record, jsonl, write_atomic
from megatron_ext.lookup.session import Session


def emit_blocklist(
    session: Session, index: TrainIndex, documents: set[tuple[int, str, int]]
) -> None:
    """Write ``documents`` ((blend member, dataset path, document)) to ``--emit-blocklist``."""
    decode, target = session.decode(), session.options.emit_blocklist
    records = []
    for member, path, document in sorted(documents):
        mid = index.mids[member]
        tokens = mid.read_document(document)
        records.append(document_record(path, document, tokens, decode, mid.source(document)))
    write_atomic(target, jsonl(records))
    note = "each names its raw record (`megatron-ext blocklist apply` removes them)"
    missing = [r for r in records if r["source"] is None]
    if missing:
        datasets = ", ".join(sorted({r["dataset_path"] for r in missing}))
        note = (
            f"{len(missing)} name no raw record: no provenance sidecar beside {datasets} "
            "(`megatron-ext provenance rebuild` writes one)"
        )
    print(f"wrote {len(records)} document(s) to {target}; {note}", file=sys.stderr)
