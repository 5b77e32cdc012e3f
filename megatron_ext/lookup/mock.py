"""Mock samples (``--mock-data``; Bridge's recipes with no ``blend``): megatron-core's
``MockGPTDataset`` built again in process from the run's seed, sequence length and sample
count, so its tokens are what the run trained (the sample log's digests check it). A mock
sample has no document and no raw record."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from megatron_ext.lookup.config import build_datasets
from megatron_ext.lookup.data import Sample
from megatron_ext.lookup.errors import PositionError

MOCK_PATH = "mock"  # Sample.dataset_path of a mock sample


class MockIndex:
    """The run's mock train dataset, in the interface the forward lookup reads."""

    kind = "MockGPTDataset"
    mids: tuple[Any, ...] = ()

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.hash = dataset.unique_description_hash

    def __len__(self) -> int:
        return len(self.dataset)

    def describe(self) -> str:
        return (
            f"data: mock ({self.kind} {self.hash[:12]}, {len(self)} samples), built again by "
            "megatron-core from the run's seed and sequence length; no documents"
        )

    def resolve(self, indices: list[int], pad_id: int | None = None) -> list[Sample]:
        """Global sample indices -> mock samples with the tokens ``__getitem__`` gives."""
        out = []
        for index in indices:
            if not 0 <= index < len(self):
                raise PositionError(
                    f"global sample {index} is beyond the {len(self)} mock samples the run built"
                )
            tokens = np.asarray(self.dataset[index]["tokens"], dtype=np.int64)
            stream = int(self.dataset.shuffle_index[index])
            out.append(Sample(index, 0, MOCK_PATH, index, stream, (), tokens))
        return out


def open_mock_index(args: Any, target_samples: int, add_extra_token: bool) -> MockIndex:
    """The train split of the run's ``MockGPTDataset`` (``target_samples`` samples), built by
    megatron-core with the run's tokenizer, writing no cache."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    args = copy.copy(args)
    args.data_path = args.train_data_path = args.valid_data_path = args.test_data_path = None
    args.data_cache_path = None
    sizes: list[int | None] = [target_samples, None, None]
    train = build_datasets(args, MockGPTDataset, sizes, add_extra_token, train_only=True)[0]
    return MockIndex(train)
