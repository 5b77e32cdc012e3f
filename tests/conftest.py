"""Shared fixtures: one tiny real corpus, tokenized once per session; the real-shaped spike
drill; the e2e and compat markers."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.demo import prepare_tiny_dataset
from tests.compat import SELECTED

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ is a real launch: mark it ``e2e``; the compatibility
    tier's selection (tests/compat/) is marked ``compat``."""
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
        if any(fragment in item.nodeid for fragment in SELECTED):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(scope="session")
def data_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Megatron data flags for the tiny corpus (real text, real BPE, real .bin/.idx)."""
    root: Path = tmp_path_factory.mktemp("tiny-data")
    document, tokenizer_args = prepare_tiny_dataset(root)
    return [
        "--data-path",
        str(document),
        "--split",
        "100,0,0",
        *tokenizer_args,
        "--data-cache-path",
        str(root / "index-cache"),
    ]


@pytest.fixture(scope="session")
def real_shaped(tmp_path_factory: pytest.TempPathFactory, data_args: list[str]) -> dict:
    """The real-shaped spike drill (tests/support/drill.py): its e2e tests and the lookup's
    attempt faults read the same two launches."""
    from tests.support.drill import real_shaped_drill

    return real_shaped_drill(tmp_path_factory.mktemp("real-shaped"), data_args)
