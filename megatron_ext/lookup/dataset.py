"""One GPTDataset, opened: a sample of it -> its documents, token spans and tokens.

The dataset level of a batch walk (the blend level above it is
:class:`megatron_ext.lookup.indices.TrainIndex`, which also opens and checks this dataset's
files; the documents and tokens below it are the ``.bin``/``.idx`` pair,
:class:`megatron_ext.lookup.formats.IndexedData`). A dataset sample goes through
``shuffle_index`` to a stream sample, whose two ``sample_index`` rows name positions in
``document_index``, hence documents and offsets, exactly as ``GPTDataset.__getitem__`` does.

Each answered sample is checked here because after a re-preprocessing the caches still "work"
and silently point at other documents: the stream arithmetic of ``sample_index`` over a window
that covers every document the sample touches must agree with the document lengths in today's
``.idx`` (a reordered or edited corpus moves document boundaries), and every document id must
lie in the split's range.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_ext.common.records.provenance import Provenance, ProvenanceError, open_sidecar
from megatron_ext.lookup.errors import DataChanged, PositionError
from megatron_ext.lookup.formats import IndexedData, will_need

# Samples walked on each side of an answered sample to pin its documents' boundaries.
WINDOW_LIMIT = 1 << 16


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


@dataclass(eq=False)
class MidIndex:
    """One GPTDataset's caches and its IndexedDataset (the .bin/.idx on disk), opened and
    checked by :func:`megatron_ext.lookup.indices.open_train_index`."""

    hash: str  # md5 of its description: the name of its cache files
    path: str  # the prefix as training recorded it
    prefix: str  # where it is read today (through --data-root)
    files: dict[str, str]  # the three cache files, for scans
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    data: IndexedData
    begin: int  # the train split: sequences [begin, end) of the .idx
    end: int
    seq_length: int
    extra: int  # 1 with add_extra_token_to_sequence (the label token read past a sample)
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = self.data.sequence_lengths

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

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
            return open_sidecar(self.prefix, checked=True)  # check_pair ran at opening
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
