"""Shared fixtures: one tiny real corpus, tokenized once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.demo import prepare_tiny_dataset


@pytest.fixture(scope="session")
def data_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Megatron data flags for the tiny corpus (real text, real BPE, real .bin/.idx)."""
    root: Path = tmp_path_factory.mktemp("tiny-data")
    document, tokenizer_args = prepare_tiny_dataset(root)
    return [
        "--data-path", str(document), "--split", "100,0,0", *tokenizer_args,
        "--data-cache-path", str(root / "index-cache"),
    ]
