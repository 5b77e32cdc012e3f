"""The Bridge example script's real ConfigContainer (docs/examples/pretrain_bridge.py), for the
Bridge tier's tests that need one without a launch."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from megatron_ext.bridge import te_standin

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "pretrain_bridge.py"


def example_config(tmp_path: Path) -> Any:
    """The example script's ConfigContainer, as its ``config()`` builds it."""
    te_standin.install()
    spec = importlib.util.spec_from_file_location("pretrain_bridge", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    options = argparse.Namespace(
        data_path=["prefix"], tokenizer=str(tmp_path), work=tmp_path, train_iters=4,
        save_interval=2, global_batch_size=8, micro_batch_size=2,
    )  # fmt: skip
    return module.config(options)
