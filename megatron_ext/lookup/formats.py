"""Megatron's data formats and data-flag rules, read without importing megatron-core.

Importing any ``megatron.core`` module runs its package ``__init__``, which loads torch's
compiler stack and probes Transformer Engine: ~5 s before a lookup could answer in
milliseconds. The lookup needs only four small pieces of Megatron, implemented here on numpy
and checked against megatron-core 0.19.2 by ``tests/unit/lookup/test_lookup_formats.py`` (same
results on the same inputs) and by the registry (``lookup-*`` assumptions: the targets still
exist with these signatures):

- :class:`IndexedData`: the ``.idx``/``.bin`` pair ``IndexedDatasetBuilder`` writes
  (``indexed_dataset._IndexReader``: header, version 1, dtype code, counts, sequence lengths,
  pointers, document indices) and ``IndexedDataset.get``;
- :func:`blend_from_list`: ``datasets.utils.get_blend_from_list`` (``--data-path`` etc.);
- :func:`blend_and_blend_per_split`: ``training.utils.get_blend_and_blend_per_split``;
- :func:`split_matrix`: ``parse_and_normalize_split`` + ``convert_split_vector_to_split_matrix``.

And the index caches' files: a cache's ``description.txt`` (:class:`Description`; Megatron
names the cache files by its md5) and its ``.npy`` arrays (:func:`map_array` for random
access, :func:`array_chunks` for scans); :func:`remap` says where any of these files is after
the data moved (``--data-root``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import mmap
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.records.pair import DTYPES, HEADER, INDEX_MAGIC, INDEX_VERSION
from megatron_ext.lookup.errors import ConfigError, DataChanged

Blend = tuple[list[str], list[float] | None]


def remap(path: str, data_root: Sequence[tuple[str, str]]) -> str:
    """Where a path the run recorded is now: under NEW for the first ``--data-root OLD=NEW``
    whose OLD holds it. Data, caches and tokenizer files move together between clusters while
    the checkpoint's args keep the old paths."""
    for old, new in data_root:
        if path == old or path.startswith(old.rstrip("/") + "/"):
            return new.rstrip("/") + path[len(old.rstrip("/")) :]
    return path


def map_random(path: str | os.PathLike[str]) -> mmap.mmap | bytes:
    """The whole file mapped read-only, advised for random access (``MADV_RANDOM``).

    Why: a lookup touches a few pages of files of many GiB (.bin, .idx, the caches). Without
    the advice every page fault reads ahead ``read_ahead_kb`` (8 MiB on a real cluster node):
    one 1,024-sample batch filled 19 GB of page cache and took 22 s instead of 0.2 s (BENCHMARKS.md
    "lookup at scale"). Whole-array scans do not use the mapping (they read in chunks).
    """
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; an empty array views nothing
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return mapping


@dataclass(frozen=True)
class Description:
    """A cache's ``description.txt``: Megatron names the cache files by the md5 of this text."""

    path: Path
    text: str
    content: dict[str, Any]  # empty when the text is not JSON

    @property
    def digest(self) -> str:
        return hashlib.md5(self.text.encode("utf-8"), usedforsecurity=False).hexdigest()

    @property
    def intact(self) -> bool:
        return self.path.name.startswith(self.digest + "-")

    def trusted(self) -> Description:
        """Itself, if its md5 is the hash in its name; the .npy files are named by that hash."""
        if not self.intact:
            raise DataChanged(
                f"{self.path}: the md5 of its contents is {self.digest}, not the hash in its "
                "name; the description was edited or copied over another, so the cache files "
                "named after it are untrusted"
            )
        return self


def read_description(path: Path) -> Description:
    """A cache's description file (its md5 is checked by :meth:`Description.trusted`)."""
    text = path.read_text(encoding="utf-8")
    try:
        content = json.loads(text)
    except json.JSONDecodeError:
        content = {}
    return Description(path, text, content if isinstance(content, dict) else {})


def _npy_layout(path: str) -> tuple[int, np.dtype, tuple[int, ...]]:
    """(data offset, dtype, shape) of a C-order .npy file, from its header."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(handle)
            offset = handle.tell()
    except ValueError as exc:
        raise DataChanged(f"{path} is not a readable .npy array: {exc}") from exc
    if fortran or dtype.hasobject:
        raise DataChanged(f"{path} is not a C-order numeric .npy array (not a Megatron cache)")
    return offset, dtype, tuple(shape)


def map_array(path: str) -> np.ndarray:
    """A cache array, memory-mapped read-only and advised for random access.

    A plain ndarray over the mapping (np.memmap's per-index subclass bookkeeping costs more
    than the lookups themselves); it keeps the mapping alive. Scans use :func:`array_chunks`.
    """
    offset, dtype, shape = _npy_layout(path)
    count = int(np.prod(shape, dtype=np.int64))
    if os.path.getsize(path) < offset + count * dtype.itemsize:
        raise DataChanged(f"{path} is shorter than its header says (truncated?)")
    return np.frombuffer(map_random(path), dtype, count, offset).reshape(shape)


def array_chunks(path: str, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of a cache array, ``rows`` at a time, read from the file.

    Why not slices of the mapping: a mapped page stays in the process's resident set once
    touched, so one pass over a 2.8 GB document index made the inverse lookup 3 GiB large;
    reads keep it at one chunk (and get the kernel's readahead, which the mapping declines).
    """
    offset, dtype, shape = _npy_layout(path)
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    with open(path, "rb") as handle:
        handle.seek(offset)
        for start in range(0, shape[0], rows):
            count = min(rows, shape[0] - start)
            chunk = np.fromfile(handle, dtype, count * per_row)
            if len(chunk) != count * per_row:
                raise DataChanged(f"{path} is shorter than its header says (truncated?)")
            yield start, chunk.reshape((count, *shape[1:]))


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The mapping a :func:`map_random` array views (None for anything else)."""
    owner: Any = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    return owner if isinstance(owner, mmap.mmap) else None


def will_need(array: np.ndarray, rows: np.ndarray, row_bytes: Any = None) -> None:
    """Have the kernel read the pages holding ``rows`` of a mapped array, all at once.

    Why: under ``MADV_RANDOM`` each first touch of a page is one synchronous read; a batch
    touches ~10 pages per sample in six files, so a cold 1,024-sample lookup waited for 10^4
    reads one after the other. ``MADV_WILLNEED`` on all of them first lets the disk serve them
    in parallel, and nothing beyond them is read. ``row_bytes``: bytes from each row's start
    (a number or one per row; default: one row).
    """
    mapping = _mapping(array)
    if mapping is None or not len(rows):
        return
    page = mmap.PAGESIZE
    start = array.ctypes.data - np.frombuffer(mapping, np.uint8, 1).ctypes.data
    first = start + np.asarray(rows, dtype=np.int64) * array.strides[0]
    size = array.strides[0] or array.itemsize if row_bytes is None else row_bytes
    low = first // page
    counts = (first + np.maximum(np.asarray(size, dtype=np.int64), 1) - 1) // page - low + 1
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    pages = np.unique(np.repeat(low, counts) + steps)
    breaks = np.flatnonzero(np.diff(pages) != 1)
    runs = zip(pages[np.r_[0, breaks + 1]].tolist(), pages[np.r_[breaks, len(pages) - 1]].tolist())
    for a, b in runs:
        mapping.madvise(
            mmap.MADV_WILLNEED, a * page, min((b - a + 1) * page, len(mapping) - a * page)
        )


class IndexedData:
    """One ``{prefix}.idx`` + ``{prefix}.bin``, memory-mapped (text datasets, not multimodal)."""

    def __init__(self, prefix: str) -> None:
        idx = prefix + ".idx"
        with open(idx, "rb") as stream:
            head = stream.read(HEADER.size)
        if len(head) < HEADER.size or head[:9] != INDEX_MAGIC:
            raise ValueError(f"bad header, cannot read: {idx}")
        _, version, code, sequences, documents = HEADER.unpack(head)
        if version != INDEX_VERSION:
            raise ValueError(f"bad version {version}, cannot read: {idx}")
        if code not in DTYPES:
            raise ValueError(f"unknown dtype code {code} in {idx}")
        self.dtype = np.dtype(DTYPES[code])
        buffer = map_random(idx)
        self.sequence_lengths = np.frombuffer(buffer, np.int32, sequences, HEADER.size)
        offset = HEADER.size + self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buffer, np.int64, sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(buffer, np.int64, documents, offset)
        self._bin = map_random(prefix + ".bin")

    def will_need(self, sequences: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Prefetch the ``.bin`` bytes of tokens [offset, offset + length) of ``sequences``."""
        if isinstance(self._bin, mmap.mmap) and len(sequences):
            starts = self.sequence_pointers[sequences] + offsets * self.dtype.itemsize
            will_need(np.frombuffer(self._bin, np.uint8), starts, lengths * self.dtype.itemsize)

    def get(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of one sequence, as ``IndexedDataset.get``."""
        if length is None:
            length = int(self.sequence_lengths[sequence]) - offset
        start = int(self.sequence_pointers[sequence]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)


def blend_from_list(blend: list[str] | None) -> Blend | None:
    """``[w1, p1, w2, p2, ...]`` or ``[p1, p2, ...]`` -> (prefixes, weights or None)."""
    if blend is None:
        return None
    if not blend:  # Megatron fails to unpack an empty list
        raise ConfigError("an empty data path list (--data-path / --*-data-path with no value)")
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    weights: list[float | None] = []
    for raw in blend[0::2]:
        try:
            weights.append(float(raw))
        except ValueError:
            weights.append(None)
    # Megatron checks ``any(is_none)`` then ``all(is_none)`` on ONE map iterator: after the
    # first None, only the weights behind it are checked. Mirrored exactly.
    is_none = iter([w is None for w in weights])
    if any(is_none):
        if not all(is_none):
            raise ConfigError(f"data paths {blend} mix weights and prefixes (Megatron asserts)")
        return [p.strip() for p in blend], None
    return [p.strip() for p in blend[1::2]], [float(w) for w in weights if w is not None]


def _read_text(path: str) -> str:
    return Path(path).read_text()


def blend_and_blend_per_split(
    args: argparse.Namespace,
) -> tuple[Blend | None, list[Blend | None] | None]:
    """The (blend, blend_per_split) Megatron derives from the data flags of ``args``."""
    if args.data_path is not None or args.data_args_path is not None:
        if args.data_args_path is not None:
            if args.data_path is not None:
                raise ConfigError(
                    "--data-path and --data-args-path are exclusive (Megatron asserts)"
                )
            return blend_from_list(_read_text(args.data_args_path).split()), None
        return blend_from_list(args.data_path), None
    splits = (args.train_data_path, args.valid_data_path, args.test_data_path)
    if any(s is not None for s in splits) or args.per_split_data_args_path is not None:
        if args.per_split_data_args_path is not None:
            per_split: dict[str, Any] = json.loads(_read_text(args.per_split_data_args_path))
            splits = tuple(
                v.split() if isinstance(v, str) else v
                for v in (per_split[k] for k in ("train", "valid", "test"))
            )
        return None, [blend_from_list(s) for s in splits]
    return None, None


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's ``datasets.utils.normalize`` (float64 division), to compare exactly."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """``--split "98,2,0"`` -> per split (train, valid, test) its [begin, end) fraction."""
    vector = [float(x) for x in re.findall(r"[.0-9]+", split)]
    vector += [0.0] * (3 - len(vector))
    if len(vector) != 3 or any(v < 0.0 for v in vector):
        raise ConfigError(f"--split {split!r} is not three non-negative numbers (Megatron asserts)")
    ends = list(itertools.accumulate(normalize(vector), initial=0))
    return [(a, b) if b > a else None for a, b in itertools.pairwise(ends)]
