"""``lookup`` of a ``--mock-data`` run: it answers what a mock sample is (its index and the
tokens megatron-core's MockGPTDataset generates, no document) instead of refusing. The answer
is checked against the train dataset the training entry point's own provider builds
(all three splits, the run's sizes); tests/bridge/test_bridge_recipes.py checks it against
a trained run's sample log."""

from __future__ import annotations

import itertools
import json

from megatron_ext.lookup import cli
from megatron_ext.lookup.config import megatron_namespace, process_group

ITERS, GBS, MBS, DP = 4, 8, 2, 2
FLAGS = ["--mock-data", "--seq-length", "64", "--micro-batch-size", str(MBS)]
FLAGS += ["--global-batch-size", str(GBS), "--train-iters", str(ITERS)]
FLAGS += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _trained_tokens(indices: list[int]) -> list[list[int]]:
    """The tokens of those train samples in the datasets the entry point builds (its config,
    megatron-core's builder, all three splits)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    from megatron_ext.loop.gpt_step import gpt_dataset_config_from_args

    args = megatron_namespace(FLAGS, None)
    args.data_parallel_size, args.rank = DP, 0
    sizes = [ITERS * GBS, 40, 40]
    config = gpt_dataset_config_from_args(args)
    with process_group():
        train = BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, config).build()[
            0
        ]
    return [train[i]["tokens"].tolist() for i in indices]


def test_a_mock_sample_is_answered_with_megatrons_tokens(capsys) -> None:
    argv = [*FLAGS, "--data-parallel-size", str(DP), "--iteration", "3", "--json"]
    assert cli.main(argv) == 0
    answer = json.loads(capsys.readouterr().out)
    samples = answer["samples"]
    assert [s["sample_index"] for s in samples] == list(range(2 * GBS, 3 * GBS))
    assert answer["data"]["kind"] == "MockGPTDataset"
    assert any(line.startswith("data: mock (MockGPTDataset") for line in answer["lines"])
    for sample in samples:
        assert sample["documents"] == [] and sample["dataset_path"] == "mock"
        assert sample["mock"].startswith(f"mock sample {sample['sample_index']}, no document")
    expected = _trained_tokens([s["sample_index"] for s in samples])
    assert [s["tokens"] for s in samples] == expected
    # MockGPTLowLevelDataset's documents: 1, 2, ... (mod the vocabulary), then the EOD token.
    eod = max(max(tokens) for tokens in expected)
    for tokens in expected:
        for a, b in itertools.pairwise(tokens):
            assert b in (a + 1, eod, 0) or a == eod, tokens


def test_a_document_of_mock_data_is_refused(capsys) -> None:
    argv = [*FLAGS, "--data-parallel-size", str(DP), "--document", "3", "--dataset", "mock"]
    assert cli.main(argv) == 1
    assert "mock data: a mock sample reads no document" in capsys.readouterr().err
