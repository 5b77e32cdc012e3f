"""The data check's start-up hook on real Megatron datasets, in process: a ``.bin``/``.idx``
pair written by megatron-core's own IndexedDatasetBuilder passes; a split with too few tokens
for one sample, a missing ``.idx`` and a missing per-split prefix are refused with the reason."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

from megatron_ext.common.features import FeatureError
from megatron_ext.data.adapter import DataCheckFeature

SEQ = 32
DOCUMENTS = 20
TOKENS_PER_DOCUMENT = 50  # 1000 tokens: a 1% split holds 10, less than one sample (33)


def _dataset(prefix: Path) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for document in range(DOCUMENTS):
        builder.add_item(torch.arange(TOKENS_PER_DOCUMENT, dtype=torch.int32) + document)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _args(**values: object) -> object:
    return SimpleNamespace(
        **{
            "mock_data": False,
            "data_path": None,
            "train_data_path": None,
            "valid_data_path": None,
            "test_data_path": None,
            "data_args_path": None,
            "per_split_data_args_path": None,
            "split": "90,10,0",
            "seq_length": SEQ,
            "rank": 0,
            **values,
        }
    )


def test_a_complete_pair_with_samples_in_every_split_passes(tmp_path: Path) -> None:
    args = _args(data_path=[_dataset(tmp_path / "corpus")])
    feature = DataCheckFeature()
    assert feature.enabled(args)
    feature.validate(args)
    assert not DataCheckFeature().enabled(_args(data_path=args.data_path, mock_data=True))


def test_a_split_too_small_for_one_sample_is_refused(tmp_path: Path) -> None:
    prefix = _dataset(tmp_path / "corpus")
    with pytest.raises(FeatureError, match=r"--split 99,1,0") as refused:
        DataCheckFeature().validate(_args(data_path=[prefix], split="99,1,0"))
    assert prefix in str(refused.value)
    with pytest.raises(FeatureError, match="rank 0 printed why"):  # the other ranks say where
        DataCheckFeature().validate(_args(data_path=[prefix], split="99,1,0", rank=1))


def test_a_missing_idx_and_per_split_prefix_are_refused(tmp_path: Path) -> None:
    prefix = _dataset(tmp_path / "corpus")
    Path(f"{prefix}.idx").unlink()
    with pytest.raises(FeatureError, match=r"corpus\.idx"):
        DataCheckFeature().validate(_args(data_path=[prefix]))
    good = _dataset(tmp_path / "good")
    with pytest.raises(FeatureError, match="missing"):
        DataCheckFeature().validate(
            _args(train_data_path=[good], valid_data_path=[str(tmp_path / "missing")])
        )
