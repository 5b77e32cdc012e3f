"""The run's index caches, read memory-mapped and checked against the data on disk.

Megatron builds, per train split, ``GPTDataset`` caches (``document_index``, ``sample_index``,
``shuffle_index``) and for blends ``BlendedDataset`` caches (``dataset_index``,
``dataset_sample_index``), named ``{md5}-{class}-train-*`` where the md5 is over the
``description.txt`` next to them (docs/megatron-facts.md, "Data"). This module reads the
caches :mod:`megatron_ext.lookup.caches` found, never rebuilds them, and resolves a global
sample index to its dataset, documents, token spans and tokens exactly as
``GPTDataset.__getitem__`` does.

Before answering it checks that the data is the data the caches were built from, because after
a re-preprocessing the caches still "work" and silently point at other documents:

- each description's md5 equals the hash in the file names, and a blend's member descriptions
  are exactly the ones embedded in the blend's description;
- per dataset, :func:`~megatron_ext.common.records.pair.check_pair`, as training start-up runs it:
  the ``.idx`` is a consistent index of its ``.bin`` (one chunked pass: a flipped pointer reads
  other tokens while every count below still agrees) and the pair is the one its fingerprint
  records;
- O(1) per dataset: the ``.bin`` size matches the ``.idx``; the train split's document count and
  token count (from the ``.idx`` pointers) give exactly the cached number of epochs,
  document-index entries and samples;
- per answered sample: the stream arithmetic of ``sample_index`` over a window that covers every
  document the sample touches must agree with the document lengths in today's ``.idx`` (a
  reordered or edited corpus moves document boundaries), and every document id must lie in the
  split's range.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.common.records.provenance import Provenance, ProvenanceError, open_sidecar
from megatron_ext.lookup.errors import CacheMissing, DataChanged, PositionError
from megatron_ext.lookup.formats import Description, IndexedData, map_array, will_need

GPT, BLENDED = "GPTDataset", "BlendedDataset"
GPT_FILES = ("document_index", "sample_index", "shuffle_index")
BLENDED_FILES = ("dataset_index", "dataset_sample_index")
# Samples walked on each side of an answered sample to pin its documents' boundaries.
WINDOW_LIMIT = 1 << 16


@dataclass(frozen=True)
class DataSpec:
    """What identifies a run's train dataset: the inputs of Megatron's dataset builder."""

    prefixes: tuple[str, ...]  # as passed to training (--data-path / --train-data-path)
    weights: tuple[float, ...] | None  # None: blend by dataset size (or a single prefix)
    per_split: bool  # --train-data-path / --per-split-data-args-path: no --split
    split: str | None
    seed: int
    sequence_length: int
    target_samples: int  # the train split size Megatron requested (for the phase)
    surplus: float  # --mid-level-dataset-surplus
    cache_dir: str | None  # --data-cache-path
    add_extra_token: bool = True


@dataclass(frozen=True)
class Span:
    """The tokens one document contributes to a sample."""

    document: int  # sequence index in the prefix's .idx
    offset: int  # first token within the document
    count: int


@dataclass(frozen=True)
class Sample:
    """One global sample resolved to data."""

    index: int  # global sample index into the train dataset (what the sampler hands out)
    dataset: int  # position of its prefix in the blend
    dataset_path: str  # the prefix as training recorded it
    dataset_sample: int  # sample index within that GPTDataset
    stream_sample: int  # shuffle_index[dataset_sample]: position in the document stream
    spans: tuple[Span, ...]  # seq_length (+1 label token) tokens, in order
    tokens: np.ndarray  # model input ids, as GPTDataset.__getitem__()["tokens"]


def remap(path: str, data_root: Sequence[tuple[str, str]]) -> str:
    for old, new in data_root:
        if path == old or path.startswith(old.rstrip("/") + "/"):
            return new.rstrip("/") + path[len(old.rstrip("/")) :]
    return path


class MidIndex:
    """One GPTDataset's caches and its IndexedDataset (the .bin/.idx on disk)."""

    def __init__(
        self,
        cache_dir: Path,
        trusted: Description,
        spec: DataSpec,
        data_root: Sequence[tuple[str, str]],
    ) -> None:
        description = trusted.content
        self.hash = trusted.digest
        self.path: str = description["dataset_path"]
        self.prefix = remap(self.path, data_root)
        self.seq_length = spec.sequence_length
        self.extra = int(spec.add_extra_token)
        base = cache_dir / f"{self.hash}-{GPT}-train-"
        missing = [f"{base}{n}.npy" for n in GPT_FILES if not os.path.isfile(f"{base}{n}.npy")]
        if missing:
            raise CacheMissing(f"GPTDataset cache files missing: {', '.join(missing)}")
        for suffix in (".idx", ".bin"):
            if not os.path.isfile(self.prefix + suffix):
                moved = (
                    ""
                    if self.prefix != self.path
                    else ("; if the data moved, map the old location with --data-root OLD=NEW")
                )
                raise DataChanged(f"dataset {self.path}: {self.prefix}{suffix} not found{moved}")
        try:
            check_pair(self.prefix)
        except PairError as exc:
            raise DataChanged(str(exc)) from None
        self.files = {name: f"{base}{name}.npy" for name in GPT_FILES}  # for scans
        self.document_index = map_array(self.files["document_index"])
        self.sample_index = map_array(self.files["sample_index"])
        self.shuffle_index = map_array(self.files["shuffle_index"])
        try:
            self.data = IndexedData(self.prefix)
        except (OSError, ValueError) as exc:
            raise DataChanged(
                f"dataset {self.path}: {self.prefix}.idx is unreadable: {exc}"
            ) from exc
        self.lengths: np.ndarray = self.data.sequence_lengths
        count = len(self.lengths)
        matrix = description["split_matrix"]
        if matrix is None:
            self.begin, self.end = 0, count
        else:
            self.begin = round(matrix[0][0] * float(count))
            self.end = round(matrix[0][1] * float(count))
        self._check_shapes(description["num_samples"])

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def _check_shapes(self, num_samples: int | None) -> None:
        """O(1): the .idx today must give the epochs, entries and samples the caches hold."""
        itemsize = self.data.dtype.itemsize
        pointers = self.data.sequence_pointers
        count = len(self.lengths)
        bin_bytes = int(pointers[-1]) + int(self.lengths[-1]) * itemsize if count else 0
        on_disk = os.path.getsize(self.prefix + ".bin")
        if on_disk != bin_bytes:
            raise DataChanged(
                f"dataset {self.path}: {self.prefix}.bin has {on_disk} bytes but its .idx "
                f"describes {bin_bytes}; the .bin and .idx are not from the same preprocessing"
            )
        if self.end <= self.begin:
            raise DataChanged(f"dataset {self.path}: the train split of {count} sequences is empty")
        end_byte = int(pointers[self.end]) if self.end < count else bin_bytes
        tokens = (end_byte - int(pointers[self.begin])) // itemsize
        epochs = 1
        if num_samples is not None:
            wanted = num_samples * self.seq_length + self.extra
            epochs = max(1, -(-wanted // tokens))
        documents = self.end - self.begin
        samples = (epochs * tokens - self.extra) // self.seq_length
        held = (len(self.document_index), self.sample_index.shape[0] - 1, len(self.shuffle_index))
        if held != (epochs * documents, samples, samples):
            raise DataChanged(
                f"dataset {self.path}: {self.prefix}.idx now has {count} sequences; its train "
                f"split [{self.begin}, {self.end}) holds {tokens} tokens, which gives {epochs} "
                f"epoch(s), {epochs * documents} document-index entries and {samples} samples, "
                f"but the caches ({self.hash}) hold {held[0]} entries and {held[1]} samples. The "
                "data was re-preprocessed, extended or replaced after the caches were built."
            )

    def _window(self, stream_sample: int) -> tuple[int, int]:
        """Sample-index rows [a, b] whose arithmetic pins every document ``stream_sample`` reads.

        Row a starts a document (offset 0) or lies in an earlier one; row b lies past the last
        document the sample reads. Very long documents are checked up to WINDOW_LIMIT rows out.
        """
        rows = self.sample_index
        first_pos, last_pos = int(rows[stream_sample][0]), int(rows[stream_sample + 1][0])
        a, chunk = stream_sample, 64
        while a > 0 and stream_sample - a < WINDOW_LIMIT:
            block = np.asarray(rows[max(0, a - chunk) : a + 1])[::-1]
            stop = np.flatnonzero((block[:, 0] < first_pos) | (block[:, 1] == 0))
            if stop.size:
                a -= int(stop[0])
                break
            a -= len(block) - 1
        b, last = stream_sample + 1, rows.shape[0] - 1
        while b < last and b - stream_sample < WINDOW_LIMIT:
            block = np.asarray(rows[b : min(last, b + chunk) + 1])
            past = np.flatnonzero(block[:, 0] > last_pos)
            if past.size:
                b += int(past[0])
                break
            b += len(block) - 1
        return a, b

    def _verify(self, stream_sample: int) -> None:
        """The cached stream arithmetic must hold with today's document lengths."""
        a, b = self._window(stream_sample)
        rows = np.asarray(self.sample_index[a : b + 1], dtype=np.int64)
        first, final = int(rows[0, 0]), int(rows[-1, 0])
        docs = np.asarray(self.document_index[first : final + 1], dtype=np.int64)
        outside = docs[(docs < self.begin) | (docs >= self.end)]
        if outside.size:
            raise DataChanged(
                f"dataset {self.path}: the caches use document {int(outside[0])}, outside the "
                f"train split [{self.begin}, {self.end}) of today's {self.prefix}.idx"
            )
        lengths = self.lengths[docs].astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        stream = starts[rows[:, 0] - first] + rows[:, 1]
        expected = stream[0] + (np.arange(len(rows)) * self.seq_length)
        bad = np.flatnonzero((stream != expected) | (rows[:, 1] > lengths[rows[:, 0] - first]))
        if bad.size:
            k = int(bad[0])
            upto = int(rows[k, 0]) - first + 1
            raise DataChanged(
                f"dataset {self.path}: sample_index rows {a}..{a + k} of cache {self.hash} span "
                f"{k * self.seq_length} tokens over documents {docs[:upto].tolist()[:8]}, but "
                f"their lengths in today's {self.prefix}.idx ({lengths[:upto].tolist()[:8]}) "
                f"give {int(stream[k] - stream[0])}: the data was re-preprocessed, reordered or "
                "edited after the caches were built, so they no longer point at what was trained"
            )

    def spans(self, dataset_sample: int) -> tuple[int, tuple[Span, ...]]:
        """(stream sample, the spans it reads), as ``_query_document_sample_shuffle_indices``."""
        if not 0 <= dataset_sample < len(self):
            raise PositionError(f"dataset {self.path} has samples 0..{len(self) - 1}")
        j = int(self.shuffle_index[dataset_sample])
        self._verify(j)
        (p0, o0), (p1, o1) = (
            tuple(map(int, self.sample_index[j])),
            tuple(map(int, self.sample_index[j + 1])),
        )
        out = []
        for position in range(p0, p1 + 1):
            document = int(self.document_index[position])
            start = o0 if position == p0 else 0
            stop = o1 + self.extra if position == p1 else int(self.lengths[document])
            if stop > start:
                out.append(Span(document, start, stop - start))
        return j, tuple(out)

    def prefetch(self, samples: np.ndarray) -> None:
        """Bring in, stage by stage and each stage in parallel, the pages that resolving
        ``samples`` reads: shuffle, sample and document index entries, .idx entries, tokens."""
        if not len(samples) or samples.min() < 0 or samples.max() >= len(self):
            return  # spans() refuses those with the reason
        will_need(self.shuffle_index, samples)
        stream = np.asarray(self.shuffle_index[samples], dtype=np.int64)
        will_need(self.sample_index, np.concatenate([stream, stream + 1]))
        begin, end = self.sample_index[stream], self.sample_index[stream + 1]
        will_need(self.document_index, begin[:, 0], None)
        will_need(self.document_index, end[:, 0], None)
        first = np.asarray(self.document_index[begin[:, 0]], dtype=np.int64)
        will_need(self.lengths, first)
        will_need(self.data.sequence_pointers, first)
        # The first document's tokens from the sample's offset (most samples read one or two
        # documents; the rest fault in as they are read).
        size = np.minimum(
            self.lengths[first].astype(np.int64) - begin[:, 1], self.seq_length + self.extra
        )
        self.data.will_need(first, begin[:, 1].astype(np.int64), np.maximum(size, 1))

    def sample(self, index: int, member: int, dataset_sample: int, pad_id: int | None) -> Sample:
        """Sample ``dataset_sample`` of this dataset (global ``index``, blend ``member``):
        its checked spans and its model-input tokens, as ``GPTDataset.__getitem__``."""
        stream, spans = self.spans(dataset_sample)
        tokens = self.read(spans)[: self.seq_length].copy()
        if pad_id is not None:
            tokens[tokens == pad_id] = 0
        return Sample(index, member, self.path, dataset_sample, stream, spans, tokens)

    @functools.cached_property
    def provenance(self) -> Provenance | None:
        """The pair's provenance sidecar (None without one), opened on first use; one that
        describes another ``.idx`` is refused like changed data, never used."""
        try:
            return open_sidecar(self.prefix, checked=True)  # check_pair ran in __init__
        except ProvenanceError as exc:
            raise DataChanged(f"dataset {self.path}: {exc}") from None

    def source(self, document: int) -> dict[str, Any] | None:
        """The raw record ``document`` was tokenized from (file, line, byte, id), or None."""
        return None if self.provenance is None else self.provenance.source(int(document))

    def read_document(self, document: int) -> np.ndarray:
        """A whole document's tokens (int64), e.g. for a blocklist's content hash."""
        return np.asarray(self.data.get(int(document)), dtype=np.int64)

    def read(self, spans: Sequence[Span]) -> np.ndarray:
        """The tokens of ``spans``, concatenated (int64)."""
        parts = [self.data.get(s.document, offset=s.offset, length=s.count) for s in spans]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)


class TrainIndex:
    """The run's train dataset: one GPTDataset, or a BlendedDataset over several."""

    def __init__(
        self,
        mids: list[MidIndex],
        blend: tuple[np.ndarray, np.ndarray] | None,
        description_hash: str,
        kind: str,
        blend_files: tuple[str, str] | None = None,
    ) -> None:
        self.mids, self.blend, self.hash, self.kind = mids, blend, description_hash, kind
        self.blend_files = blend_files  # (dataset_index, dataset_sample_index) .npy, for scans

    def __len__(self) -> int:
        return len(self.mids[0]) if self.blend is None else int(self.blend[0].shape[0])

    def prefetch(self, indices: np.ndarray) -> None:
        """Prefetch what resolving global samples ``indices`` reads (see MidIndex.prefetch)."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices) or indices.min() < 0 or indices.max() >= len(self):
            return  # route() refuses those with the reason
        if self.blend is not None:
            will_need(self.blend[0], indices)
            will_need(self.blend[1], indices)
        members, within = self.route(indices)
        for member, mid in enumerate(self.mids):
            mid.prefetch(within[members == member])

    def route(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(blend member, sample within it) of global sample indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise PositionError(
                f"global sample {int(indices.max())} is beyond the {len(self)} samples the caches "
                "cover; the run never reached it (or the batch settings passed are wrong)"
            )
        if self.blend is None:
            return np.zeros_like(indices), indices
        return (
            np.asarray(self.blend[0][indices], dtype=np.int64),
            np.asarray(self.blend[1][indices], dtype=np.int64),
        )

    def resolve(self, indices: Sequence[int], pad_id: int | None = None) -> list[Sample]:
        """Global sample indices -> samples with documents, spans and model-input tokens.

        ``pad_id``: the tokenizer's pad id as GPTDataset resolves it; its occurrences become 0
        in the model input, as ``GPTDataset.__getitem__`` does. None when no tokenizer is known.
        """
        self.prefetch(np.asarray(indices, dtype=np.int64))
        members, within = self.route(np.asarray(indices, dtype=np.int64))
        return [
            self.mids[member].sample(int(index), member, sample, pad_id)
            for index, member, sample in zip(indices, members.tolist(), within.tolist())
        ]
