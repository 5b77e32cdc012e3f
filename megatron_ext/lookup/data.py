"""The run's train index: caches found by their ``description.txt`` md5 (never built), memory-
mapped with ``MADV_RANDOM``, checked against today's ``.bin``/``.idx``; a sample resolved to
documents and tokens as ``BlendedDataset``/``GPTDataset`` do, or a document to samples in
chunked passes. docs/megatron-facts.md, "Data".
"""

from __future__ import annotations

import argparse
import bisect
import functools
import hashlib
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megatron_ext.common.records.pair import (
    DTYPES,
    HEADER,
    INDEX_MAGIC,
    INDEX_VERSION,
    PairError,
    check_pair,
)
from megatron_ext.common.records.provenance import Provenance, ProvenanceError, open_sidecar
from megatron_ext.lookup.errors import CacheMissing, ConfigError, DataChanged, PositionError

Blend = tuple[list[str], list[float] | None]

# Identifiers 0.18+ add, with the value that names the same tokenizer as their absence in 0.17.
ADDED_DEFAULTS = {"chat_template": "None", "ignore_extra_whitespaces": "True", "pad_id": "-1"}


def comparable(identifiers: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tokenizer's ``unique_identifiers`` as every verified megatron-core would write them
    (version-added identifiers at their default dropped), for matching a run's caches."""
    if identifiers is None:
        return None
    return {k: v for k, v in identifiers.items() if ADDED_DEFAULTS.get(k, object()) != v}


def remap(path: str, data_root: Sequence[tuple[str, str]]) -> str:
    """Where a path the run recorded is now: under NEW for the first ``--data-root OLD=NEW``
    whose OLD holds it. Data, caches and tokenizer files move together between clusters while
    the checkpoint's args keep the old paths."""
    for old, new in data_root:
        if path == old or path.startswith(old.rstrip("/") + "/"):
            return new.rstrip("/") + path[len(old.rstrip("/")) :]
    return path


def map_random(path: str | os.PathLike[str]) -> mmap.mmap | bytes:
    """The whole file mapped read-only, advised for random access (``MADV_RANDOM``)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; an empty array views nothing
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
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


def _open_npy(path: str) -> np.memmap:
    """A C-order numeric .npy cache array, memory-mapped read-only (nothing read yet)."""
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as exc:  # not an .npy, truncated, or Python objects
        raise DataChanged(f"{path} is not a readable .npy array: {exc}") from exc
    if not array.flags.c_contiguous:
        raise DataChanged(f"{path} is not a C-order numeric .npy array (not a Megatron cache)")
    return array


def map_array(path: str) -> np.ndarray:
    """A cache array, memory-mapped read-only and advised for random access."""
    array = _open_npy(path)
    array.base.madvise(mmap.MADV_RANDOM)
    return array.view(np.ndarray)  # np.memmap's Python-level indexing would slow bisection


def array_chunks(path: str, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) of a cache array, ``rows`` at a time, read from the file (a scan
    through the mapping would keep every page it touched resident)."""
    layout = _open_npy(path)
    shape, per_row = layout.shape, int(np.prod(layout.shape[1:], dtype=np.int64))
    with open(path, "rb") as handle:
        handle.seek(layout.offset)
        for start in range(0, shape[0], rows):
            count = min(rows, shape[0] - start)
            chunk = np.fromfile(handle, layout.dtype, count * per_row)
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
    """Have the kernel read the pages holding ``rows`` of a mapped array, all at once."""
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
        self.bin = map_random(prefix + ".bin")

    def get(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of one sequence, as ``IndexedDataset.get``."""
        if length is None:
            length = int(self.sequence_lengths[sequence]) - offset
        start = int(self.sequence_pointers[sequence]) + offset * self.dtype.itemsize
        return np.frombuffer(self.bin, self.dtype, length, start)


def blend_and_blend_per_split(
    args: argparse.Namespace,
) -> tuple[Blend | None, list[Blend | None] | None]:
    """The (blend, blend_per_split) Megatron derives from the data flags of ``args``."""
    from megatron.training.utils import get_blend_and_blend_per_split

    try:
        return get_blend_and_blend_per_split(args)
    except (AssertionError, ValueError) as exc:
        raise ConfigError(
            "the run's data flags are ones Megatron rejects (--data-path with --data-args-path, "
            f"an empty list, or weights mixed with prefixes): {type(exc).__name__} {exc}"
        ) from None


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's ``datasets.utils.normalize`` (float64 division)."""
    from megatron.core.datasets.utils import normalize as megatron_normalize

    return megatron_normalize(list(weights))


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """``--split "98,2,0"`` -> per split (train, valid, test) its [begin, end) fraction."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"--split {split!r} is not three non-negative numbers: {exc}") from None


GPT, BLENDED = "GPTDataset", "BlendedDataset"
GPT_FILES = ("document_index", "sample_index", "shuffle_index")
BLENDED_FILES = ("dataset_index", "dataset_sample_index")


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
class FoundDataset:
    """One GPTDataset's caches: its description (md5 checked) and the files named after it."""

    description: Description
    files: dict[str, str]  # each of GPT_FILES -> its .npy path


def _differences(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [
        f"{k}={found.get(k)!r} (expected {v!r})"
        for k, v in expected.items()
        if k != "datasets" and found.get(k) != v
    ]


def _expected_gpt(spec: DataSpec, prefix: str, num_samples: int | None) -> dict[str, Any]:
    """A GPTDataset's description, as the run's builder wrote it (tuples as JSON lists)."""
    matrix = None if spec.per_split else json.loads(json.dumps(split_matrix(spec.split)))
    return {
        "class": GPT,
        "dataset_path": prefix,
        "num_samples": num_samples,
        "index_split": "train",
        "random_seed": spec.seed,
        "sequence_length": spec.sequence_length,
        "split": None if spec.per_split else spec.split,
        "split_matrix": matrix,
    }


def _member_sizes(spec: DataSpec) -> tuple[list[int | None], list[float] | None, int | None]:
    """Per-member num_samples, blend weights and blend size, as BlendedMegatronDatasetBuilder."""
    if spec.weights is None:
        return [None] * len(spec.prefixes), None, None
    weights = normalize(spec.weights)
    target = [math.ceil(spec.target_samples * w) for w in weights]
    buffered = [math.ceil(t * (1 + spec.surplus)) for t in target]
    return list(buffered), normalize(weights), sum(target)


def _choose(found: list[Description], tokenizer: dict[str, Any] | None, what: str) -> Description:
    """One cache among those matching on every field; the tokenizer decides between them."""

    def tok(description: Description) -> Any:
        # As every verified megatron-core names it (0.18 added identifiers: .tokenizer).
        return comparable(
            description.content.get("datasets", [description.content])[0].get("tokenizer")
        )

    if tokenizer is not None:
        same = [f for f in found if tok(f) == comparable(tokenizer)]
        if not same:
            raise ConfigError(
                f"the {what} caches that match this run ({', '.join(f.path.name for f in found)})"
                f" were built with another tokenizer ({tok(found[0])}) than the one given"
            )
        found = same
    if len({json.dumps(tok(f), sort_keys=True) for f in found}) > 1:
        raise ConfigError(
            f"several {what} caches match this run and differ only in the tokenizer "
            f"({', '.join(f.path.name for f in found)}); pass the run's tokenizer flags (or "
            "--from-checkpoint) so the right one is chosen"
        )
    return found[0].trusted()


def _same(found: dict[str, Any], expected: dict[str, Any]) -> bool:
    """A GPTDataset description equals the expected one, the tokenizer aside (:func:`_choose`)."""
    return {k: v for k, v in found.items() if k != "tokenizer"} == expected


def _find(
    directory: Path,
    kind: str,
    matches: Callable[[dict[str, Any]], bool],
    expected: dict[str, Any],
    tokenizer: dict[str, Any] | None,
) -> Description:
    """The one ``kind`` train cache in ``directory`` whose description ``matches`` the run."""
    names = sorted(directory.glob(f"*-{kind}-train-description.txt")) if directory.is_dir() else []
    candidates = [read_description(path) for path in names]
    found = [c for c in candidates if matches(c.content)]
    if not found:
        raise _not_found(kind, directory, candidates, expected)
    return _choose(found, tokenizer, kind)


def _not_found(
    kind: str, directory: Path, candidates: list[Description], expected: dict[str, Any]
) -> CacheMissing:
    near = [
        f"  {d.path.name}: "
        + (", ".join(_differences(d.content, expected)) or "differs in a member dataset")
        for d in candidates[:5]
    ]
    broken = [d.path.name for d in candidates if not d.intact]
    return CacheMissing(
        f"no {kind} train cache in {directory} matches this run "
        f"({len(candidates)} other {kind} train caches there)"
        + ("; nearest:\n" + "\n".join(near) if near else "")
        + (
            f"\n{len(broken)} description(s) there do not hash to their names (edited?): "
            f"{', '.join(broken[:5])}"
            if broken
            else ""
        )
        + "\nIf the caches were deleted, rebuild them with --rebuild-caches (megatron-core's "
        "BlendedMegatronDatasetBuilder, same config); if they live elsewhere, pass --cache-dir."
    )


def _files(base: str, kind: str, names: tuple[str, ...]) -> dict[str, str]:
    """The ``.npy`` files of one cache (``base`` is their common name); refuses missing ones."""
    files = {name: f"{base}{name}.npy" for name in names}
    missing = [path for path in files.values() if not os.path.isfile(path)]
    if missing:
        raise CacheMissing(f"{kind} cache files missing: {', '.join(missing)}")
    return files


def _dataset(directory: Path, trusted: Description) -> FoundDataset:
    """A GPTDataset's caches in ``directory``, named after its trusted description's md5."""
    base = str(directory / f"{trusted.digest}-{GPT}-train-")
    return FoundDataset(trusted, _files(base, GPT, GPT_FILES))


def _member(blend: Description, member: dict[str, Any], directory: Path) -> FoundDataset:
    """A blend member's caches: the description embedded in the blend's must be on disk, under
    its md5, word for word (else the member caches are not the ones the blend was built on)."""
    member_text = json.dumps(member, indent=4)
    digest = hashlib.md5(member_text.encode("utf-8"), usedforsecurity=False).hexdigest()
    member_path = directory / f"{digest}-{GPT}-train-description.txt"
    if not member_path.is_file():
        raise CacheMissing(
            f"the blend cache {blend.path.name} names the GPTDataset cache {member_path}, which "
            "is missing; rebuild with --rebuild-caches"
        )
    member_description = read_description(member_path).trusted()
    if member_description.text != member_text:
        raise DataChanged(f"{member_path} differs from the blend description {blend.path.name}")
    return _dataset(directory, member_description)


def open_train_index(
    spec: DataSpec,
    *,
    cache_dir: str | None = None,
    data_root: Sequence[tuple[str, str]] = (),
    tokenizer: dict[str, Any] | None = None,
) -> TrainIndex:
    """Find the run's train caches (never building any), check that they belong together,
    and memory-map them with the ``.bin``/``.idx`` pairs they index, checked against them."""
    # --data-cache-path moves with the data (--data-root); an explicit --cache-dir is as given.
    chosen = cache_dir or (remap(spec.cache_dir, data_root) if spec.cache_dir else None)
    if len(spec.prefixes) == 1 and (spec.weights is None or spec.per_split):
        default = Path(remap(spec.prefixes[0], data_root), "cache", f"{GPT}_indices")  # Megatron's
        directory = Path(chosen) if chosen else default
        expected = _expected_gpt(spec, spec.prefixes[0], spec.target_samples)
        trusted = _find(directory, GPT, lambda c: _same(c, expected), expected, tokenizer)
        mid = _open_dataset(_dataset(directory, trusted), spec, data_root)
        return TrainIndex([mid], None, trusted.digest, GPT)

    if not chosen:
        raise CacheMissing(
            "this run blends several datasets without --data-cache-path, so Megatron computed "
            "the blend indices in memory and never stored them; pass --rebuild-caches "
            "--cache-dir DIR to build them with megatron-core's builder (they are deterministic)"
        )
    directory = Path(chosen)
    sizes, weights, size = _member_sizes(spec)
    members = [_expected_gpt(spec, p, n) for p, n in zip(spec.prefixes, sizes)]
    expected_top = {"class": BLENDED, "split": "train"}
    if weights is not None:
        expected_top |= {"weights": weights, "size": size}

    def matches(description: dict[str, Any]) -> bool:
        inner = description.get("datasets", [])
        return (
            all(description.get(k) == v for k, v in expected_top.items())
            and len(inner) == len(members)
            and all(_same(d, m) for d, m in zip(inner, members))
        )

    blend = _find(directory, BLENDED, matches, expected_top, tokenizer)
    datasets = [_member(blend, member, directory) for member in blend.content["datasets"]]
    files = _files(str(blend.path)[: -len("description.txt")], BLENDED, BLENDED_FILES)
    return _open_blend(blend, [_open_dataset(d, spec, data_root) for d in datasets], spec, files)


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
    checked by :func:`open_train_index`."""

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
        """Sample-index rows [a, b] whose arithmetic pins every document ``stream_sample`` reads."""
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
        (p0, o0), (p1, o1) = self.sample_index[j : j + 2].tolist()
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
        will_need(self.document_index, begin[:, 0])
        will_need(self.document_index, end[:, 0])
        first = np.asarray(self.document_index[begin[:, 0]], dtype=np.int64)
        will_need(self.lengths, first)
        will_need(self.data.sequence_pointers, first)
        # The first document's tokens from the sample's offset (most samples read one or two
        # documents; the rest fault in as they are read).
        size = np.minimum(
            self.lengths[first].astype(np.int64) - begin[:, 1], self.seq_length + self.extra
        )
        itemsize = self.data.dtype.itemsize
        starts = self.data.sequence_pointers[first] + begin[:, 1].astype(np.int64) * itemsize
        will_need(np.frombuffer(self.data.bin, np.uint8), starts, np.maximum(size, 1) * itemsize)

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

    def read(self, spans: Sequence[Span]) -> np.ndarray:
        """The tokens of ``spans``, concatenated (int64)."""
        parts = [self.data.get(s.document, offset=s.offset, length=s.count) for s in spans]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)


def _open_dataset(
    found: FoundDataset, spec: DataSpec, data_root: Sequence[tuple[str, str]]
) -> MidIndex:
    """One GPTDataset's caches and its .bin/.idx pair, mapped and checked against each other."""
    description = found.description.content
    path: str = description["dataset_path"]
    prefix = remap(path, data_root)
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            moved = "; if the data moved, map the old location with --data-root OLD=NEW"
            moved = "" if prefix != path else moved
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
    matrix = description["split_matrix"]  # the train split's [begin, end) fractions
    begin, end = (0, count) if matrix is None else (round(f * float(count)) for f in matrix[0])
    mid = MidIndex(
        hash=found.description.digest,
        path=path,
        prefix=prefix,
        files=found.files,
        **arrays,  # document_index, sample_index, shuffle_index
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


def _open_blend(
    blend: Description, mids: list[MidIndex], spec: DataSpec, blend_files: dict[str, str]
) -> TrainIndex:
    """The BlendedDataset's two arrays over its opened members, checked against both."""
    files = (blend_files["dataset_index"], blend_files["dataset_sample_index"])
    dataset_index, dataset_sample_index = map_array(files[0]), map_array(files[1])
    description, name = blend.content, blend.path.name
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
    return TrainIndex(mids, (dataset_index, dataset_sample_index), blend.digest, BLENDED, files)


@dataclass(eq=False)
class TrainIndex:
    """The run's train dataset: one GPTDataset, or a BlendedDataset over several."""

    mids: list[MidIndex]
    blend: tuple[np.ndarray, np.ndarray] | None  # (dataset_index, dataset_sample_index)
    hash: str  # md5 of the top description
    kind: str
    blend_files: tuple[str, str] | None = None  # the blend's two .npy files, for scans

    def __len__(self) -> int:
        return len(self.mids[0]) if self.blend is None else int(self.blend[0].shape[0])

    def resolve(self, indices: Sequence[int], pad_id: int | None = None) -> list[Sample]:
        """Global sample indices -> samples with documents, spans and model-input tokens; the
        pages each stage reads are prefetched first (here the blend's, then MidIndex.prefetch)."""
        wanted = np.asarray(indices, dtype=np.int64)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= len(self)):
            raise PositionError(
                f"global sample {int(wanted.max())} is beyond the {len(self)} samples the caches "
                "cover; the run never reached it (or the batch settings passed are wrong)"
            )
        if self.blend is None:
            members, within = np.zeros_like(wanted), wanted
        else:
            will_need(self.blend[0], wanted)
            will_need(self.blend[1], wanted)
            members, within = (np.asarray(a[wanted], dtype=np.int64) for a in self.blend)
        for member, mid in enumerate(self.mids):
            mid.prefetch(within[members == member])
        return [
            self.mids[member].sample(int(index), member, sample, pad_id)
            for index, member, sample in zip(indices, members.tolist(), within.tolist())
        ]


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
        # (bisect on the memory-mapped column reads log n rows; np.searchsorted copies it)
        first = max(0, bisect.bisect_left(column, position) - 1)
        last = bisect.bisect_left(column, position + 1) - 1
        for j in range(first, min(last, rows.shape[0] - 2) + 1):
            (p0, o0), (p1, o1) = map(int, rows[j]), map(int, rows[j + 1])
            begin = o0 if p0 == position else 0
            stop = o1 + mid.extra if p1 == position else length
            if p0 <= position <= p1 and stop > begin:
                streams.append(j)
                offsets.append(begin)
                counts.append(stop - begin)
    return (*(np.asarray(v, dtype=np.int64) for v in (streams, offsets, counts)), entries)


def _progress(path: str, entries: int, what: str) -> Iterator[tuple[int, np.ndarray]]:
    """Chunks of a cache file, with a progress bar on stderr after the first two seconds."""
    with tqdm(
        total=entries, desc=f"scanning {what}", unit="entry", unit_scale=True, delay=2
    ) as bar:
        for start, chunk in array_chunks(path, CHUNK):
            yield start, chunk
            bar.update(len(chunk))


def _scan_rows(
    paths: tuple[str, ...], entries: int, targets: np.ndarray, keep: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One chunked pass: rows whose last file's value is in ``targets`` (and whose first
    file's value equals ``keep`` when given). Returns (row numbers, matched values)."""
    rows, values = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
    if not len(targets):
        return rows[0], values[0]
    wanted, low, table = _matcher(targets)
    first = array_chunks(paths[0], CHUNK) if keep is not None else None
    for start, chunk in _progress(paths[-1], entries, paths[-1].rsplit("-", 1)[-1]):
        mask = _members(chunk, wanted, low, table)
        if first is not None:
            mask &= next(first)[1] == keep
        hits = np.flatnonzero(mask)
        rows.append(hits + start)
        values.append(chunk[hits].astype(np.int64))
    return np.concatenate(rows), np.concatenate(values)


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
    samples, sample_streams = _scan_rows((mid.files["shuffle_index"],), len(mid), streams)
    scanned += len(mid.shuffle_index)
    via: dict[int, int] = dict(zip(samples.tolist(), sample_streams.tolist()))
    if index.blend is None:
        owners, owned = samples, samples
    else:
        # dataset_index[g] == member and dataset_sample_index[g] is such a sample -> global g.
        assert index.blend_files is not None
        owners, owned = _scan_rows(index.blend_files, len(index), samples, keep=member)
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
