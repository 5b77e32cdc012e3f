"""A ``.bin``/``.idx`` pair that no reader can see mixed: published in order, fingerprinted.

Megatron opens ``PREFIX.idx`` and ``PREFIX.bin`` independently and trusts that they belong
together; a new ``.bin`` beside an old ``.idx`` opens without complaint and returns wrong
tokens. Two renames cannot replace both files at once, so :func:`publish` orders them so that
no moment shows a mixed pair:

1. the old ``.idx`` is removed (from now on Megatron refuses to open the prefix: no index);
2. the new ``.bin`` is renamed into place (still no index);
3. the new ``.idx`` is renamed into place (a complete new pair).

A kill between the steps leaves a prefix without an ``.idx``: every reader fails loudly, and
:func:`check_pair` says a preprocess was interrupted. The ``.idx`` also carries a fingerprint
of its ``.bin`` after the arrays Megatron reads (Megatron reads each array by the counts in
its header, so trailing bytes are never read; registry assumption ``idx-trailing-bytes``):
the ``.bin`` size and a SHA-256 over blocks sampled across it, checked in O(1) reads by the
overlay's readers (training start-up, lookup), so a pair put together by hand or by another
tool is refused too. No Megatron import here.
"""

from __future__ import annotations

import hashlib
import os
import struct

from megatron_ext.errors import Refusal
from megatron_ext.io import kill_point, remove_durably, rename_durably

MAGIC = b"MXEXPAIR"
_TRAILER = struct.Struct("<8sQ32s")  # magic, .bin size, sampled SHA-256
SAMPLE_BLOCK = 1 << 16
SAMPLE_COUNT = 16


class PairError(Refusal, ValueError):
    """The .bin/.idx pair is incomplete or mixed; the message names it and the fix."""


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


def append_fingerprint(idx_path: str | os.PathLike[str], bin_path: str | os.PathLike[str]) -> None:
    """Add the trailer to a finished (not yet published) ``.idx``."""
    size, digest = fingerprint(bin_path)
    with open(idx_path, "ab") as handle:
        handle.write(_TRAILER.pack(MAGIC, size, digest))
        handle.flush()
        os.fsync(handle.fileno())


def recorded_fingerprint(idx_path: str | os.PathLike[str]) -> tuple[int, bytes] | None:
    """The trailer of an ``.idx`` (None: written by another tool, no fingerprint)."""
    with open(idx_path, "rb") as handle:
        if handle.seek(0, os.SEEK_END) < _TRAILER.size:
            return None
        handle.seek(-_TRAILER.size, os.SEEK_END)
        magic, size, digest = _TRAILER.unpack(handle.read(_TRAILER.size))
    return (size, digest) if magic == MAGIC else None


def check_pair(prefix: str) -> None:
    """Raise :class:`PairError` unless ``PREFIX.bin``/``.idx`` exist and belong together
    (when the ``.idx`` carries a fingerprint; one from another tool cannot be checked)."""
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
    recorded = recorded_fingerprint(idx_path)
    if recorded is not None and recorded != fingerprint(bin_path):
        raise PairError(
            f"dataset {prefix}: {bin_path} is not the .bin its .idx was written with (size "
            f"{os.path.getsize(bin_path)}, fingerprint differs; the .idx expects "
            f"{recorded[0]} bytes): the pair comes from two preprocessings, and Megatron would "
            "read wrong tokens. Rerun the preprocessing of this prefix"
        )


def publish(temporary: str, prefix: str) -> None:
    """Move ``TEMPORARY.bin``/``.idx`` to ``PREFIX.bin``/``.idx`` in the order above.

    Kill points (tests only, ``MEGATRON_EXT_TEST_KILL_AT_STEP``) follow steps 1 and 2.
    """
    remove_durably(f"{prefix}.idx")
    kill_point()
    rename_durably(f"{temporary}.bin", f"{prefix}.bin")
    kill_point()
    rename_durably(f"{temporary}.idx", f"{prefix}.idx")
