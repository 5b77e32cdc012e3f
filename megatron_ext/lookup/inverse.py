"""Document -> every global sample that read it: the lookup chain walked backwards, vectorised.

``document_index`` gives the stream positions of the document (one per epoch);
``sample_index`` (binary search, no copy) the stream samples whose token range touches them;
one pass over ``shuffle_index`` finds the dataset samples that are those stream samples, and,
for blends, one pass over ``dataset_index``/``dataset_sample_index`` the global samples. The
passes read the cache files in chunks (not through their mappings, whose touched pages would
stay resident), so memory stays at a few chunks at any index size; progress goes to stderr
when a pass takes more than a moment (a 50 M-document run scans ~5 GB).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_ext.lookup.dataset import MidIndex
from megatron_ext.lookup.errors import ConfigError, PositionError
from megatron_ext.lookup.formats import array_chunks
from megatron_ext.lookup.indices import TrainIndex

CHUNK = 1 << 22  # entries per pass step: large enough to amortise numpy calls, small in RAM
FEW = 8  # up to this many targets, equality passes beat a lookup table


@dataclass(frozen=True)
class DocumentHits:
    """Where one document was read: parallel arrays, one entry per read (a global sample reads
    a document once, or twice when an epoch boundary puts it back to back with itself)."""

    global_indices: np.ndarray
    dataset_samples: np.ndarray
    offsets: np.ndarray  # first token of the document inside the sample's read
    counts: np.ndarray  # tokens of the document the sample reads
    scanned: int  # cache entries scanned (for throughput figures)


def _members(
    values: np.ndarray, targets: np.ndarray, low: int, table: np.ndarray | None
) -> np.ndarray:
    """Boolean mask: which ``values`` are among the sorted ``targets``."""
    if table is None:
        mask = values == targets[0]
        for target in targets[1:]:
            mask |= values == target
        return mask
    shifted = values.astype(np.int64) - low
    inside = (shifted >= 0) & (shifted < len(table))
    mask = np.zeros(values.shape, dtype=bool)
    mask[inside] = table[shifted[inside]]
    return mask


def _matcher(targets: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
    """Sorted unique targets, and for many targets a boolean table over their value range."""
    targets = np.unique(np.asarray(targets, dtype=np.int64))
    if len(targets) <= FEW:
        return targets, 0, None
    low = int(targets[0])
    table = np.zeros(int(targets[-1]) - low + 1, dtype=bool)
    table[targets - low] = True
    return targets, low, table


def _first_row_at_least(column: np.ndarray, value: int) -> int:
    """Binary search on a non-decreasing memory-mapped column, without copying it."""
    lo, hi = 0, len(column)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(column[mid]) < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _stream_samples(mid: MidIndex, document: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Stream samples reading ``document``: (stream sample, offset, count), entries scanned."""
    positions = []
    entries = len(mid.document_index)
    for start, chunk in _progress(mid.files["document_index"], entries, "document_index"):
        positions.append(np.flatnonzero(chunk == document) + start)
    found = np.concatenate(positions) if positions else np.empty(0, dtype=np.int64)
    rows = mid.sample_index
    column = rows[:, 0]
    length = int(mid.lengths[document])
    streams, offsets, counts = [], [], []
    for position in found.tolist():
        # Samples j with start row position <= p <= end row position.
        first = max(0, _first_row_at_least(column, position) - 1)
        last = _first_row_at_least(column, position + 1) - 1
        for j in range(first, min(last, rows.shape[0] - 2) + 1):
            (p0, o0), (p1, o1) = map(int, rows[j]), map(int, rows[j + 1])
            begin = o0 if p0 == position else 0
            stop = o1 + mid.extra if p1 == position else length
            if p0 <= position <= p1 and stop > begin:
                streams.append(j)
                offsets.append(begin)
                counts.append(stop - begin)

    def as_array(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    return as_array(streams), as_array(offsets), as_array(counts), entries


def _progress(path: str, entries: int, what: str) -> Iterator[tuple[int, np.ndarray]]:
    """Chunks of a cache file, with a progress bar on stderr after the first two seconds."""
    with tqdm(
        total=entries, desc=f"scanning {what}", unit="entry", unit_scale=True, delay=2
    ) as bar:
        for start, chunk in array_chunks(path, CHUNK):
            yield start, chunk
            bar.update(len(chunk))


def _scan(
    paths: tuple[str, ...], entries: int, targets: np.ndarray, keep: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One chunked pass: rows whose last file's value is in ``targets`` (and whose first
    file's value equals ``keep`` when given). Returns (row numbers, matched values)."""
    wanted, low, table = _matcher(targets)
    rows, values = [], []
    first = array_chunks(paths[0], CHUNK) if keep is not None else None
    for start, chunk in _progress(paths[-1], entries, paths[-1].rsplit("-", 1)[-1]):
        mask = _members(chunk, wanted, low, table)
        if first is not None:
            mask &= next(first)[1] == keep
        hits = np.flatnonzero(mask)
        rows.append(hits + start)
        values.append(chunk[hits].astype(np.int64))
    empty = np.empty(0, dtype=np.int64)
    return (np.concatenate(rows) if rows else empty), (np.concatenate(values) if values else empty)


def find_document(index: TrainIndex, member: int, document: int) -> DocumentHits:
    """Every global sample of the train dataset that reads ``document`` of blend ``member``."""
    mid = index.mids[member]
    if not mid.begin <= document < mid.end:
        raise PositionError(
            f"document {document} is not in the train split [{mid.begin}, {mid.end}) of "
            f"{mid.path}; the run never trained on it"
        )
    streams, offsets, counts, scanned = _stream_samples(mid, document)
    reads: dict[int, list[tuple[int, int]]] = {}
    for stream, offset, count in zip(streams.tolist(), offsets.tolist(), counts.tolist()):
        reads.setdefault(stream, []).append((offset, count))
    # shuffle_index[i] is a stream sample that reads the document -> dataset sample i.
    samples, sample_streams = (
        _scan((mid.files["shuffle_index"],), len(mid), streams)
        if streams.size
        else (streams, streams)
    )
    scanned += len(mid.shuffle_index)
    via: dict[int, int] = dict(zip(samples.tolist(), sample_streams.tolist()))
    if index.blend is None:
        owners, owned = samples, samples
    else:
        # dataset_index[g] == member and dataset_sample_index[g] is such a sample -> global g.
        assert index.blend_files is not None
        owners, owned = (
            _scan(index.blend_files, len(index), samples, keep=member)
            if samples.size
            else (samples, samples)
        )
        scanned += len(index.blend[0])
    rows = [
        (g, i, offset, count)
        for g, i in zip(owners.tolist(), owned.tolist())
        for offset, count in reads[via[i]]
    ]
    columns = np.asarray(rows, dtype=np.int64).reshape(-1, 4).T
    return DocumentHits(columns[0], columns[1], columns[2], columns[3], scanned)


def member_of(index: TrainIndex, dataset: str) -> int:
    """Which blend member ``--dataset`` names: a recorded or on-disk prefix, a name, a number."""
    paths = [m.path for m in index.mids]
    named = [i for i, m in enumerate(index.mids) if dataset in (m.path, m.prefix)] or [
        i for i, p in enumerate(paths) if Path(p).name == dataset
    ]
    if len(named) == 1:
        return named[0]
    if dataset.isdigit() and int(dataset) < len(paths):
        return int(dataset)
    if named:
        raise ConfigError(
            f"--dataset {dataset!r} is in the blend {len(named)} times "
            f"(positions {named}); pass its position"
        )
    raise ConfigError(f"--dataset {dataset!r} is not one of the run's datasets: {paths}")
