"""The Megatron-Bridge tier (``.ci/run``: ``.venv-bridge/bin/python -m pytest -m bridge
tests/bridge``, in the venv ``tools/bridge_venv.sh`` builds). Where Megatron-Bridge is not
installed (the main venv), nothing here is collected: these tests need Bridge's real
``pretrain``, and the main suite must not fail or wait on a package it does not have."""

from __future__ import annotations

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("megatron.bridge") else ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/bridge/" in item.nodeid:
            item.add_marker(pytest.mark.bridge)
