"""The provenance sidecar ``PREFIX.prov``: for every sequence of a ``.bin``/``.idx`` pair, the
raw record it was tokenized from (shard, line, byte offset, id when one was named; a Parquet
shard's row from 1 and its row group). Written by ``preprocess`` and ``provenance rebuild``,
read by the lookup, the incident report and ``blocklist apply``; its layout: docs/lookup.md.
:func:`open_sidecar` refuses one whose ``.idx`` differs, a truncated one or another version.
"""

from __future__ import annotations

import json
import os
import struct
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from megatron_ext.common.errors import Refusal
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.pair import fingerprint, index_identity

SUFFIX = ".prov"
MAGIC = b"MXEXPROV"
VERSION = 1
HEADER = struct.Struct("<8sIQQQ32s")  # magic, version, sequences, meta, .idx body, .idx SHA
_WIDE = 0xFFFF  # more shards than this: a uint32 shard column


class ProvenanceError(Refusal, ValueError):
    """A sidecar that does not describe its ``.idx`` (stale, damaged, another version), or
    sources that cannot be recorded; the message names the file and the fix."""


def _align(offset: int) -> int:
    return -(-offset // 8) * 8


def shard_entry(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A shard as the sidecar records it: absolute path, size, sampled fingerprint (as a .bin's)."""
    size, digest = fingerprint(path)
    return {"path": os.path.abspath(path), "size": size, "fingerprint": digest.hex()}


def write_sidecar(
    path: str | os.PathLike[str],
    idx_path: str | os.PathLike[str],
    *,
    files: list[dict[str, Any]],
    id_key: str | None,
    columns: tuple[np.ndarray, np.ndarray, np.ndarray],
    ids: tuple[np.ndarray, bytes | bytearray] | None,
    checked: bool,
) -> None:
    """Write the sidecar of ``idx_path`` atomically: ``columns`` (shard index, line, byte per
    sequence), with ``id_key`` the ``ids`` (end offsets, UTF-8 blob); ``checked``: the pair's."""
    sequences, body, digest = index_identity(idx_path, checked=checked)
    if any(len(column) != sequences for column in columns) or (ids and len(ids[0]) != sequences):
        raise ProvenanceError(
            f"{len(columns[0])} sources recorded for the {sequences} sequences of {idx_path}: "
            "the sidecar would name the wrong records; nothing was written"
        )
    dtype = "<u2" if len(files) <= _WIDE else "<u4"
    meta = json.dumps({"files": files, "id_key": id_key, "shard_dtype": dtype}).encode()
    parts = [np.frombuffer(meta, np.uint8), columns[0].astype(dtype)]
    parts += [column.astype("<u8") for column in columns[1:]]
    if id_key is not None:
        assert ids is not None, "ids are recorded whenever an id key is named"
        parts += [ids[0].astype("<u8"), np.frombuffer(ids[1], np.uint8)]

    def fill(handle: BinaryIO) -> None:
        handle.write(HEADER.pack(MAGIC, VERSION, sequences, len(meta), body, digest))
        for part in parts:
            handle.write(b"\0" * (_align(handle.tell()) - handle.tell()))
            handle.write(memoryview(np.ascontiguousarray(part)).cast("B"))

    atomic_write(path, fill)


class Recorder:
    """The sources of a preprocessing in compact arrays (20 bytes a sequence plus its id);
    ``describe`` makes a shard's entry (:func:`shard_entry`, or one that adds its format)."""

    def __init__(
        self, files: list[Path], id_key: str | None, describe: Callable[[Path], dict[str, Any]]
    ) -> None:
        self.files, self.id_key, self.describe = files, id_key, describe
        self.shard = array("I")
        self.line, self.byte, self.id_end = array("Q"), array("Q"), array("Q")
        self.blob = bytearray()

    def add(self, shard: int, line: int, byte: int, record_id: str | None) -> None:
        """One sequence: from shard ``shard`` (index into ``files``), at ``line`` / ``byte``."""
        self.shard.append(shard)
        self.line.append(line)
        self.byte.append(byte)
        if self.id_key is not None:
            self.blob += (record_id or "").encode("utf-8")
            self.id_end.append(len(self.blob))

    def write(self, path: str | os.PathLike[str], idx_path: str | os.PathLike[str]) -> None:
        """The sidecar of the just-fingerprinted ``idx_path`` (its trailer's digest is used)."""
        write_sidecar(
            path,
            idx_path,
            files=[self.describe(f) for f in self.files],
            id_key=self.id_key,
            columns=(
                np.frombuffer(self.shard, np.uint32),
                np.frombuffer(self.line, np.uint64),
                np.frombuffer(self.byte, np.uint64),
            ),
            ids=(np.frombuffer(self.id_end, np.uint64), self.blob) if self.id_key else None,
            checked=True,
        )


class Provenance:
    """An opened, checked sidecar: where each sequence of its ``.idx`` came from."""

    def __init__(self, path: str, sequences: int, meta: dict[str, Any], start: int) -> None:
        self.path, self.sequences = path, sequences
        self.files: list[dict[str, Any]] = meta["files"]
        self.id_key: str | None = meta["id_key"]

        def column(dtype: str) -> np.ndarray:
            nonlocal start
            start = _align(start)
            mapped = np.memmap(path, dtype=dtype, mode="r", offset=start, shape=(sequences,))
            start += mapped.nbytes
            return mapped

        self.shard = column(meta["shard_dtype"])
        self.line, self.byte = column("<u8"), column("<u8")
        self.id_end: np.ndarray | None = None
        self.blob: np.ndarray | None = None
        size = os.path.getsize(path)
        if self.id_key is not None:
            self.id_end = column("<u8")
            blob = _align(start)
            start = blob + (int(self.id_end[-1]) if sequences else 0)
            if start == size:
                self.blob = np.memmap(path, np.uint8, "r", blob, (start - blob,))
        if start != size:
            raise ProvenanceError(
                f"{path} has {size} bytes, its header and ids need {start} (cut or appended to)"
            )

    def source(self, sequence: int) -> dict[str, Any]:
        """Sequence ``sequence``'s raw record: file, line, byte offset, id (None without ids),
        and what ``blocklist apply`` checks the shard with (id key, size, fingerprint)."""
        if not 0 <= sequence < self.sequences:
            raise ProvenanceError(f"{self.path} has sequences 0..{self.sequences - 1}: {sequence}")
        shard = int(self.shard[sequence])
        if shard >= len(self.files):
            raise ProvenanceError(
                f"{self.path} is damaged: sequence {sequence} names file {shard}, but it lists "
                f"{len(self.files)}. Rebuild it (megatron-ext provenance rebuild) or rerun the "
                "preprocessing of its prefix"
            )
        entry = self.files[shard]
        record_id = None
        if self.id_end is not None and self.blob is not None:
            start = int(self.id_end[sequence - 1]) if sequence else 0
            record_id = bytes(self.blob[start : int(self.id_end[sequence])]).decode("utf-8")
        source = {
            "file": entry["path"],
            "line": int(self.line[sequence]),
            "byte": int(self.byte[sequence]),
            "id": record_id,
            "id_key": self.id_key,
            "file_size": entry["size"],
            "file_fingerprint": entry["fingerprint"],
        }
        if entry.get("format") == "parquet":  # line: the row from 1, byte: its row group
            row, group = source["line"] - 1, source["byte"]
            in_group = row - sum(entry["row_groups"][:group])
            source |= {"format": "parquet", "row": row, "row_group": group, "group_row": in_group}
        return source


def place(source: dict[str, Any]) -> str:
    """A raw record's place for people: ``file:line``, or a Parquet shard's row."""
    if source.get("format") == "parquet":
        return (
            f"{source['file']} row {source['row']} (row group {source['row_group']}, "
            f"row {source['group_row']})"
        )
    return f"{source['file']}:{source['line']}"


def open_sidecar(prefix: str, *, checked: bool) -> Provenance | None:
    """``PREFIX.prov`` opened and checked against ``PREFIX.idx``; None when there is none.
    ``checked``: the pair has just passed ``check_pair`` (its trailer's digest is trusted)."""
    path = prefix + SUFFIX
    if not os.path.isfile(path):
        return None
    fix = (
        f"Rebuild it (megatron-ext provenance rebuild --dataset {prefix} --input FILES...) or "
        "rerun the preprocessing of this prefix"
    )
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise ProvenanceError(f"{path} is not a provenance sidecar (no {MAGIC!r}). {fix}")
        _, version, sequences, meta_bytes, body, digest = HEADER.unpack(head)
        if version != VERSION:
            raise ProvenanceError(f"{path} is version {version}; this reads {VERSION}. {fix}")
        handle.seek(_align(HEADER.size))
        try:
            meta = json.loads(handle.read(meta_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProvenanceError(f"{path} is damaged (its file table: {exc}). {fix}") from None
    found = index_identity(prefix + ".idx", checked=checked)
    if found != (sequences, body, digest):
        raise ProvenanceError(
            f"{path} describes another .idx ({sequences} sequences, SHA-256 {digest.hex()[:12]}) "
            f"than today's {prefix}.idx ({found[0]} sequences, SHA-256 {found[2].hex()[:12]}): "
            "the data was preprocessed again after it was written, and its lines would name "
            f"other records. {fix}"
        )
    end = _align(HEADER.size) + meta_bytes
    expected = _align(end) + sequences * (2 if meta["shard_dtype"] == "<u2" else 4)
    expected = _align(expected) + 16 * sequences + (8 * sequences if meta["id_key"] else 0)
    if size < expected:
        raise ProvenanceError(f"{path} is truncated ({size} bytes, its header needs more). {fix}")
    try:
        return Provenance(path, sequences, meta, end)
    except ProvenanceError as exc:
        raise ProvenanceError(f"{exc}. {fix}") from None
