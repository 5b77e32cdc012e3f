"""Per-bucket grad norms and the per-step signals log: the cores (the real loop is in
tests/e2e/test_telemetry.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.common.records.signals import (
    SignalRecord,
    SignalsWriter,
    latest_per_iteration,
    read_signals,
)
from megatron_ext.telemetry.bucket_layout import (
    BucketView,
    bucket_name,
    clip_range,
    global_layer_name,
    layer_paths,
    squared_norms,
)


def _record(iteration: int, loss: float = 2.0) -> SignalRecord:
    return SignalRecord(
        iteration=iteration,
        attempt=0,
        job_id="j",
        wall_time=1.0,
        consumed_samples=8 * iteration,
        skipped_samples=0,
        lm_loss=loss,
    )


# -- cores ------------------------------------------------------------------------------------


def test_squared_norms_sum_segments_per_bucket() -> None:
    data = torch.arange(10, dtype=torch.float32)
    views = [
        BucketView("a", (data[0:3], data[5:7])),
        BucketView("b", (data[7:10],)),
        BucketView("empty", ()),
    ]
    expected = [0 + 1 + 4 + 25 + 36, 49 + 64 + 81, 0]
    assert squared_norms(views).tolist() == pytest.approx(expected, rel=1e-6)
    assert clip_range(2, 8, 5, 10) == (5, 8) and clip_range(0, 5, 5, 10) is None


def test_bucket_names_are_readable_and_stable() -> None:
    names = [
        "module.module.decoder.layers.1.mlp.linear_fc2.weight",
        "module.module.decoder.layers.0.self_attention.linear_qkv.weight",
    ]
    assert bucket_name(3, names) == (
        "b3:layers0-1[decoder.layers.1.mlp.linear_fc2.weight.."
        "decoder.layers.0.self_attention.linear_qkv.weight]"
    )
    assert bucket_name(0, ["module.output_layer.weight"]).startswith("b0:no-layers[")


def test_bucket_names_use_global_layer_numbers() -> None:
    """Stage 1 of two 2-layer stages: its local layers 0 and 1 are global layers 2 and 3."""
    modules = [
        ("module", SimpleNamespace()),
        ("module.decoder.layers", SimpleNamespace()),
        ("module.decoder.layers.0", SimpleNamespace(layer_number=3)),
        ("module.decoder.layers.1", SimpleNamespace(layer_number=4)),
        ("module.decoder.layers.1.mlp", SimpleNamespace(layer_number="not a layer")),
    ]
    paths = layer_paths(modules)
    assert paths == {
        "module.decoder.layers.0": "module.decoder.layers.2",
        "module.decoder.layers.1": "module.decoder.layers.3",
    }
    local = ["module.decoder.layers.1.mlp.linear_fc2.weight", "module.output_layer.weight"]
    assert [global_layer_name(n, paths) for n in local] == [
        "module.decoder.layers.3.mlp.linear_fc2.weight",
        "module.output_layer.weight",
    ]
    # Whole path components only: local layer 1 is not a prefix of local layer 10.
    assert global_layer_name("module.decoder.layers.10.x", paths) == "module.decoder.layers.10.x"
    names = [global_layer_name(n, paths) for n in local]
    assert bucket_name(0, names).startswith("b0:layers3-3[decoder.layers.3.mlp.linear_fc2")


def test_restart_appends_a_new_attempt_and_readers_take_the_latest(tmp_path: Path) -> None:
    first = SignalsWriter(tmp_path)
    for i in (1, 2, 3):
        first.write(_record(i, loss=float(i)))
    with open(first.path, "a") as f:
        f.write('{"iteration": 4, "attem')  # kill -9 mid-line
    second = SignalsWriter(tmp_path)  # the rollback restarts from iteration 2
    assert second.attempt == 2
    second.write(_record(3, loss=30.0))
    second.write(_record(4, loss=float("nan")))
    with pytest.warns(UserWarning, match="torn"):
        records = read_signals(first.path)
    assert [(r.iteration, r.attempt) for r in records] == [(1, 1), (2, 1), (3, 1), (3, 2), (4, 2)]
    latest = latest_per_iteration(records)
    assert [(r.iteration, r.attempt) for r in latest] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert latest[2].lm_loss == 30.0 and math.isnan(latest[3].lm_loss)


def test_foreign_json_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "signals.jsonl"
    SignalsWriter(tmp_path).write(_record(1, loss=1.0))
    with open(path, "a") as f:
        f.write('{"iteration": 2, "who": "another tool"}\n')
    with pytest.warns(UserWarning, match=r"not signals records: line 2 .*unknown fields"):
        assert [r.iteration for r in read_signals(path)] == [1]
