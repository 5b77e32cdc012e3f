"""A ``.bin``/``.idx`` pair that no reader can see mixed or damaged (docs/data.md). Megatron
opens the two independently, so a new ``.bin`` beside an old ``.idx`` reads wrong tokens
silently: :func:`publish` removes the old ``.idx`` before renaming the pair into place, and
:func:`check_pair` checks the ``.idx`` layout and ``preprocess``'s fingerprint trailer (registry
``idx-trailing-bytes``). No Megatron import here.
"""

from __future__ import annotations

import hashlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from megatron_ext.common.errors import Refusal
from megatron_ext.common.io import kill_point, remove_durably, rename_durably

# The .idx layout of megatron-core's indexed_dataset._IndexReader, defined once for every
# reader in megatron-ext (registry copy ``lookup-indexed-dataset-format``).
INDEX_MAGIC = b"MMIDIDX\x00\x00"  # indexed_dataset._INDEX_HEADER
INDEX_VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
# indexed_dataset.DType: the code stored in the .idx -> the token dtype of the .bin
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
ITEM_SIZES = {code: np.dtype(dtype).itemsize for code, dtype in DTYPES.items()}
MAGIC = b"MXEXPAIR"  # trailer version 1: the .bin's fingerprint
MAGIC_V2 = b"MXEXPAI2"  # version 2: and the SHA-256 of the .idx's header and arrays
_TRAILERS = {
    MAGIC: struct.Struct("<8sQ32s"),  # magic, .bin size, sampled SHA-256
    MAGIC_V2: struct.Struct("<8sQ32s32s"),  # magic, .bin size, sampled SHA-256, .idx SHA-256
}
SAMPLE_BLOCK = 1 << 16
SAMPLE_COUNT = 16
CHUNK = 1 << 20  # entries per read: 29 MiB of reused buffers (+ the hash's 16 MiB block)
_FIX = "Rerun the preprocessing of this prefix (or restore its .bin and .idx from a good copy)"
_SHORTER = "it became shorter while it was read (rewritten meanwhile?)"


class PairError(Refusal, ValueError):
    """The .bin/.idx pair is incomplete or mixed; the message names it and the fix."""


class IndexDamaged(PairError):
    """The ``.idx`` is not a consistent index (truncated, edited); the message says how."""


@dataclass(frozen=True)
class _Layout:
    """What an ``.idx`` header promises, checked against the file's size."""

    header: bytes
    sequences: int
    documents: int
    itemsize: int
    body: int  # header and arrays: where a trailer starts
    trailer: tuple[int, bytes, bytes | None] | None  # .bin size, .bin SHA, .idx SHA (v2)


def _damaged(idx_path: str | os.PathLike[str], what: str) -> IndexDamaged:
    return IndexDamaged(
        f"{idx_path} is damaged: {what}; Megatron would fail or read wrong tokens. {_FIX}"
    )


def fingerprint(bin_path: str | os.PathLike[str]) -> tuple[int, bytes]:
    """(size, SHA-256 over SAMPLE_COUNT blocks spread evenly from the first to the last)."""
    size = os.path.getsize(bin_path)
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(bin_path, "rb") as handle:
        span = max(0, size - SAMPLE_BLOCK)
        for k in range(SAMPLE_COUNT):
            handle.seek(span * k // (SAMPLE_COUNT - 1))
            digest.update(handle.read(SAMPLE_BLOCK))
    return size, digest.digest()


def _layout(handle: BinaryIO, idx_path: str | os.PathLike[str]) -> _Layout:
    """The header's promise, checked in O(1) against the file size; the trailer, if any."""
    size = os.fstat(handle.fileno()).st_size
    head = handle.read(HEADER.size)
    if len(head) < HEADER.size:
        raise _damaged(idx_path, f"it has {size} bytes, fewer than the {HEADER.size}-byte header")
    magic, version, code, sequences, documents = HEADER.unpack(head)
    if magic != INDEX_MAGIC:
        raise _damaged(
            idx_path,
            "it does not start with Megatron's index magic MMIDIDX (not an .idx, or its header "
            "was overwritten)",
        )
    if version != INDEX_VERSION:
        raise _damaged(idx_path, f"its header says index version {version}, not {INDEX_VERSION}")
    if code not in ITEM_SIZES:
        raise _damaged(idx_path, f"its dtype code {code} is none of Megatron's (1-8)")
    body = HEADER.size + 12 * sequences + 8 * documents
    counts = f"its header's {sequences} sequences and {documents} document indices"
    if size < body:
        raise _damaged(
            idx_path,
            f"it has {size} bytes but {counts} need {body} (truncated, or a count in its header "
            "changed)",
        )
    trailer = None
    if size > body:
        layout = None
        if size - body <= max(t.size for t in _TRAILERS.values()):
            handle.seek(body)
            tail = handle.read(size - body)
            layout = _TRAILERS.get(tail[:8])
        if layout is None or layout.size != size - body:
            raise _damaged(
                idx_path,
                f"{size - body} bytes follow the arrays of {counts} and are not megatron-ext's "
                "fingerprint trailer (a cut trailer, appended data, or a count in its header "
                "changed)",
            )
        _, bin_size, bin_digest, *idx_digest = layout.unpack(tail)
        trailer = (bin_size, bin_digest, idx_digest[0] if idx_digest else None)
    return _Layout(head, sequences, documents, ITEM_SIZES[code], body, trailer)


def _read(
    handle: BinaryIO, idx_path: str | os.PathLike[str], offset: int, into: np.ndarray
) -> None:
    """Fill ``into`` from ``offset`` (read, not mapped: a scan must not stay resident)."""
    handle.seek(offset)
    if handle.readinto(memoryview(into).cast("B")) != into.nbytes:
        raise _damaged(idx_path, _SHORTER)


def _body_digest(idx_path: str | os.PathLike[str], body: int) -> bytes:
    """SHA-256 of the ``.idx`` up to its trailer (header and arrays), read in large blocks."""
    digest = hashlib.sha256()
    with open(idx_path, "rb") as handle:
        while (left := body - handle.tell()) > 0:
            block = handle.read(min(left, 1 << 24))
            if not block:
                raise _damaged(idx_path, _SHORTER)
            digest.update(block)
    return digest.digest()


def _check_arrays(
    handle: BinaryIO, idx_path: str | os.PathLike[str], layout: _Layout, bin_path: str
) -> None:
    """Lengths, pointers and document indices against each other and the ``.bin`` size,
    CHUNK entries at a time in buffers reused across chunks (fresh ones would cost a page
    fault per 4 KiB: more than the checks)."""
    sequences, itemsize = layout.sequences, layout.itemsize
    size = max(1, min(CHUNK, max(sequences, layout.documents)))
    lengths_buffer = np.empty(size, np.int32)
    pointers_buffer, steps, expected = (np.empty(size, np.int64) for _ in range(3))
    backwards = np.empty(size, np.bool_)
    pointers_at = HEADER.size + 4 * sequences
    end = 0  # where the next sequence must start in the .bin
    for first in range(0, sequences, CHUNK):
        count = min(CHUNK, sequences - first)
        lengths, pointers = lengths_buffer[:count], pointers_buffer[:count]
        _read(handle, idx_path, HEADER.size + 4 * first, lengths)
        _read(handle, idx_path, pointers_at + 8 * first, pointers)
        if int(lengths.min()) < 0:
            at = int(np.argmax(lengths < 0))
            raise _damaged(idx_path, f"sequence {first + at} has length {lengths[at]} < 0")
        np.subtract(pointers[1:], pointers[:-1], out=steps[: count - 1])
        np.multiply(lengths[:-1], itemsize, out=expected[: count - 1], dtype=np.int64)
        if pointers[0] != end or not np.array_equal(steps[: count - 1], expected[: count - 1]):
            starts = np.concatenate(([0], np.cumsum(expected[: count - 1]))) + end
            at = int(np.argmax(pointers != starts))
            raise _damaged(
                idx_path,
                f"sequence {first + at} points at byte {pointers[at]} of the .bin, but the "
                f"lengths before it end at byte {starts[at]} (a pointer or length changed)",
            )
        end = int(pointers[-1]) + int(lengths[-1]) * itemsize
    bin_size = os.path.getsize(bin_path)
    if end != bin_size:
        raise PairError(
            f"{idx_path} describes {end} bytes of tokens but {bin_path} has {bin_size}: the "
            ".bin is truncated or extended, or the pair comes from two preprocessings, and "
            f"Megatron would read wrong tokens. {_FIX}"
        )
    if not layout.documents:
        raise _damaged(idx_path, "it has no document index (Megatron writes at least the first, 0)")
    last = 0  # the document indices start at 0 and never step back
    for first in range(0, layout.documents, CHUNK):
        count = min(CHUNK, layout.documents - first)
        documents = pointers_buffer[:count]
        _read(handle, idx_path, pointers_at + 8 * sequences + 8 * first, documents)
        if first == 0 and documents[0] != 0:
            raise _damaged(idx_path, f"its document indices start at {documents[0]}, not 0")
        back = backwards[: count - 1]
        np.less(documents[1:], documents[:-1], out=back)
        if documents[0] < last or back.any():
            at = 0 if documents[0] < last else int(np.argmax(back)) + 1
            before = last if at == 0 else int(documents[at - 1])
            raise _damaged(
                idx_path,
                f"document index {first + at} is {documents[at]}, below the one before it "
                f"({before})",
            )
        last = int(documents[-1])
    if last != sequences:
        raise _damaged(
            idx_path, f"its document indices end at sequence {last}, not at its {sequences}"
        )


def _check_index(
    handle: BinaryIO, idx_path: str | os.PathLike[str], layout: _Layout, bin_path: str
) -> bytes:
    """:func:`_check_arrays` while another thread hashes header and arrays (both release the
    GIL); the digest."""
    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(_body_digest, idx_path, layout.body)
        _check_arrays(handle, idx_path, layout, bin_path)
        return digest.result()


def append_fingerprint(idx_path: str | os.PathLike[str], bin_path: str | os.PathLike[str]) -> None:
    """Check a finished (not yet published) ``.idx`` against its ``.bin`` and write the
    trailer after its arrays (replacing any earlier one)."""
    size, digest = fingerprint(bin_path)
    with open(idx_path, "r+b") as handle:
        layout = _layout(handle, idx_path)
        own = _check_index(handle, idx_path, layout, os.fspath(bin_path))
        handle.seek(layout.body)
        handle.write(_TRAILERS[MAGIC_V2].pack(MAGIC_V2, size, digest, own))
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


def check_pair(prefix: str) -> None:
    """Raise :class:`PairError` unless ``PREFIX.bin``/``.idx`` exist, the ``.idx`` is a
    consistent index of the ``.bin`` (:class:`IndexDamaged` otherwise), and, when the ``.idx``
    carries a trailer, the pair is the one it records (one from another tool has none)."""
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    if not os.path.isfile(idx_path):
        state = (
            "exists without it: a `megatron-ext preprocess` was interrupted while publishing"
            if os.path.isfile(bin_path)
            else "is missing too"
        )
        raise PairError(
            f"dataset {prefix}: {idx_path} not found and the .bin {state}; rerun the "
            "preprocessing of this prefix (or fix the --data-path)"
        )
    if not os.path.isfile(bin_path):
        raise PairError(f"dataset {prefix}: {bin_path} not found beside its .idx")
    with open(idx_path, "rb") as handle:
        layout = _layout(handle, idx_path)
        if layout.trailer is not None and layout.trailer[:2] != fingerprint(bin_path):
            raise PairError(
                f"dataset {prefix}: {bin_path} is not the .bin its .idx was written with (size "
                f"{os.path.getsize(bin_path)}, fingerprint differs; the .idx expects "
                f"{layout.trailer[0]} bytes): the pair comes from two preprocessings, and "
                "Megatron would read wrong tokens. Rerun the preprocessing of this prefix"
            )
        recorded = layout.trailer[2] if layout.trailer is not None else None
        if recorded is None:  # no trailer, or the first version: the structure only
            _check_arrays(handle, idx_path, layout, bin_path)
            return
        digest = _check_index(handle, idx_path, layout, bin_path)
    if digest != recorded:
        raise _damaged(
            idx_path,
            "its header and arrays are not what `megatron-ext preprocess` wrote (their SHA-256 "
            "differs from the one in its trailer): it was edited or corrupted",
        )


def index_identity(idx_path: str | os.PathLike[str], *, checked: bool) -> tuple[int, int, bytes]:
    """(sequences, bytes of header and arrays, their SHA-256): what a provenance sidecar binds
    to. ``checked``: the pair just passed :func:`check_pair`, so a v2 trailer's digest is used."""
    with open(idx_path, "rb") as handle:
        layout = _layout(handle, idx_path)
    recorded = layout.trailer[2] if layout.trailer is not None else None
    if checked and recorded is not None:
        return layout.sequences, layout.body, recorded
    return layout.sequences, layout.body, _body_digest(idx_path, layout.body)


def publish(temporary: str, prefix: str) -> None:
    """Move ``TEMPORARY.bin``/``.idx`` to ``PREFIX.bin``/``.idx`` (old ``.idx`` removed first;
    kill points for the fault tests follow steps 1 and 2)."""
    remove_durably(f"{prefix}.idx")
    kill_point()
    rename_durably(f"{temporary}.bin", f"{prefix}.bin")
    kill_point()
    rename_durably(f"{temporary}.idx", f"{prefix}.idx")
