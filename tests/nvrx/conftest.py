"""The nvidia-resiliency-ext tier (``.ci/run``: ``.venv-nvrx/bin/python -m pytest -m nvrx
tests/nvrx``; ``tools/nvrx_venv.sh`` unpacks nvrx 0.6.0's wheel and ``grpcio`` there, as
``tools/bridge_venv.sh`` does for Bridge). Where nvrx's launcher cannot be imported (the main
venv) nothing here is collected."""

from __future__ import annotations

import importlib.util

import pytest

FOUND = importlib.util.find_spec("nvidia_resiliency_ext") is not None
collect_ignore_glob = [] if FOUND and importlib.util.find_spec("grpc") else ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/nvrx/" in item.nodeid:
            item.add_marker(pytest.mark.nvrx)
