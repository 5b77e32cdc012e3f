"""The lookup's ``.idx``/``.bin`` reader reads what megatron-core reads; data flags Megatron
rejects are refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_ext.lookup import data as formats
from megatron_ext.lookup.errors import ConfigError, DataChanged

# The compatibility tier runs this module on every supported megatron-core (tests/compat).
pytestmark = pytest.mark.compat


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_indexed_data_reads_what_megatron_reads(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(3)
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for _ in range(3):
        for _ in range(int(rng.integers(1, 4))):
            document = rng.integers(0, 200, int(rng.integers(1, 50)))
            builder.add_document(document, [len(document)])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours, theirs = formats.IndexedData(prefix), IndexedDataset(prefix, mmap=True)
    assert ours.dtype == np.dtype(theirs.index.dtype)
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        assert np.array_equal(getattr(ours, name), getattr(theirs.index, name)), name
    for sequence in range(len(theirs)):
        length = int(theirs.sequence_lengths[sequence])
        assert np.array_equal(ours.get(sequence), theirs.get(sequence))
        offset = length // 2
        tail = length - offset
        assert np.array_equal(ours.get(sequence, offset, tail), theirs.get(sequence, offset, tail))
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(ValueError, match="bad header"):
        formats.IndexedData(str(tmp_path / "bad"))


@pytest.mark.parametrize(
    "flags",
    [
        {"data_path": []},
        {"data_path": ["a", "b", "0.5", "c"]},
        {"data_path": ["x"], "data_args_path": "y"},
    ],
)
def test_data_flags_megatron_rejects_are_refused(flags: dict[str, object]) -> None:
    names = ("data_path", "data_args_path", "train_data_path", "valid_data_path", "test_data_path")
    args = argparse.Namespace(**dict.fromkeys((*names, "per_split_data_args_path")), **{})
    for name, value in flags.items():
        setattr(args, name, value)
    with pytest.raises(ConfigError, match="Megatron rejects"):
        formats.blend_and_blend_per_split(args)


def test_a_split_megatron_rejects_is_refused() -> None:
    assert formats.split_matrix("98,2,0")[0] == (0, 0.98)
    with pytest.raises(ConfigError, match="--split"):
        formats.split_matrix("1,2,3,4")


def test_a_damaged_cache_array_is_refused_by_both_readers(tmp_path: Path) -> None:
    """Megatron's index caches: mapped (answers) and read in chunks (inverse scans) alike."""
    good = tmp_path / "good.npy"
    np.save(good, np.arange(12, dtype=np.int64).reshape(6, 2))
    assert np.array_equal(formats.map_array(str(good)), np.load(good))
    chunks = [chunk for _, chunk in formats.array_chunks(str(good), 4)]
    assert np.array_equal(np.concatenate(chunks), np.load(good))
    truncated, objects, fortran = (tmp_path / f"{n}.npy" for n in ("cut", "obj", "f"))
    truncated.write_bytes(good.read_bytes()[:-8])
    np.save(objects, np.array([1, "a"], dtype=object))
    np.save(fortran, np.asfortranarray(np.arange(12).reshape(3, 4)))
    damaged = {
        truncated: "mmap length is greater than file size",
        objects: "Python objects in dtype",
        fortran: "is not a C-order numeric .npy array",
    }
    for path, why in damaged.items():
        for read in (formats.map_array, lambda p: next(formats.array_chunks(p, 4))):
            with pytest.raises(DataChanged, match=why):
                read(str(path))
