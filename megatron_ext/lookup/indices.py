"""The run's train index: the caches :mod:`megatron_ext.lookup.caches` found, opened and
checked, and a global sample routed through the blend to its GPTDataset.

Opening maps every cache ``.npy`` and every ``.bin``/``.idx`` pair read-only (never building
anything), and checks that the data on disk is the data the caches were built from, because
after a re-preprocessing the caches still "work" and silently point at other documents:

- per dataset, :func:`~megatron_ext.common.records.pair.check_pair`, as training start-up runs it:
  the ``.idx`` is a consistent index of its ``.bin`` (one chunked pass: a flipped pointer reads
  other tokens while every count below still agrees) and the pair is the one its fingerprint
  records;
- O(1) per dataset: the ``.bin`` size matches the ``.idx``; the train split's document count and
  token count (from the ``.idx`` pointers) give exactly the cached number of epochs,
  document-index entries and samples;
- per blend: its two arrays hold as many entries as its description says, and a blend by
  dataset size was built from today's member sizes.

:class:`TrainIndex` is then the blend level of a batch walk (``BlendedDataset.__getitem__``):
global sample -> (member, sample within it), handed down to that member's
:class:`~megatron_ext.lookup.dataset.MidIndex`, which checks each answered sample against
today's ``.idx`` as it resolves it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_ext.common.records.pair import PairError, check_pair
from megatron_ext.lookup.caches import DataSpec, FoundCaches, FoundDataset, find_train_caches
from megatron_ext.lookup.dataset import MidIndex, Sample
from megatron_ext.lookup.errors import DataChanged, PositionError
from megatron_ext.lookup.formats import IndexedData, map_array, normalize, remap, will_need


def open_train_index(
    spec: DataSpec,
    *,
    cache_dir: str | None = None,
    data_root: Sequence[tuple[str, str]] = (),
    tokenizer: dict[str, Any] | None = None,
) -> TrainIndex:
    """Find (:func:`~megatron_ext.lookup.caches.find_train_caches`), verify and memory-map the
    caches of the run's train dataset, with the ``.bin``/``.idx`` pairs they index."""
    found = find_train_caches(spec, cache_dir=cache_dir, data_root=data_root, tokenizer=tokenizer)
    mids = [_open_dataset(dataset, spec, data_root) for dataset in found.datasets]
    if found.blend_files is None:
        return TrainIndex(mids, None, found.description.digest, found.kind)
    return _open_blend(found, mids, spec)


def _open_dataset(
    found: FoundDataset, spec: DataSpec, data_root: Sequence[tuple[str, str]]
) -> MidIndex:
    """One GPTDataset's caches and its .bin/.idx pair, mapped and checked against each other."""
    description = found.description.content
    path: str = description["dataset_path"]
    prefix = remap(path, data_root)
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            moved = (
                ""
                if prefix != path
                else ("; if the data moved, map the old location with --data-root OLD=NEW")
            )
            raise DataChanged(f"dataset {path}: {prefix}{suffix} not found{moved}")
    try:
        check_pair(prefix)
    except PairError as exc:
        raise DataChanged(str(exc)) from None
    arrays = {name: map_array(file) for name, file in found.files.items()}
    try:
        data = IndexedData(prefix)
    except (OSError, ValueError) as exc:
        raise DataChanged(f"dataset {path}: {prefix}.idx is unreadable: {exc}") from exc
    count = len(data.sequence_lengths)
    matrix = description["split_matrix"]
    if matrix is None:
        begin, end = 0, count
    else:
        begin = round(matrix[0][0] * float(count))
        end = round(matrix[0][1] * float(count))
    mid = MidIndex(
        hash=found.description.digest,
        path=path,
        prefix=prefix,
        files=found.files,
        document_index=arrays["document_index"],
        sample_index=arrays["sample_index"],
        shuffle_index=arrays["shuffle_index"],
        data=data,
        begin=begin,
        end=end,
        seq_length=spec.sequence_length,
        extra=int(spec.add_extra_token),
    )
    _check_shapes(mid, description["num_samples"])
    return mid


def _check_shapes(mid: MidIndex, num_samples: int | None) -> None:
    """O(1): the .idx today must give the epochs, entries and samples the caches hold."""
    itemsize = mid.data.dtype.itemsize
    pointers = mid.data.sequence_pointers
    count = len(mid.lengths)
    bin_bytes = int(pointers[-1]) + int(mid.lengths[-1]) * itemsize if count else 0
    on_disk = os.path.getsize(mid.prefix + ".bin")
    if on_disk != bin_bytes:
        raise DataChanged(
            f"dataset {mid.path}: {mid.prefix}.bin has {on_disk} bytes but its .idx "
            f"describes {bin_bytes}; the .bin and .idx are not from the same preprocessing"
        )
    if mid.end <= mid.begin:
        raise DataChanged(f"dataset {mid.path}: the train split of {count} sequences is empty")
    end_byte = int(pointers[mid.end]) if mid.end < count else bin_bytes
    tokens = (end_byte - int(pointers[mid.begin])) // itemsize
    epochs = 1
    if num_samples is not None:
        wanted = num_samples * mid.seq_length + mid.extra
        epochs = max(1, -(-wanted // tokens))
    documents = mid.end - mid.begin
    samples = (epochs * tokens - mid.extra) // mid.seq_length
    held = (len(mid.document_index), mid.sample_index.shape[0] - 1, len(mid.shuffle_index))
    if held != (epochs * documents, samples, samples):
        raise DataChanged(
            f"dataset {mid.path}: {mid.prefix}.idx now has {count} sequences; its train "
            f"split [{mid.begin}, {mid.end}) holds {tokens} tokens, which gives {epochs} "
            f"epoch(s), {epochs * documents} document-index entries and {samples} samples, "
            f"but the caches ({mid.hash}) hold {held[0]} entries and {held[1]} samples. The "
            "data was re-preprocessed, extended or replaced after the caches were built."
        )


def _open_blend(found: FoundCaches, mids: list[MidIndex], spec: DataSpec) -> TrainIndex:
    """The BlendedDataset's two arrays over its opened members, checked against both."""
    assert found.blend_files is not None
    files = (found.blend_files["dataset_index"], found.blend_files["dataset_sample_index"])
    dataset_index, dataset_sample_index = map_array(files[0]), map_array(files[1])
    description, name = found.description.content, found.description.path.name
    blend_size = description["size"]
    if blend_size is None:
        blend_size = int(sum(description["weights"]))
    if spec.weights is None:  # blended by member size: weights are the member lengths
        sizes_now = [len(m) for m in mids]
        size_now = min(spec.target_samples, sum(sizes_now))
        if (description["size"], description["weights"]) != (size_now, normalize(sizes_now)):
            raise DataChanged(
                f"blend cache {name} was built from member sizes {description['weights']} "
                f"(size {description['size']}); today's member caches give {sizes_now}"
            )
    if dataset_index.shape[0] != blend_size or dataset_sample_index.shape[0] != blend_size:
        raise DataChanged(
            f"blend cache {name} holds {dataset_index.shape[0]} entries, "
            f"its description says {blend_size}"
        )
    return TrainIndex(
        mids, (dataset_index, dataset_sample_index), found.description.digest, found.kind, files
    )


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

    def sample(self, index: int, member: int, dataset_sample: int, pad_id: int | None) -> Sample:
        """Global sample ``index``, routed to ``dataset_sample`` of blend ``member``, resolved
        by that member (see MidIndex.sample)."""
        return self.mids[member].sample(index, member, dataset_sample, pad_id)

    def sources(self, sample: Sample) -> list[dict[str, Any] | None]:
        """The raw record of each document ``sample`` reads (None without provenance)."""
        mid = self.mids[sample.dataset]
        return [mid.source(span.document) for span in sample.spans]

    def resolve(self, indices: Sequence[int], pad_id: int | None = None) -> list[Sample]:
        """Global sample indices -> samples with documents, spans and model-input tokens.

        ``pad_id``: the tokenizer's pad id as GPTDataset resolves it; its occurrences become 0
        in the model input, as ``GPTDataset.__getitem__`` does. None when no tokenizer is known.
        """
        self.prefetch(np.asarray(indices, dtype=np.int64))
        members, within = self.route(np.asarray(indices, dtype=np.int64))
        return [
            self.sample(int(index), member, sample, pad_id)
            for index, member, sample in zip(indices, members.tolist(), within.tolist())
        ]
